"""Registration's statistics pass over one block's elements: compiled kernels (numba), nothing else.

`delta_pass` decodes an expert block and its base block, and accumulates the statistics of
Δ = expert − base that stats.block_stats turns into a catalog row: the block's magnitude summary
(counts of |Δ| by the top 15 bits of its float32 pattern), the exceptions (finite |Δ| whose low 17
bits are not all zero), the CountSketch buckets, the four partial sums of θ₀·Δ, the NaN/Inf count,
and every |Δ| pattern. Sums are taken in element order, four interleaved lanes for θ₀·Δ, so the
results depend on neither the thread count nor how a block is cut into runs.

Chunks of a block whose bytes equal the base's (and whose base values are finite) have Δ = 0
exactly: they only count as zeros, because adding ±0 to a float64 sum that starts at +0 changes
nothing (such a sum is never −0). `delta_pass` finds them with one vectorised pass over 64-bit
words when a sample says there are some (an embedding whose fine-tune saw few tokens), and scans
the runs between them; otherwise it scans the whole block.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros

CHUNK = 512  # elements a zero chunk spans: a multiple of 64, so lanes and exception masks line up
SAMPLE_STEP = 16  # chunks: the first look at a block checks one chunk in this many


@numba.njit(nogil=True, cache=True, inline="always")
def decode(raw, i, shift):  # pragma: no cover - compiled
    # element i of a float32 bit pattern array (shift 0) or of bf16 patterns (uint16, shift 16)
    return np.uint32(np.uint32(raw[i]) << np.uint32(shift)).view(np.float32)


@numba.njit(nogil=True, cache=True, inline="always")
def _delta_elem(e, b, shift, i, abs_bits, codes, counts, sk, bd, emask):  # pragma: no cover - compiled
    # Element i of _delta_pass. Returns emask with bit i % 64 set if |Δ| is an exception, and 1 if
    # Δ is NaN/Inf (it then counts nowhere else).
    bv = decode(b, i, shift)
    dv = decode(e, i, shift) - bv
    av = abs(dv)
    bits = np.float32(av).view(np.uint32)
    abs_bits[i] = bits
    if not av <= np.float32(3.4028234663852886e38):
        return emask, 1
    counts[bits >> 17] += 1
    emask |= np.uint64((bits & np.uint32(0x1FFFF)) != 0) << np.uint64(i & 63)
    d64 = np.float64(dv)
    bd[i & 3] += np.float64(bv) * d64
    c = np.int64(codes[i])
    sk[c >> 1] += (1.0 - 2.0 * np.float64(c & 1)) * d64
    return emask, 0


@numba.njit(nogil=True, cache=True)
def _delta_pass(e, b, shift, abs_bits, codes, counts, sk, bd, exc, n_exc):  # pragma: no cover - compiled
    # e, b: (n,) bit patterns, decoded here (_decode); abs_bits: (n,) uint32 receives |Δ|'s float32
    # pattern. counts: (SUMMARY_BINS,) this block's magnitude summary (finite |Δ| by their top 15
    # bits). exc: (cap + 1,) receives the patterns of finite |Δ| whose low 17 bits are not all
    # zero, in element order from index n_exc (the last slot takes the writes once full). codes:
    # (n,) uint16 sketch_codes of the block. bd: (4,) float64 partial sums of θ₀·Δ, element i in
    # bd[i % 4]. Returns (NaN/Inf count, exceptions in all: n_exc plus this block's).
    # The exceptions are marked in a 64-bit mask, one bit an element, and copied out of abs_bits
    # every 64 elements: a store per exception only, and no branch on whether an element is one
    # (a branch mispredicted when they were common, a store per element cost more than the rest).
    cap = exc.shape[0] - 1
    nonfinite = 0
    emask = np.uint64(0)
    n = e.shape[0]
    for i in range(n):
        emask, bad = _delta_elem(e, b, shift, i, abs_bits, codes, counts, sk, bd, emask)
        nonfinite += bad
        if (i & 63) == 63 or i == n - 1:
            first = i & ~63
            while emask:
                exc[min(n_exc, cap)] = abs_bits[first + trailing_zeros(emask)]
                n_exc += 1
                emask &= emask - np.uint64(1)
    return nonfinite, n_exc


@numba.njit(nogil=True, cache=True)
def _equal_chunks(ew, bw, words, step, em, el, top):  # pragma: no cover - compiled
    # ew, bw: (w,) uint64 words of the expert and base blocks -> (w // words,) bool: the chunk's
    # words are equal and no base value in it is NaN/Inf (per lane, (x & em) + el sets the lane's
    # top bit exactly when its exponent is all ones). Only chunks c with c % step == 0 are looked at.
    out = np.zeros(ew.shape[0] // words, np.bool_)
    for c in range(0, out.shape[0], step):
        diff = np.uint64(0)
        bad = np.uint64(0)
        for w in range(c * words, (c + 1) * words):
            diff |= ew[w] ^ bw[w]
            bad |= (bw[w] & em) + el
        out[c] = diff == 0 and (bad & top) == 0
    return out


@numba.njit(nogil=True, cache=True)
def _delta_runs(e, b, shift, abs_bits, codes, counts, sk, bd, exc, n_exc, zero):  # pragma: no cover
    # _delta_pass over the runs between the chunks marked in `zero` (CHUNK elements each, from 0):
    # those only count as zeros. Runs start at multiples of CHUNK, so the lanes (i % 4) and the
    # exception masks (i % 64) are the whole block's. Returns what _delta_pass does.
    nonfinite = 0
    start = 0
    for c in range(zero.shape[0]):
        if zero[c]:
            stop = c * CHUNK
            if start < stop:
                s = slice(start, stop)
                bad, n_exc = _delta_pass(e[s], b[s], shift, abs_bits[s], codes[s], counts, sk, bd, exc, n_exc)
                nonfinite += bad
            abs_bits[stop : stop + CHUNK] = 0
            counts[0] += CHUNK
            start = stop + CHUNK
    n = e.shape[0]
    if start < n:
        s = slice(start, n)
        bad, n_exc = _delta_pass(e[s], b[s], shift, abs_bits[s], codes[s], counts, sk, bd, exc, n_exc)
        nonfinite += bad
    return nonfinite, n_exc


# per element width: (bytes, exponent mask, its lowest bit, the top bit of each lane), 4 bf16 or 2 float32 a word
_LANES = {
    16: (2, np.uint64(0x7F807F807F807F80), np.uint64(0x0080008000800080), np.uint64(0x8000800080008000)),
    0: (4, np.uint64(0x7F8000007F800000), np.uint64(0x0080000000800000), np.uint64(0x8000000080000000)),
}


def delta_pass(e, b, shift, abs_bits, codes, counts, sk, bd, exc, n_exc):  # type: ignore[no-untyped-def]
    """The statistics pass over one block (see _delta_pass for the arguments): (NaN/Inf count,
    exceptions in all). e, b: bf16 patterns (uint16, shift 16) or float32 patterns (uint32, shift 0)."""
    size, em, el, top = _LANES[shift]
    words = CHUNK * size // 8
    n_words = e.shape[0] * size // 8
    # blocks of a few chunks are not worth a look; the word view needs contiguous patterns
    if n_words >= words * SAMPLE_STEP and e.flags.c_contiguous and b.flags.c_contiguous:
        ew = e.view(np.uint8)[: n_words * 8].view(np.uint64)
        bw = b.view(np.uint8)[: n_words * 8].view(np.uint64)
        if _equal_chunks(ew, bw, words, SAMPLE_STEP, em, el, top).any():
            zero = _equal_chunks(ew, bw, words, 1, em, el, top)
            return _delta_runs(e, b, shift, abs_bits, codes, counts, sk, bd, exc, n_exc, zero)
    return _delta_pass(e, b, shift, abs_bits, codes, counts, sk, bd, exc, n_exc)
