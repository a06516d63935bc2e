"""The merge kernels compiled with numba: the fallback where native.py cannot build its C twin (no C
compiler), MERGEDB_KERNELS=numba, and the per-step path's pieces (kernels.sparsify, Accumulator).

Fused block kernels. One pass per group of expert blocks: decode (bf16/f16/f32 bits) → subtract the
base → trim or drop → fold into the running sums, chunk by chunk: a chunk's sums (CHUNK elements × 5
float32 for TIES-style methods, 320 KiB) stay in cache while every expert of the group is folded in,
so the sums go through memory once per group instead of once per expert. Per element the float32
operations and their order are exactly those of `sparsify` + `Accumulator` (experts in plan order),
so results are bit-identical to them; native.c performs the same operations in the same order.

Several trims at once (a sweep's TIES densities over one mask): `fold_many` decodes a chunk of an
expert once and trims and adds it into every set; `finish_many` finishes several plans of one fold
set with the base decoded once. Both go through the same inlined pieces (`_band`, `_add_consensus`,
`_finish_chunk`, `_round_bf16`), experts in plan order, so each set is bit-identical to its own
`fold_group` by construction (tests/test_foldshare.py). Measured on one 2M-element bf16 block, K =
8, 4 sets: 0.6× the CPU time of four `fold_group` calls.

Random draws (DARE, DELLA) are counter-based: draw i of stream `key` is word 0 of Threefry-2x32
with 20 rounds (Random123), keyed by the 64-bit `key` with the 64-bit element index i as counter,
divided by 2^32; so a block's draws equal the whole tensor's at its offset, whatever the threads.
"""

from __future__ import annotations

import numpy as np

from . import jitload
from .jitload import numba  # imported with Ctrl-C held

CHUNK = 16384  # elements per cache-resident chunk (kernels.CHUNK, native.c's CHUNK)
# the random stream below (Threefry-2x32-20) is named by methods.RNG, which plans and manifests record
_PARITY = 0x1BD11BDA  # Threefry's key-schedule parity constant (Skein)


@numba.njit(nogil=True, cache=True, inline="always")
def _rotl(x, r):  # pragma: no cover - compiled
    return np.uint32((x << np.uint32(r)) | (x >> np.uint32(32 - r)))


@numba.njit(nogil=True, cache=True, inline="always")
def _rounds4(x0, x1, r0, r1, r2, r3):  # pragma: no cover - compiled
    # four Threefry rounds: x0 += x1; x1 = rotl(x1, r) ^ x0
    x0 = np.uint32(x0 + x1)
    x1 = _rotl(x1, r0) ^ x0
    x0 = np.uint32(x0 + x1)
    x1 = _rotl(x1, r1) ^ x0
    x0 = np.uint32(x0 + x1)
    x1 = _rotl(x1, r2) ^ x0
    x0 = np.uint32(x0 + x1)
    x1 = _rotl(x1, r3) ^ x0
    return x0, x1


@numba.njit(nogil=True, cache=True, inline="always")
def _draw32(k0, k1, i):  # pragma: no cover - compiled
    """Draw i of stream (k1:k0): word 0 of Threefry-2x32-20 (Salmon et al. 2011, Random123) with
    key (k0, k1) and counter (low, high 32 bits of i). Only 32-bit adds, xors and rotations, so a
    loop of draws vectorises (8 lanes on AVX2). Rotations 13, 15, 26, 6 then 17, 29, 16, 24, four
    rounds each, a key injection between."""
    k2 = k0 ^ k1 ^ np.uint32(_PARITY)
    x0 = np.uint32(np.uint32(i & np.uint64(0xFFFFFFFF)) + k0)
    x1 = np.uint32(np.uint32(i >> np.uint64(32)) + k1)
    x0, x1 = _rounds4(x0, x1, 13, 15, 26, 6)
    x0, x1 = np.uint32(x0 + k1), np.uint32(x1 + k2 + np.uint32(1))
    x0, x1 = _rounds4(x0, x1, 17, 29, 16, 24)
    x0, x1 = np.uint32(x0 + k2), np.uint32(x1 + k0 + np.uint32(2))
    x0, x1 = _rounds4(x0, x1, 13, 15, 26, 6)
    x0, x1 = np.uint32(x0 + k0), np.uint32(x1 + k1 + np.uint32(3))
    x0, x1 = _rounds4(x0, x1, 17, 29, 16, 24)
    x0, x1 = np.uint32(x0 + k1), np.uint32(x1 + k2 + np.uint32(4))
    x0, x1 = _rounds4(x0, x1, 13, 15, 26, 6)
    return np.uint32(x0 + k2)  # word 1 (x1 + k0 + 5) is not used


@numba.njit(nogil=True, cache=True)
def _draws(k0, k1, i0, out):  # pragma: no cover - compiled
    # draws i0 … i0+len(out)−1 of stream (k1:k0) into `out` (uint32)
    for i in range(out.shape[0]):
        out[i] = _draw32(k0, k1, i0 + np.uint64(i))


@numba.njit(nogil=True, cache=True)
def _uniform(key, offset, n):  # pragma: no cover - compiled
    k0, k1 = np.uint32(key & np.uint64(0xFFFFFFFF)), np.uint32(key >> np.uint64(32))
    out = np.empty(n, np.float64)
    for i in range(n):
        out[i] = np.float64(_draw32(k0, k1, offset + np.uint64(i))) * (1.0 / 4294967296.0)
    return out


@numba.njit(nogil=True, cache=True)
def _keep_band(d, lo, hi):  # pragma: no cover - compiled
    # magnitude / band trim in place: keep lo ≤ |d| < hi
    lo32, hi32 = np.float32(lo), np.float32(hi)
    for i in range(d.shape[0]):
        a = abs(d[i])
        if not (a >= lo32 and a < hi32):
            d[i] = np.float32(0.0)


@numba.njit(nogil=True, cache=True)
def _add_scaled(total, d, c):  # pragma: no cover - compiled
    c32 = np.float32(c)
    for i in range(d.shape[0]):
        total[i] += c32 * d[i]


@numba.njit(nogil=True, cache=True, inline="always")
def _f32_bits(v, kind):  # pragma: no cover - compiled
    # raw element bits -> float32 bits (exact: every bf16/f16 value is a float32)
    x = np.uint32(v)
    if kind == 0:
        return x << np.uint32(16)
    if kind == 2:
        return x
    s = (x & np.uint32(0x8000)) << np.uint32(16)
    e = (x >> np.uint32(10)) & np.uint32(0x1F)
    m = x & np.uint32(0x3FF)
    if e == 0:
        if m == 0:
            return s
        e2 = np.uint32(113)  # subnormal half: normalise the mantissa
        while (m & np.uint32(0x400)) == 0:
            m = m << np.uint32(1)
            e2 -= np.uint32(1)
        return s | (e2 << np.uint32(23)) | ((m & np.uint32(0x3FF)) << np.uint32(13))
    if e == 31:
        return s | np.uint32(0x7F800000) | (m << np.uint32(13))
    return s | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))


@numba.njit(nogil=True, cache=True)
def decode_bits(raw, kind, out):  # pragma: no cover - compiled
    """Raw element bits (uint16 or uint32) of dtype `kind` -> float32 bits in `out` (uint32)."""
    for i in range(raw.shape[0]):
        out[i] = _f32_bits(raw[i], kind)


@numba.njit(nogil=True, cache=True, inline="always")
def _decode_chunk(raw, kind, out):  # pragma: no cover - compiled
    # one branch per dtype outside the loop, so each loop vectorises
    if kind == 0:
        for i in range(out.shape[0]):
            out[i] = np.uint32(raw[i]) << np.uint32(16)
    elif kind == 2:
        for i in range(out.shape[0]):
            out[i] = np.uint32(raw[i])
    else:
        for i in range(out.shape[0]):
            out[i] = _f32_bits(raw[i], kind)


@numba.njit(nogil=True, cache=True, inline="always")
def _band(src, dst, lo32, hi32):  # pragma: no cover - compiled
    # dst = src where lo ≤ |src| < hi, else +0 (src and dst may be one array); fold_group's and fold_many's trim
    zero = np.float32(0.0)
    for i in range(src.shape[0]):
        x = src[i]
        a = abs(x)
        dst[i] = x if (a >= lo32) & (a < hi32) else zero


@numba.njit(nogil=True, cache=True, inline="always")
def _add_consensus(t, c, tot, pos, neg, pos_w, neg_w):  # pragma: no cover - compiled
    # branch-free: a sum that starts at +0 is never -0, so adding +0 leaves it unchanged; three loops
    # over few arrays each, so each vectorises (fewer aliasing checks)
    zero = np.float32(0.0)
    m = t.shape[0]
    for i in range(m):
        tot[i] += c * t[i]
    for i in range(m):
        x = t[i]
        wd = c * x
        pos[i] += wd if x > zero else zero
        pos_w[i] += c if x > zero else zero
    for i in range(m):
        x = t[i]
        wd = c * x
        neg[i] += wd if x < zero else zero
        neg_w[i] += c if x < zero else zero


@numba.njit(nogil=True, cache=True, inline="always")
def _finish_chunk(rf, bf, tot, pos, neg, pos_w, neg_w, consensus, normalize, s32, lam32):  # pragma: no cover
    # rf = s·base + update from one chunk's sums: the elected sign's sum (+1 on zero, mergekit), divided
    # by its agreeing weights with normalize (only a zero divisor is 1, as mergekit), times λ
    one = np.float32(1.0)
    zero = np.float32(0.0)
    m = rf.shape[0]
    if consensus:
        for i in range(m):
            a, b = pos[i], neg[i]  # both loaded: a select, not a branch
            rf[i] = a if tot[i] >= zero else b
        if normalize:
            for i in range(m):
                a, b = pos_w[i], neg_w[i]
                den = a if tot[i] >= zero else b
                rf[i] = rf[i] / (one if den == zero else den)
        for i in range(m):
            rf[i] = s32 * bf[i] + lam32 * rf[i]
    else:
        for i in range(m):
            rf[i] = s32 * bf[i] + tot[i]


@numba.njit(nogil=True, cache=True, inline="always")
def _round_bf16(bits, out):  # pragma: no cover - compiled
    # float32 bit patterns to bfloat16, rounded to nearest even; NaN stays NaN (encoding.float32_to_bf16)
    for i in range(out.shape[0]):
        x = bits[i]
        r = (x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        nan = (x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        out[i] = np.uint16(0x7FC0) if nan else np.uint16(r)


@numba.njit(nogil=True, cache=True)
def fold_group(base, ex, kind, mode, offset, coefs, lo, hi, keys, p, eps, ranks, acc):  # pragma: no cover - compiled
    """Fold experts ex[0..g) (each (n,) raw bits of one block) into the sums `acc`.

    base (n,) raw bits; ex (g, n) raw bits in plan order; coefs (g,) float32: c_k for additive
    sums (acc (1, n)), w_k for sign consensus (acc (5, n): total, pos, neg, pos_w, neg_w);
    mode 0: Δ as is, 1: keep lo_k ≤ |Δ| < hi_k, 2: DARE keep Δ / p where draw < p, 3: DELLA keep
    Δ / p_i where draw < p_i, p_i = float32(p − ε + 2ε·ranks[k, bits(|Δ_i|) >> 17]) (draws of
    stream keys_k at element offset + i, as `uniform`)."""
    n = base.shape[0]
    g = ex.shape[0]
    consensus = acc.shape[0] == 5
    p32 = np.float32(p)
    p_lo, two_eps = p - eps, 2.0 * eps  # DELLA: float64, as `sparsify` computes them
    inv32 = 1.0 / 4294967296.0
    thr = np.ceil(min(max(p, 0.0), 1.0) * 4294967296.0)  # DARE: keep draws r < thr
    keep_all = thr >= 4294967296.0
    thr32 = np.uint32(min(thr, 4294967295.0))
    bbits = np.empty(CHUNK, np.uint32)
    dbits = np.empty(CHUNK, np.uint32)
    rbits = np.empty(CHUNK, np.uint32)  # (m,) the chunk's draws
    for c0 in range(0, n, CHUNK):
        m = min(CHUNK, n - c0)
        bf = bbits[:m].view(np.float32)  # (m,) float32 base
        df = dbits[:m].view(np.float32)  # (m,) float32 Δ of one expert
        _decode_chunk(base[c0 : c0 + m], kind, bbits[:m])
        for k in range(g):
            _decode_chunk(ex[k, c0 : c0 + m], kind, dbits[:m])
            for i in range(m):
                df[i] = df[i] - bf[i]
            if mode == 1:
                _band(df, df, np.float32(lo[k]), np.float32(hi[k]))
            elif mode >= 2:
                # the draws first (a loop of 32-bit integer ops only, vectorised), then the test
                k0, k1 = np.uint32(keys[k] & np.uint64(0xFFFFFFFF)), np.uint32(keys[k] >> np.uint64(32))
                _draws(k0, k1, np.uint64(offset + c0), rbits[:m])
                # branch-free (a 50% branch mispredicts): divide everything, then clear dropped bits
                if mode == 2:  # u < p  ⇔  r·2^-32 < p  ⇔  r < ceil(p·2^32): the same test in integers
                    for i in range(m):
                        df[i] = df[i] / p32
                    if not keep_all:
                        for i in range(m):
                            dbits[i] = dbits[i] & (np.uint32(0) - np.uint32(rbits[i] < thr32))
                else:
                    tab = ranks[k]
                    for i in range(m):
                        pi = np.float32(p_lo + two_eps * tab[(dbits[i] & np.uint32(0x7FFFFFFF)) >> np.uint32(17)])
                        u = np.float64(rbits[i]) * inv32  # exact: `uniform`'s draw
                        rbits[i] = np.uint32(0) - np.uint32(u < np.float64(pi))  # keep mask
                        df[i] = df[i] / pi
                    for i in range(m):
                        dbits[i] = dbits[i] & rbits[i]
            c = coefs[k]
            tot = acc[0, c0 : c0 + m]
            if consensus:
                pos, neg = acc[1, c0 : c0 + m], acc[2, c0 : c0 + m]
                pos_w, neg_w = acc[3, c0 : c0 + m], acc[4, c0 : c0 + m]
                _add_consensus(df, c, tot, pos, neg, pos_w, neg_w)
            else:
                for i in range(m):
                    tot[i] += c * df[i]


@numba.njit(nogil=True, cache=True)
def finish(base, kind, acc, normalize, lam, res, bf16, scale=1.0):  # pragma: no cover - compiled
    """scale·base + merged update (Accumulator.merged_delta) from the sums of `fold_group`: into
    `res` (n,) float32, or, when `bf16` (n,) uint16 is not empty, as bfloat16 bits rounded to nearest
    even (encoding.float32_to_bf16; NaN stays NaN). scale (SLERP's s0 + s1) is 1.0 for every other
    method, and x·1.0 == x exactly, so their outputs do not change."""
    n = base.shape[0]
    consensus = acc.shape[0] == 5
    lam32 = np.float32(lam)
    s32 = np.float32(scale)
    to_bf16 = bf16.shape[0] > 0
    bbits = np.empty(CHUNK, np.uint32)
    rbits = np.empty(CHUNK, np.uint32)
    for c0 in range(0, n, CHUNK):
        m = min(CHUNK, n - c0)
        bf = bbits[:m].view(np.float32)  # (m,) float32 base
        rf = rbits[:m].view(np.float32) if to_bf16 else res[c0 : c0 + m]  # (m,) float32 result
        _decode_chunk(base[c0 : c0 + m], kind, bbits[:m])
        tot = acc[0, c0 : c0 + m]
        pos = neg = pos_w = neg_w = tot  # (unread without consensus)
        if consensus:
            pos, neg = acc[1, c0 : c0 + m], acc[2, c0 : c0 + m]
            pos_w, neg_w = acc[3, c0 : c0 + m], acc[4, c0 : c0 + m]
        _finish_chunk(rf, bf, tot, pos, neg, pos_w, neg_w, consensus, normalize, s32, lam32)
        if to_bf16:
            _round_bf16(rbits[:m], bf16[c0 : c0 + m])


# -- model_stock -------------------------------------------------------------------------------
# Its scale t needs ⟨Δ_j, Δ_k⟩ over the whole tensor, so each block's unit folds Σ c_k Δ_k and
# returns the block's exact pairwise dots; the tensor's last unit sums them (blocks in order) and
# applies t. A dot is summed in float64 in a fixed order whatever the machine (BLAS picks its own
# order per CPU, which would make a replay elsewhere differ): per CHUNK of the block, 8 lanes by
# element index mod 8, the lanes added 0..7, the chunks in order.


@numba.njit(nogil=True, cache=True, inline="always")
def _dot_chunk(a, b, m):  # pragma: no cover - compiled
    lanes = np.zeros(8, np.float64)
    m8 = m - m % 8
    for i in range(0, m8, 8):
        for j in range(8):
            lanes[j] += np.float64(a[i + j]) * np.float64(b[i + j])
    for i in range(m8, m):
        lanes[i - m8] += np.float64(a[i]) * np.float64(b[i])
    s = 0.0
    for j in range(8):
        s += lanes[j]
    return s


@numba.njit(nogil=True, cache=True)
def dot64(a, b):  # pragma: no cover - compiled
    """⟨a, b⟩ of two (n,) float32 arrays in float64, in the fixed order `stock_fold` uses."""
    s = 0.0
    for c0 in range(0, a.shape[0], CHUNK):
        m = min(CHUNK, a.shape[0] - c0)
        s += _dot_chunk(a[c0 : c0 + m], b[c0 : c0 + m], m)
    return s


@numba.njit(nogil=True, cache=True)
def stock_fold(base, ex, kind, coefs, acc, dots):  # pragma: no cover - compiled
    """model_stock's block: acc (1, n) float32 = Σ_k coefs_k Δ_k (experts in plan order, as
    `fold_group` mode 0) and dots (g, g) float64, upper triangle += ⟨Δ_a, Δ_b⟩ as `dot64`.
    base (n,) raw bits; ex (g, n) raw bits of every expert of the block."""
    n = base.shape[0]
    g = ex.shape[0]
    bbits = np.empty(CHUNK, np.uint32)
    dbits = np.empty((g, CHUNK), np.uint32)
    for c0 in range(0, n, CHUNK):
        m = min(CHUNK, n - c0)
        bf = bbits[:m].view(np.float32)  # (m,) float32 base
        _decode_chunk(base[c0 : c0 + m], kind, bbits[:m])
        tot = acc[0, c0 : c0 + m]
        for k in range(g):
            df = dbits[k, :m].view(np.float32)  # (m,) float32 Δ_k
            _decode_chunk(ex[k, c0 : c0 + m], kind, dbits[k, :m])
            c = coefs[k]
            for i in range(m):
                df[i] = df[i] - bf[i]
            for i in range(m):
                tot[i] += c * df[i]
        for a in range(g):
            for b in range(a + 1, g):
                dots[a, b] += _dot_chunk(dbits[a, :m].view(np.float32), dbits[b, :m].view(np.float32), m)


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


def uniform(key: int, offset: int, n: int) -> np.ndarray:
    """Uniform [0, 1) draws for elements offset … offset+n−1 of the stream `key` (float64)."""
    return _uniform(np.uint64(key), np.uint64(offset), n)


jitload.light_cache_loads(vars())  # first calls load the cached code without numba's full refresh
