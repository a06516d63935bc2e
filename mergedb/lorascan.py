"""Registration of LoRA adapters: the same per-block statistics as a dense expert, from the factors.

For every block of rows of an adapted tensor, ΔW[rows] = s · L[rows] @ R is formed in float32
(loraread; never the whole ΔW unless the tensor is one block, never a full model copy), and the
block's "expert" values are e = float32(θ₀ + ΔW) with θ₀ the base block decoded to float32. The
statistics are those of Δ = e − θ₀ from `stats.block_stats`, the dense experts' code, so they
describe exactly the float32 delta the merger folds in (merger_lora.py forms the same e). A
modules_to_save tensor is read like a dense expert's (its own rows, decoded to float32).

Costs (schema/009): a block's `read_bytes` is what a merge reads for it, the rows of L (rank ×
rows × itemsize) or the replacement rows; the tensor's `fixed_bytes` is R, read once per (expert,
tensor). Tensors the adapter does not touch get the rows of a block identical to the base (Δ = 0,
free, never read, read_bytes 0). A block whose formed Δ is exactly zero is recorded as identical
too (free: reading it would change nothing).

Content hash of an adapter block: xxh3-128 of the raw bytes it reads (the rows of L, or the
replacement rows) followed by the raw bytes of R; the merger's --verify recomputes it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from . import scan, stats
from .checkpoint import Checkpoint
from .layout import FamilyTensor, element_offset
from .lora import Adapter
from .loraread import AdapterFiles, delta_rows, dense_rows, read_fixed, read_rows
from .readahead import in_order
from .sources import RemoteOptions, Sources
from .tensorfile import DTYPES, as_float32
from .units import check_threads


class AdapterStats(scan.ExpertStats):
    """An adapter's ExpertStats plus its costs: per block (tensor_idx, block_idx) -> read_bytes,
    and per adapted tensor_idx -> fixed_bytes (R's bytes; 0 for a modules_to_save tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.read_bytes: dict[tuple[int, int], int] = {}
        self.fixed_bytes: dict[int, int] = {}


# scan.Sink plus an adapter's costs, per row: sink(k, block_rows, tensor_rows, read_bytes, fixed_bytes)
Sink = Callable[[int, list[scan.BlockRow], list[scan.TensorRow], list[int], list[int]], None]


def block_hash(rows_raw: np.ndarray, fixed_raw: np.ndarray | None) -> str:
    """The content hash of an adapter block (see the module docstring)."""
    h = xxhash.xxh3_128()
    h.update(rows_raw)
    if fixed_raw is not None:
        h.update(fixed_raw)
    return h.hexdigest()


def scan_adapters(
    base: Checkpoint,
    adapters: list[Adapter],
    family: list[FamilyTensor],
    base_hashes: dict[tuple[int, int], str],
    sketch_dim: int,
    threads: int,
    progress: scan.Progress | None = None,
    sink: Sink | None = None,
) -> list[AdapterStats]:
    """Statistics of every adapter's delta, one (adapter, touched tensor) unit per worker thread;
    rows in (tensor, block) order whatever the thread count. With `sink`, the rows and costs go there
    as each unit ends (and an untouched tensor's as the scan ends); the AdapterStats hold the content
    hash only."""
    check_threads(threads)
    bwhere = {t.name: (fi, t) for fi, t in base.tensors}
    group = Sources(RemoteOptions.from_env())  # the base may be local or behind a URL (sources.py)
    base_files = scan.Files(base, group)
    files = [AdapterFiles(a) for a in adapters]
    scratch = scan.Scratch()

    def unit(k: int, ft: FamilyTensor) -> tuple[list[scan.BlockRow], scan.TensorRow, list[str], dict, int]:
        ad, af = adapters[k], files[k]
        bfi, bt = bwhere[ft.name]
        factor = ad.factors.get(ft.name)
        right, fixed_raw = read_fixed(af, factor) if factor is not None else (None, None)  # R (rank, cols) float32
        if progress and fixed_raw is not None:
            progress(fixed_raw.nbytes)
        abs_delta = scratch.get("abs", ft.numel * 4).view(np.float32)
        summary = np.zeros(stats.SUMMARY_BINS, np.int64)
        cap = ft.numel // 2 + 1024
        exceptions = stats.Exceptions(cap, scratch.get("exc", cap * 4 + 4).view(np.uint32))
        rows: list[scan.BlockRow] = []
        hashes: list[str] = []
        costs: dict[tuple[int, int], int] = {}
        all_zero = True
        for blk in ft.blocks:
            braw = scratch.get("b", blk.nbytes)
            base_files.src[bfi].read_into(memoryview(braw), bt.start + blk.byte_start)
            b32 = as_float32(
                braw.view(DTYPES[ft.dtype][1]), ft.dtype, scratch.get("b32", blk.numel * 4).view(np.float32)
            )
            e32_buf = scratch.get("e32", blk.numel * 4).view(np.float32)
            e32, rows_raw = block_values(ad, af, ft.name, ft.shape, blk.row_start, blk.row_end, b32, right, e32_buf)
            if progress:
                progress(rows_raw.nbytes + blk.nbytes)
            seg = abs_delta[element_offset(ft, blk) : element_offset(ft, blk) + blk.numel]
            codes = shared.get(ft, blk.block_idx, blk.numel)  # hashed once per block for all adapters
            s = stats.block_stats(
                e32, b32, seg, stats.sketch_key(ft.name, blk.block_idx), summary, sketch_dim, exceptions, codes
            )
            key = (ft.tensor_idx, blk.block_idx)
            if s.nnz == 0 and s.nonfinite == 0:  # Δ = 0 exactly: free, as a block identical to the base
                rows.append(scan.zero_row(ft.tensor_idx, blk.block_idx, base_hashes[key], sketch_dim))
                hashes.append(base_hashes[key])
                costs[key] = 0
                continue
            all_zero = False
            chash = block_hash(rows_raw, fixed_raw)
            hashes.append(chash)
            costs[key] = rows_raw.nbytes
            rows.append(scan.changed_row(ft.tensor_idx, blk.block_idx, chash, s))
        if all_zero:
            thresholds = np.zeros(len(stats.DENSITY_GRID), np.float32)
        else:
            thresholds = stats.tensor_thresholds(abs_delta, summary, exceptions)
        codes_, counts = stats.summary_bins(summary)
        fixed = factor.fixed_bytes if factor is not None and not all_zero else 0
        return rows, scan.TensorRow(ft.tensor_idx, all_zero, thresholds, codes_, counts), hashes, costs, fixed

    units = [(k, ft) for k, ad in enumerate(adapters) for ft in family if ft.mergeable and ft.name in _touched(ad)]
    units.sort(key=lambda u: (-u[1].nbytes, u[1].tensor_idx, u[0]))  # largest first: a short tail
    shared = scan.SharedCodes(Counter(ft.tensor_idx for _, ft in units), sketch_dim)

    def run(u: tuple[int, FamilyTensor]) -> tuple[list[scan.BlockRow], scan.TensorRow, list[str], dict, int]:
        try:
            return unit(*u)
        finally:
            shared.release(u[1].tensor_idx)  # the tensor's last unit drops its codes

    out = [AdapterStats() for _ in adapters]
    put = sink or _collect(out)
    hashes_of: dict[tuple[int, int], bytes] = {}  # (adapter, tensor) -> its block hashes, joined
    try:
        with ThreadPoolExecutor(threads) as pool:
            for (k, ft), (rows, trow, hashes, costs, fixed) in zip(units, in_order(pool, run, units, 8 * threads + 8)):
                hashes_of[k, ft.tensor_idx] = "".join(hashes).encode()
                put(k, rows, [trow], [costs[r.tensor_idx, r.block_idx] for r in rows], [fixed])
    finally:
        group.close()
        for f in files:
            f.close()
    for k, st in enumerate(out):
        pieces: list[str | bytes] = []
        for ft in family:
            if (k, ft.tensor_idx) in hashes_of:
                pieces.append(hashes_of.pop((k, ft.tensor_idx)))
                continue
            hashes = [base_hashes[(ft.tensor_idx, b.block_idx)] for b in ft.blocks]
            pieces += hashes
            if not ft.mergeable:
                continue
            rows = [scan.zero_row(ft.tensor_idx, b.block_idx, h, sketch_dim) for b, h in zip(ft.blocks, hashes)]
            zeros = np.zeros(len(stats.DENSITY_GRID), np.float32)
            trow = scan.TensorRow(ft.tensor_idx, True, zeros, *stats.summary_bins(_zeros(ft)))
            put(k, rows, [trow], [0] * len(rows), [0])  # untouched: Δ = 0, never read
        st.content_hash = scan.content_hash(pieces)
        st.blocks.sort(key=lambda r: (r.tensor_idx, r.block_idx))  # collected (stable: a unit's rows are in order)
        st.tensors.sort(key=lambda r: r.tensor_idx)
    return out


def _collect(out: list[AdapterStats]) -> Sink:
    """A Sink that keeps the rows and costs of adapter k in out[k]."""

    rows = scan.collect(out)  # type: ignore[arg-type]

    def sink(k: int, blocks: list, tensors: list, read_bytes: list[int], fixed_bytes: list[int]) -> None:
        rows(k, blocks, tensors)
        out[k].read_bytes.update(((r.tensor_idx, r.block_idx), c) for r, c in zip(blocks, read_bytes))
        out[k].fixed_bytes.update((r.tensor_idx, c) for r, c in zip(tensors, fixed_bytes))

    return sink


def block_values(
    ad: Adapter,
    af: AdapterFiles,
    name: str,
    shape: tuple[int, ...],
    r0: int,
    r1: int,
    b32: np.ndarray,
    right: np.ndarray | None,
    out: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The adapter's float32 values e (flat (numel,)) of rows [r0, r1) of base tensor `name` of
    `shape`, given those rows of the base decoded to float32 `b32`: θ₀ + ΔW (ΔW = s · L[r0:r1] @ R,
    `right` = R), or the decoded rows of a modules_to_save tensor; and the raw bytes read for them
    (the block's read cost)."""
    factor = ad.factors.get(name)
    if factor is None:
        return dense_rows(af, ad.dense[name], shape, r0, r1, out)
    assert right is not None  # read_fixed's R for every adapted tensor (callers pass it)
    left, raw = read_rows(af, factor, r0, r1)  # (rows, rank) float32
    d = delta_rows(factor, left, right, out.reshape(r1 - r0, -1))  # (rows, cols) float32 ΔW
    np.add(b32, d.reshape(-1), out=out)  # e = float32(θ₀ + ΔW)
    return out, raw


def _touched(ad: Adapter) -> set[str]:
    return {*ad.factors, *ad.dense}


def _zeros(ft: FamilyTensor) -> np.ndarray:
    summary = np.zeros(stats.SUMMARY_BINS, np.int64)
    summary[0] = ft.numel
    return summary


def bytes_to_read(ad: Adapter, family: list[FamilyTensor]) -> int:
    """What registering `ad` reads: every factor and replacement tensor once, and the base's blocks
    of the tensors it adapts (untouched tensors are never read)."""
    touched = _touched(ad)
    return sum(t.nbytes for _, t in ad.tensors) + sum(ft.nbytes for ft in family if ft.mergeable and ft.name in touched)
