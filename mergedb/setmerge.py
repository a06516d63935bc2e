"""One merge producing the outputs of several plans: a sweep's fold set, merged together.

The plans of one fold set (foldshare.mask_sets: one FoldKey group, or TIES-style groups over one
mask that fold in one pass) read the same base and expert blocks and fold them to sums that differ
only by group. `SetMerger` does that once for the whole set: each base tensor is read once (not
once per plan), each selected block is folded once (into G sets of sums when the set has G
groups, multifold.fold_many), and each plan's output block is finished from its group's sums with
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
from .executor import ShardsWritten, write_shard
from .layout import block_bytes, output_dtype, row_elems
from .manifest import ExecutionPlan
from .merger import AHEAD_BYTES, Bands, Merger, ReadBlock, Unit
from .tensorfile import DTYPES, tensor_nbytes

FEED = 2  # finished tensors a plan's writer may have waiting
_NO_F32, _NO_BF16 = np.empty(0, np.float32), np.empty(0, np.uint16)  # `kernels.finish`'s unused output

Item = tuple[int, str, str, tuple[int, ...], np.ndarray, bool]  # (tensor_idx, name, dtype, shape, bytes, pooled)


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
        self.free: dict[int, list[np.ndarray]] = collections.defaultdict(list)
        self.free_bytes = 0
        self.pool_lock = threading.Lock()
        self.folds = self.shared = 0  # blocks folded once; plans that finished one without folding it

    # -- buffers -------------------------------------------------------------------------------

    def buffer(self, size: int) -> np.ndarray:
        with self.pool_lock:
            if self.free[size]:
                self.free_bytes -= size
                return self.free[size].pop()
        return np.empty(size, np.uint8)

    def give_back(self, buf: np.ndarray) -> None:
        """A plan's writer is done with `buf`: keep it for a later tensor of its size (a few per plan)."""
        with self.pool_lock:
            if self.free_bytes + buf.nbytes <= len(self.plans) * AHEAD_BYTES:
                self.free[buf.nbytes].append(buf)
                self.free_bytes += buf.nbytes

    # -- scheduling ----------------------------------------------------------------------------

    def plan_tensors(self, indices: list[int]) -> Iterator[tuple[int, list[np.ndarray] | None, np.ndarray]]:
        """(tensor_idx, each plan's output buffer or None, base bytes) in the order of `indices`;
        None: the plans' output is the base's bytes. As Merger.tensors: a bounded reorder buffer."""
        pending: collections.deque[tuple[int, Future[np.ndarray], list[Future[None]], list[np.ndarray] | None]]
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

    def _start_set(self, ti: int) -> tuple[int, Future[np.ndarray], list[Future[None]], list[np.ndarray] | None]:
        t = self.xp.tensors[ti]
        base_f = self.io.submit(self._read_base, ti)
        units = self.units(ti)
        if not units:
            return ti, base_f, [], None
        outs = [self.buffer(tensor_nbytes(output_dtype(t, self.dtype), t.shape)) for _ in self.plans]
        merged = {b for u in units for b in u.blocks}
        rest = [b for b in range(len(t.rows)) if b not in merged]  # the base's bytes (same dtype: see units)
        futs = [self.compute.submit(self._copy_base, ti, rest, base_f, outs)] if rest else []
        futs += [self.compute.submit(self._run_set, u, base_f, outs) for u in units]
        return ti, base_f, futs, outs

    def _copy_base(self, ti: int, blocks: list[int], base_f: Future[np.ndarray], outs: list[np.ndarray]) -> None:
        base = base_f.result()
        for b in blocks:
            lo, hi = block_bytes(self.xp.tensors[ti], base.nbytes, b)
            for out in outs:
                out[lo:hi] = base[lo:hi]

    # -- arithmetic ----------------------------------------------------------------------------

    def _run_set(self, u: Unit, base_f: Future[np.ndarray], outs: list[np.ndarray]) -> None:
        """Fold each block of `u` once, then finish every plan's output block from its group's sums."""
        base_raw = base_f.result()
        ti = u.tensor_idx
        for b in u.blocks:
            _, n, _, _ = self._block(ti, b, base_raw)
            if self.bands is not None:
                acc = self.local.get("acc", self.nsums * 5 * n, np.float32).reshape(self.nsums, 5, n)
                self._fold(ti, b, base_raw, acc, tuple(np.stack([bd[i][ti] for bd in self.bands]) for i in range(3)))
            else:
                acc = self.local.get("acc", (5 if self.method.consensus else 1) * n, np.float32).reshape(-1, n)
                self._fold(ti, b, base_raw, acc)
            for p, out in enumerate(outs):
                self._finish_plan(p, ti, b, base_raw, acc[self.group_of[p]] if self.bands is not None else acc, out)
            with self._lock:
                self.folds += 1
                self.shared += len(outs) - 1

    def _finish_plan(self, p: int, ti: int, b: int, base_raw: np.ndarray, acc: np.ndarray, out: np.ndarray) -> None:
        """Plan p's block b of tensor ti from the sums `acc`: merger.Merger._finish with p's λ,
        normalize and base scale."""
        t = self.xp.tensors[ti]
        out_dtype = output_dtype(t, self.dtype)
        out_dt = np.dtype(DTYPES[out_dtype][1])
        kind = kernels.IN_KIND[t.dtype]
        lo, n, _, base = self._block(ti, b, base_raw)
        tv = self.lams[p].get((0, ti)) or self.lam0[p]  # λ and the base scale are per tensor
        lam, scale, normalize = tv.lam, tv.base_scale, self.normalize[p]
        target = out.view(out_dt)[lo : lo + n]
        if out_dtype == "BF16":  # rounded inside the kernel
            kernels.finish(base, kind, acc, normalize, lam, _NO_F32, target.view(np.uint16), scale)
        elif out_dtype == "F32":
            kernels.finish(base, kind, acc, normalize, lam, target, _NO_BF16, scale)
        else:  # F16: numpy's float32 -> float16 rounding, from a reused float32 buffer
            res = self.local.get("res", n, np.float32)  # (n,) float32
            kernels.finish(base, kind, acc, normalize, lam, res, _NO_BF16, scale)
            target[...] = res


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

    def stop(self) -> None:
        """The writer failed or finished early: unblock the producer and drop what waits."""
        self.dead = True
        while True:
            try:
                self.q.get_nowait()
            except queue.Empty:
                return

    def tensors(self, indices: list[int], keep: bool = False) -> Iterator[tuple[str, str, tuple[int, ...], np.ndarray]]:
        """(name, dtype, shape, bytes) of tensors `indices`, which must come next; a written buffer
        goes back to the pool when the next is asked for (`keep`: never, the caller holds them)."""
        for want in indices:
            item = self.q.get()
            if isinstance(item, BaseException):
                raise item
            ti, name, dt, shape, data, pooled = item
            if ti != want:
                raise MergeDBError(f"sweep: tensor {ti} came where {want} was expected (a bug in mergedb)")
            if keep and not pooled:
                data = data.copy()  # the base's bytes, shared by the set's plans: each state its own
            yield name, dt, shape, data
            if pooled and not keep and self.merger is not None:
                self.merger.give_back(data)

    def write_shards(
        self,
        xp: ExecutionPlan,
        groups: list[list[int]],
        names: list[str],
        tmp: Path,
        dtype: str | None,
        progress: Callable[[int], None] | None,
    ) -> ShardsWritten:
        """executor.WriteShards: the plan's shards from this feed (executor.write_shard on each)."""
        hashes: dict[str, str] = {}
        weight_map: dict[str, str] = {}
        written = 0
        try:
            for fname, group in zip(names, groups):
                h, n = write_shard(self, xp, group, tmp / fname, dtype, progress)  # type: ignore[arg-type]
                hashes.update(h)
                weight_map.update(dict.fromkeys(h, fname))
                written += n
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
            for p, feed in enumerate(feeds):
                feed.put((ti, t.name, dt, t.shape, base if outs is None else outs[p], outs is not None))
            step()
    except BaseException as e:
        for feed in feeds:
            feed.put(e)
        raise
    finally:
        if merger is not None:
            merger.close()
