"""Sweeps: many merges of one family from one pass over the experts.

A sweep plans every request (each a normal stored plan, named `PREFIX-param=value-...`), closes
the catalog, then runs the plans in waves of at most `max_parallel` (sweepwave.py). Each plan
still writes its own output through the ordinary path (`executor.execute` into
`DIR/<plan-name>/`: temporary folder, fsync, manifest, atomic install; or in memory), and every
output has exactly the bytes of that plan executed alone. What the plans of a wave share:

- the reading: each expert block is read once per wave and served to every merge that selected
  it (sweepwave.SharedReads), so a wave reads the union of its plans' masks once and N plans with
  one mask read the bytes of one plan;
- the merge of a fold set (foldshare.py: plans that differ only in what `kernels.finish` applies,
  e.g. TIES' λ, and TIES-style trims over one mask): one `setmerge.SetMerger` reads each base
  tensor once, folds each block once for the set and finishes every plan's output block from
  those sums; the plans only write (their `write_shards`).

Memory. Per set in flight, what one execution holds (a few blocks per thread, the reorder buffer
counted with all the set's outputs; nothing grows with K) plus up to setmerge.FEED finished
tensors per plan waiting for its writer, and the shared blocks some merges of the wave have taken
and others not yet. The wave's pace keeps each merge within LEAD tensors of the slowest, which
keeps that set small; `cache_bytes` caps it: a block that does not fit is read by each merge that
needs it instead (correct, only more reads; `SweepResult.reread_bytes` says how many). It also
caps a set's per-thread sums (20 bytes per element per TIES group): a set whose sums do not fit
runs plan by plan, each with its own Merger, sharing folds through foldshare.SharedFolds within
the same cap. Waves run one after another, so P < N plans read the union once per wave.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import grid, measure, outdir, outspace, planner, plans, rerun
from .errors import MergeDBError, PlanError, RunNotRecordedError
from .lora import is_adapter
from .manifest import ExecutionPlan
from .sweepwave import Slot, Wave, Work
from .units import check_threads

if TYPE_CHECKING:
    from .catalog import Catalog
    from .executor import ExecuteResult
    from .plans import PlanSummary

CACHE_BYTES = 1 << 30  # default cap on shared blocks held for merges that have not taken them yet


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
    base_bytes_read: int = 0  # base tensor bytes read: once per set merged together, once per plan run alone


def _dtypes(dtype: str | None | Sequence[str | None], n: int) -> list[str | None]:
    """One output dtype per request (a single one for all, or a list as long as the requests)."""
    from .tensorfile import normalize_dtype

    if dtype is not None and not isinstance(dtype, (str, list, tuple)):
        raise MergeDBError(f"dtype is bf16, fp16, fp32 or None (or a list of those, one per plan), got {dtype!r}")
    out = [dtype] * n if dtype is None or isinstance(dtype, str) else list(dtype)
    if len(out) != n:
        raise MergeDBError(f"{len(out)} output dtypes for {n} plans; give one dtype, or one per plan")
    for d in out:
        normalize_dtype(d)  # refused before anything is planned
    return out


def _waves(n: int, max_parallel: int) -> Iterator[list[int]]:
    for start in range(0, n, _check_parallel(max_parallel)):
        yield list(range(start, min(start + max_parallel, n)))


def _checked(
    requests: Any, max_parallel: int, threads: int | None, dtype: Any, cache_bytes: Any, *calls: Any
) -> tuple[list, list[str | None]]:
    """A sweep's options checked before anything is planned: (the requests as a list, one dtype per
    request). One plan reference or request alone is one plan."""
    _check_parallel(max_parallel)
    if isinstance(requests, (str, int, planner.PlanRequest, plans.PlanSummary)):
        requests = [requests]
    if not isinstance(requests, (list, tuple)):
        raise MergeDBError(f"a sweep takes a list of PlanRequests or plan references, got {type(requests).__name__}")
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
        raise MergeDBError(f"cache_bytes is a whole number of bytes ≥ 0, got {cache_bytes!r}")
    if threads is not None:
        check_threads(threads)
    for v in calls:  # progress, on_total: not called before the plans are made
        if v is not None and not callable(v):
            raise MergeDBError(f"a sweep's progress and on_total are functions or None, got {type(v).__name__}")
    return list(requests), _dtypes(dtype, len(requests))


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
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> SweepResult:
    """Plan `requests` (or take stored plans by id or name), then execute them together into
    `out_dir/<plan-name>/` (`plan-<id>` for an unnamed plan), each expert block read once per wave
    and folded once per fold group (foldshare.py). `dtype`: one output dtype, or one per request.

    The catalog is open only to plan, to read the execution plans and to record each run. An
    output that exists is refused before anything is planned or run; so are named plans an earlier run of
    this sweep stored, with the commands that finish it (rerun.py). If a plan fails, the rest of its wave
    finishes, no further wave starts, and MergeDBError names the failed plans (each failure is
    recorded as a failed run, each success as an ok one). `on_total(n)` is told the tensor bytes of
    every output once the plans are made, then `progress(k)` each tensor's bytes as a plan writes it
    (from the merge threads; for a byte-based progress bar, as in `execute`)."""
    from . import executor  # the merge kernels are heavy to import; planning and the catalog do not need them

    requests, dtypes = _checked(requests, max_parallel, threads, dtype, cache_bytes, progress, on_total)
    root = Path(out_dir)
    _check_root(root)
    outdir.remove_stale_in(root)  # a killed sweep's temporary folders, before the space is counted
    rerun.check(cat, requests, root, dtypes, max_shard_size)  # an interrupted sweep run again: how to finish it
    rows = cat.sql("SELECT name, role, base_id, checkpoint_id, path, root FROM checkpoints").to_pylist()
    registered = [p for row in rows for p in (row["path"], row["root"])]
    _refuse_adapters(rows, requests)
    outspace.check_space_early(cat, root, requests, dtypes)  # a grid of thousands is planned for minutes otherwise
    _check_outs(registered, [_out(root, r.name) for r in requests if isinstance(r, planner.PlanRequest) and r.name])
    outs: list[Path] = []
    need: list[int] = []

    def refuse(summaries: list[PlanSummary], xps: list[ExecutionPlan]) -> None:  # before the plans are stored
        _refuse(xps)
        for xp in {xp.base.name: xp for xp in xps}.values():  # a base that lost config.json since, once per base
            executor.refuse_lost_side_files(xp)
        outs[:] = [_out(root, s.name or f"plan-{s.plan_id}") for s in summaries]
        _check_outs(registered, outs)
        need.append(outspace.check_space(root, xps, dtypes))

    summaries, xps = grid.plan_and_load(cat, requests, check=refuse)
    total = need[0]
    if on_total:
        on_total(total)
    t0, phys0 = time.perf_counter(), measure.physical_read_bytes()
    results: list[ExecuteResult | None] = [None] * len(xps)
    read = served = reread = peak = groups = shared_folds = passes = base = 0
    failed: list[str] = []
    unrecorded: list[str] = []  # complete outputs whose runs the catalog could not record
    why: list[MergeDBError] = []  # the first recording's failure: later runs are not tried (each waits)

    def record(i: int, res: ExecuteResult | None, error: str | None = None) -> None:
        if not why:
            try:
                run = xps[i]
                cat.record_run(run.plan_id, outs[i], res, error=error, wait=cat.RECORD_WAIT, plan_hash=run.plan_hash)
                return
            except MergeDBError as rec:
                why.append(rec)
        if res is not None:
            unrecorded.append(str(outs[i]))

    for idx in _waves(len(xps), max_parallel):
        wave = Wave(xps, idx, cache_bytes, threads, dtypes)

        def work(i: int) -> Work:
            def run(slot: Slot) -> ExecuteResult:
                kw: dict[str, Any] = {"max_shard_size": max_shard_size, "dtype": dtypes[i]}
                if slot.feed is not None:  # its set merges together: this plan only writes
                    return executor.execute(
                        xps[i], outs[i], write_shards=slot.feed.write_shards, progress=progress, **kw
                    )

                def step(nbytes: int) -> None:
                    slot.step()
                    if progress:
                        progress(nbytes)

                return executor.execute(
                    xps[i],
                    outs[i],
                    threads=slot.threads,
                    progress=step,
                    read_block=slot.reader,
                    fold_block=slot.fold,
                    **kw,
                )

            return run

        with contextlib.closing(wave.results(work)) as futures:  # closed at once on Ctrl-C: stops the wave
            for j, (i, f) in enumerate(zip(idx, futures)):
                try:
                    res = f.result()
                except MergeDBError as e:
                    failed.append(f"{summaries[i].name or summaries[i].plan_id}: {e}")
                    record(i, None, str(e))
                    continue
                results[i] = res
                served += res.expert_bytes
                base += 0 if j in wave.feeds else res.base_bytes
                record(i, res)
        read, reread = read + wave.shared.read_bytes, reread + wave.shared.reread_bytes
        peak = max(peak, wave.shared.peak)
        groups, shared_folds = groups + len(wave.groups), shared_folds + wave.folds_shared
        passes += len(wave.folds.sets)
        base += sum(m.count.base for m in wave.mergers)
        if failed:
            done = [summaries[i].name for i in range(len(xps)) if results[i] is not None]
            raise MergeDBError(
                f"{len(failed)} plan(s) of the sweep failed: {'; '.join(failed)}. Outputs complete: "
                f"{', '.join(str(n) for n in done) or 'none'}; fix the cause and sweep the rest "
                f"(mergedb execute PLAN runs one){_unrecorded(unrecorded, why)}"
            )
    if why:
        raise RunNotRecordedError(
            f"every merge of the sweep is complete and good{_unrecorded(unrecorded, why)}"
            if unrecorded
            else f"the sweep's runs could not be recorded in the catalog: {why[0]}"
        )
    return SweepResult(
        tuple((s, r) for s, r in zip(summaries, results) if r is not None),
        time.perf_counter() - t0,
        read,
        served,
        reread,
        measure.physical_read_bytes() - phys0,
        measure.peak_rss(),
        peak,
        groups,
        shared_folds,
        passes,
        base,
    )


def _refuse(xps: list[ExecutionPlan]) -> None:
    """Refuse plans whose inputs moved away (plans.refuse_gone), and adapters: they read their factors
    outside the shared reads (loramerge.py), which a sweep could not count."""
    for xp in xps:
        plans.refuse_gone(xp)
    for src in (s for xp in xps for s in xp.experts if is_adapter(s.path)):
        raise PlanError(f"{src.name!r} is a LoRA adapter; sweeps do not take adapters yet: execute each plan alone")


def _refuse_adapters(rows: list[dict[str, Any]], requests: Sequence[planner.PlanRequest | int | str]) -> None:
    """_refuse's adapter rule for the requests to plan, before any is planned: a grid of 1,500 points
    took a minute to plan, holding the catalog, before the adapter among its experts was refused. (An
    unknown name is left to the planner, which says what is registered.)"""
    base_id = {r["name"]: r["checkpoint_id"] for r in rows if r["role"] == "base"}
    experts = [r for r in rows if r["role"] == "expert"]
    for req in (r for r in requests if isinstance(r, planner.PlanRequest)):
        names = set(req.experts) if req.experts is not None else None
        for r in experts:
            mine = r["name"] in names if names is not None else r["base_id"] == base_id.get(req.base)
            if mine and is_adapter(r["path"]):
                raise PlanError(
                    f"{r['name']!r} is a LoRA adapter; sweeps do not take adapters yet: execute each plan alone"
                )


def _out(root: Path, name: str) -> Path:
    """OUT/NAME, the folder of the plan named `name`: refused unless `name` is one folder name (no
    '/', not '..', short enough for its temporary folder), so that every output lies inside OUT."""
    if name in ("", ".", "..") or "/" in name or "\0" in name or len(os.fsencode(name)) > 220:
        raise MergeDBError(
            f"a sweep writes each plan into OUT/NAME, and {name!r} is not a folder name of at most 220 bytes "
            "(no '/', not '..'); pick another --name"
        )
    return root / name


def _unrecorded(outs: list[str], why: list[MergeDBError]) -> str:
    """What a sweep's message adds for the complete outputs whose runs were not recorded."""
    if not why:
        return ""
    return (
        f"; the runs of {', '.join(outs) or 'none'} could not be recorded in the catalog (their outputs are "
        f"complete: `mergedb check --output DIR` verifies one): {why[0]}"
    )


def _check_root(root: Path) -> None:
    """Refuse, before any plan is stored, a sweep folder that cannot be made or written: under a
    file, or where the nearest existing folder is read-only (its plans were stored, then the rerun
    with another --out was refused for their names)."""
    at = outspace.nearest(root)
    if not at.is_dir():
        where = "" if at == root else f": {at}"
        raise MergeDBError(f"--out {root}{where} is a file, not a folder; a sweep writes a folder per plan in --out")
    if not os.access(at, os.W_OK | os.X_OK):
        raise MergeDBError(
            f"--out {root}: {at} cannot be written (read-only); choose an --out in a folder you can write"
        )


def _check_outs(registered: list[str], outs: list[Path]) -> None:
    """Refuse, before anything runs, outputs that clash, exist, or overlap a registered checkpoint."""
    dup = [o for o, c in Counter(outs).items() if c > 1]
    if dup:
        raise MergeDBError(f"two plans of the sweep would write {dup[0]}; give each plan its own name")
    for o in outs:
        outdir.check_clear_of(o, registered, "a registered checkpoint")
        # a sweep never replaces an output (no --force): the folder's name comes from --out and --name
        outdir.check_out(outdir.resolve_out(o), False, "choose another --out or --name, or move that folder away")


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

    requests, dtypes = _checked(requests, max_parallel, threads, dtype, cache_bytes)
    if into is not None and not callable(getattr(into, "state_dict", None)):
        raise MergeDBError(f"into= takes a torch module (it has a state_dict), got {type(into).__name__}")
    _refuse_adapters(cat.sql("SELECT name, role, base_id, checkpoint_id, path FROM checkpoints").to_pylist(), requests)

    def check(_: Any, xps: list[ExecutionPlan]) -> None:  # before the plans are stored
        _refuse(xps)
        if into is not None:  # a model that cannot take the merge: refused with no plan stored
            target = into.state_dict()
            for xp in {xp.base.name: xp for xp in xps}.values():
                _check_model(target, {t.name: tuple(t.shape) for t in xp.tensors})

    summaries, xps = grid.plan_and_load(cat, requests, check=check)
    for idx in _waves(len(xps), max_parallel):
        wave = Wave(xps, idx, cache_bytes, threads, dtypes)

        def work(i: int) -> Work:
            def merge(slot: Slot) -> Any:
                if slot.feed is not None:  # its set merges together: take the tensors as they come
                    every = list(range(len(xps[i].tensors)))
                    return {
                        n: executor.tensor_array(dt, shape, data)
                        for n, dt, shape, data in slot.feed.tensors(every, True)
                    }
                return executor.merge_to_dict(xps[i], dtypes[i], slot.threads, slot.reader, slot.step, slot.fold)

            return merge

        with contextlib.closing(wave.results(work)) as futures:
            for i, f in zip(idx, futures):
                state = f.result()
                yield summaries[i], state if into is None else load_into(into, state)


def load_into(model: Any, state: dict[str, np.ndarray]) -> Any:
    """Copy `state` into a torch module's parameters and buffers by name, in place; the module.

    Every merged tensor must name an entry of the module's state_dict with the same shape, on a real
    device (not meta); names that share one storage (tied weights, e.g. embed_tokens and lm_head)
    must be given equal values. All of it is checked before the first copy, so a refused call leaves
    the model as it was. Entries the merge does not name are left as they are. Each copy is torch's
    cast of the merged values into the entry's dtype: the output dtype's rounding, as written to disk,
    when they are the same (--dtype, by default the base's)."""
    import torch

    target = model.state_dict()
    _check_model(target, {name: arr.shape for name, arr in state.items()})
    shared: dict[tuple[int, int], str] = {}  # (storage, offset) -> the first merged name there
    copies = []
    for name, arr in state.items():
        t = target[name]
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        first = shared.setdefault(key, name)
        if first != name:  # tied: one storage, two names
            if not np.array_equal(state[first], arr, equal_nan=True):
                raise MergeDBError(
                    f"the model ties {first!r} and {name!r} (one storage), but the merge gives them different "
                    "values; untie them in the model (e.g. tie_word_embeddings=False), or merge into a dict"
                )
            continue
        copies.append((t, arr))
    with torch.no_grad():
        for t, arr in copies:
            t.copy_(torch.from_numpy(np.ascontiguousarray(arr)))
    return model


def _check_model(target: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse a torch state_dict `target` that cannot take tensors of `shapes` (name -> shape)."""
    missing = sorted(set(shapes) - set(target))
    if missing:
        raise MergeDBError(
            f"the model has no parameter or buffer named {missing[0]!r} ({len(missing)} merged tensors "
            "missing); pass a model whose state_dict names match the checkpoint's tensors"
        )
    for name, shape in shapes.items():
        t = target[name]
        if tuple(t.shape) != tuple(shape):
            raise MergeDBError(
                f"tensor {name!r} is {list(shape)} in the merge but {list(t.shape)} in the model; "
                "pass a model of this family's architecture"
            )
        if t.is_meta:
            raise MergeDBError(
                f"the model's {name!r} is on the meta device, where a copy stores nothing; materialise the "
                "model first (model.to_empty(device='cpu'))"
            )
