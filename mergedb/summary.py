"""The catalog's summaries of |Δ| and what is read from them without compiled code: the block
histogram's and the tensor magnitude summary's bins, the density grid with exact thresholds, and a
top-k threshold for any density from the summary (stats.py computes them; the planner reads them
here, so `mergedb plan` never loads numba)."""

from __future__ import annotations

import numpy as np

HIST_SHIFT = 22  # block histogram: top 10 bits of |Δ|'s float32 pattern
HIST_BINS = 1 << (32 - HIST_SHIFT - 1)  # sign bit is always 0 for |Δ|: 512 bins
SUMMARY_SHIFT = 17  # tensor magnitude summary: top 15 bits (relative bin width 2^-6)
SUMMARY_BINS = 1 << (32 - SUMMARY_SHIFT - 1)  # 16384
DEFAULT_SKETCH_DIM = 64
MAX_SKETCH_DIM = 2**15  # stats.sketch_codes packs 2·bucket + sign into a uint16

# Density grid with exact thresholds: every 0.1% up to 10%, then every 1% up to 100%.
DENSITY_GRID = np.array([round(i / 1000, 3) for i in range(1, 101)] + [round(i / 100, 2) for i in range(11, 101)])


def kth_count(density: float, n: int) -> int:
    """How many elements a top-`density` trim keeps: k = max(1, int(density·n)) (mergekit's rule)."""
    return max(1, int(density * n))


def kth_counts(densities: np.ndarray, n: int) -> np.ndarray:
    """kth_count of each of `densities` (float64) at once: (len,) int64, the same float64 products
    truncated (every n below 2^53 is exact in float64, as in kth_count's product)."""
    return np.maximum((np.asarray(densities, np.float64) * n).astype(np.int64), 1)


def hist_hi(lo: np.ndarray) -> np.ndarray:
    """Upper edges of histogram bins given their lower edges."""
    codes = np.asarray(lo, np.float32).view(np.uint32) >> np.uint32(HIST_SHIFT)
    return ((codes + np.uint32(1)) << np.uint32(HIST_SHIFT)).view(np.float32)


def summary_bins(summary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sparse form of a magnitude summary: (codes ascending uint16, counts int64)."""
    nz = np.flatnonzero(summary != 0)  # on the bool mask: np.nonzero of int64 is ~6x slower (16,384 bins)
    return nz.astype(np.uint16), summary[nz].astype(np.int64)


def threshold_from_summary(codes: np.ndarray, counts: np.ndarray, n: int, density: float) -> float:
    """A keep-threshold for any density: the lower edge of the summary bin holding the k-th largest
    |Δ|, so every element ≥ the k-th largest is kept (and its bin-mates below it, < 1.6% smaller for
    |Δ| ≥ 2^-126; float32's subnormals share wider bins, the lowest, code 0, all of them and zero).
    Most bf16/fp16 deltas sit on bin lower edges, where this is the exact k-th value (ties kept, as
    on the grid), but not all: the float32 difference of two bf16 values can carry more than the
    bins' six mantissa bits (README, "Differences from mergekit"). It never keeps fewer than k, and
    a larger density never keeps fewer elements. (The bin's geometric middle, used before, dropped
    the k-th largest and its ties: a four-element tensor at density 0.237 kept nothing, 0.0505 kept
    fewer than 0.05.)"""
    k = kth_count(density, n)
    order = np.argsort(codes)[::-1]
    cum = np.cumsum(np.asarray(counts)[order])
    i = int(np.searchsorted(cum, k, side="left"))
    if i >= len(order):
        return 0.0
    code = int(np.asarray(codes)[order][i])
    if code == 0:
        return 0.0  # zero (or a denormal below 2^-126): nothing meaningful to trim at
    return float(np.array([code << SUMMARY_SHIFT], np.uint32).view(np.float32)[0])
