"""Consecutive blocks of one tensor scanned in one compiled call (registration's unit of numeric work).

With 64 KiB vocabulary blocks (`--block-size auto`) a call per block cost more than the block's
arithmetic: ~10 numpy and compiled calls, each an allocation, a dispatch and a GIL release and
re-acquire that the other threads waited on. A group is a run of blocks of at most GROUP_BYTES
(a larger block alone); every statistic is still the block's own, the same numbers a call per
block gives (regkernels.group_pass, stats.base_group_stats).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import xxhash

from . import regkernels, stats
from .layout import Block, FamilyTensor, element_offset
from .tensorfile import DTYPES, as_float32

GROUP_BYTES = 4 << 20

Buffer = Callable[[str, int], np.ndarray]  # a reused per-thread buffer: (name, bytes) -> uint8 array


def groups(blocks: tuple[Block, ...]) -> Iterator[list[Block]]:
    """Runs of consecutive blocks of at most GROUP_BYTES together (a larger block alone)."""
    run: list[Block] = []
    for blk in blocks:
        if run and sum(b.nbytes for b in run) + blk.nbytes > GROUP_BYTES:
            yield run
            run = []
        run.append(blk)
    if run:
        yield run


def group_codes(ft: FamilyTensor, group: list[Block], dim: int) -> np.ndarray:
    """(elements of the group,) uint16: each block's stats.sketch_codes, one after another."""
    out = np.empty(sum(b.numel for b in group), np.uint16)
    at = 0
    for blk in group:
        stats.sketch_codes(stats.sketch_key(ft.name, blk.block_idx), blk.numel, dim, out[at : at + blk.numel])
        at += blk.numel
    return out


def base_rows(
    ft: FamilyTensor, group: list[Block], buf: np.ndarray, buffer: Buffer
) -> list[tuple[str, float | None, int | None]]:
    """(xxh3-128 hash, ‖θ₀,b‖₂, NaN/Inf count) of each block of a group of the base, from the
    group's bytes `buf` (norm and count None for pass-through tensors)."""
    at = np.cumsum([0] + [blk.nbytes for blk in group])
    norms: list[tuple[float | None, int | None]] = [(None, None)] * len(group)
    if ft.mergeable:
        x = buf.view(np.dtype(DTYPES[ft.dtype][1]))  # BF16 and F32 are decoded inside base_group_stats
        if ft.dtype not in ("BF16", "F32"):
            x = as_float32(x, ft.dtype, buffer("x", x.size * 4).view(np.float32))
        norms = stats.base_group_stats(x, np.cumsum([0] + [blk.numel for blk in group]))  # type: ignore[assignment]
    return [(xxhash.xxh3_128_hexdigest(buf[at[i] : at[i + 1]]), *norms[i]) for i in range(len(group))]


def expert_stats(
    ft: FamilyTensor,
    group: list[Block],
    eraw: np.ndarray,
    braw: np.ndarray,
    abs_delta: np.ndarray,
    summary: np.ndarray,
    exceptions: stats.Exceptions,
    codes: np.ndarray | None,
    dim: int,
    buffer: Buffer,
) -> tuple[np.ndarray, ...]:
    """regkernels.group_pass over one group of an expert's blocks (eraw) and the base's (braw), both
    the group's bytes: its `out` arrays (stats.group_arrays; stats.group_block_stats reads a
    block's row). Writes the group's |Δ| into its part of the tensor's `abs_delta`, adds to the
    tensor's `summary` and `exceptions`. codes: group_codes of the group, when shared."""
    n = sum(blk.numel for blk in group)
    n0 = element_offset(ft, group[0])
    raw_dtype = np.dtype(DTYPES[ft.dtype][1])
    if ft.dtype in ("BF16", "F32"):  # decoded inside the statistics pass
        e, b = eraw.view(raw_dtype), braw.view(raw_dtype)
    else:
        e = as_float32(eraw.view(raw_dtype), ft.dtype, buffer("ef", n * 4).view(np.float32))
        b = as_float32(braw.view(raw_dtype), ft.dtype, buffer("bf", n * 4).view(np.float32))
    if e.dtype != np.uint16:
        e, b = e.view(np.uint32), b.view(np.uint32)  # float32 patterns
    out = stats.group_arrays(len(group), dim)
    exceptions.n = regkernels.group_pass(
        eraw, braw, e, b,
        np.cumsum([0] + [blk.nbytes for blk in group]), np.cumsum([0] + [blk.numel for blk in group]),
        abs_delta[n0 : n0 + n].view(np.uint32), group_codes(ft, group, dim) if codes is None else codes,
        summary, exceptions.buf, exceptions.n, stats.EDGE, stats.EDGE_SQ, stats.HIST_SHIFT, stats.SUMMARY_SHIFT, out,
    )  # fmt: skip
    return out
