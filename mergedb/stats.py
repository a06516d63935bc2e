"""Exact statistics of a delta Δ = expert − base, computed block by block in one fused pass.

Pure numeric code (numpy, and the compiled kernels regkernels.py chooses); nothing here knows of
files or catalogs.

Definitions (the planner, the executor and the tests all use these):
- Δ is computed in float32 from the decoded expert and base values; norms and the inner product
  ⟨θ₀, Δ⟩ with the decoded base accumulate in float64.
- A block histogram bins |Δ| by the top 10 bits of its float32 pattern (exponent plus one mantissa
  bit): bin edges are 2^e and 1.5·2^e, so each bin spans a factor of 1.5 or 4/3.
- A tensor's magnitude summary bins |Δ| by the top 15 bits (relative width 2^-6): it gives the
  exact count above every bin edge, hence a top-k threshold for any density (the k-th largest's bin edge).
- An exception is a finite |Δ| whose low 17 bits are not all zero; every other finite |Δ| equals
  its summary bin's lower edge exactly. A bf16/fp16 delta is a few units in the last place of its
  base value, so exceptions are rare, and the histogram sums, ‖Δ‖, max |Δ| and the exact top-k
  thresholds follow from the summary counts plus the exceptions, with no second pass over |Δ|
  (one is made when a tensor has too many: fp32 deltas). Float64 sums are taken in a fixed order
  that depends on neither the thread count nor the order units run in.
- A linear sketch is a CountSketch: element i of block b of tensor t goes to bucket h(i) with sign
  s(i), both from a 64-bit hash of (key(t, b), i) — never of the checkpoint, so
  sketch(θ_k) − sketch(θ_0) = sketch(Δ_k) and E⟨S a, S b⟩ = ⟨a, b⟩.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from . import regkernels
from .summary import (  # re-exported: stats.X names what registration computes
    DEFAULT_SKETCH_DIM,
    DENSITY_GRID,
    HIST_BINS,
    HIST_SHIFT,
    MAX_SKETCH_DIM,
    SUMMARY_BINS,
    SUMMARY_SHIFT,
    hist_hi,  # noqa: F401
    kth_counts,
    summary_bins,  # noqa: F401
    threshold_from_summary,  # noqa: F401
)


def sketch_key(tensor: str, block: int) -> np.uint64:
    """The sketch's hash key for block `block` of tensor `tensor` (independent of any checkpoint)."""
    digest = hashlib.sha256(f"mergedb-sketch\0{tensor}\0{block}".encode()).digest()
    return np.uint64(int.from_bytes(digest[:8], "little"))


@dataclass(frozen=True)
class BlockStats:
    """Exact statistics of one block's delta."""

    norm: float  # ‖Δ‖₂, float64 accumulation
    max_abs: float
    nnz: int
    nonfinite: int
    hist_lo: np.ndarray  # (B,) float32 lower bin edges of the non-empty bins, ascending
    hist_count: np.ndarray  # (B,) int64
    hist_sum: np.ndarray  # (B,) float64 Σ|Δ| per bin
    hist_sumsq: np.ndarray  # (B,) float64 ΣΔ² per bin
    sketch: np.ndarray  # (D,) float32
    base_dot: float  # ⟨θ₀, Δ⟩, float64 accumulation (NaN when nonfinite > 0, as norm)


def base_group_stats(x: np.ndarray, start: np.ndarray) -> list[tuple[float, int]]:
    """(‖θ₀,b‖₂, NaN/Inf count) of each of consecutive base blocks of `x` (block k: elements
    start[k]:start[k + 1]) in one compiled call: the norm of its finite values (float64
    accumulation) and the count of the others. x: (n,) float32, or bf16 bit patterns as uint16. The
    planner's output-rounding bound needs the norm; the count lets it blame a non-finite base
    instead of every expert whose delta inherits the NaN."""
    ss, bad = np.zeros(len(start) - 1), np.zeros(len(start) - 1, np.int64)
    regkernels.base_group(x if x.dtype == np.uint16 else x.view(np.uint32), np.asarray(start, np.int64), ss, bad)
    return [(float(np.sqrt(v)), int(c)) for v, c in zip(ss, bad)]


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two equal-length uint8 buffers hold the same bytes (np.array_equal without its
    full-size temporary: ~10× faster on 4 MiB blocks)."""
    return a.shape == b.shape and regkernels.same_bytes(a, b)


def sketch_codes(key: np.uint64, n: int, dim: int, out: np.ndarray | None = None) -> np.ndarray:
    """The CountSketch bucket and sign of each of `n` elements under `key`, as (n,) uint16 codes
    2·bucket + (sign < 0). They depend on the tensor, block and position only, never on the
    checkpoint, so one table serves every expert's block; block_stats takes it instead of hashing.
    `out`: an (n,) uint16 array to fill (e.g. a block's part of a group's table), else a new one."""
    if not 0 < dim <= MAX_SKETCH_DIM:
        raise ValueError(f"sketch dimension {dim} does not fit a uint16 code (1..{MAX_SKETCH_DIM})")
    if out is None:
        out = np.empty(n, np.uint16)
    elif out.shape != (n,) or out.dtype != np.uint16:
        raise ValueError(f"sketch_codes' out must be ({n},) uint16, not {out.shape} {out.dtype}")
    regkernels.bucket_codes(np.uint64(key), dim, out)
    return out


def sketch(x: np.ndarray, key: np.uint64, dim: int = DEFAULT_SKETCH_DIM) -> np.ndarray:
    """CountSketch of the flat float array `x` under `key`: (dim,) float64."""
    from . import deltapass  # numba's: a reference, not registration's path

    out = np.zeros(dim)
    deltapass.sketch(np.ascontiguousarray(x).reshape(-1), np.uint64(key), out)
    return out


class Exceptions:
    """A tensor's |Δ| values that its magnitude summary does not pin exactly: the float32 patterns
    of finite |Δ| whose low 17 bits are not all zero (a bf16 or fp16 delta is a few units in the
    last place of its base value, so it rarely has any). Filled by block_stats across the blocks
    of one tensor; `complete` while they fit in the buffer."""

    def __init__(self, capacity: int, buf: np.ndarray | None = None) -> None:
        # (capacity + 1,) uint32: the statistics pass appends each exception's pattern (into the
        # last slot once full, still counting them)
        self.buf = np.empty(capacity + 1, np.uint32) if buf is None else buf[: capacity + 1]
        if len(self.buf) != capacity + 1:
            raise ValueError(f"an exceptions buffer for {capacity} needs {capacity + 1} slots, not {len(self.buf)}")
        self.n = 0

    @property
    def complete(self) -> bool:
        return self.n < len(self.buf)

    def values(self) -> np.ndarray:
        return self.buf[: self.n]


# lower edge of every summary bin, and its square, as float64 (both exact); 0 for the codes of
# Inf/NaN patterns, which the summary never counts
EDGE = np.arange(SUMMARY_BINS, dtype=np.uint32) << np.uint32(SUMMARY_SHIFT)
EDGE = np.where(EDGE < np.uint32(0x7F800000), EDGE, np.uint32(0)).view(np.float32).astype(np.float64)
EDGE_SQ = EDGE * EDGE


def block_stats(
    e: np.ndarray,
    b: np.ndarray,
    abs_out: np.ndarray,
    key: np.uint64,
    summary: np.ndarray,
    dim: int,
    exceptions: Exceptions | None = None,
    codes: np.ndarray | None = None,
) -> BlockStats:
    """Statistics of Δ = e − b (flat, equal dtypes); writes |Δ| (float32) into `abs_out`, adds to
    `summary` and collects `exceptions`. e, b: float32, or bf16 bit patterns as uint16 (decoded in
    the same pass). `codes`: the block's sketch_codes(key, n, dim), when the caller shares them.

    One pass over the elements counts the block's summary and collects its exceptions; a finite
    |Δ| that is no exception equals its summary bin's lower edge exactly, so the histogram (counts,
    Σ|Δ|, ΣΔ²), ‖Δ‖, max |Δ| and the non-zeros follow from the counts plus the exceptions, exact up
    to float64 rounding of the sums. A block whose exceptions do not fit gets a second pass over
    its |Δ| (deltapass.abs_pass) instead. Runs numba's kernels (LoRA registration's per-block path,
    and the tests' reference for group_pass)."""
    from .deltapass import abs_pass, block_hist, delta_pass

    shift = 16 if e.dtype == np.uint16 else 0
    if shift == 0:
        e, b = e.view(np.uint32), b.view(np.uint32)  # float32 patterns
    n = e.shape[0]
    counts = np.zeros(SUMMARY_BINS, np.int64)  # this block's magnitude summary
    sk = np.zeros(dim)
    bd = np.zeros(4)  # Σ θ₀·Δ in four interleaved partial sums
    exc = exceptions if exceptions is not None else Exceptions(0)
    first = exc.n
    abs_bits = abs_out.view(np.uint32)
    if codes is None:  # the same hash as shared codes: one table, used once
        codes = sketch_codes(key, n, dim)
    nonfinite, n_exc = delta_pass(e, b, shift, abs_bits, codes, counts, sk, bd, exc.buf, exc.n)
    exc.n = n_exc
    if exc.complete:  # one compiled pass over the counts and this block's exceptions
        hcount, hsum, hsq, mx, zeros = block_hist(
            counts, summary, exc.buf[first : exc.n], EDGE, EDGE_SQ, HIST_SHIFT, SUMMARY_SHIFT
        )
    else:
        summary += counts
        # a histogram bin is 2^(SUMMARY_SHIFT - HIST_SHIFT) = 32 consecutive summary bins
        hcount = counts.reshape(HIST_BINS, -1).sum(axis=1)
        hsum = np.zeros(HIST_BINS)
        hsq = np.zeros(HIST_BINS)
        mx, zeros = abs_pass(abs_bits, abs_out, hsum, hsq)
    nz = np.flatnonzero(hcount)
    lo = (nz.astype(np.uint32) << np.uint32(HIST_SHIFT)).view(np.float32)
    norm = float(np.sqrt(hsq.sum())) if nonfinite == 0 else float("nan")
    base_dot = float((bd[0] + bd[1]) + (bd[2] + bd[3])) if nonfinite == 0 else float("nan")
    return BlockStats(
        norm,
        float(mx),
        n - int(zeros),
        int(nonfinite),
        lo,
        hcount[nz],
        hsum[nz],
        hsq[nz],
        sk.astype(np.float32),
        base_dot,
    )


def group_arrays(n_blocks: int, dim: int) -> tuple[np.ndarray, ...]:
    """regkernels.group_pass' `out`: a zeroed row per block of (identical, NaN/Inf count, zeros,
    max |Δ|, histogram counts, Σ|Δ|, ΣΔ², sketch, the four partial sums of θ₀·Δ)."""
    z = np.zeros
    return (
        z(n_blocks, np.bool_), z(n_blocks, np.int64), z(n_blocks, np.int64), z(n_blocks),
        z((n_blocks, HIST_BINS), np.int64), z((n_blocks, HIST_BINS)), z((n_blocks, HIST_BINS)),
        z((n_blocks, dim)), z((n_blocks, 4)),
    )  # fmt: skip


def group_block_stats(out: tuple[np.ndarray, ...], k: int, n: int) -> BlockStats:
    """Block k's statistics from regkernels.group_pass' `out` (n: its elements), exactly as
    block_stats returns them for the same block."""
    _, nonfinite, zeros, mx, hcount, hsum, hsq, sk, bd = out
    nz = np.flatnonzero(hcount[k])
    ok = nonfinite[k] == 0
    return BlockStats(
        float(np.sqrt(hsq[k].sum())) if ok else float("nan"),
        float(mx[k]),
        n - int(zeros[k]),
        int(nonfinite[k]),
        (nz.astype(np.uint32) << np.uint32(HIST_SHIFT)).view(np.float32),
        hcount[k][nz],
        hsum[k][nz],
        hsq[k][nz],
        sk[k].astype(np.float32),
        float((bd[k, 0] + bd[k, 1]) + (bd[k, 2] + bd[k, 3])) if ok else float("nan"),
    )


SUB_SHIFT = SUMMARY_SHIFT - 8  # second radix level: 256 sub-bins per summary bin


def _locate(counts: np.ndarray, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of `counts` (ascending digit order) and a 0-based rank from the top per row: the
    digit holding that rank and the rank inside it. counts: (m, D) int64; rank: (m,) int64."""
    cum = np.cumsum(counts[:, ::-1], axis=1)  # (m, D) descending-digit running counts
    j = (cum <= rank[:, None]).sum(axis=1)  # first descending position whose running count > rank
    digit = counts.shape[1] - 1 - j
    rows = np.arange(len(rank))
    return digit, rank - (cum[rows, j] - counts[rows, digit])


def _wanted(summary: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For every density of the grid: whether it has a threshold (rank k within the finite
    elements), and for those, the summary code holding the k-th largest |Δ| and its 0-based rank
    from the top of that code's bin. Returns (ks, valid, codes, rank). Over the summary's non-empty
    bins only (an empty bin never holds a rank): a tensor of a few elements has a few of its 16,384,
    and families of many such tensors ran this once per (expert, tensor)."""
    ks = kth_counts(DENSITY_GRID, n)
    desc_codes = np.flatnonzero(summary != 0)[::-1]  # non-empty bins, largest code first (summary_bins)
    desc = summary[desc_codes]
    cum_desc = np.cumsum(desc)
    pos = np.searchsorted(cum_desc, ks, side="left")  # index (descending-code order) of rank k's bin
    valid = pos < desc_codes.size  # ranks past the finite elements (non-finite Δ) have no threshold
    pos_v = pos[valid]
    codes = desc_codes[pos_v]
    rank = ks[valid] - 1 - (cum_desc[pos_v] - desc[pos_v])  # 0-based rank from the top of its bin
    return ks, valid, codes, rank


# tensor_thresholds sorts a tensor's finite |Δ| up to SORT_MAX elements, and up to SORT_MAX_RADIX when
# its exceptions overflowed: measured, a sort of 64-4,096 elements takes 11-26 us, grid_thresholds
# 24-60 us from complete exceptions and ~1.1 ms through the radix passes (190 rows of 256 and 512
# counts gathered and summed, whatever the tensor's size); at 2^18 float32 elements the sort still
# beat the radix select (0.74 against 1.0 ms), while grid_thresholds from complete exceptions wins
# from ~32k elements on (33 against 35 us)
SORT_MAX = 4096
SORT_MAX_RADIX = 1 << 18


def tensor_thresholds(abs_delta: np.ndarray, summary: np.ndarray, exceptions: Exceptions) -> np.ndarray:
    """grid_thresholds of a tensor, by whichever way is faster at its size (the values are the same)."""
    n = abs_delta.size
    if n <= SORT_MAX or (n <= SORT_MAX_RADIX and not exceptions.complete):
        return sorted_thresholds(abs_delta)
    return grid_thresholds(abs_delta, summary, exceptions)


def sorted_thresholds(abs_delta: np.ndarray) -> np.ndarray:
    """The k-th largest finite |Δ| for every density of DENSITY_GRID by a sort of the finite values:
    (G,) float32, NaN where k passes them. Non-negative floats order as their bit patterns, so these
    are grid_thresholds' values (zeros for an empty tensor, as there)."""
    flat = abs_delta.reshape(-1)
    if flat.size == 0:
        return np.zeros(len(DENSITY_GRID), np.float32)
    finite = np.sort(flat[np.isfinite(flat)])
    ks = kth_counts(DENSITY_GRID, flat.size)
    out = np.full(ks.size, 0x7FC00000, np.uint32).view(np.float32)  # NaN where there is no threshold
    has = ks <= finite.size
    out[has] = finite[finite.size - ks[has]]
    return out


def grid_thresholds(abs_delta: np.ndarray, summary: np.ndarray, exceptions: Exceptions | None = None) -> np.ndarray:
    """Exact k-th largest |Δ| for every density of DENSITY_GRID: (G,) float32.

    With complete `exceptions` (block_stats') no pass over |Δ| is needed: a finite |Δ| outside
    them equals its bin's lower edge (code << 17) exactly, and a bin's exceptions lie above it,
    so the r-th largest of a bin is its r-th largest exception, or else the edge itself.

    A three-level radix select on the float32 bit patterns (non-negative floats order as their
    patterns): `summary` (the tensor's magnitude summary from block_stats) gives the top 15 bits of
    every wanted rank; one pass histograms those bins by their next 8 bits, a second pass the
    wanted (bin, sub-bin) pairs by their last 9 bits, which pins every wanted value exactly. No
    gather and no sort: bf16 deltas take few distinct values, so a sub-bin can hold a third of a
    tensor, but it never holds more than 512 distinct patterns.
    """
    n = abs_delta.size
    if n == 0:
        return np.zeros(len(DENSITY_GRID), np.float32)
    assert SUMMARY_SHIFT == 17 and SUB_SHIFT == 9  # the kernels hard-code these shifts
    ks, valid, codes, rank = _wanted(summary, n)
    out = np.full(len(ks), 0x7FC00000, np.uint32)  # NaN where there is no threshold
    if not valid.any():
        return out.view(np.float32)
    if exceptions is not None and exceptions.complete:
        out[valid] = _from_exceptions(exceptions.values(), codes, rank)
        return out.view(np.float32)
    bits = abs_delta.view(np.uint32).reshape(-1)
    # level 2: wanted bins by their next 8 bits
    # small tables stay in L1: slots and pairs are at most len(DENSITY_GRID) + 1, counts at most n
    count_t = np.int32 if n < 2**31 else np.int64
    wanted_codes, slot = np.unique(codes, return_inverse=True)
    slot_of = np.full(len(summary), len(wanted_codes), np.int16)  # unwanted: the dummy last row
    slot_of[wanted_codes] = np.arange(len(wanted_codes), dtype=np.int16)
    sub = np.zeros((len(wanted_codes) + 1, 256), count_t)
    regkernels.sub_histogram(bits, slot_of, sub)
    s, rank = _locate(sub[slot].astype(np.int64), rank)
    # level 3: wanted (bin, sub-bin) pairs by their last 9 bits
    pairs, pair = np.unique(slot * 256 + s, return_inverse=True)
    pair_of = np.full((len(wanted_codes) + 1, 256), len(pairs), np.int16)  # unwanted: the dummy row
    pair_of[pairs // 256, pairs % 256] = np.arange(len(pairs), dtype=np.int16)
    low = np.zeros((len(pairs) + 1, 512), count_t)
    regkernels.low_histogram(bits, slot_of, pair_of, low)
    lowbits, _ = _locate(low[pair].astype(np.int64), rank)
    out[valid] = (codes.astype(np.uint32) << np.uint32(SUMMARY_SHIFT)) | (s.astype(np.uint32) << np.uint32(SUB_SHIFT))
    out[valid] |= lowbits.astype(np.uint32)
    return out.view(np.float32)


def _from_exceptions(exc: np.ndarray, codes: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """The rank-th largest pattern of each code's bin, from that bin's exceptions (all above its
    lower edge) and otherwise the edge. exc: (m,) uint32; codes, rank: (G,) int64 -> (G,) uint32."""
    edge = codes.astype(np.uint32) << np.uint32(SUMMARY_SHIFT)
    is_wanted = np.zeros(SUMMARY_BINS, bool)  # a lookup per exception (np.isin sorted them all)
    is_wanted[codes] = True
    wanted = exc[is_wanted[exc >> np.uint32(SUMMARY_SHIFT)]]
    asc = np.sort(wanted)  # (m',) uint32 ascending: a code's exceptions are one run
    hi = np.searchsorted(asc, edge + np.uint32(1 << SUMMARY_SHIFT), side="left")  # end of the code's run
    lo = np.searchsorted(asc, edge, side="left")
    if len(asc) == 0:
        return edge
    picked = asc[np.clip(hi - 1 - rank, 0, len(asc) - 1)]  # meaningful where rank < the run's length
    return np.where(rank < hi - lo, picked, edge)
