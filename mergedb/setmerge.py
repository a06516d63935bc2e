"""One merge producing the outputs of several plans: a sweep's fold set, merged together.

The plans of one fold set (foldshare.mask_sets: one FoldKey group, or TIES-style groups over one
mask that fold in one pass) read the same base and expert blocks and fold them to sums that differ
only by group. `SetMerger` does that once for the whole set: each base tensor is read once (not
once per plan), each selected block is folded once (into G sets of sums when the set has G
groups, kernels.fold_many), and each plan's output block is finished from its group's sums with
its own λ, normalize and base scale (`kernels.finish`, exactly as merger.py's `_finish`), into a
buffer of that plan. A tensor the plans do not merge is the base's bytes, one buffer for all.

The plans still write their own folders through `executor.execute` (its `write_shards` seam:
temporary folder, shards, manifest, fsync, atomic install); each plan's writer takes its tensors
from a `Feed`, and gives the buffer back to the set's pool once written (fresh buffers of a
tensor's size cost a page fault per 4 KiB). Every output has exactly the bytes of its plan executed
alone: the same kernels run on the same bytes in the same order (tests/test_sweep_set.py).

Memory: the Merger's reorder buffer (AHEAD_BYTES of later tensors, counted with all P outputs),
per compute thread the sums of one block (G × 5 float32 per element), and per plan at most FEED
finished tensors waiting for its writer.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from . import kernels
from .errors import MergeDBError
from .executor import ShardsWritten, write_shard_files
from .layout import block_bytes, output_dtype, row_elems
from .manifest import ExecutionPlan
from .merger import AHEAD_BYTES, Bands, Merger, ReadBlock, Unit
from .tensorfile import DTYPES, tensor_nbytes

FEED = 2  # finished tensors a plan's writer may have waiting
_NO_F32, _NO_BF16 = np.empty(0, np.float32), np.empty(0, np.uint16)  # `kernels.finish`'s unused output


class Lease:
    """A tensor's (P, bytes) output buffer, one row per plan, back to the pool when every plan's
    writer has given its row back."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.left = buf, buf.shape[0]


Item = tuple[
    int, str, str, tuple[int, ...], np.ndarray, "Lease | None"
]  # (tensor_idx, name, dtype, shape, bytes, lease)


def sums_bytes(xp: ExecutionPlan, groups: int, consensus: bool) -> int:
    """Bytes of one compute thread's running sums for the largest block of `xp`: G × (5 or 1) float32."""
    most = max((max((r1 - r0) for r0, r1 in t.rows) * row_elems(t.shape) for t in xp.tensors if t.rows), default=0)
    return groups * (5 if consensus else 1) * 4 * most


class SetMerger(Merger):
    """Merges `plans` (one fold set; `group_of[p]` is plan p's fold group, 0..G-1) in one pass.

    Reads, units and folds are those of `plans[0]`'s Merger (the set shares its mask, base,
    experts, output dtype and base scales; with one group its trims too); with G > 1 groups,
    `bands[g]` is group g's (weight, lo, hi) as foldshare.bands gives them."""

    def __init__(
        self,
        plans: Sequence[ExecutionPlan],
        group_of: Sequence[int],
        bands: Sequence[Bands] | None,
        dtype: str | None,
        threads: int,
        read_block: ReadBlock | None,
    ) -> None:
        super().__init__(plans[0], dtype, threads=threads, read_block=read_block)
        self.plans, self.group_of = list(plans), list(group_of)
        self.bands = list(bands) if bands and len(bands) > 1 else None
        self.nsums = len(self.bands) if self.bands else 1
        self.lams = [xp.tensor_values() for xp in plans]
        self.lam0 = [xp.default_values(0) for xp in plans]
        self.normalize = [bool(xp.params.get("normalize", True)) for xp in plans]
        self.group_arr = np.array(self.group_of, np.int64)
        self.normalize_arr = np.array(self.normalize, np.bool_)
        self.free: dict[int, list[np.ndarray]] = collections.defaultdict(list)
        self.free_bytes = 0
        self.pool_lock = threading.Lock()
        self.folds = self.shared = 0  # blocks folded once; plans that finished one without folding it

    # -- buffers -------------------------------------------------------------------------------

    def buffer(self, size: int) -> np.ndarray:
        """A (P, size) uint8 buffer: every plan's output of one tensor, from the pool when it holds one."""
        with self.pool_lock:
            if self.free[size]:
                self.free_bytes -= size * len(self.plans)
                return self.free[size].pop()
        return np.empty((len(self.plans), size), np.uint8)

    def give_back(self, lease: Lease) -> None:
        """A plan's writer is done with its row of `lease`; the last one's keeps the buffer for a
        later tensor of its size (at most AHEAD_BYTES per plan are kept)."""
        with self.pool_lock:
            lease.left -= 1
            buf = lease.buf
            if lease.left == 0 and self.free_bytes + buf.nbytes <= len(self.plans) * AHEAD_BYTES:
                self.free[buf.shape[1]].append(buf)
                self.free_bytes += buf.nbytes

    # -- scheduling ----------------------------------------------------------------------------

    def plan_tensors(self, indices: list[int]) -> Iterator[tuple[int, np.ndarray | None, np.ndarray]]:
        """(tensor_idx, the plans' (P, bytes) outputs or None, base bytes) in the order of `indices`;
        None: the plans' output is the base's bytes. As Merger.tensors: a bounded reorder buffer."""
        pending: collections.deque[tuple[int, Future[np.ndarray], list[Future[None]], np.ndarray | None]]
        pending = collections.deque()
        ahead = nxt = 0
        while nxt < len(indices) or pending:
            while nxt < len(indices) and (not pending or ahead < AHEAD_BYTES):
                ti = indices[nxt]
                nxt += 1
                pending.append(self._start_set(ti))
                ahead += self._nbytes(ti)
            ti, base_f, futs, outs = pending.popleft()
            for f in futs:
                f.result()
            ahead -= self._nbytes(ti)
            yield ti, outs, base_f.result()

    def _nbytes(self, ti: int) -> int:
        t = self.xp.tensors[ti]
        return tensor_nbytes(t.dtype, t.shape) + len(self.plans) * tensor_nbytes(output_dtype(t, self.dtype), t.shape)

    def _start_set(self, ti: int) -> tuple[int, Future[np.ndarray], list[Future[None]], np.ndarray | None]:
        t = self.xp.tensors[ti]
        base_f = self.io.submit(self._read_base, ti)
        units = self.units(ti)
        if not units:
            return ti, base_f, [], None
        outs = self.buffer(tensor_nbytes(output_dtype(t, self.dtype), t.shape))  # (P, bytes)
        merged = {b for u in units for b in u.blocks}
        rest = [b for b in range(len(t.rows)) if b not in merged]  # the base's bytes (same dtype: see units)
        futs = [self.compute.submit(self._copy_base, ti, rest, base_f, outs)] if rest else []
        futs += [self.compute.submit(self._run_set, u, base_f, outs) for u in units]
        return ti, base_f, futs, outs

    def _copy_base(self, ti: int, blocks: list[int], base_f: Future[np.ndarray], outs: np.ndarray) -> None:
        base = base_f.result()
        for b in blocks:
            lo, hi = block_bytes(self.xp.tensors[ti], base.nbytes, b)
            outs[:, lo:hi] = base[lo:hi]  # every plan's row

    # -- arithmetic ----------------------------------------------------------------------------

    def _run_set(self, u: Unit, base_f: Future[np.ndarray], outs: np.ndarray) -> None:
        """Fold each block of `u` once, then finish every plan's output block from its group's sums
        (kernels.finish_many: the base decoded once for all; F16 outputs plan by plan)."""
        base_raw = base_f.result()
        ti = u.tensor_idx
        t = self.xp.tensors[ti]
        out_dtype = output_dtype(t, self.dtype)
        for b in u.blocks:
            lo, n, _, base = self._block(ti, b, base_raw)
            acc: np.ndarray  # (G, 5, n) float32 sums of the set's G groups, or (1 or 5, n) of its one group
            if self.bands is not None:
                acc = self.local.get("acc", self.nsums * 5 * n, np.float32).reshape(self.nsums, 5, n)
                w, t_lo, t_hi = (np.stack([bd[i][ti] for bd in self.bands]) for i in range(3))  # (G, K) each
                self._fold(ti, b, base_raw, acc, (w, t_lo, t_hi))
            else:
                acc = self.local.get("acc", (5 if self.method.consensus else 1) * n, np.float32).reshape(-1, n)
                self._fold(ti, b, base_raw, acc)
            if out_dtype == "F16":
                for p, out in enumerate(outs):
                    self._finish_plan(p, ti, b, base_raw, acc[self.group_of[p]] if self.bands is not None else acc, out)
            else:
                sums = acc if self.bands is not None else acc.reshape(1, *acc.shape)  # (G, S, n)
                lam, scale = self._lam_scale(ti)
                flat = outs.view(DTYPES[out_dtype][1]).reshape(-1)  # P rows of `stride` elements
                stride, kind = flat.size // len(outs), kernels.IN_KIND[t.dtype]
                args = (base, kind, sums, self.group_arr, self.normalize_arr, lam, scale)
                if out_dtype == "BF16":
                    kernels.finish_many(*args, _NO_F32, flat, stride, lo)
                else:
                    kernels.finish_many(*args, flat, _NO_BF16, stride, lo)
            with self._lock:
                self.folds += 1
                self.shared += len(outs) - 1

    def _lam_scale(self, ti: int) -> tuple[np.ndarray, float]:
        """Each plan's λ in tensor ti (P,) float64, and the set's base scale there."""
        tvs = [lams.get((0, ti)) or lam0 for lams, lam0 in zip(self.lams, self.lam0)]
        return np.array([tv.lam for tv in tvs], np.float64), tvs[0].base_scale

    def _finish_plan(self, p: int, ti: int, b: int, base_raw: np.ndarray, acc: np.ndarray, out: np.ndarray) -> None:
        """Plan p's block b of tensor ti from the sums `acc`: merger.Merger._finish with p's λ,
        normalize and base scale."""
        tv = self.lams[p].get((0, ti)) or self.lam0[p]  # λ and the base scale are per tensor
        self._finish(ti, b, base_raw, acc, out, tv, self.normalize[p])


class Feed:
    """One plan's tensors from its set's SetMerger, in header order, for executor.execute's
    `write_shards` (or an in-memory state). `close(error)` ends it: the writer raises."""

    def __init__(self) -> None:
        self.merger: SetMerger | None = None  # set by `produce` before the first tensor
        self.q: queue.Queue[Item | BaseException] = queue.Queue(FEED)
        self.dead = False  # the writer stopped: the producer puts nothing more

    def put(self, item: Item | BaseException) -> None:
        if not self.dead:
            self.q.put(item)

    def close(self, error: BaseException) -> None:
        """End the feed with `error` for its writer (its set's merge never started: the queue is empty)."""
        try:
            self.q.put_nowait(error)
        except queue.Full:  # the merge did start: it ends the feed itself
            pass

    def stop(self) -> None:
        """The writer failed or finished early: unblock the producer and drop what waits."""
        self.dead = True
        while True:
            try:
                self.q.get_nowait()
            except queue.Empty:
                return

    def tensors(
        self, indices: list[int], keep: bool = False, copy: bool = False
    ) -> Iterator[tuple[str, str, tuple[int, ...], np.ndarray]]:
        """(name, dtype, shape, bytes) of tensors `indices`, which must come next; a written row goes
        back to the pool when the next is asked for (`keep`: each a copy, which the caller holds).
        `copy` (Merger.tensors' offer of the base's file range for untouched tensors) is declined:
        the set's producer already holds every tensor's bytes, so the feed always yields arrays."""
        for want in indices:
            item = self.q.get()
            if isinstance(item, BaseException):
                raise item
            ti, name, dt, shape, data, lease = item
            if ti != want:
                raise MergeDBError(f"sweep: tensor {ti} came where {want} was expected (a bug in mergedb)")
            if keep:
                data = data.copy()  # a row of the set's buffer, or the base's bytes: each state its own
            yield name, dt, shape, data
            if lease is not None and self.merger is not None:
                self.merger.give_back(lease)

    def write_shards(
        self,
        xp: ExecutionPlan,
        groups: list[list[int]],
        names: list[str],
        tmp: Path,
        dtype: str | None,
        progress: Callable[[int], None] | None,
    ) -> ShardsWritten:
        """executor.WriteShards: the plan's shards from this feed (executor.write_shard_files)."""
        try:
            hashes, weight_map, written = write_shard_files(self, xp, groups, names, tmp, dtype, progress)  # type: ignore[arg-type]
        except BaseException:
            self.stop()
            raise
        m = self.merger
        return ShardsWritten(hashes, weight_map, written, m.count.expert if m else 0, m.count.base if m else 0)


def produce(make: Callable[[], SetMerger], feeds: Sequence[Feed], step: Callable[[], None]) -> None:
    """Run the set's merge (`make()` builds it) and hand each plan its tensors; `step()` after each
    tensor (the sweep's pace). An error ends every feed with it (each plan then fails with it);
    when every plan's writer has stopped, the merge stops too."""
    merger = None
    try:
        merger = make()
        for feed in feeds:
            feed.merger = merger
        indices = list(range(len(merger.xp.tensors)))
        for ti, outs, base in merger.plan_tensors(indices):
            if all(f.dead for f in feeds):
                raise MergeDBError("every plan of this fold set stopped; its merge stopped too")
            t = merger.xp.tensors[ti]
            dt = output_dtype(t, merger.dtype)
            lease = None if outs is None else Lease(outs)
            for p, feed in enumerate(feeds):
                if feed.dead and lease is not None:
                    merger.give_back(lease)  # this plan stopped: its row is not written
                feed.put((ti, t.name, dt, t.shape, base if outs is None else outs[p], lease))
            step()
    except BaseException as e:
        for feed in feeds:
            feed.put(e)
        raise
    finally:
        if merger is not None:
            merger.close()
