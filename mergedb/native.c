/* The fused merge kernels in C, for processes that should not pay numba's start (native.py).

   Every function performs the float32 (and, for DELLA's keep probability and model_stock's dots,
   float64) operations of its namesake in jitkernels.py, element by element in the same order, so
   the two give the same bits (tests/test_native.py checks every kernel and every method against
   each other). That rests on three compiler flags native.py always passes: -ffp-contract=off (no
   fused multiply-adds, which round once where numba rounds twice), no -ffast-math (no reordered
   sums), and -fno-strict-aliasing (chunks are read as float32 through uint32 buffers, as numba's
   .view(np.float32) does).

   Arrays: raw element bits are uint16 (BF16, F16) or uint32 (F32) as `wide` says; 2-D arrays are
   passed as a pointer and a row stride in elements (rows may be column slices of a larger buffer),
   each row contiguous. A function returns 0, or -1 when it could not allocate its chunk buffers. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 16384 /* elements per cache-resident chunk (kernels.CHUNK) */

typedef int64_t i64;

/* -- Threefry-2x32-20 (Random123): draw i of stream (k1:k0), as jitkernels._draw32 ------------- */

static inline uint32_t rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

#define ROUNDS4(x0, x1, r0, r1, r2, r3) \
    x0 += x1; x1 = rotl(x1, r0) ^ x0;      \
    x0 += x1; x1 = rotl(x1, r1) ^ x0;      \
    x0 += x1; x1 = rotl(x1, r2) ^ x0;      \
    x0 += x1; x1 = rotl(x1, r3) ^ x0;

static inline uint32_t draw32(uint32_t k0, uint32_t k1, uint64_t i) {
    uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
    uint32_t x0 = (uint32_t)i + k0, x1 = (uint32_t)(i >> 32) + k1;
    ROUNDS4(x0, x1, 13, 15, 26, 6)
    x0 += k1; x1 += k2 + 1u;
    ROUNDS4(x0, x1, 17, 29, 16, 24)
    x0 += k2; x1 += k0 + 2u;
    ROUNDS4(x0, x1, 13, 15, 26, 6)
    x0 += k0; x1 += k1 + 3u;
    ROUNDS4(x0, x1, 17, 29, 16, 24)
    x0 += k1; x1 += k2 + 4u;
    ROUNDS4(x0, x1, 13, 15, 26, 6)
    return x0 + k2;
}

/* -- decoding: raw element bits -> float32 bits (exact) ---------------------------------------- */

static inline uint32_t f16_bits(uint32_t x) {
    uint32_t s = (x & 0x8000u) << 16, e = (x >> 10) & 0x1Fu, m = x & 0x3FFu;
    if (e == 0) {
        if (m == 0) return s;
        uint32_t e2 = 113; /* subnormal half: normalise the mantissa */
        while ((m & 0x400u) == 0) { m <<= 1; e2 -= 1; }
        return s | (e2 << 23) | ((m & 0x3FFu) << 13);
    }
    if (e == 31) return s | 0x7F800000u | (m << 13);
    return s | ((e + 112u) << 23) | (m << 13);
}

static inline uint32_t f32_bits(uint32_t x, int kind) {
    if (kind == 0) return x << 16;
    if (kind == 2) return x;
    return f16_bits(x);
}

/* elements [at, at + m) of `raw` into out[0, m): one branch per dtype outside the loop */
static void decode(const void *raw, int wide, i64 at, int kind, i64 m, uint32_t *restrict out) {
    if (wide) {
        const uint32_t *r = (const uint32_t *)raw + at;
        if (kind == 0) for (i64 i = 0; i < m; i++) out[i] = r[i] << 16;
        else if (kind == 2) memcpy(out, r, (size_t)m * 4);
        else for (i64 i = 0; i < m; i++) out[i] = f16_bits(r[i]);
    } else {
        const uint16_t *r = (const uint16_t *)raw + at;
        if (kind == 0) for (i64 i = 0; i < m; i++) out[i] = (uint32_t)r[i] << 16;
        else if (kind == 2) for (i64 i = 0; i < m; i++) out[i] = r[i];
        else for (i64 i = 0; i < m; i++) out[i] = f16_bits(r[i]);
    }
}

static void *chunks(i64 count) { /* `count` chunk buffers of uint32, cache-line aligned */
    return aligned_alloc(64, (size_t)count * CHUNK * sizeof(uint32_t));
}

static const void *row(const void *a, int wide, i64 stride, i64 k) {
    return wide ? (const void *)((const uint32_t *)a + k * stride) : (const void *)((const uint16_t *)a + k * stride);
}

/* -- the inlined pieces (jitkernels._band, _add_consensus, _finish_chunk, _round_bf16) ---------- */

static inline void sub(float *restrict d, const float *restrict b, i64 m) { /* Δ = expert − base */
    for (i64 i = 0; i < m; i++) d[i] = d[i] - b[i];
}

static inline void add_scaled(float *restrict tot, const float *restrict d, float c, i64 m) {
    for (i64 i = 0; i < m; i++) tot[i] += c * d[i];
}

static inline void band(const float *src, float *dst, float lo, float hi, i64 m) {
    for (i64 i = 0; i < m; i++) {
        float x = src[i], a = fabsf(x);
        dst[i] = ((a >= lo) & (a < hi)) ? x : 0.0f;
    }
}

static inline void add_consensus(const float *restrict t, float c, float *restrict tot, float *restrict pos,
                                 float *restrict neg, float *restrict pos_w, float *restrict neg_w, i64 m) {
    add_scaled(tot, t, c, m);
    for (i64 i = 0; i < m; i++) {
        float x = t[i], wd = c * x;
        pos[i] += x > 0.0f ? wd : 0.0f;
        pos_w[i] += x > 0.0f ? c : 0.0f;
    }
    for (i64 i = 0; i < m; i++) {
        float x = t[i], wd = c * x;
        neg[i] += x < 0.0f ? wd : 0.0f;
        neg_w[i] += x < 0.0f ? c : 0.0f;
    }
}

static inline void finish_chunk(float *restrict rf, const float *restrict bf, const float *tot, const float *pos,
                                const float *neg, const float *pos_w, const float *neg_w, int consensus,
                                int normalize, float s32, float lam32, i64 m) {
    if (consensus) {
        for (i64 i = 0; i < m; i++) rf[i] = tot[i] >= 0.0f ? pos[i] : neg[i];
        if (normalize)
            for (i64 i = 0; i < m; i++) {
                float den = tot[i] >= 0.0f ? pos_w[i] : neg_w[i];
                rf[i] = rf[i] / (den == 0.0f ? 1.0f : den);
            }
        for (i64 i = 0; i < m; i++) rf[i] = s32 * bf[i] + lam32 * rf[i];
    } else {
        for (i64 i = 0; i < m; i++) rf[i] = s32 * bf[i] + tot[i];
    }
}

static inline void round_bf16(const uint32_t *restrict bits, uint16_t *restrict out, i64 m) {
    for (i64 i = 0; i < m; i++) {
        uint32_t x = bits[i];
        uint32_t r = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
        out[i] = (x & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0u : (uint16_t)r;
    }
}

/* -- exported kernels ------------------------------------------------------------------------- */

void mdb_decode_bits(const void *raw, int wide, i64 n, int kind, uint32_t *out) { decode(raw, wide, 0, kind, n, out); }

void mdb_draws(uint64_t key, uint64_t offset, i64 n, double *out) { /* jitkernels._uniform */
    uint32_t k0 = (uint32_t)(key & 0xFFFFFFFFu), k1 = (uint32_t)(key >> 32);
    for (i64 i = 0; i < n; i++) out[i] = (double)draw32(k0, k1, offset + (uint64_t)i) * (1.0 / 4294967296.0);
}

int mdb_fold_group(const void *base, int wide, const void *ex, i64 ex_stride, i64 g, i64 n, int kind, int mode,
                   i64 offset, const float *coefs, const double *lo, const double *hi, const uint64_t *keys,
                   double p, double eps, const double *ranks, i64 ranks_stride, float *acc, i64 acc_rows,
                   i64 acc_stride) {
    int consensus = acc_rows == 5;
    float p32 = (float)p;
    double p_lo = p - eps, two_eps = 2.0 * eps; /* DELLA: float64, as `sparsify` computes them */
    double inv32 = 1.0 / 4294967296.0;
    double pc = p > 0.0 ? p : 0.0;
    double thr = ceil((pc < 1.0 ? pc : 1.0) * 4294967296.0); /* DARE: keep draws r < thr */
    int keep_all = thr >= 4294967296.0;
    uint32_t thr32 = (uint32_t)(thr < 4294967295.0 ? thr : 4294967295.0);
    uint32_t *bbits = chunks(3);
    if (!bbits) return -1;
    uint32_t *dbits = bbits + CHUNK, *rbits = bbits + 2 * CHUNK;
    float *bf = (float *)bbits, *df = (float *)dbits;
    for (i64 c0 = 0; c0 < n; c0 += CHUNK) {
        i64 m = n - c0 < CHUNK ? n - c0 : CHUNK;
        decode(base, wide, c0, kind, m, bbits);
        for (i64 k = 0; k < g; k++) {
            decode(row(ex, wide, ex_stride, k), wide, c0, kind, m, dbits);
            sub(df, bf, m);
            if (mode == 1) {
                band(df, df, (float)lo[k], (float)hi[k], m);
            } else if (mode >= 2) {
                uint32_t k0 = (uint32_t)(keys[k] & 0xFFFFFFFFu), k1 = (uint32_t)(keys[k] >> 32);
                uint64_t i0 = (uint64_t)(offset + c0);
                for (i64 i = 0; i < m; i++) rbits[i] = draw32(k0, k1, i0 + (uint64_t)i);
                if (mode == 2) { /* r < ceil(p·2^32) ⇔ u < p: divide everything, then clear dropped bits */
                    for (i64 i = 0; i < m; i++) df[i] = df[i] / p32;
                    if (!keep_all)
                        for (i64 i = 0; i < m; i++) dbits[i] = dbits[i] & (0u - (uint32_t)(rbits[i] < thr32));
                } else {
                    const double *tab = ranks + k * ranks_stride;
                    for (i64 i = 0; i < m; i++) {
                        float pi = (float)(p_lo + two_eps * tab[(dbits[i] & 0x7FFFFFFFu) >> 17]);
                        double u = (double)rbits[i] * inv32; /* exact: `uniform`'s draw */
                        rbits[i] = 0u - (uint32_t)(u < (double)pi);
                        df[i] = df[i] / pi;
                    }
                    for (i64 i = 0; i < m; i++) dbits[i] = dbits[i] & rbits[i];
                }
            }
            float c = coefs[k];
            float *tot = acc + c0;
            if (consensus) {
                add_consensus(df, c, tot, acc + acc_stride + c0, acc + 2 * acc_stride + c0, acc + 3 * acc_stride + c0,
                              acc + 4 * acc_stride + c0, m);
            } else {
                add_scaled(tot, df, c, m);
            }
        }
    }
    free(bbits);
    return 0;
}

int mdb_finish(const void *base, int wide, i64 n, int kind, const float *acc, i64 acc_rows, i64 acc_stride,
               int normalize, double lam, float *res, uint16_t *bf16, int to_bf16, double scale) {
    int consensus = acc_rows == 5;
    float lam32 = (float)lam, s32 = (float)scale;
    uint32_t *bbits = chunks(2);
    if (!bbits) return -1;
    uint32_t *rbits = bbits + CHUNK;
    for (i64 c0 = 0; c0 < n; c0 += CHUNK) {
        i64 m = n - c0 < CHUNK ? n - c0 : CHUNK;
        decode(base, wide, c0, kind, m, bbits);
        float *rf = to_bf16 ? (float *)rbits : res + c0;
        const float *s = acc + c0;
        i64 rs = consensus ? acc_stride : 0; /* rows 1..4 unread without consensus */
        finish_chunk(rf, (const float *)bbits, s, s + rs, s + 2 * rs, s + 3 * rs, s + 4 * rs, consensus, normalize,
                     s32, lam32, m);
        if (to_bf16) round_bf16(rbits, bf16 + c0, m);
    }
    free(bbits);
    return 0;
}

static double dot_chunk(const float *a, const float *b, i64 m) { /* jitkernels._dot_chunk */
    double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    i64 m8 = m - m % 8;
    for (i64 i = 0; i < m8; i += 8)
        for (int j = 0; j < 8; j++) lanes[j] += (double)a[i + j] * (double)b[i + j];
    for (i64 i = m8; i < m; i++) lanes[i - m8] += (double)a[i] * (double)b[i];
    double s = 0.0;
    for (int j = 0; j < 8; j++) s += lanes[j];
    return s;
}

double mdb_dot64(const float *a, const float *b, i64 n) {
    double s = 0.0;
    for (i64 c0 = 0; c0 < n; c0 += CHUNK) s += dot_chunk(a + c0, b + c0, n - c0 < CHUNK ? n - c0 : CHUNK);
    return s;
}

int mdb_stock_fold(const void *base, int wide, const void *ex, i64 ex_stride, i64 g, i64 n, int kind,
                   const float *coefs, float *acc, double *dots, i64 dots_stride) {
    uint32_t *bbits = chunks(g + 1);
    if (!bbits) return -1;
    float *bf = (float *)bbits;
    for (i64 c0 = 0; c0 < n; c0 += CHUNK) {
        i64 m = n - c0 < CHUNK ? n - c0 : CHUNK;
        decode(base, wide, c0, kind, m, bbits);
        float *tot = acc + c0;
        for (i64 k = 0; k < g; k++) {
            uint32_t *dk = bbits + (k + 1) * CHUNK;
            float *df = (float *)dk, c = coefs[k];
            decode(row(ex, wide, ex_stride, k), wide, c0, kind, m, dk);
            sub(df, bf, m);
            add_scaled(tot, df, c, m);
        }
        for (i64 a = 0; a < g; a++)
            for (i64 b = a + 1; b < g; b++)
                dots[a * dots_stride + b] +=
                    dot_chunk((const float *)(bbits + (a + 1) * CHUNK), (const float *)(bbits + (b + 1) * CHUNK), m);
    }
    free(bbits);
    return 0;
}

int mdb_fold_many(const void *base, int wide, const void *ex, i64 ex_stride, i64 g, i64 n, int kind,
                  const float *coefs, const double *lo, const double *hi, i64 par_stride, float *acc, i64 sets,
                  i64 set_stride, i64 row_stride) {
    uint32_t *bbits = chunks(3);
    if (!bbits) return -1;
    uint32_t *dbits = bbits + CHUNK;
    float *bf = (float *)bbits, *df = (float *)dbits, *t = (float *)(bbits + 2 * CHUNK);
    for (i64 c0 = 0; c0 < n; c0 += CHUNK) {
        i64 m = n - c0 < CHUNK ? n - c0 : CHUNK;
        decode(base, wide, c0, kind, m, bbits);
        for (i64 k = 0; k < g; k++) {
            decode(row(ex, wide, ex_stride, k), wide, c0, kind, m, dbits);
            sub(df, bf, m);
            for (i64 q = 0; q < sets; q++) {
                float *s = acc + q * set_stride + c0;
                band(df, t, (float)lo[q * par_stride + k], (float)hi[q * par_stride + k], m);
                add_consensus(t, coefs[q * par_stride + k], s, s + row_stride, s + 2 * row_stride, s + 3 * row_stride,
                              s + 4 * row_stride, m);
            }
        }
    }
    free(bbits);
    return 0;
}

int mdb_finish_many(const void *base, int wide, i64 n, int kind, const float *acc, i64 acc_rows, i64 set_stride,
                    i64 row_stride, const i64 *group, i64 plans, const uint8_t *normalize, const double *lam,
                    double scale, float *res, uint16_t *bf16, int to_bf16, i64 stride, i64 at) {
    int consensus = acc_rows == 5;
    float s32 = (float)scale;
    uint32_t *bbits = chunks(2);
    if (!bbits) return -1;
    uint32_t *rbits = bbits + CHUNK;
    for (i64 c0 = 0; c0 < n; c0 += CHUNK) {
        i64 m = n - c0 < CHUNK ? n - c0 : CHUNK;
        decode(base, wide, c0, kind, m, bbits); /* once for every plan */
        for (i64 p = 0; p < plans; p++) {
            i64 o = p * stride + at + c0; /* plan p's first element of this chunk */
            float *rf = to_bf16 ? (float *)rbits : res + o;
            const float *s = acc + group[p] * set_stride + c0;
            i64 rs = consensus ? row_stride : 0; /* rows 1..4 unread without consensus */
            finish_chunk(rf, (const float *)bbits, s, s + rs, s + 2 * rs, s + 3 * rs, s + 4 * rs, consensus,
                         normalize[p], s32, (float)lam[p], m);
            if (to_bf16) round_bf16(rbits, bf16 + o, m);
        }
    }
    free(bbits);
    return 0;
}
