"""A wave of a sweep: the plans that run together, their shared reads, folds and pace.

Reads. Every merge of the wave reads expert blocks through `SharedReads` (the `read_block` seam of
merger.py), which reads an (expert, tensor, block) once and serves the copy to every reader of the
wave that selected it, dropping it when the last one has taken it: a wave reads the union of its
plans' masks once.

Merges. The wave's plans fall into fold sets (foldshare.mask_sets: plans whose folds are identical,
and TIES-style groups over one mask). A set runs as one `setmerge.SetMerger`, which reads each base
tensor and folds each block once for the whole set and finishes every plan's output from those
sums; each plan's writer takes its tensors from a `setmerge.Feed`. A set whose per-thread sums
would not fit in `cache_bytes`, and a plan without a FoldKey (model_stock, the per-step methods),
runs plan by plan instead, each with its own `Merger`, a set's plans sharing their folds through
foldshare.SharedFolds.

Pace. `Pace` keeps each runner (a set's merge, or a plan run alone) within LEAD tensors of the
slowest runner of its wave (a runner that runs ahead waits after a tensor; the slowest never
waits, so the wave always moves), which keeps the set of shared blocks held small.
"""

from __future__ import annotations

import math
import os
import threading
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import MergeDBError
from .manifest import ExecutionPlan
from .units import check_threads

if TYPE_CHECKING:
    from .merger import FoldBlock
    from .setmerge import Feed

LEAD = 2  # tensors a runner may produce ahead of the slowest runner of its wave

Key = tuple[str, str, int, str]  # (expert file, tensor, block, content hash)


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
                with self.lock:  # every other taker released it while this read ran (release skips unready ones)
                    gone = self.need[key] <= 0
                if gone:
                    self._drop(key, e, n)
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


class Pace:
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


@dataclass(frozen=True)
class Slot:
    """What one plan of a wave runs with: its `feed` when its set merges together (the plan only
    writes), else its own merge's `reader` (merger.ReadBlock), `fold` (merger.FoldBlock or None),
    `step` (call after each tensor) and compute `threads`."""

    feed: Feed | None
    reader: _Reader
    fold: FoldBlock | None
    step: Callable[[], None]
    threads: int


Work = Callable[[Slot], Any]  # one plan's merge in a wave


class Wave:
    """Plans `idx` of a sweep, run together: their fold groups and sets (foldshare.py), one reader
    per set over the wave's shared reads, a SetMerger per set that merges together, the other
    sets' shared folds, the pace of their runners."""

    def __init__(
        self,
        xps: Sequence[ExecutionPlan],
        idx: list[int],
        cache_bytes: int,
        threads: int | None,
        dtypes: Sequence[str | None],
    ) -> None:
        from . import foldshare, setmerge  # import the merge kernels

        self.idx = idx
        self.wx, self.wd = [xps[i] for i in idx], [dtypes[i] for i in idx]
        self.groups = foldshare.fold_groups(self.wx, self.wd)  # wave positions
        self.sets = sets = foldshare.mask_sets(self.wx, self.wd, self.groups)  # groups folded together
        self.members = [[j for g in gs for j in self.groups[g]] for gs in sets]  # plans of each set, by group
        self.set_of = {j: d for d, js in enumerate(self.members) for j in js}
        self.group_of = {j: g for g, js in enumerate(self.groups) for j in js}
        most = check_threads(threads) if threads is not None else (os.cpu_count() or 1)
        self.together = [
            d
            for d, gs in enumerate(sets)
            if (k := foldshare.fold_key(self.wx[self.members[d][0]], self.wd[self.members[d][0]])) is not None
            and setmerge.sums_bytes(self.wx[self.members[d][0]], len(gs), k.consensus) * most <= cache_bytes
        ]
        alone = [j for d, js in enumerate(self.members) if d not in self.together for j in js]
        self.runner = {("set", d): r for r, d in enumerate(self.together)}
        self.runner.update({("plan", j): len(self.together) + r for r, j in enumerate(alone)})
        many = {g: foldshare.bands(self.wx[self.groups[g][0]]) for gs in sets if len(gs) > 1 for g in gs}
        self.bands = many
        self.folds = foldshare.SharedFolds([len(js) for js in self.groups], cache_bytes, sets, many)
        # one reader per set: a block is read by the one merge of the set that folds it
        keys = [plan_keys(self.wx[js[0]]) for js in self.members]
        self.shared = SharedReads(Counter(k for ks in keys for k in ks.values()), cache_bytes)
        self.readers = [_Reader(ks, self.shared) for ks in keys]
        self.running = [len(js) + (d in self.together) for d, js in enumerate(self.members)]  # not finished
        self.feeds = {j: setmerge.Feed() for d in self.together for j in self.members[d]}
        self.mergers: list[Any] = []  # the SetMergers started (their fold counts)
        self.lock = threading.Lock()
        self.pace = Pace(len(self.runner))
        self.threads = _threads(threads, len(self.runner))

    @property
    def folds_shared(self) -> int:
        """Blocks a plan finished from sums folded for another plan of its set."""
        return self.folds.shared + sum(m.shared for m in self.mergers)

    def _done(self, d: int) -> None:
        with self.lock:
            self.running[d] -= 1
            last = self.running[d] == 0
        if last:
            self.readers[d].release()

    def produce(self, d: int) -> BaseException | None:
        """Set d's merge (setmerge.produce), feeding its plans' writers; its error, if any (the
        plans fail with it)."""
        from . import setmerge

        js, gs = self.members[d], self.sets[d]
        q = {g: i for i, g in enumerate(gs)}

        def merger() -> setmerge.SetMerger:
            m = setmerge.SetMerger(
                [self.wx[j] for j in js],
                [q[self.group_of[j]] for j in js],
                [self.bands[g] for g in gs] if len(gs) > 1 else None,
                self.wd[js[0]],
                self.threads,
                self.readers[d],
            )
            self.mergers.append(m)
            return m

        r = self.runner[("set", d)]
        try:
            setmerge.produce(merger, [self.feeds[j] for j in js], lambda: self.pace.step(r))
            return None
        except BaseException as e:  # every plan of the set got it through its feed
            return e
        finally:
            self.pace.finish(r)
            self._done(d)

    def run(self, j: int, work: Work) -> Any:
        """`work(slot)` for the wave's j-th plan."""
        d, g = self.set_of[j], self.group_of[j]
        feed = self.feeds.get(j)
        if feed is not None:  # its set's merge paces itself; this plan only writes
            try:
                return work(Slot(feed, self.readers[d], None, lambda: None, self.threads))
            finally:
                feed.stop()  # the set's merge puts nothing more for this plan
                self._done(d)
        r = self.runner[("plan", j)]
        fold = self.folds.block(g) if self.folds.plans(g) > 1 else None
        try:
            return work(Slot(None, self.readers[d], fold, lambda: self.pace.step(r), self.threads))
        finally:
            self.pace.finish(r)
            self._done(d)

    def results(self, work: Callable[[int], Work]) -> Generator[Any, None, None]:
        """Run `work(i)` for every plan of the wave at once; their futures in order."""
        n = len(self.idx) + len(self.together)
        with ThreadPoolExecutor(n, thread_name_prefix="mergedb-sweep") as pool:
            started: set[int] = set()  # sets whose merge was submitted
            futs: list[Any] = []
            try:
                for d in self.together:
                    pool.submit(self.produce, d)
                    started.add(d)
                for j, i in enumerate(self.idx):
                    futs.append(pool.submit(self.run, j, work(i)))
                yield from futs
            except BaseException:  # the caller stopped (Ctrl-C, an abandoned generator): stop the others
                self.pace.cancel()  # a set's merge stops at its next tensor and fails its feeds
                # a Ctrl-C may land between two submits: what waits on one never submitted must not wait
                # for ever, or the pool's exit does (a set's merge filling a feed no writer reads, a writer
                # reading a feed no merge fills)
                stopped = MergeDBError("the sweep was stopped; this plan's output was not installed")
                for j, feed in self.feeds.items():
                    if j >= len(futs):  # (its writer may have started as the submit was cut: it gets the error)
                        feed.stop()
                        feed.close(stopped)
                    elif self.set_of[j] not in started:
                        feed.close(stopped)
                raise


def _threads(threads: int | None, in_flight: int) -> int:
    if threads is not None:
        return check_threads(threads)
    return max(1, (os.cpu_count() or 1) // max(1, in_flight))
