"""The merge engine: produces a plan's merged tensors, in header order, on all cores.

Threads. The work is a plain list of `Unit`s, one per (tensor, block) that an expert touches, or per
span of consecutive blocks with one expert set (at most SPAN_BYTES: one read per expert and one
kernel call for an `auto` layout's small vocabulary blocks; layout.spans) (model_stock's scale t
needs the whole tensor: its block units fold their sums and dots, and the tensor's last unit applies
t; see stock.py). It is long because the scheduler and every method's fused block path share the
per-block state kept here. Units write disjoint rows of their tensor's output and each element's
float32 operations run in the same order on any thread, so the output bytes do not depend on the
thread count or on the order units run in. `threads` compute threads run units (the compiled kernels
release the GIL: ctypes calls, nogil numba); IO_THREADS threads read the base and the expert blocks
ahead of them; the caller receives tensors in header order from a reorder buffer of at most
AHEAD_BYTES of later tensors. Memory: per compute thread, the running sums of one block (5 float32
per element for TIES-style methods, 1 otherwise) and two groups of READ_AHEAD expert blocks (of
small blocks, up to SMALL_GROUP_BYTES of them; one being folded in, one being read), reused from
block to block; a block or span of more than slicefold.SLICE_BYTES is merged slice by slice, so
these hold one slice's (slicefold.py: the sums stay in cache); plus the tensors in the reorder
buffer. None of it grows with K, except for model_stock: every expert block of one block at once per
thread (its pairwise dots), and its tensor's float32 update.

A block that a LoRA adapter of the plan contributes to is formed from the adapter's factors and
folded as float32, one expert at a time (loramerge.py); every other block takes the path above.
"""

from __future__ import annotations

import collections
import os
import random
import threading
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from . import fetchplan, kernels, methods, slicefold, stepwise
from .checkpoint import PlanInputs
from .errors import ChangedFileError
from .layout import TensorLayout, block_bytes, output_dtype, row_elems, span_bytes, spans
from .lora import is_adapter
from .manifest import ExecutionPlan, Source
from .remote import is_url
from .stock import StockTensor
from .tensorfile import DTYPES, FileRange, normalize_dtype, tensor_nbytes
from .tensorparams import TensorParams
from .units import check_threads

READ_AHEAD = 3  # expert blocks folded in per kernel call; the next group is read meanwhile
SMALL_GROUP_BYTES = 64 << 10  # small blocks: as many experts a group as fit here (one kernel call),
# and a group this size or less is read on the merge thread, not handed to an I/O thread: its reads then
# overlap no arithmetic (measured on a local disk only: a group of tiny blocks costs less to read than
# to hand over; on slow network storage the hand-over may be worth it again)
IO_THREADS = 4  # threads that only read (pread releases the GIL)
AHEAD_BYTES = 64 * 2**20  # later tensors in flight while one is written (the reorder buffer)
SPAN_BYTES = 4 * 2**20  # consecutive blocks with one expert set merged as one unit up to this size
_NO_F32, _NO_BF16 = np.empty(0, np.float32), np.empty(0, np.uint16)  # `kernels.finish`'s unused output


# read_block(tensor_idx, block_idx, position, raw, pread): fill `raw` (uint8, the block's exact size)
# with expert `position`'s bytes of that block; `pread(buf)` reads them from the file into `buf`.
# None: pread(raw). A sweep passes one that serves a block read once to every plan (sweep.py).
ReadBlock = Callable[[int, int, int, np.ndarray, Callable[[np.ndarray], None]], None]
# fold_block(tensor_idx, block_idx, acc, fold, finish): call `finish(sums)` once with the block's
# running sums, folded here by `fold(buf)` (into `acc` or a buffer of the same shape) or folded by
# another plan with the same fold (foldshare.py; `finish` only reads them); True when `fold` ran
# here. `fold(buf, bands)` folds several TIES-style trims at once: buf (G, 5, n), bands = Bands of
# (G, K) arrays (weight, keep |Δ| ≥ lo, < hi per set and expert position), as kernels.fold_many.
# None: fold(acc), finish(acc). Only the fused, non-model_stock path calls it.
Bands = tuple[np.ndarray, np.ndarray, np.ndarray]
Fold = Callable[..., None]
FoldBlock = Callable[[int, int, np.ndarray, Fold, Callable[[np.ndarray], None]], bool]


def _loramerge() -> Any:
    """loramerge.py (and the LoRA scan code it uses), imported only for plans with adapters."""
    from . import loramerge

    return loramerge


@dataclass
class Counters:
    expert: int = 0
    base: int = 0


@dataclass(frozen=True)
class Unit:
    """One independent piece of work: merge blocks `blocks` of tensor `tensor_idx` into its output.

    Units touch disjoint rows of the output, so any worker may run them in any order; the unit
    list of a plan is a plain list (the same list could be shipped to remote workers)."""

    tensor_idx: int
    blocks: tuple[int, ...]


class _ThreadBuffers(threading.local):
    """Per-thread reused buffers (fresh large allocations cost page faults on every block)."""

    def __init__(self) -> None:
        self.bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, n: int, dtype: Any) -> np.ndarray:
        buf = self.bufs.get(name)
        if buf is None or buf.size < n or buf.dtype != dtype:
            buf = self.bufs[name] = np.empty(n, dtype)
        return buf[:n]


_TRIM_COLUMNS = ("t_lo", "t_hi", "rank_codes", "rank_counts")  # what _make_trim reads of a plan's thresholds


class Merger:
    """Produces merged tensors of a plan; one per process (or worker), fed tensor indices.

    Arithmetic runs on `threads` compute threads, one `Unit` at a time each; expert and base reads
    run on I/O threads ahead of it (a group of READ_AHEAD expert blocks is read while the previous
    group is folded in; a group of small blocks, on the compute thread itself). Tensors come out in
    the order asked for: at most AHEAD_BYTES of later tensors are in flight while one is being
    written (a bounded reorder buffer), so memory is threads × a few blocks plus those tensors,
    whatever K."""

    def __init__(
        self,
        xp: ExecutionPlan,
        dtype: str | None = None,
        verify: bool = False,
        threads: int | None = None,
        unit_order_seed: int | None = None,
        read_block: ReadBlock | None = None,
        fold_block: FoldBlock | None = None,
        tensors: Collection[int] | None = None,
    ) -> None:
        """`tensors`: the only tensors this merger will merge (a Ray task's shard), so that only
        their reads are declared to remote sources (fetched ahead); None: every tensor of `xp`."""
        # a server may answer a range with other bytes (fsspec does not check Content-Range): blocks
        # read from a URL are always checked against their registered hashes, as --verify does
        verify = verify or any(is_url(s.path) for s in (xp.base, *xp.experts))
        self.xp, self.verify = xp, verify
        self.read_block, self.fold_block = read_block, fold_block
        self.dtype = normalize_dtype(dtype)
        self.method = methods.get_method(xp.method)
        self.sel = xp.selected(hashes=verify)
        self._trim_cache: dict[tuple[int, int], kernels.Trim] = {}
        # the plan's thresholds by (position, tensor_idx): a row number in an (experts, tensors) array and a
        # list per column (a dict per row was ~420 bytes: 135 MB at 16 experts of 20k tensors)
        self._trim_row = np.full((len(xp.experts), len(xp.tensors)), -1, np.int64)
        where = [xp.trims.column(c).to_numpy(zero_copy_only=False) for c in ("position", "tensor_idx")]
        self._trim_row[where[0].astype(np.int64), where[1].astype(np.int64)] = np.arange(xp.trims.num_rows)
        self.trims = {c: xp.trims.column(c).to_pylist() for c in xp.trims.column_names if c in _TRIM_COLUMNS}
        self.threads = (os.cpu_count() or 1) if threads is None else check_threads(threads)
        self.order = random.Random(unit_order_seed) if unit_order_seed is not None else None
        self.fused = self.method.sparsify in kernels.MODE
        self._stock: dict[int, StockTensor] = {}  # model_stock: tensors whose blocks are running
        self.values = xp.tensor_values()  # per (position, tensor_idx), where the plan sets them per tensor
        self.defaults = [xp.default_values(p) for p in range(len(xp.experts))]
        self.io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="mergedb-io")
        self.lora = _loramerge().LoraInputs(xp) if any(is_adapter(s.path) for s in xp.experts) else None
        try:  # remote files fetch ahead on the I/O threads; adapters are read by self.lora
            self.inputs = PlanInputs(xp, self.lora.positions if self.lora else frozenset(), pool=self.io)
        except BaseException:
            self.io.shutdown()
            if self.lora:
                self.lora.close()
            raise
        # spans (units()): one read per expert and one kernel call for consecutive blocks with one expert
        # set, exact (kernels are elementwise, keyed by element offset); not where a block is its own unit
        # (nor for remote files: their reads are declared block by block, fetchplan.declare_merge). The
        # same path merges a block or span larger than a slice slice by slice (slicefold.py)
        plain = xp.method != "model_stock" and self.lora is None and not verify
        remote = any(src.remote for where in self.inputs.where for src, _, _ in where.values())
        self.spans = self.fused and plain and not remote and read_block is None and fold_block is None
        self.local_files = not remote
        fetchplan.declare_merge(xp, self.inputs, tensors)
        self.count = Counters()
        self._lock = threading.Lock()
        self.compute = ThreadPoolExecutor(self.threads, thread_name_prefix="mergedb-merge")
        self.local = _ThreadBuffers()
        if self.fused:  # loading the kernels overlaps the first reads (the pools run FIFO)
            stock = xp.method == "model_stock"
            kinds = {t.dtype for t in xp.tensors if t.mergeable and t.dtype in kernels.IN_KIND}
            for bits in {np.uint32 if k == "F32" else np.uint16 for k in kinds}:
                self.compute.submit(kernels.warm, bits, stock)

    def close(self, wait: bool = True) -> None:
        """Stop the pools. `wait=False` after a failure or an interrupt: a worker may never finish (one
        loading numba's cache can wait forever on an import lock that Ctrl-C left held in the main
        thread), and its results are discarded anyway; it only reads inputs."""
        self.compute.shutdown(wait=wait, cancel_futures=True)
        self.io.shutdown(wait=wait, cancel_futures=True)
        self.inputs.close()
        if self.lora:
            self.lora.close()

    def _read_base(self, ti: int) -> np.ndarray:
        """The base's bytes of tensor `ti` (streamed in full, unbudgeted)."""
        t = self.xp.tensors[ti]
        src, info, path = self.inputs.where[0][t.name]
        base = np.empty(info.nbytes, np.uint8)
        src.read_into(memoryview(base), info.start)
        with self._lock:
            self.count.base += info.nbytes
        if self.verify and t.base_hashes:
            for b in range(len(t.rows)):
                lo, hi = block_bytes(t, info.nbytes, b)
                if xxhash.xxh3_128_hexdigest(base[lo:hi]) != t.base_hashes[b]:
                    raise ChangedFileError(
                        f"{path}: block {b} of {t.name!r} changed since registration; register the base again"
                    )
        return base

    def pread_block(self, ti: int, b: int | tuple[int, ...], pos: int, raw: np.ndarray, skip: int = 0) -> None:
        """Fill `raw` with expert `pos`'s bytes of block `b` (or span) of tensor `ti` from byte `skip`
        of the block on, from its file."""
        t = self.xp.tensors[ti]
        src, info, _ = self.inputs.where[pos + 1][t.name]
        lo, _ = span_bytes(t, info.nbytes, b)
        src.read_into(memoryview(raw), info.start + lo + skip)

    def _read_one(
        self, ti: int, b: int | tuple[int, ...], pos: int, h: str, raw: np.ndarray | None = None, skip: int = 0
    ) -> np.ndarray:
        """Expert `pos`'s bytes of block `b` (or span: no --verify, no read_block) of tensor `ti`
        (into `raw` if given; checked against `h` with --verify). `skip`: a slice's bytes from byte
        `skip` of the block on, as many as `raw` holds (slicefold.py: no --verify, no read_block)."""
        t = self.xp.tensors[ti]
        fd, info, path = self.inputs.where[pos + 1][t.name]
        lo, hi = span_bytes(t, info.nbytes, b)
        if raw is None:
            raw = np.empty(hi - lo, np.uint8)
        if self.read_block is None:
            self.pread_block(ti, b, pos, raw, skip)
        else:
            self.read_block(ti, b, pos, raw, lambda buf: self.pread_block(ti, b, pos, buf))
        with self._lock:
            self.count.expert += raw.nbytes
        if self.verify and xxhash.xxh3_128_hexdigest(raw) != h:
            raise ChangedFileError(
                f"{path}: block {b} of {t.name!r} does not match its registered hash; the file changed "
                "since registration: re-register it with --refresh and plan again"
            )
        return raw

    # -- scheduling ----------------------------------------------------------------------------

    def units(self, ti: int) -> list[Unit]:
        """The units of tensor `ti`; none when the base's bytes are the output (copied without decoding)."""
        t = self.xp.tensors[ti]
        selected = self.sel.get(ti, {})
        # untouched rows keep the base's bytes unless the dtype changes or SLERP scales θ₀ (s0 + s1 ≠ 1)
        rescale = self._values(0, ti).base_scale != 1.0
        if not t.mergeable or (not selected and output_dtype(t, self.dtype) == t.dtype and not rescale):
            return []
        blocks = list(range(len(t.rows))) if output_dtype(t, self.dtype) != t.dtype or rescale else sorted(selected)
        if self.xp.method == "model_stock" and not self.fused:  # per-step path: the tensor in one unit
            return [Unit(ti, tuple(blocks))]
        if self.spans:  # runs of consecutive blocks with one expert set (see __init__)
            nbytes = tensor_nbytes(t.dtype, t.shape)
            key = lambda b: [pos for pos, _ in selected.get(b, [])]  # noqa: E731
            return [Unit(ti, span) for span in spans(t, nbytes, blocks, key, SPAN_BYTES)]
        return [Unit(ti, (b,)) for b in blocks]

    def tensors(
        self, indices: list[int], copy: bool = False
    ) -> Iterator[tuple[str, str, tuple[int, ...], np.ndarray | FileRange]]:
        """(name, dtype, shape, bytes as uint8 array) of each merged tensor, in the order of `indices`;
        with `copy`, the base's `FileRange` for the tensors the plan leaves untouched (see base_range)."""
        pending: collections.deque[tuple[int, Future[np.ndarray] | FileRange, list[Future[None]], np.ndarray | None]]
        pending = collections.deque()
        ahead = 0  # bytes of tensors started but not yet handed out
        nxt = 0
        while nxt < len(indices) or pending:
            while nxt < len(indices) and (not pending or ahead < AHEAD_BYTES):
                ti = indices[nxt]
                nxt += 1
                rng = self.base_range(ti) if copy else None
                pending.append((ti, rng, [], None) if rng else self._start(ti))
                ahead += rng.nbytes if rng else self._nbytes(ti)  # a copy's read-ahead fills page cache
            ti, base_f, futs, out = pending.popleft()
            for f in futs:
                f.result()
            for pos in range(len(self.xp.experts)):  # its units are done: its trims are not needed again
                self._trim_cache.pop((pos, ti), None)
            t = self.xp.tensors[ti]
            copied = isinstance(base_f, FileRange)
            ahead -= base_f.nbytes if copied else self._nbytes(ti)
            data = base_f if copied else base_f.result() if out is None else out
            yield t.name, output_dtype(t, self.dtype), t.shape, data

    def base_range(self, ti: int) -> FileRange | None:
        """Where the base holds tensor `ti`'s output bytes, when the plan leaves it untouched (no unit,
        same dtype), the base is a local file and no --verify asks for its blocks' hashes. The writer
        copies these file to file (executor.write_shard); the kernel starts reading them ahead now."""
        t = self.xp.tensors[ti]
        if self.units(ti) or output_dtype(t, self.dtype) != t.dtype or (self.verify and t.base_hashes):
            return None
        src, info, path = self.inputs.where[0][t.name]
        if src.remote:
            return None
        os.posix_fadvise(src.fd, info.start, info.nbytes, os.POSIX_FADV_WILLNEED)
        with self._lock:  # read by the copy, as by _read_base
            self.count.base += info.nbytes
        return FileRange(src.fd, path, info.start, info.nbytes)

    def _nbytes(self, ti: int) -> int:
        t = self.xp.tensors[ti]
        return tensor_nbytes(t.dtype, t.shape) + tensor_nbytes(output_dtype(t, self.dtype), t.shape)

    def _start(self, ti: int) -> tuple[int, Future[np.ndarray], list[Future[None]], np.ndarray | None]:
        t = self.xp.tensors[ti]
        base_f = self.io.submit(self._read_base, ti)
        units = self.units(ti)
        if self.order is not None:
            self.order.shuffle(units)
        out_dtype = output_dtype(t, self.dtype)
        out = None  # the base buffer itself, overwritten block by block
        if units and out_dtype != t.dtype:
            out = np.empty(tensor_nbytes(out_dtype, t.shape), np.uint8)
        if units and self.fused and self.xp.method == "model_stock":
            self._stock[ti] = StockTensor(self.xp, ti, sorted(b for u in units for b in u.blocks))
        futs = [self.compute.submit(self.run_unit, u, base_f, out) for u in units]
        return ti, base_f, futs, out

    # -- arithmetic ----------------------------------------------------------------------------

    def run_unit(self, u: Unit, base_f: Future[np.ndarray], out: np.ndarray | None) -> None:
        """Merge unit `u` into `out` (or, when None, into the base's buffer in place)."""
        base_raw = base_f.result()
        if out is None:
            out = base_raw
        if self.fused and self.xp.method == "model_stock":
            self._stock_block(u.tensor_idx, u.blocks[0], base_raw, out)
        elif self.fused and len(u.blocks) > 1:  # a span (units())
            self._fused_block(u.tensor_idx, u.blocks, base_raw, out)
        elif self.fused:
            for b in u.blocks:
                if self._has_adapter(u.tensor_idx, b):  # formed from its factors, folded as float32
                    _loramerge().fused_block(self, u.tensor_idx, b, base_raw, out)
                else:
                    self._fused_block(u.tensor_idx, b, base_raw, out)
        else:
            stepwise.merge_slow(self, u, base_raw, out)

    def _has_adapter(self, ti: int, b: int) -> bool:
        return self.lora is not None and any(pos in self.lora.adapters for pos, _ in self.sel.get(ti, {}).get(b, []))

    def _block(self, ti: int, b: int | tuple[int, ...], base_raw: np.ndarray) -> tuple[int, int, np.dtype, np.ndarray]:
        """Block `b` (or span) of tensor `ti`: first element, count, raw-bits dtype, the base's (n,) raw bits."""
        t = self.xp.tensors[ti]
        raw_dt = np.dtype(DTYPES[t.dtype][1])
        bits_dt = np.dtype(np.uint32 if raw_dt.itemsize == 4 else np.uint16)
        r0, r1 = (t.rows[b][0], t.rows[b][1]) if isinstance(b, int) else (t.rows[b[0]][0], t.rows[b[-1]][1])
        lo, n = r0 * row_elems(t.shape), (r1 - r0) * row_elems(t.shape)
        return lo, n, bits_dt, base_raw[lo * raw_dt.itemsize : (lo + n) * raw_dt.itemsize].view(bits_dt)

    def _fused_block(self, ti: int, b: int, base_raw: np.ndarray, out: np.ndarray) -> None:
        """One block through the fused kernels: fold the selected experts into running sums (or take
        the sums from `fold_block`), then finish them into the output."""
        _, n, _, base = self._block(ti, b, base_raw)
        if n == 0:  # a zero-size tensor's block: nothing to fold or write (a unit when the dtype changes)
            return
        if self.spans and base.nbytes > slicefold.SLICE_BYTES:  # the running sums of a slice stay in cache
            slicefold.merge_sliced(self, ti, b, base_raw, out)
            return
        acc = self.local.get("acc", (5 if self.method.consensus else 1) * n, np.float32)
        acc = acc.reshape(-1, n)  # (1 or 5, n) float32 running sums
        if self.fold_block is None:
            self._fold(ti, b, base_raw, acc)
            self._finish(ti, b, base_raw, acc, out)
        elif not self.fold_block(
            ti,
            b,
            acc,
            lambda a, bands=None: self._fold(ti, b, base_raw, a, bands),
            lambda a: self._finish(ti, b, base_raw, a, out),
        ):
            with self._lock:  # the sums came from a plan with the same fold: count what this plan consumed
                self.count.expert += len(self.sel.get(ti, {}).get(b, [])) * base.nbytes

    def _fold(self, ti: int, b: int, base_raw: np.ndarray, acc: np.ndarray, bands: Bands | None = None) -> None:
        """Fold block `b` of tensor `ti`'s selected experts into `acc`: groups of READ_AHEAD experts,
        the next group read on the I/O threads while this one is folded in. With `bands`, into the
        (G, 5, n) sums of G TIES-style trims at once (see FoldBlock)."""
        t = self.xp.tensors[ti]
        kind = kernels.IN_KIND[t.dtype]
        lo, n, bits_dt, base = self._block(ti, b, base_raw)
        nb = base.nbytes
        acc.fill(0)
        groups = self._groups(ti, b, nb)
        most = max((len(g) for g in groups), default=0) * nb
        bufs = [self.local.get(f"ex{j}", most, np.uint8) for j in range(2)]
        inline = self.local_files and self.read_block is None and most <= SMALL_GROUP_BYTES

        def submit(gi: int) -> list[Future[np.ndarray]]:
            buf = bufs[gi % 2]
            if inline:  # a few small local reads: cheaper here than handed to an I/O thread and back
                for k, (pos, h) in enumerate(groups[gi]):
                    self._read_one(ti, b, pos, h, buf[k * nb : (k + 1) * nb])
                return []
            return [
                self.io.submit(self._read_one, ti, b, pos, h, buf[k * nb : (k + 1) * nb])
                for k, (pos, h) in enumerate(groups[gi])
            ]

        reads = submit(0) if groups else []
        for gi, grp in enumerate(groups):
            for f in reads:
                f.result()
            if gi + 1 < len(groups):
                reads = submit(gi + 1)
            ex = bufs[gi % 2][: len(grp) * nb].view(bits_dt).reshape(len(grp), n)  # (g, n) raw bits
            if bands is not None:  # each expert decoded once, trimmed and added into every set
                at = [pos for pos, _ in grp]
                w, t_lo, t_hi = (np.ascontiguousarray(x[:, at]) for x in bands)  # (G, g) each
                kernels.fold_many(base, ex, kind, w, t_lo, t_hi, acc)
                continue
            self._fold_group(ti, grp, base, ex, lo, acc)

    def _groups(self, ti: int, b: int | tuple[int, ...], nbytes: int) -> list[list[tuple[int, str]]]:
        """The (position, hash) of the experts block `b` of tensor `ti` reads (a span: its blocks' one
        expert set), in groups of READ_AHEAD, or of as many as fit in SMALL_GROUP_BYTES when its
        `nbytes` (one expert's) are small: a kernel call and its Python around it per group. Not for
        DELLA, whose calls take each expert's rank table (256 KiB, kernels.py) whatever the block."""
        work = self.sel.get(ti, {}).get(b if isinstance(b, int) else b[0], [])
        small = self.method.sparsify != "della"
        per = max(READ_AHEAD, SMALL_GROUP_BYTES // max(nbytes, 1)) if small else READ_AHEAD
        return [work[i : i + per] for i in range(0, len(work), per)]

    def _fold_group(
        self, ti: int, grp: list[tuple[int, str]], base: np.ndarray, ex: np.ndarray, lo: int, acc: np.ndarray
    ) -> None:
        """Fold one group of experts (`ex` (g, n) raw bits of (position, hash) `grp`) into `acc`; `base`
        (n,) raw bits, `lo` the first element's offset in the tensor (DARE/DELLA draws are keyed by it)."""
        t = self.xp.tensors[ti]
        kind = kernels.IN_KIND[t.dtype]
        mode = kernels.MODE[self.method.sparsify]
        draws = self.method.draws
        srcs = [self.xp.experts[pos] for pos, _ in grp]
        vals = [self._values(pos, ti) for pos, _ in grp]
        trims = [self._trim(pos, ti, t, src) for (pos, _), src in zip(grp, srcs)]
        coefs = np.array([v.weight if self.method.consensus else v.coef for v in vals], np.float32)
        t_lo = np.array([tr.t_lo for tr in trims], np.float64)
        t_hi = np.array([np.inf if tr.t_hi is None else tr.t_hi for tr in trims], np.float64)
        keys = np.array([tr.key for tr in trims], np.uint64)
        dens = [(v.density, v.epsilon or 0.0) for v in vals]
        ranks = np.stack([tr.rank for tr in trims]) if mode == kernels.MODE["della"] else kernels.NO_RANKS
        j0 = 0
        while j0 < len(grp):  # one call per run of experts with one DARE/DELLA density and ε (each
            j1 = j0 + 1  # element's operations and their order do not depend on where a group is cut)
            while j1 < len(grp) and (not draws or dens[j1] == dens[j0]):
                j1 += 1
            sl = slice(j0, j1)
            rk = ranks[sl] if len(ranks) else ranks
            p, eps = dens[j0]
            kernels.fold_group(base, ex[sl], kind, mode, lo, coefs[sl], t_lo[sl], t_hi[sl], keys[sl], p, eps, rk, acc)
            j0 = j1

    def _finish(
        self, ti: int, b: int, raw: np.ndarray, acc: np.ndarray, out: np.ndarray, tv=None, norm=None, part=None
    ) -> None:
        """Write block `b` of tensor `ti`: the base (times the tensor's base scale) plus the merged
        update of the sums `acc`; `tv`, `norm`: another plan's λ and normalize (setmerge's fold sets);
        `part` (first, count): only those elements of the block (slicefold.py)."""
        t = self.xp.tensors[ti]
        out_dtype = output_dtype(t, self.dtype)
        out_dt = np.dtype(DTYPES[out_dtype][1])
        kind = kernels.IN_KIND[t.dtype]
        lo, n, _, base = self._block(ti, b, raw)
        if part is not None:
            first, n = part
            base, lo = base[first : first + n], lo + first
        normalize = bool(self.xp.params.get("normalize", True)) if norm is None else norm
        tv = tv or self._values(0, ti)  # λ and the base scale are per tensor: the same at every position
        lam, scale = tv.lam, tv.base_scale
        target = out.view(out_dt)[lo : lo + n]
        if out_dtype == "BF16":  # rounded inside the kernel
            kernels.finish(base, kind, acc, normalize, lam, _NO_F32, target.view(np.uint16), scale)
        elif out_dtype == "F32":
            kernels.finish(base, kind, acc, normalize, lam, target, _NO_BF16, scale)
        else:  # F16: numpy's float32 -> float16 rounding, from a reused float32 buffer
            res = self.local.get("res", n, np.float32)  # (n,) float32
            kernels.finish(base, kind, acc, normalize, lam, res, _NO_BF16, scale)
            target[...] = res

    def _stock_block(self, ti: int, b: int, base_raw: np.ndarray, out: np.ndarray) -> None:
        """model_stock's block: Σ c_k Δ_k into the tensor's update and the block's pairwise dots;
        the tensor's last block computes t and writes every block (see StockTensor)."""
        t = self.xp.tensors[ti]
        lo, n, bits_dt, base = self._block(ti, b, base_raw)
        nb = base.nbytes
        work = self.sel.get(ti, {}).get(b, [])
        kind = kernels.IN_KIND[t.dtype]
        if self._has_adapter(ti, b):  # float32 bits of the base and of every expert (loramerge)
            base, ex, kind = _loramerge().stock_inputs(self, ti, b, base, kind)
        else:
            buf = self.local.get("stock", max(1, len(work)) * nb, np.uint8)  # every expert of the block at once
            for f in [
                self.io.submit(self._read_one, ti, b, pos, h, buf[k * nb : k * nb + nb])
                for k, (pos, h) in enumerate(work)
            ]:
                f.result()
            ex = buf[: len(work) * nb].view(bits_dt).reshape(len(work), n)  # (g, n) raw bits
        state = self._stock[ti]
        acc = state.update[lo : lo + n].reshape(1, n)  # (1, n) float32: this block's rows of the update
        acc.fill(0)
        dots = np.zeros((len(work), len(work)))  # (g, g) float64, upper triangle
        coefs = np.array([self._values(pos, ti).coef for pos, _ in work], np.float32)
        kernels.stock_fold(base, ex, kind, coefs, acc, dots)
        if state.done(b, [pos for pos, _ in work], dots):  # the tensor's last block: t is known
            scale = np.float32(state.t())
            for blk in state.blocks:
                lo, n, _, _ = self._block(ti, blk, base_raw)
                upd = state.update[lo : lo + n]
                np.multiply(upd, scale, out=upd)  # t·Σ c_k Δ_k, float32 as the per-step path
                self._finish(ti, blk, base_raw, upd.reshape(1, n), out)
            del self._stock[ti]

    def _values(self, pos: int, ti: int) -> TensorParams:
        """Expert `pos`'s weight, coefficient, density, ε, λ and base scale in tensor `ti`."""
        return self.values.get((pos, ti)) or self.defaults[pos]

    def _trim(self, pos: int, ti: int, t: TensorLayout, src: Source) -> kernels.Trim:
        """Expert `pos`'s trim of tensor `ti`, built once (its stream key is a sha256 and DELLA's rank
        table a 32768-bin pass) and shared by every block; a race only builds the same value twice."""
        trim = self._trim_cache.get((pos, ti))
        if trim is None:
            trim = self._trim_cache[(pos, ti)] = self._make_trim(pos, ti, t, src)
        return trim

    def _make_trim(self, pos: int, ti: int, t: TensorLayout, src: Source) -> kernels.Trim:
        i = int(self._trim_row[pos, ti])
        key = kernels.rng_key(self.xp.seed, src.name, t.name)
        if i < 0:
            return kernels.Trim(key=key)
        r = {c: v[i] for c, v in self.trims.items()}
        rank = kernels.rank_table(r["rank_codes"], r["rank_counts"]) if r.get("rank_codes") is not None else None
        return kernels.Trim(r["t_lo"] or 0.0, r["t_hi"], key, rank)
