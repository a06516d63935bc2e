"""Sweeps: many merges of one family from one pass over the experts.

A sweep plans every request (each a normal stored plan, named `PREFIX-param=value-...`), closes
the catalog, then runs the plans in waves of at most `max_parallel`. The plans of a wave run
together, each through the ordinary path (`executor.execute` into `DIR/<plan-name>/`: temporary
folder, fsync, manifest, atomic install; or in memory), each with its own `Merger`, so every
output has exactly the bytes of that plan executed alone. What they share is the reading: each
Merger's expert reads go through `SharedReads` (the `read_block` seam of merger.py), which reads
an (expert, tensor, block) once and serves the copy to every plan of the wave that selected it,
dropping it when the last one has taken it. A wave therefore reads the union of its plans' masks
once; N plans in one wave with one mask read the bytes of one plan. Plans whose folds are identical
(foldshare.FoldKey: they differ only in what `kernels.finish` applies, e.g. TIES' λ) also share
the arithmetic: each block is folded by one plan of the group and every plan of the group finishes
its own output from those sums (`fold_block`, the second seam of merger.py).

Memory. Per plan in flight, what one execution holds (a few blocks per thread and the reorder
buffer; nothing grows with K), plus the shared blocks some plans of the wave have taken and
others not yet. `_Pace` keeps each plan within LEAD tensors of the slowest plan of its wave (a
writer that runs ahead waits after writing a tensor; the slowest never waits, so the wave always
moves), which keeps that set small; `cache_bytes` caps it: a block that does not fit is read by
each plan that needs it instead (correct, only more reads; `SweepResult.reread_bytes` says how
many); it caps the folded sums held for groups separately (20 bytes per element for TIES; beyond
it a plan folds the block itself). Waves run one after another, so P < N plans read the union
once per wave.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import grid, outdir, planner
from .errors import MergeDBError, PlanError
from .lora import is_adapter
from .manifest import ExecutionPlan
from .units import check_threads

if TYPE_CHECKING:
    from .catalog import Catalog
    from .executor import ExecuteResult
    from .merger import FoldBlock
    from .plans import PlanSummary

LEAD = 2  # tensors a plan may write ahead of the slowest plan of its wave
CACHE_BYTES = 1 << 30  # default cap on shared blocks held for plans that have not taken them yet

Key = tuple[str, str, int, str]  # (expert file, tensor, block, content hash)


@dataclass(frozen=True)
class SweepResult:
    """What a sweep wrote and read. `runs` pairs each plan with its execution, in request order."""

    runs: tuple[tuple[PlanSummary, ExecuteResult], ...]
    seconds: float
    expert_bytes_read: int  # bytes actually read from expert files (each shared block once)
    expert_bytes_served: int  # Σ over plans of the expert bytes each consumed (what N runs would read)
    reread_bytes: int  # blocks read again because they did not fit in cache_bytes
    physical_read_bytes: int  # /proc/self/io read_bytes during the sweep (experts and bases)
    peak_rss: int
    peak_shared_bytes: int  # most bytes of shared blocks held at once
    fold_groups: int = 0  # groups of plans with one fold (foldshare.FoldKey), summed over waves
    folds_shared: int = 0  # blocks a plan finished from sums its group folded, not folding them itself
    fold_passes: int = 0  # folds per block: sets of groups folded together (foldshare.mask_sets), over waves


# -- shared reads -------------------------------------------------------------------------------


class _Entry:
    def __init__(self) -> None:
        self.ready = threading.Event()
        self.data: np.ndarray | None = None  # None once ready: the read failed, read it yourself


class SharedReads:
    """Expert blocks read once and served to every plan of a wave that selected them.

    `need[key]` counts the reads of `key` still to come (one per plan whose mask selects it); an
    entry is held from the first read until the last, or not at all when it would push the held
    bytes over `cap` (then each plan reads it itself)."""

    def __init__(self, need: Counter[Key], cap: int) -> None:
        self.need, self.cap = need, cap
        self.entries: dict[Key, _Entry] = {}
        self.lock = threading.Lock()
        self.held = self.peak = 0
        self.read_bytes = self.reread_bytes = 0
        self.fetched: set[Key] = set()

    def read(self, key: Key, raw: np.ndarray, pread: Callable[[np.ndarray], None]) -> None:
        n = raw.nbytes
        with self.lock:
            self.need[key] -= 1
            last = self.need[key] <= 0
            e = self.entries.get(key)
            mine = e is None and not last and self.held + n <= self.cap
            if mine:
                e = self.entries[key] = _Entry()
                self.held += n
                self.peak = max(self.peak, self.held)
        if e is None or mine:  # first of several, or a plain read (the only one, or it does not fit)
            try:
                self._fetch(key, pread, raw)
            except BaseException:
                if e is not None:
                    self._drop(key, e, n)
                    e.ready.set()  # waiters find no data and read it themselves
                raise
            if e is not None:
                try:
                    e.data = raw.copy()  # the Merger reuses `raw` for its next block
                finally:
                    e.ready.set()
            return
        e.ready.wait()
        if e.data is None:
            self._fetch(key, pread, raw)
        else:
            raw[...] = e.data
        if last:
            self._drop(key, e, n)

    def _fetch(self, key: Key, pread: Callable[[np.ndarray], None], raw: np.ndarray) -> None:
        pread(raw)
        with self.lock:
            self.read_bytes += raw.nbytes
            if key in self.fetched:
                self.reread_bytes += raw.nbytes
            self.fetched.add(key)

    def _drop(self, key: Key, e: _Entry, n: int) -> None:
        with self.lock:
            if self.entries.get(key) is e:
                del self.entries[key]
                self.held -= n

    def release(self, keys: Iterable[Key]) -> None:
        """A plan that stopped early will not take `keys`: let them go."""
        for key in keys:
            with self.lock:
                self.need[key] -= 1
                e = self.entries.get(key) if self.need[key] <= 0 else None
            if e is not None and e.ready.is_set():
                self._drop(key, e, e.data.nbytes if e.data is not None else 0)


class _Reader:
    """One plan's `read_block` (merger.ReadBlock): maps its (tensor, block, position) to the shared key."""

    def __init__(self, keys: dict[tuple[int, int, int], Key], shared: SharedReads) -> None:
        self.keys, self.shared = keys, shared
        self.taken: set[Key] = set()

    def __call__(self, ti: int, b: int, pos: int, raw: np.ndarray, pread: Callable[[np.ndarray], None]) -> None:
        key = self.keys[(ti, b, pos)]
        self.taken.add(key)
        self.shared.read(key, raw, pread)

    def release(self) -> None:
        self.shared.release(k for k in self.keys.values() if k not in self.taken)


def plan_keys(xp: ExecutionPlan) -> dict[tuple[int, int, int], Key]:
    """(tensor_idx, block_idx, position) -> shared key of every block the plan reads."""
    cols = [xp.mask.column(c).to_pylist() for c in ("position", "tensor_idx", "block_idx", "content_hash")]
    return {(t, b, p): (xp.experts[p].path, xp.tensors[t].name, b, h) for p, t, b, h in zip(*cols)}


class _Pace:
    """Keeps the plans of a wave within LEAD tensors of the slowest (which never waits); after
    `cancel` every plan stops at its next tensor."""

    def __init__(self, n: int) -> None:
        self.done = [0.0] * n
        self.cv = threading.Condition()
        self.cancelled = False

    def step(self, i: int) -> None:
        with self.cv:
            self.done[i] += 1
            self.cv.notify_all()
            while not self.cancelled and self.done[i] > min(self.done) + LEAD:
                self.cv.wait()
            if self.cancelled:
                raise MergeDBError("the sweep was stopped; this plan's output was not installed")

    def finish(self, i: int) -> None:
        with self.cv:
            self.done[i] = math.inf
            self.cv.notify_all()

    def cancel(self) -> None:
        with self.cv:
            self.cancelled = True
            self.cv.notify_all()


# work(read_block, fold_block, step, threads): one plan's merge in a wave; `step()` after each tensor
Work = Callable[[_Reader, "FoldBlock | None", Callable[[], None], int], Any]


class _Wave:
    """Plans `idx` of a sweep, run together: their fold groups (foldshare.py), one reader per group
    over the wave's shared reads, the groups' shared folds, their pace."""

    def __init__(
        self,
        xps: Sequence[ExecutionPlan],
        idx: list[int],
        cache_bytes: int,
        threads: int | None,
        dtypes: Sequence[str | None],
    ) -> None:
        from . import foldshare  # imports the merge kernels

        self.idx = idx
        wx, wd = [xps[i] for i in idx], [dtypes[i] for i in idx]
        self.groups = foldshare.fold_groups(wx, wd)  # wave positions
        sets = foldshare.mask_sets(wx, wd, self.groups)  # groups folded together
        many = {g: foldshare.bands(wx[self.groups[g][0]]) for gs in sets if len(gs) > 1 for g in gs}
        self.folds = foldshare.SharedFolds([len(js) for js in self.groups], cache_bytes, sets, many)
        self.set_of = {j: d for d, gs in enumerate(sets) for g in gs for j in self.groups[g]}
        self.group_of = {j: g for g, js in enumerate(self.groups) for j in js}
        # one reader per set: a block is read by the one plan of the set that folds it
        keys = [plan_keys(wx[self.groups[gs[0]][0]]) for gs in sets]
        self.shared = SharedReads(Counter(k for ks in keys for k in ks.values()), cache_bytes)
        self.readers = [_Reader(ks, self.shared) for ks in keys]
        self.running = [sum(len(self.groups[g]) for g in gs) for gs in sets]  # plans of each set not finished
        self.lock = threading.Lock()
        self.pace = _Pace(len(idx))
        self.threads = _threads(threads, len(idx))

    def run(self, j: int, work: Work) -> Any:
        """`work(read_block, fold_block, step, threads)` for the wave's j-th plan."""
        g, d = self.group_of[j], self.set_of[j]
        fold = self.folds.block(g) if self.folds.plans(g) > 1 else None
        try:
            return work(self.readers[d], fold, lambda: self.pace.step(j), self.threads)
        finally:
            self.pace.finish(j)
            with self.lock:
                self.running[d] -= 1
                last = self.running[d] == 0
            if last:
                self.readers[d].release()

    def results(self, work: Callable[[int], Work]) -> Iterator[Any]:
        """Run `work(i)` for every plan of the wave at once; their futures in order."""
        with ThreadPoolExecutor(len(self.idx), thread_name_prefix="mergedb-sweep") as pool:
            futs = [pool.submit(self.run, j, work(i)) for j, i in enumerate(self.idx)]
            try:
                yield from futs
            except BaseException:  # the caller stopped (Ctrl-C, an abandoned generator): stop the others
                self.pace.cancel()
                raise


def _waves(n: int, max_parallel: int) -> Iterator[list[int]]:
    for start in range(0, n, _check_parallel(max_parallel)):
        yield list(range(start, min(start + max_parallel, n)))


def _threads(threads: int | None, in_flight: int) -> int:
    if threads is not None:
        return check_threads(threads)
    return max(1, (os.cpu_count() or 1) // max(1, in_flight))


def _dtypes(dtype: str | None | Sequence[str | None], n: int) -> list[str | None]:
    """One output dtype per request (a single one for all, or a list as long as the requests)."""
    if dtype is None or isinstance(dtype, str):
        return [dtype] * n
    out = list(dtype)
    if len(out) != n:
        raise MergeDBError(f"{len(out)} output dtypes for {n} plans; give one dtype, or one per plan")
    return out


def _check_parallel(max_parallel: int) -> int:
    if isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or max_parallel < 1:
        raise MergeDBError(f"--max-parallel must be a whole number ≥ 1, got {max_parallel!r}; e.g. --max-parallel 8")
    return max_parallel


# -- to disk ------------------------------------------------------------------------------------


def sweep(
    cat: Catalog,
    requests: Sequence[planner.PlanRequest | int | str],
    out_dir: str | os.PathLike[str],
    *,
    max_parallel: int = 8,
    threads: int | None = None,
    dtype: str | None | Sequence[str | None] = None,
    max_shard_size: int = 5 * 10**9,
    cache_bytes: int = CACHE_BYTES,
) -> SweepResult:
    """Plan `requests` (or take stored plans by id or name), then execute them together into
    `out_dir/<plan-name>/` (`plan-<id>` for an unnamed plan), each expert block read once per wave
    and folded once per fold group (foldshare.py). `dtype`: one output dtype, or one per request.

    The catalog is open only to plan, to read the execution plans and to record each run. An
    output that exists is refused before anything is planned or run. If a plan fails, the rest of its wave
    finishes, no further wave starts, and MergeDBError names the failed plans (each failure is
    recorded as a failed run, each success as an ok one)."""
    from . import executor  # the merge kernels are heavy to import; planning and the catalog do not need them

    _check_parallel(max_parallel)
    dtypes = _dtypes(dtype, len(requests))
    root = Path(out_dir)
    _check_outs(cat, [root / r.name for r in requests if isinstance(r, planner.PlanRequest) and r.name])
    summaries, xps = grid.plan_and_load(cat, requests)
    _refuse_adapters(xps)
    outs = [root / (s.name or f"plan-{s.plan_id}") for s in summaries]
    _check_outs(cat, outs)
    t0, phys0 = time.perf_counter(), executor.physical_read_bytes()
    results: list[ExecuteResult | None] = [None] * len(xps)
    read = served = reread = peak = groups = shared_folds = passes = 0
    failed: list[str] = []
    for idx in _waves(len(xps), max_parallel):
        wave = _Wave(xps, idx, cache_bytes, threads, dtypes)

        def work(i: int) -> Work:
            return lambda reader, fold, step, nthreads: executor.execute(
                xps[i],
                outs[i],
                max_shard_size=max_shard_size,
                dtype=dtypes[i],
                threads=nthreads,
                progress=lambda _n: step(),
                read_block=reader,
                fold_block=fold,
            )

        with contextlib.closing(wave.results(work)) as futures:  # closed at once on Ctrl-C: stops the wave
            for i, f in zip(idx, futures):
                try:
                    res = f.result()
                except MergeDBError as e:
                    failed.append(f"{summaries[i].name or summaries[i].plan_id}: {e}")
                    cat.record_run(xps[i].plan_id, outs[i], error=str(e), wait=RECORD_WAIT)
                    continue
                results[i] = res
                served += res.expert_bytes
                cat.record_run(xps[i].plan_id, outs[i], res, wait=RECORD_WAIT)
        read, reread = read + wave.shared.read_bytes, reread + wave.shared.reread_bytes
        peak = max(peak, wave.shared.peak)
        groups, shared_folds = groups + len(wave.groups), shared_folds + wave.folds.shared
        passes += len(wave.folds.sets)
        if failed:
            done = [summaries[i].name for i in range(len(xps)) if results[i] is not None]
            raise MergeDBError(
                f"{len(failed)} plan(s) of the sweep failed: {'; '.join(failed)}. Outputs complete: "
                f"{', '.join(str(n) for n in done) or 'none'}; fix the cause and sweep the rest "
                "(mergedb execute PLAN runs one)"
            )
    return SweepResult(
        tuple((s, r) for s, r in zip(summaries, results) if r is not None),
        time.perf_counter() - t0,
        read,
        served,
        reread,
        executor.physical_read_bytes() - phys0,
        executor.peak_rss(),
        peak,
        groups,
        shared_folds,
        passes,
    )


def _refuse_adapters(xps: list[ExecutionPlan]) -> None:
    """Adapters read their factors outside the shared reads (loramerge.py): a sweep could not count them."""
    for src in (s for xp in xps for s in xp.experts if is_adapter(s.path)):
        raise PlanError(f"{src.name!r} is a LoRA adapter; sweeps do not take adapters yet: execute each plan alone")


RECORD_WAIT = 30.0  # seconds a finished merge waits for the catalog to record its run


def _check_outs(cat: Catalog, outs: list[Path]) -> None:
    """Refuse, before anything runs, outputs that clash, exist, or overlap a registered checkpoint."""
    dup = [o for o, c in Counter(outs).items() if c > 1]
    if dup:
        raise MergeDBError(f"two plans of the sweep would write {dup[0]}; give each plan its own name")
    registered = [p for row in cat.sql("SELECT path, root FROM checkpoints").to_pylist() for p in row.values()]
    for o in outs:
        outdir.check_clear_of(o, registered, "a registered checkpoint")
        outdir.check_out(outdir.resolve_out(o), force=False)


# -- in memory ----------------------------------------------------------------------------------


def in_memory(
    cat: Catalog,
    requests: Sequence[planner.PlanRequest | int | str],
    *,
    into: Any = None,
    max_parallel: int = 8,
    threads: int | None = None,
    dtype: str | None = None,
    cache_bytes: int = CACHE_BYTES,
) -> Iterator[tuple[PlanSummary, Any]]:
    """Plan `requests` (or take stored plans), merge them together in memory and yield
    `(plan, state)` in request order, nothing written to disk.

    `state` is a dict name -> numpy array (as `executor.merge_to_dict`), or, with `into=model` (a
    torch module whose state_dict names match the checkpoint's tensors), the model itself with
    the plan's tensors copied into its parameters and buffers, valid until the next plan is
    yielded. A wave's states are held until they are yielded: memory is max_parallel models.
    A generator: planning starts with the iteration."""
    from . import executor

    _check_parallel(max_parallel)
    summaries, xps = grid.plan_and_load(cat, requests)
    _refuse_adapters(xps)
    dtypes = [dtype] * len(xps)
    for idx in _waves(len(xps), max_parallel):
        wave = _Wave(xps, idx, cache_bytes, threads, dtypes)

        def work(i: int) -> Work:
            def merge(reader: _Reader, fold: FoldBlock | None, step: Callable[[], None], nthreads: int) -> Any:
                return executor.merge_to_dict(xps[i], dtype, nthreads, reader, on_tensor=step, fold_block=fold)

            return merge

        with contextlib.closing(wave.results(work)) as futures:
            for i, f in zip(idx, futures):
                state = f.result()
                yield summaries[i], state if into is None else load_into(into, state)


def load_into(model: Any, state: dict[str, np.ndarray]) -> Any:
    """Copy `state` into a torch module's parameters and buffers by name, in place; the module.

    Every merged tensor must name an entry of the module's state_dict with the same shape;
    entries the merge does not name are left as they are."""
    import torch

    target = model.state_dict()
    missing = sorted(set(state) - set(target))
    if missing:
        raise MergeDBError(
            f"the model has no parameter or buffer named {missing[0]!r} ({len(missing)} merged tensors "
            "missing); pass a model whose state_dict names match the checkpoint's tensors"
        )
    with torch.no_grad():
        for name, arr in state.items():
            t = target[name]
            if tuple(t.shape) != arr.shape:
                raise MergeDBError(
                    f"tensor {name!r} is {list(arr.shape)} in the merge but {list(t.shape)} in the model; "
                    "pass a model of this family's architecture"
                )
            t.copy_(torch.from_numpy(np.ascontiguousarray(arr)))
    return model
