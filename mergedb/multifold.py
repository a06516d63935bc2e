"""One fold of a block into the sums of several TIES-style trims at once (a sweep's densities), and
one finish of several plans from their sums (a fold set's outputs, setmerge.py).

`kernels.fold_group` decodes each expert block, subtracts the base, trims and adds into one set of
sign-consensus sums. Plans of a sweep that differ only in their trims (TIES densities over one
mask) would each decode the same bytes; `fold_many` decodes a chunk of an expert once and trims and
adds it into every set. Both trim and add through the same inlined pieces of kernels.py (`_band`,
`_add_consensus`; finishing: `_finish_chunk`, `_round_bf16`), experts in plan order, so each set is
bit-identical to its own `fold_group` by construction (tests/test_foldshare.py checks it).
Measured on one 2M-element bf16 block, K = 8, 4 sets: 0.6×
the CPU time of four `fold_group` calls.
"""

from __future__ import annotations

import numpy as np

from .jitload import numba  # imported with Ctrl-C held
from .kernels import CHUNK, _add_consensus, _band, _decode_chunk, _finish_chunk, _round_bf16


@numba.njit(nogil=True, cache=True)
def fold_many(base, ex, kind, coefs, lo, hi, acc):  # pragma: no cover - compiled
    """Fold experts ex[0..g) into sets acc[0..G) of sign-consensus sums, trimming with each set's bands.

    base (n,) raw bits; ex (g, n) raw bits in plan order; coefs (G, g) float32 weights; lo, hi
    (G, g) float64: set q keeps lo[q, k] ≤ |Δ_k| < hi[q, k]; acc (G, 5, n) float32 (total, pos,
    neg, pos_w, neg_w), added to."""
    n = base.shape[0]
    g = ex.shape[0]
    sets = acc.shape[0]
    bbits = np.empty(CHUNK, np.uint32)
    dbits = np.empty(CHUNK, np.uint32)
    kept = np.empty(CHUNK, np.float32)
    for c0 in range(0, n, CHUNK):
        m = min(CHUNK, n - c0)
        bf = bbits[:m].view(np.float32)  # (m,) float32 base
        df = dbits[:m].view(np.float32)  # (m,) float32 Δ of one expert
        t = kept[:m]  # (m,) Δ trimmed for one set
        _decode_chunk(base[c0 : c0 + m], kind, bbits[:m])
        for k in range(g):
            _decode_chunk(ex[k, c0 : c0 + m], kind, dbits[:m])
            for i in range(m):
                df[i] = df[i] - bf[i]
            for q in range(sets):
                _band(df, t, np.float32(lo[q, k]), np.float32(hi[q, k]))
                tot, pos, neg = acc[q, 0, c0 : c0 + m], acc[q, 1, c0 : c0 + m], acc[q, 2, c0 : c0 + m]
                pos_w, neg_w = acc[q, 3, c0 : c0 + m], acc[q, 4, c0 : c0 + m]
                _add_consensus(t, coefs[q, k], tot, pos, neg, pos_w, neg_w)


@numba.njit(nogil=True, cache=True)
def finish_many(base, kind, acc, group, normalize, lam, scale, res, bf16, stride, at):  # pragma: no cover - compiled
    """`kernels.finish` for P plans of one fold set at once: the base decoded once per chunk.

    base (n,) raw bits; acc (G, S, n) float32 sums (S = 5 sign-consensus, 1 weighted); plan p
    finishes from acc[group[p]] with normalize[p] (bool) and lam[p] (float64, rounded to float32
    as `finish` does) and the set's `scale`, into elements [p·stride + at, p·stride + at + n) of
    res (flat float32: P rows of `stride`), or, when bf16 (flat uint16) is not empty, of bf16 as
    bfloat16 bits rounded to nearest even. Flat rows keep every loop over contiguous memory. Per
    element and plan the float32 operations and their order are exactly those of `finish`, so each
    plan's elements are bit-identical to it."""
    n = base.shape[0]
    plans = group.shape[0]
    consensus = acc.shape[1] == 5
    s32 = np.float32(scale)
    to_bf16 = bf16.shape[0] > 0
    bbits = np.empty(CHUNK, np.uint32)
    rbits = np.empty(CHUNK, np.uint32)
    for c0 in range(0, n, CHUNK):
        m = min(CHUNK, n - c0)
        bf = bbits[:m].view(np.float32)  # (m,) float32 base, decoded once for every plan
        _decode_chunk(base[c0 : c0 + m], kind, bbits[:m])
        for p in range(plans):
            o = p * stride + at + c0  # plan p's first element of this chunk
            rf = rbits[:m].view(np.float32) if to_bf16 else res[o : o + m]  # (m,) float32 result
            q = group[p]
            tot = acc[q, 0, c0 : c0 + m]
            pos = neg = pos_w = neg_w = tot  # (unread without consensus)
            if consensus:
                pos, neg = acc[q, 1, c0 : c0 + m], acc[q, 2, c0 : c0 + m]
                pos_w, neg_w = acc[q, 3, c0 : c0 + m], acc[q, 4, c0 : c0 + m]
            _finish_chunk(rf, bf, tot, pos, neg, pos_w, neg_w, consensus, normalize[p], s32, np.float32(lam[p]))
            if to_bf16:
                _round_bf16(rbits[:m], bf16[o : o + m])
