/* Registration's statistics kernels in C (native.py compiles this file after native.c, as one unit).

   Every function computes what its namesake in deltapass.py computes, with the same float64
   operations in the same order, so the two give the same bits (tests/test_register_speed.py and
   tests/test_regkernels.py compare them on bf16 and float32 blocks with exceptions, NaN/Inf, equal
   chunks and overflowing exception buffers). native.py checks every argument before a call: the
   code below trusts its arrays' extents. Where numba's loop handles one element at a time,
   `delta_run` takes 64 at a time: one pass the compiler vectorises (decode, Δ, |Δ|, the four lanes
   of θ₀·Δ, ±Δ), then the exception mask, and the scattered counts and sketch updates in element
   order. The lanes of θ₀·Δ are element i % 4, each summed in element order: a four-wide vector add
   performs exactly those adds.

   Arrays: raw element patterns are bf16 (uint16, shifted left 16 bits to float32) or float32
   (uint32) as `wide` says. Block k of a group spans raw bytes raw_start[k]..raw_start[k + 1] and
   elements start[k]..start[k + 1]. */

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PASS_CHUNK 512 /* elements an equal chunk spans (deltapass.CHUNK) */
#define SAMPLE_STEP 16 /* the first look at a block checks one chunk in this many (deltapass.SAMPLE_STEP) */
#define FLOAT_MAX_BITS 0x7F7FFFFFu

typedef double v4d __attribute__((vector_size(32)));

static inline float as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t as_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline uint32_t pattern(const void *raw, int wide, i64 i) {
    return wide ? ((const uint32_t *)raw)[i] : (uint32_t)((const uint16_t *)raw)[i] << 16;
}
/* ±d: d with its sign flipped when `neg` (exactly -d; a select compiled to a branch mispredicted half the time) */
static inline double signed_by(double d, uint32_t neg) {
    uint64_t u;
    memcpy(&u, &d, 8);
    u ^= (uint64_t)neg << 63;
    memcpy(&d, &u, 8);
    return d;
}
static inline uint64_t word(const uint8_t *p, i64 w) { uint64_t x; memcpy(&x, p + 8 * w, 8); return x; }

typedef struct { /* what a run of the pass adds to: deltapass._delta_pass' arguments after codes */
    i64 *counts;
    double *sk, *bd;
    uint32_t *exc;
    i64 cap, n_exc, nonfinite;
} pass_t;

static inline void take_exceptions(pass_t *p, uint64_t mask, const uint32_t *abs_bits) {
    while (mask) {
        p->exc[p->n_exc < p->cap ? p->n_exc : p->cap] = abs_bits[__builtin_ctzll(mask)];
        p->n_exc++;
        mask &= mask - 1;
    }
}

/* bit j set where ab[j] (finite) is an exception: its low 17 bits are not all zero */
static inline uint64_t exception_mask(const uint32_t *ab) {
#if defined(__AVX512F__)
    __m512i low = _mm512_set1_epi32(0x1FFFF);
    uint64_t m = 0;
    for (int q = 0; q < 4; q++)
        m |= (uint64_t)_mm512_test_epi32_mask(_mm512_loadu_si512((const void *)(ab + 16 * q)), low) << (16 * q);
    return m;
#else
    uint64_t m = 0;
    for (int j = 0; j < 64; j++) m |= (uint64_t)((ab[j] & 0x1FFFFu) != 0) << j;
    return m;
#endif
}

/* deltapass._delta_elem, one element (the path of a chunk with a NaN/Inf Δ, and of a short tail) */
static inline uint64_t delta_elem(float bv, float dv, i64 j, uint16_t code, pass_t *p, uint64_t emask) {
    uint32_t bits = as_bits(dv) & 0x7FFFFFFFu;
    if (bits > FLOAT_MAX_BITS) { p->nonfinite++; return emask; }
    p->counts[bits >> 17]++;
    emask |= (uint64_t)((bits & 0x1FFFFu) != 0) << (j & 63);
    double d64 = (double)dv;
    p->bd[j & 3] += (double)bv * d64;
    p->sk[code >> 1] += signed_by(d64, code & 1u);
    return emask;
}

/* deltapass._delta_pass over elements [0, n) of a run (starting at a multiple of 64 in its block) */
static void delta_run(const void *e, const void *b, int wide, i64 n, uint32_t *abs_bits, const uint16_t *codes,
                      pass_t *p) {
    float bf[64], df[64];
    for (i64 c0 = 0; c0 < n; c0 += 64) {
        i64 m = n - c0 < 64 ? n - c0 : 64;
        uint32_t *ab = abs_bits + c0;
        uint32_t worst = 0;
        for (i64 j = 0; j < m; j++) {
            float bv = as_float(pattern(b, wide, c0 + j)), dv = as_float(pattern(e, wide, c0 + j)) - bv;
            uint32_t bits = as_bits(dv) & 0x7FFFFFFFu;
            ab[j] = bits;
            bf[j] = bv;
            df[j] = dv;
            worst = bits > worst ? bits : worst;
        }
        uint64_t emask = 0;
        if (m == 64 && worst <= FLOAT_MAX_BITS) { /* every Δ finite: the vectorised path */
            v4d lane = {p->bd[0], p->bd[1], p->bd[2], p->bd[3]};
            for (int j = 0; j < 64; j += 4) {
                v4d x = {bf[j], bf[j + 1], bf[j + 2], bf[j + 3]}, y = {df[j], df[j + 1], df[j + 2], df[j + 3]};
                lane += x * y;
            }
            for (int q = 0; q < 4; q++) p->bd[q] = lane[q];
            double sd[64]; /* ±Δ as the sketch adds it */
            const uint16_t *restrict code = codes + c0;
            for (int j = 0; j < 64; j++) sd[j] = signed_by((double)df[j], code[j] & 1u);
            emask = exception_mask(ab);
            i64 *restrict counts = p->counts;
            double *restrict sk = p->sk;
            for (int j = 0; j < 64; j++) {
                counts[ab[j] >> 17]++;
                sk[code[j] >> 1] += sd[j];
            }
        } else {
            for (i64 j = 0; j < m; j++) emask = delta_elem(bf[j], df[j], j, codes[c0 + j], p, emask);
        }
        take_exceptions(p, emask, ab);
    }
}

/* deltapass._equal_chunks for one chunk: its words are equal and no base value in it is NaN/Inf */
static int equal_chunk(const uint8_t *ew, const uint8_t *bw, i64 c, i64 words, int wide) {
    uint64_t em = wide ? 0x7F8000007F800000ull : 0x7F807F807F807F80ull;
    uint64_t el = wide ? 0x0080000000800000ull : 0x0080008000800080ull;
    uint64_t top = wide ? 0x8000000080000000ull : 0x8000800080008000ull;
    uint64_t diff = 0, bad = 0;
    for (i64 w = c * words; w < (c + 1) * words; w++) {
        uint64_t x = word(ew, w), y = word(bw, w);
        diff |= x ^ y;
        bad |= (y & em) + el;
    }
    return diff == 0 && (bad & top) == 0;
}

/* deltapass._block_pass over one block of n elements; ew, bw: its patterns as bytes, `words` whole
   64-bit words of them usable (0: none) */
static void block_pass(const void *e, const void *b, int wide, i64 n, const uint8_t *ew, const uint8_t *bw,
                       i64 n_words, uint32_t *abs_bits, const uint16_t *codes, pass_t *p) {
    i64 size = wide ? 4 : 2, words = PASS_CHUNK * size / 8, chunks = n_words / words;
    int any = 0;
    if (n_words >= words * SAMPLE_STEP)
        for (i64 c = 0; c < chunks && !any; c += SAMPLE_STEP) any = equal_chunk(ew, bw, c, words, wide);
    if (!any) {
        delta_run(e, b, wide, n, abs_bits, codes, p);
        return;
    }
    i64 start = 0; /* deltapass._delta_runs: the runs between equal chunks, which only count as zeros */
    for (i64 c = 0; c < chunks; c++) {
        if (!equal_chunk(ew, bw, c, words, wide)) continue;
        i64 stop = c * PASS_CHUNK;
        if (start < stop)
            delta_run(row(e, wide, start, 1), row(b, wide, start, 1), wide, stop - start, abs_bits + start,
                      codes + start, p);
        memset(abs_bits + stop, 0, PASS_CHUNK * sizeof(uint32_t));
        p->counts[0] += PASS_CHUNK;
        start = stop + PASS_CHUNK;
    }
    if (start < n)
        delta_run(row(e, wide, start, 1), row(b, wide, start, 1), wide, n - start, abs_bits + start, codes + start,
                  p);
}

/* deltapass._pairwise: numpy's pairwise sum of a[0, 32) */
static inline double pairwise32(const double *a) {
    double r[8];
    for (int q = 0; q < 8; q++) r[q] = a[q];
    for (int i = 8; i < 32; i += 8)
        for (int q = 0; q < 8; q++) r[q] += a[i + q];
    return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
}

/* deltapass.block_hist into one block's rows; returns its exact zeros. PER summary bins a histogram
   bin; esum: scratch of 2 * bins / PER doubles. Leaves `counts` all zero again, clearing only the
   histogram bins that had any (a memset of all 16,384 counts per 64 KiB block cost 3% of a
   registration). Without exceptions their sums are skipped: adding their zeros changes no sum (a
   sum here is never -0). */
#define PER 32
static i64 block_hist(i64 *counts, i64 *summary, i64 bins, const uint32_t *exc, i64 m, const double *edge,
                      const double *edge_sq, int hist_shift, int summary_shift, i64 *hcount, double *hsum,
                      double *hsq, double *mx, double *esum) {
    i64 n_hist = bins / PER;
    for (i64 h = 0; h < n_hist; h++) {
        i64 t = 0;
        for (i64 j = h * PER; j < (h + 1) * PER; j++) {
            summary[j] += counts[j];
            t += counts[j];
        }
        hcount[h] = t;
    }
    for (i64 i = 0; i < m; i++) counts[exc[i] >> summary_shift]--;
    i64 zeros = counts[0];
    double prod[PER], prod_sq[PER];
    i64 top = -1;
    for (i64 h = 0; h < n_hist; h++) {
        if (hcount[h] == 0) continue; /* its counts are all zero: none counted, so no exception taken off */
        for (i64 j = 0; j < PER; j++) {
            double c = (double)counts[h * PER + j];
            prod[j] = c * edge[h * PER + j];
            prod_sq[j] = c * edge_sq[h * PER + j];
            if (counts[h * PER + j] != 0) top = h * PER + j;
        }
        memset(counts + h * PER, 0, PER * sizeof(i64));
        hsum[h] = 0.0 + pairwise32(prod);
        hsq[h] = 0.0 + pairwise32(prod_sq);
    }
    double vmax = 0.0, *esq = esum + n_hist;
    if (m > 0) memset(esum, 0, (size_t)n_hist * 2 * sizeof(double));
    for (i64 i = 0; i < m; i++) {
        double v = (double)as_float(exc[i]);
        esum[exc[i] >> hist_shift] += v;
        esq[exc[i] >> hist_shift] += v * v;
        vmax = i == 0 ? v : (v > vmax ? v : vmax);
    }
    for (i64 h = 0; h < n_hist && m > 0; h++) {
        hsum[h] += esum[h];
        hsq[h] += esq[h];
    }
    *mx = (top >= 0 && edge[top] > vmax) ? edge[top] : vmax;
    return zeros;
}

/* deltapass.abs_pass over one block's |Δ| (its exceptions did not fit); returns its exact zeros */
static i64 abs_pass(const uint32_t *abs_bits, i64 n, double *hsum, double *hsq, double *mx) {
    float m = 0.0f;
    i64 zeros = 0;
    for (i64 i = 0; i < n; i++) {
        uint32_t bits = abs_bits[i];
        zeros += bits == 0;
        if (bits >= 0x7F800000u) continue;
        float av = as_float(bits);
        m = av > m ? av : m;
        hsum[bits >> 22] += (double)av;
        hsq[bits >> 22] += (double)av * (double)av;
    }
    *mx = (double)m;
    return zeros;
}

/* deltapass.group_pass: the statistics of consecutive blocks of one tensor into the out rows (ident,
   nonfinite, zeros, mx, hcount, hsum, hsq, sk, bd; hcount/hsum/hsq rows hist_bins long, sk rows
   dim), each block's cleared before it is written (numba's must be zero on entry). counts: (bins,)
   scratch, all zero on entry and left so; esum: scratch of 2 * bins / PER doubles. Returns the
   exceptions in all, or -2 (nothing done) when a sketch code names a bucket past dim. */
i64 mdb_group_pass(const uint8_t *e_raw, const uint8_t *b_raw, const void *e, const void *b, int wide, i64 n_bytes,
                   const i64 *raw_start, const i64 *start, i64 blocks, uint32_t *abs_bits, const uint16_t *codes,
                   i64 *summary, i64 bins, uint32_t *exc, i64 exc_len, i64 n_exc, const double *edge,
                   const double *edge_sq, int hist_shift, int summary_shift, uint8_t *ident, i64 *nonfinite,
                   i64 *zeros, double *mx, i64 *hcount, double *hsum, double *hsq, i64 hist_bins, double *sk,
                   i64 dim, double *bd, i64 *counts, double *esum) {
    i64 size = wide ? 4 : 2, all_words = n_bytes / 8;
    uint16_t top_code = 0;
    for (i64 i = 0; i < start[blocks]; i++) top_code = codes[i] > top_code ? codes[i] : top_code;
    if ((i64)(top_code >> 1) >= dim) return -2;
    for (i64 k = 0; k < blocks; k++) {
        i64 s = start[k], t = start[k + 1], r0 = raw_start[k], r1 = raw_start[k + 1];
        ident[k] = 0;
        nonfinite[k] = zeros[k] = 0;
        mx[k] = 0.0;
        memset(hcount + k * hist_bins, 0, (size_t)hist_bins * sizeof(i64));
        memset(hsum + k * hist_bins, 0, (size_t)hist_bins * sizeof(double));
        memset(hsq + k * hist_bins, 0, (size_t)hist_bins * sizeof(double));
        memset(sk + k * dim, 0, (size_t)dim * sizeof(double));
        memset(bd + 4 * k, 0, 4 * sizeof(double));
        if (memcmp(e_raw + r0, b_raw + r0, (size_t)(r1 - r0)) == 0) {
            ident[k] = 1;
            memset(abs_bits + s, 0, (size_t)(t - s) * sizeof(uint32_t));
            summary[0] += t - s;
            continue;
        }
        i64 w0 = s * size, w1 = t * size, n_words = 0; /* words only when the block starts on one */
        if (w0 % 8 == 0 && w1 / 8 <= all_words) n_words = w1 / 8 - w0 / 8;
        pass_t p = {counts, sk + k * dim, bd + 4 * k, exc, exc_len - 1, n_exc, 0};
        block_pass(row(e, wide, s, 1), row(b, wide, s, 1), wide, t - s, (const uint8_t *)e + w0,
                   (const uint8_t *)b + w0, n_words, abs_bits + s, codes + s, &p);
        nonfinite[k] = p.nonfinite;
        i64 *hc = hcount + k * hist_bins;
        double *hs = hsum + k * hist_bins, *hq = hsq + k * hist_bins;
        if (p.n_exc < exc_len) { /* the exceptions so far all fit */
            zeros[k] = block_hist(counts, summary, bins, exc + n_exc, p.n_exc - n_exc, edge, edge_sq, hist_shift,
                                  summary_shift, hc, hs, hq, mx + k, esum);
        } else {
            for (i64 h = 0; h < bins / PER; h++) {
                i64 c = 0;
                for (i64 j = h * PER; j < (h + 1) * PER; j++) {
                    summary[j] += counts[j];
                    c += counts[j];
                    counts[j] = 0;
                }
                hc[h] = c;
            }
            zeros[k] = abs_pass(abs_bits + s, t - s, hs, hq, mx + k);
        }
        n_exc = p.n_exc;
    }
    return n_exc;
}

/* deltapass.base_group: per block, Σ x² over its finite values (float64, element i in lane i % 4, added
   as (l0 + l1) + (l2 + l3)) and its NaN/Inf count. A non-finite value adds +0.0 to its lane, as in
   numba's loop. 64 elements at a time: the squares in one pass the compiler vectorises, then the
   four lanes' adds. */
void mdb_base_group(const void *x, int wide, const i64 *start, i64 blocks, double *ss, i64 *bad) {
    double sq[64];
    for (i64 k = 0; k < blocks; k++) {
        v4d lane = {0.0, 0.0, 0.0, 0.0};
        i64 s = start[k], n = start[k + 1] - s, nonfinite = 0;
        for (i64 c0 = 0; c0 < n; c0 += 64) {
            i64 m = n - c0 < 64 ? n - c0 : 64;
            uint32_t kept[64]; /* the value's pattern where finite, else +0.0's: its square is +0.0 */
            for (i64 j = 0; j < m; j++) {
                uint32_t bits = pattern(x, wide, s + c0 + j);
                uint32_t bad_one = (bits & 0x7F800000u) == 0x7F800000u;
                nonfinite += bad_one;
                kept[j] = bits & (bad_one - 1u);
            }
            for (i64 j = 0; j < m; j++) {
                double v = (double)as_float(kept[j]);
                sq[j] = v * v;
            }
            i64 j = 0;
            for (; j + 4 <= m; j += 4) lane += (v4d){sq[j], sq[j + 1], sq[j + 2], sq[j + 3]};
            for (; j < m; j++) lane[j & 3] += sq[j];
        }
        ss[k] = (lane[0] + lane[1]) + (lane[2] + lane[3]);
        bad[k] = nonfinite;
    }
}

/* deltapass.bucket_codes: out[i] = 2 * bucket + (sign < 0) of element i under `key` (deltapass._hash_bucket) */
void mdb_bucket_codes(uint64_t key, i64 dim, i64 n, uint16_t *out) {
    for (i64 i = 0; i < n; i++) {
        uint64_t z = (key + (uint64_t)i) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 32)) * 0xBF58476D1CE4E5B9ull;
        z = z ^ (z >> 29);
        uint64_t j = ((z & 0xFFFFFFFFull) * (uint64_t)dim) >> 32;
        out[i] = (uint16_t)(2 * j + (z >> 63));
    }
}

/* deltapass.sub_histogram (pair_of NULL) and deltapass.low_histogram: counts of |Δ| patterns by their
   next 8 bits (sub[slot_of[bits >> 17], (bits >> 9) & 255]) or by their last 9 bits
   (low[pair_of[slot, sub-bin], bits & 511]); counts int32 or int64 as `c64` says */
void mdb_radix_histogram(const uint32_t *abs_bits, i64 n, const int16_t *slot_of, const int16_t *pair_of,
                         int c64, void *out) {
    for (i64 i = 0; i < n; i++) {
        uint32_t bits = abs_bits[i];
        i64 slot = slot_of[(bits & 0x7FFFFFFFu) >> 17], at; /* |Δ| patterns: the sign bit is never set */
        if (pair_of) at = (i64)pair_of[slot * 256 + ((bits >> 9) & 255)] * 512 + (bits & 511);
        else at = slot * 256 + ((bits >> 9) & 255);
        if (c64) ((i64 *)out)[at]++;
        else ((int32_t *)out)[at]++;
    }
}

/* deltapass.same_bytes: whether n bytes at a and b are equal */
int mdb_same_bytes(const void *a, const void *b, i64 n) { return memcmp(a, b, (size_t)n) == 0; }
