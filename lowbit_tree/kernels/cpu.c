/* CPU kernels for lowbit_tree (see kernels_cpu.py): quantize, dequantize and the
 * fused Adam step, one pass per tile of whole blocks, bit-identical to the
 * reference quantizer. Plain C99 + OpenMP, no Python or torch headers, so it
 * compiles in about a second. Must be built with -ffp-contract=off and without
 * -ffast-math: every float operation rounds exactly like torch's eager float32 ops.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif
/* AVX-512 paths (16 lanes, mask registers) where the build targets them (-march=native on a CPU
 * with AVX-512F/BW/DQ/VL); -mno-avx512f builds the AVX2 paths, which stay tested. Each AVX-512
 * path is checked at load like the AVX2 one it replaces (lbt_prepare), and gives the same bits. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define LBT_AVX512 1
#endif

typedef struct {
    int32_t bits;       /* 8 or 4 */
    int32_t is_signed;  /* negative input valid */
    int32_t sqrt_;      /* store sqrt(x) */
    int32_t float8;     /* codes are e4m3 bytes (encode table) */
    float divisor;      /* scale = absmax / divisor */
    int32_t last;       /* the largest code index (thresholds: last) */
    const float *decode;         /* 256: code byte -> normalized value */
    const uint8_t *encode;       /* last + 1: index -> stored byte */
    const float *sorted;         /* last: all thresholds, ascending */
    /* filled by lbt_prepare: */
    uint32_t *packed;            /* the range table's rows (see build_range_table), malloc'ed */
    int32_t encode_mode;         /* 0: encode table, 1: idx + encode_arg, 2: e4m3 signed around encode_arg */
    int32_t encode_arg;
    int32_t e4m3_arith;          /* e4m3 codes rounded and decoded by bit arithmetic: 1 signed, 2 zero-free */
    int32_t rng_adj[8];          /* row = (mag - rng_adj[k]) >> rng_sh[k], slot k = max(mag >> 23, rng_elow) & 7 */
    int32_t rng_sh[8];
    int32_t rng_elow;            /* octaves <= elow share one slot, the 7 above have one each */
    int32_t rng_kmin, rng_kmax;  /* magnitudes are clamped into [kmin, kmax] */
    int32_t rng_npos;            /* rows of non-negative values; negative ones follow (signed formats) */
    int32_t lin;                 /* 4-bit maps with evenly spaced thresholds: index = floor(x * lin_a - lin_b) */
    float lin_a, lin_b;
    uint8_t *planes;             /* 8-bit table decodes with AVX-512 VBMI: decode's float bits as 4 planes of
                                  * 256 bytes (byte k of entry c at 256 * k + c), malloc'ed; else NULL */
} lbt_format;

static inline int32_t f2i(float x) { int32_t i; memcpy(&i, &x, 4); return i; }

/* The reference code index of a normalized value: the number of thresholds
 * <= x (NaN: the last index). What every fast path is checked against at load. */
static int32_t ref_index(const lbt_format *f, float x) {
    int32_t c = 0;
    for (int32_t k = 0; k < f->last; k++) c += f->sorted[k] <= x;
    return x != x ? f->last : c;
}

/* e4m3 by arithmetic (no table), for the float8 formats. The map's midpoints
 * are the half-ulp points of e4m3 (exact in float32), and the reference rounds
 * ties to the larger value: up for positive n, toward zero for negative n.
 * Round the float32 bits to 3 mantissa bits (normal range, |n| >= 2**-6) or to
 * a multiple of 2**-9 (subnormal range) with integer adds and shifts. The map's
 * zero is stored as 0x80; NaN goes to the map's last value (0x7E, 448);
 * zero-free maps (unsigned) start at code 1. lbt_prepare checks all of this
 * against the format's tables and falls back to them if anything differs. */
static inline int32_t e4m3_code(float v, int32_t zero_free) {
    uint32_t neg = v < 0.0f; /* false for NaN and -0.0 */
    uint32_t a = (uint32_t)f2i(v) & 0x7FFFFFFFu, e = a >> 23;
    /* |n| as an integer with the kept bits above bit ``sh``: normal e4m3 range: the
     * float bits rebased to e4m3's exponent (sh = 20); below it: the mantissa with
     * its implicit bit, shifted further by the missing exponent (sh <= 25: all
     * smaller values round to 0 either way) */
    uint32_t normal = e >= 121;
    uint32_t m = normal ? a - (120u << 23) : ((a & 0x7FFFFFu) | 0x800000u);
    uint32_t sh = normal ? 20 : (e >= 116 ? 20 + 121 - e : 25);
    int32_t mag = (int32_t)((m + (1u << (sh - 1)) - neg) >> sh); /* ties: up for n > 0, toward 0 for n < 0 */
    mag = mag > 126 ? 126 : mag;
    if (zero_free) return mag < 1 ? 1 : mag;
    return (neg | (mag == 0)) ? (0x80 | mag) : mag;
}

static inline float e4m3_value(uint8_t c) {
    int32_t mag = c & 0x7F;
    float sub = (float)mag * (1.0f / 512.0f);
    int32_t bits = (((mag >> 3) + 120) << 23) | ((mag & 7) << 20);
    float nrm;
    memcpy(&nrm, &bits, 4);
    float r = mag >= 8 ? nrm : sub;
    r = mag == 0x7F ? NAN : r;
    return (c & 0x80) ? -r : r;
}

#ifdef __AVX2__
/* The same two functions on 8 lanes (GCC's own vectorization of them spills). */
static inline __m256 e4m3_value8(__m256i c) {
    const __m256i m7f = _mm256_set1_epi32(0x7F);
    __m256i mag = _mm256_and_si256(c, m7f);
    __m256 nrm = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512.0f));
    __m256 r = _mm256_blendv_ps(sub, nrm, _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32(7))));
    r = _mm256_blendv_ps(r, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, m7f)));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(r), sign));
}

static inline __m256i e4m3_code8(__m256 v, int32_t zero_free) {
    __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ)); /* -1 / 0 */
    __m256i a = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF));
    __m256i e = _mm256_srli_epi32(a, 23);
    __m256i normal = _mm256_cmpgt_epi32(e, _mm256_set1_epi32(120));
    __m256i m = _mm256_blendv_epi8(_mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0x7FFFFF)), _mm256_set1_epi32(0x800000)),
                                   _mm256_sub_epi32(a, _mm256_set1_epi32(120 << 23)), normal);
    __m256i sh = _mm256_min_epi32(_mm256_sub_epi32(_mm256_set1_epi32(141), e), _mm256_set1_epi32(25));
    sh = _mm256_blendv_epi8(sh, _mm256_set1_epi32(20), normal);
    __m256i half = _mm256_sllv_epi32(_mm256_set1_epi32(1), _mm256_sub_epi32(sh, _mm256_set1_epi32(1)));
    __m256i mag = _mm256_srlv_epi32(_mm256_add_epi32(_mm256_add_epi32(m, half), neg), sh);
    mag = _mm256_min_epi32(mag, _mm256_set1_epi32(126));
    if (zero_free) return _mm256_max_epi32(mag, _mm256_set1_epi32(1));
    __m256i z = _mm256_or_si256(neg, _mm256_cmpeq_epi32(mag, _mm256_setzero_si256()));
    return _mm256_or_si256(mag, _mm256_and_si256(z, _mm256_set1_epi32(0x80)));
}

/* low byte of each 32-bit lane -> 8 bytes */
static inline void store_bytes8(uint8_t *dst, __m256i x) {
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i b = _mm256_shuffle_epi8(x, pick);
    uint32_t lo = (uint32_t)_mm256_extract_epi32(b, 0), hi = (uint32_t)_mm256_extract_epi32(b, 4);
    uint64_t w = (uint64_t)lo | ((uint64_t)hi << 32);
    memcpy(dst, &w, 8);
}

/* low bytes of the 32-bit lanes of a, b, c, d (each 0..255) -> 32 bytes in order */
static inline void store_bytes32(uint8_t *dst, __m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i x = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
    _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

static inline __m256i load_bytes8(const uint8_t *src) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));
}
#endif

#ifdef LBT_AVX512
/* e4m3_value and e4m3_code on 16 lanes */
static inline __m512 e4m3_value16(__m512i c) {
    const __m512i m7f = _mm512_set1_epi32(0x7F);
    __m512i mag = _mm512_and_si512(c, m7f);
    __m512 nrm = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512.0f));
    __m512 r = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(7)), sub, nrm);
    r = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(mag, m7f), r, _mm512_set1_ps(NAN));
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(r), sign));
}

static inline __m512i e4m3_code16(__m512 v, int32_t zero_free) {
    const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512i a = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF));
    __m512i e = _mm512_srli_epi32(a, 23);
    const __mmask16 normal = _mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(120));
    __m512i m = _mm512_mask_blend_epi32(normal,
                                        _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0x7FFFFF)),
                                                        _mm512_set1_epi32(0x800000)),
                                        _mm512_sub_epi32(a, _mm512_set1_epi32(120 << 23)));
    __m512i sh = _mm512_min_epi32(_mm512_sub_epi32(_mm512_set1_epi32(141), e), _mm512_set1_epi32(25));
    sh = _mm512_mask_blend_epi32(normal, sh, _mm512_set1_epi32(20));
    __m512i half = _mm512_sllv_epi32(_mm512_set1_epi32(1), _mm512_sub_epi32(sh, _mm512_set1_epi32(1)));
    __m512i t = _mm512_add_epi32(m, half);
    t = _mm512_mask_sub_epi32(t, neg, t, _mm512_set1_epi32(1)); /* ties toward 0 for n < 0 */
    __m512i mag = _mm512_min_epi32(_mm512_srlv_epi32(t, sh), _mm512_set1_epi32(126));
    if (zero_free) return _mm512_max_epi32(mag, _mm512_set1_epi32(1));
    const __mmask16 z = neg | _mm512_cmpeq_epi32_mask(mag, _mm512_setzero_si512());
    return _mm512_mask_or_epi32(mag, z, mag, _mm512_set1_epi32(0x80));
}
#endif

static void e4m3_pass(const float *restrict x, int64_t n, float safe, int32_t zero_free, uint8_t *restrict codes);
static void bucket_pass(const float *restrict x, int64_t n, float safe, const lbt_format *f,
                        int32_t *restrict bucket, int32_t *restrict low);
#ifdef LBT_AVX512
static int64_t table_codes_avx512(const float *restrict x, int64_t n, float safe, const lbt_format *f,
                                  uint8_t *restrict codes);
#endif
#ifdef __AVX2__
static int64_t table_codes_avx2(const float *restrict x, int64_t n, float safe, const lbt_format *f,
                                uint8_t *restrict codes, int32_t *restrict rows, int32_t *restrict lanes);
#endif
static void decode_e4m3_block(const uint8_t *restrict codes, int64_t n, float s, int32_t sq, float *restrict out);

/* The arithmetic e4m3 path (scalar and vector) against the format's tables: all
 * 256 decodes, every map value, every threshold and the float below it, and
 * non-finite / out-of-range inputs. */
static int e4m3_matches(const lbt_format *f, int32_t zero_free) {
    float dec[256];
    uint8_t all[256];
    for (int32_t c = 0; c < 256; c++) all[c] = (uint8_t)c;
    decode_e4m3_block(all, 256, 1.0f, 0, dec);
    for (int32_t c = 0; c < 256; c++) {
        float d = dec[c], e = e4m3_value((uint8_t)c), t = f->decode[c];
        if ((f2i(d) != f2i(t) || f2i(e) != f2i(t)) && !(d != d && t != t && e != e)) return 0;
    }
    const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-45f, -1e-45f, 1e-30f, -1e-30f,
                              1e30f, -1e30f, 448.0f, 500.0f, -448.0f, -500.0f};
    int64_t cap = 3 * (f->last + 1) + 16, n = 0;
    float *x = (float *)malloc(sizeof(float) * cap);
    uint8_t *want = (uint8_t *)malloc(cap), *got = (uint8_t *)malloc(cap);
    for (int32_t i = 0; i <= f->last; i++) {
        x[n] = f->decode[f->encode[i]], want[n++] = f->encode[i];
        if (i < f->last) {
            x[n] = f->sorted[i], want[n++] = f->encode[i + 1];
            x[n] = nextafterf(f->sorted[i], -INFINITY), want[n++] = f->encode[i];
        }
    }
    for (unsigned j = 0; j < sizeof specials / sizeof *specials; j++) {
        float v = specials[j];
        if (!f->is_signed && v < 0.0f) continue;
        x[n] = v, want[n++] = f->encode[ref_index(f, v)];
    }
    e4m3_pass(x, n, 1.0f, zero_free, got);
    int ok = 1;
    for (int64_t i = 0; i < n; i++) ok &= got[i] == want[i] && e4m3_code(x[i], zero_free) == want[i];
    free(x);
    free(want);
    free(got);
    return ok;
}

/* The range table of an 8-bit map: where the codes of x come from, one table
 * row per lane, a compact successor of the bucket table (base / thresholds).
 * The magnitude bits of x, clamped into [kmin, kmax], fall into one of 8 slots:
 * the 7 octaves up to kmax's each get a slot, all lower octaves share one.
 * Slot k cuts its magnitudes into buckets of 2**rng_sh[k], each holding at
 * most one threshold of either sign, so the dense top octaves of a
 * dynamic map get fine buckets and its sparse low octaves coarse ones (about a
 * fifth of one uniform shift's rows: the rows stay in L1 while params and grads
 * stream through). The slot's shift and offset come from two 8-lane permutes,
 * no memory. Signed formats have a second set of rows for negative values.
 * With lane = mag ^ (x < 0 ? ~0 : 0) (so lanes of one bucket are ordered like
 * the values) and row = ((c0 + has_threshold + bias - H) << 24) - t (modulo
 * 2**32), where c0 is the number of thresholds below the bucket's values, t the
 * low 24 bits of its threshold's lane (0 if none), bias the code of index 0 in
 * mode-1 encodings (else 0) and H the lane bits from 24 up, the same for the
 * whole bucket because a bucket never crosses a multiple of 2**24 magnitudes:
 *   code = (row + lane) >> 24
 * (a low lane >= t carries into the top byte, one below t borrows from it).
 * lbt_prepare checks the result against a brute-force count at every bucket
 * edge and threshold. */
static inline int32_t high_bit(uint32_t x) { return 31 - __builtin_clz(x); }

static inline int32_t range_slot(int32_t mag, const lbt_format *f) {
    int32_t e = mag >> 23;
    return (e < f->rng_elow ? f->rng_elow : e) & 7;
}

static inline int32_t range_pos(int32_t mag, const lbt_format *f) {
    int32_t k = range_slot(mag, f);
    return (int32_t)(((uint32_t)mag - (uint32_t)f->rng_adj[k]) >> f->rng_sh[k]);
}

/* scalar row index and lane value of one (already scaled) value */
static inline void range_key(float v, const lbt_format *f, int32_t *row, int32_t *lane) {
    int32_t mag = f2i(v) & 0x7FFFFFFF;
    mag = mag < f->rng_kmin ? f->rng_kmin : mag;
    mag = mag > f->rng_kmax ? f->rng_kmax : mag;
    int32_t neg = (f->is_signed & (v < 0.0f)) ? -1 : 0;
    *row = range_pos(mag, f) + (neg & f->rng_npos);
    *lane = mag ^ neg;
}

/* the code index of a lane from its range-table row (plus the table's bias,
 * modulo 256) */
static inline int32_t row_index(int32_t e, int32_t lane) { return (int32_t)(((uint32_t)e + (uint32_t)lane) >> 24); }

static float bits2f(int32_t i) { float x; memcpy(&x, &i, 4); return x; }

/* The magnitudes [*lo, *hi] of slot octave o (o <= elow: all lower octaves)
 * within [kmin, kmax], its first bucket's start aligned down to the slot's
 * shift; returns 0 if the slot holds none. */
static int slot_span(const lbt_format *f, int32_t o, int32_t sh, int64_t *a0, int64_t *hi) {
    int64_t lo = o == f->rng_elow ? 0 : (int64_t)o << 23, top = ((int64_t)o + 1) << 23;
    lo = lo > f->rng_kmin ? lo : f->rng_kmin;
    *hi = top - 1 < f->rng_kmax ? top - 1 : f->rng_kmax;
    *a0 = (lo >> sh) << sh;
    return lo <= *hi;
}

static int build_range_table(lbt_format *f, int32_t bias) {
    const int32_t n = f->last; /* thresholds */
    const float *t = f->sorted;
    if (n < 1) return -1;
    int32_t mmin = 0x7FFFFFFF, mmax = 0;
    for (int32_t k = 0; k < n; k++) {
        if (!(t[k] != 0.0f && isfinite(t[k])) || (k && !(t[k] > t[k - 1]))) return -2;
        if (!f->is_signed && t[k] < 0.0f) return -2;
        int32_t m = f2i(t[k]) & 0x7FFFFFFF;
        mmin = m < mmin ? m : mmin;
        mmax = m > mmax ? m : mmax;
    }
    /* finest shift each octave needs: neighbouring thresholds of one sign differ above it */
    int32_t need[256];
    for (int32_t o = 0; o < 256; o++) need[o] = 23;
    for (int32_t k = 1; k < n; k++) {
        if ((t[k] < 0.0f) != (t[k - 1] < 0.0f)) continue;
        int32_t a = f2i(t[k]) & 0x7FFFFFFF, b = f2i(t[k - 1]) & 0x7FFFFFFF;
        if ((a >> 23) != (b >> 23)) continue;
        int32_t h = high_bit((uint32_t)(a ^ b)), o = a >> 23;
        need[o] = h < need[o] ? h : need[o];
    }
    /* magnitudes are clamped into [mmin - 1, mmax + 1]: every threshold of
     * either sign lies strictly inside, so clamping never moves a value across
     * one (NaN and inf go to the top) */
    if (mmax + 1 >= 0x7F800000) return -3;
    f->rng_kmin = mmin - 1, f->rng_kmax = mmax + 1;
    f->rng_elow = (f->rng_kmax >> 23) - 7;
    if (f->rng_kmin < 0 || f->rng_elow < 1) return -3;
    int32_t shlow = 23;
    for (int32_t o = 0; o <= f->rng_elow; o++) shlow = need[o] < shlow ? need[o] : shlow;
    /* rows slot by slot, upwards */
    int64_t rows = 0;
    for (int32_t o = f->rng_elow; o <= f->rng_elow + 7; o++) {
        int32_t sh = o == f->rng_elow ? shlow : need[o];
        int64_t a0, hi;
        if (!slot_span(f, o, sh, &a0, &hi)) {
            f->rng_adj[o & 7] = 0, f->rng_sh[o & 7] = 0;
            continue;
        }
        /* (mag - adj) >> sh must stay below 2**32: a coarser slot above many
         * rows takes a finer shift (always valid) */
        while (sh > 0 && ((rows << sh) + (hi - a0) >= (1LL << 31))) sh--;
        slot_span(f, o, sh, &a0, &hi);
        if (sh == 0 && (rows + (hi - a0)) >= (1LL << 31)) return -3;
        f->rng_adj[o & 7] = (int32_t)(a0 - (rows << sh));
        f->rng_sh[o & 7] = sh;
        rows += ((hi - a0) >> sh) + 1;
    }
    if (rows > (1 << 20)) return -3;
    const int32_t npos = (int32_t)rows, nrows = f->is_signed ? 2 * npos : npos;
    uint32_t *tab = (uint32_t *)malloc(sizeof(uint32_t) * nrows);
    if (!tab) return -5;
    f->rng_npos = npos;
    int32_t row = 0;
    for (int32_t o = f->rng_elow; o <= f->rng_elow + 7; o++) {
        int32_t sh = f->rng_sh[o & 7];
        int64_t a0, hi;
        if (!slot_span(f, o, sh, &a0, &hi)) continue;
        for (int64_t a = a0; a <= hi; a += 1LL << sh, row++) {
            int64_t b = a + (1LL << sh); /* exclusive */
            if (range_pos((int32_t)a, f) != row) { free(tab); return -4; }
            for (int32_t side = 0; side < (f->is_signed ? 2 : 1); side++) {
                /* the bucket's smallest value: +a, or -(b - 1) on the negative side */
                const int64_t top = b - 1 < 0x7F800000 ? b - 1 : 0x7F800000;
                const float lowest = side ? -bits2f((int32_t)top) : bits2f((int32_t)a);
                int32_t c0 = 0, inside = 0, tv = 0;
                for (int32_t k = 0; k < n; k++) {
                    int32_t m = f2i(t[k]) & 0x7FFFFFFF, tneg = t[k] < 0.0f;
                    if (tneg == side && m >= a && m < b) inside++, tv = side ? ~m & 0xFFFFFF : m & 0xFFFFFF;
                    else if (t[k] < lowest) c0++;
                }
                if (inside > 1) { free(tab); return -4; }
                /* the lane's bits from 24 up are the same for the whole bucket: folded in */
                uint32_t high = ((uint32_t)a ^ (side ? 0xFFFFFFFFu : 0u)) >> 24;
                tab[row + side * npos] = ((uint32_t)(c0 + inside + bias - high) << 24) - (uint32_t)tv;
            }
        }
    }
    if (row != npos) { free(tab); return -4; }
    f->packed = tab; /* lives as long as the format (the process) */
    return 0;
}

/* Fills f->encode_mode / encode_arg and the range table (8-bit); returns 0,
 * or a negative number when the tables do not have the shape the kernels rely on. */
static int prepare_tables(lbt_format *f) {
    int ok = 1;
    for (int32_t i = 0; i <= f->last; i++) ok &= f->encode[i] == (uint8_t)(i + f->encode[0]);
    if (ok) {
        f->encode_mode = 1;
        f->encode_arg = f->encode[0];
    } else {
        int32_t z = -1;
        for (int32_t i = 0; i <= f->last; i++)
            if (f->encode[i] == 0x80 || f->encode[i] == 0) { z = i; break; }
        ok = z >= 0;
        for (int32_t i = 0; ok && i <= f->last; i++)
            ok &= f->encode[i] == (uint8_t)(i > z ? i - z : 0x80 | (z - i));
        f->encode_mode = ok ? 2 : 0;
        f->encode_arg = ok ? z : 0;
    }
    /* mode 1: the rows give the code byte itself */
    return f->bits == 8 ? build_range_table(f, f->encode_mode == 1 ? f->encode_arg : 0) : 0;
}

/* The range table (scalar and vector paths) against a brute-force count of the
 * thresholds <= x, at both ends of every bucket, at every threshold and its two
 * float neighbours, and at non-finite and out-of-range values: the code is a
 * step function that is constant in a bucket except at its one threshold, so
 * these points decide it everywhere. */
static int range_table_matches(const lbt_format *f) {
    const int32_t n = f->last, sides = f->is_signed ? 2 : 1, bias = f->encode_mode == 1 ? f->encode_arg : 0;
    const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-45f, -1e-45f, 1e-30f, -1e-30f,
                              1e30f, -1e30f, 1.0f, -1.0f, 3.4e38f, -3.4e38f};
    int64_t cap = 4 * (int64_t)f->rng_npos * sides + 6 * n + 16, m = 0;
    float *x = (float *)malloc(sizeof(float) * cap);
    int32_t *want = (int32_t *)malloc(sizeof(int32_t) * cap), *row = (int32_t *)malloc(sizeof(int32_t) * cap);
    int32_t *lane = (int32_t *)malloc(sizeof(int32_t) * cap);
    uint8_t *codes = (uint8_t *)malloc(cap);
    int ok = x && want && row && lane && codes;
    for (int32_t o = f->rng_elow; ok && o <= f->rng_elow + 7; o++) { /* bucket edges, slot by slot */
        int32_t sh = f->rng_sh[o & 7];
        int64_t a0, hi;
        if (!slot_span(f, o, sh, &a0, &hi)) continue;
        for (int64_t a = a0; a <= hi; a += 1LL << sh) {
            int64_t lo = a < f->rng_kmin ? f->rng_kmin : a, b = a + (1LL << sh) - 1;
            b = b > hi ? hi : b;
            for (int32_t side = 0; side < sides; side++) {
                x[m++] = side ? -bits2f((int32_t)lo) : bits2f((int32_t)lo);
                x[m++] = side ? -bits2f((int32_t)b) : bits2f((int32_t)b);
            }
        }
    }
    for (int32_t k = 0; ok && k < n; k++)
        for (int32_t d = 0; d < 3; d++) {
            float t = f->sorted[k];
            x[m] = d == 0 ? t : nextafterf(t, d == 1 ? -INFINITY : INFINITY);
            m += f->is_signed || x[m] >= 0.0f;
        }
    for (unsigned j = 0; ok && j < sizeof specials / sizeof *specials; j++) {
        x[m] = specials[j];
        m += f->is_signed || !(x[m] < 0.0f);
    }
    for (int64_t i = 0; ok && i < m; i++) {
        want[i] = ref_index(f, x[i]);
        range_key(x[i], f, row + i, lane + i);
        ok &= row[i] >= 0 && row[i] < f->rng_npos * sides;
        ok = ok && row_index((int32_t)f->packed[row[i]], lane[i]) == ((want[i] + bias) & 0xFF);
    }
#ifdef LBT_AVX512
    if (ok && f->encode_mode == 1) {
        int64_t done = table_codes_avx512(x, m, 1.0f, f, codes);
        for (int64_t i = 0; i < done; i++) ok &= codes[i] == (uint8_t)(want[i] + bias);
    }
#endif
#ifdef __AVX2__
    if (ok && f->encode_mode == 1) {
        int64_t done = table_codes_avx2(x, m, 1.0f, f, codes, row, lane); /* scratch: their check is done */
        for (int64_t i = 0; i < done; i++) ok &= codes[i] == (uint8_t)(want[i] + bias);
    }
#endif
    free(x);
    free(want);
    free(row);
    free(lane);
    free(codes);
    return ok;
}

static void lin_pass(const float *restrict x, int64_t n, float safe, const lbt_format *f, int32_t *restrict idx);

/* The arithmetic 4-bit index against a brute-force count of the thresholds <=
 * x, at every threshold and its two float neighbours and at non-finite, zero,
 * negative, tiny and huge values (vector and scalar paths). The computed index
 * is monotone in x (each rounding is), like the count, so agreeing at every
 * threshold and the float below it means agreeing everywhere. */
static int lin_matches(const lbt_format *f) {
    const int32_t n = f->last;
    const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-45f, -1e-45f, 1e-30f, -1e-30f,
                              1e30f, -1e30f, 1.0f, -1.0f, 3.4e38f, -3.4e38f, 0.5f, 2.0f};
    float x[3 * 16 + 18];
    int32_t want[3 * 16 + 18], got[3 * 16 + 18];
    int32_t m = 0;
    if (n < 1 || n > 16) return 0;
    for (int32_t k = 0; k < n; k++) {
        x[m++] = f->sorted[k];
        x[m++] = nextafterf(f->sorted[k], -INFINITY);
        x[m++] = nextafterf(f->sorted[k], INFINITY);
    }
    for (unsigned j = 0; j < sizeof specials / sizeof *specials; j++) x[m++] = specials[j];
    for (int32_t i = 0; i < m; i++) want[i] = ref_index(f, x[i]);
    lin_pass(x, m, 1.0f, f, got);
    int ok = 1;
    for (int32_t i = 0; i < m; i++) ok &= got[i] == want[i];
    for (int32_t i = 0; i < m; i++) { /* the scalar tail on every point */
        lin_pass(x + i, 1, 1.0f, f, got + i);
        ok &= got[i] == want[i];
    }
    return ok;
}

/* 4-bit maps: evenly spaced thresholds with a power-of-two spacing get lin_pass */
static void prepare_lin(lbt_format *f) {
    f->lin = 0;
    if (f->bits != 4 || f->last < 2) return;
    const float *t = f->sorted;
    float d = t[1] - t[0];
    if (!(d > 0.0f)) return;
    float a = 1.0f / d;
    int32_t e = (f2i(a) >> 23) & 0xFF;
    if (f2i(a) != (e << 23) || e == 0 || e == 0xFF) return; /* not a power of two */
    for (int32_t k = 1; k < f->last; k++)
        if ((t[k] - t[k - 1]) * a != 1.0f) return;
    f->lin_a = a;
    f->lin_b = t[0] * a - 1.0f;
    f->lin = 1;
    if (!lin_matches(f)) f->lin = 0; /* the 15 comparisons then (inspectable: lin) */
}

static int64_t decode8_planes(const uint8_t *restrict c, int64_t n, const uint8_t *restrict planes, float s,
                              int32_t sq, float *restrict o);

/* The decode table as byte planes (lbt_format.planes), for the 8-bit table formats (not e4m3
 * by arithmetic) on CPUs with AVX-512 VBMI; NULL (the scalar-load decode) where the planes'
 * decode of all 256 codes is not the table's, bit for bit. */
static void prepare_planes(lbt_format *f) {
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    if (f->bits != 8 || f->e4m3_arith) return;
    void *mem = NULL; /* posix_memalign: gnu99 declares no aligned_alloc (C11), and an undeclared one returns int */
    if (posix_memalign(&mem, 64, 1024) != 0) return;
    uint8_t *pl = (uint8_t *)mem;
    for (int32_t c = 0; c < 256; c++)
        for (int32_t k = 0; k < 4; k++) pl[256 * k + c] = (uint8_t)((uint32_t)f2i(f->decode[c]) >> (8 * k));
    uint8_t all[256];
    float got[256];
    for (int32_t c = 0; c < 256; c++) all[c] = (uint8_t)c;
    int ok = decode8_planes(all, 256, pl, 1.0f, 0, got) == 256;
    for (int32_t c = 0; ok && c < 256; c++) ok = f2i(got[c]) == f2i(f->decode[c] * 1.0f);
    if (ok) f->planes = pl; /* lives as long as the format (the process) */
    else free(pl);
#else
    (void)f;
#endif
}

#ifdef LBT_AVX512
static int64_t encode4_avx512(const float *restrict x, int64_t n, float safe, const lbt_format *f,
                              uint8_t *restrict codes);
#endif

/* The AVX-512 4-bit encoder (encode4_avx512) against a brute-force count of the thresholds <= x,
 * with f's index (lin or not) and with the binary search, at every threshold and its two float
 * neighbours and at non-finite, zero, negative, tiny and huge values (both indices are monotone
 * in x, like the count); 1 where it is not built. */
static int encode4_matches(const lbt_format *f) {
#ifdef LBT_AVX512
    if (f->bits != 4 || f->last < 1 || f->last > 15) return f->bits != 4;
    const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-45f, -1e-45f, 1e-30f, -1e-30f,
                              1e30f, -1e30f, 1.0f, -1.0f, 3.4e38f, -3.4e38f, 0.5f, 2.0f};
    enum { CAP = 3 * 15 + 18 + 31 };
    float x[CAP];
    uint8_t codes[CAP / 2 + 1];
    int32_t m = 0;
    for (int32_t k = 0; k < f->last; k++) {
        x[m++] = f->sorted[k];
        x[m++] = nextafterf(f->sorted[k], -INFINITY);
        x[m++] = nextafterf(f->sorted[k], INFINITY);
    }
    for (unsigned j = 0; j < sizeof specials / sizeof *specials; j++) x[m++] = specials[j];
    while (m % 32) x[m] = x[m - 1], m++; /* whole 32s: the encoder's unit */
    int ok = 1;
    for (int32_t pass = 0; pass < 1 + !!f->lin; pass++) { /* f's own index, then (lin) the search too */
        lbt_format g = *f;
        g.lin = pass ? 0 : f->lin;
        ok &= encode4_avx512(x, m, 1.0f, &g, codes) == m;
        for (int32_t i = 0; i < m; i++) ok &= ((codes[i / 2] >> (4 * (i & 1))) & 0x0F) == ref_index(f, x[i]);
    }
    return ok;
#else
    (void)f;
    return 1;
#endif
}

/* The checks lbt_prepare runs, for tests: 1 if f's range table (8-bit) and
 * arithmetic 4-bit index (when on) and the AVX-512 4-bit encoder (where built) give the
 * reference codes. */
/* The vector paths this build has (native.vector_paths): 1 AVX2, 2 AVX-512 (LBT_AVX512), 4 the
 * AVX-512 VBMI decode planes; chosen at build time by the compiler's target (-march=native,
 * LOWBIT_TREE_CFLAGS), not by the CPU running it. */
int lbt_vector_paths(void) {
    int paths = 0;
#ifdef __AVX2__
    paths |= 1;
#endif
#ifdef LBT_AVX512
    paths |= 2;
#endif
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    paths |= 4;
#endif
    return paths;
}

int lbt_check_tables(const lbt_format *f) {
    return (f->bits != 8 || (f->packed && range_table_matches(f))) && (!f->lin || lin_matches(f)) &&
           encode4_matches(f);
}

int lbt_prepare(lbt_format *f) {
    f->packed = NULL;
    f->planes = NULL;
    int rc = prepare_tables(f);
    if (rc == 0 && f->bits == 8 && !range_table_matches(f)) rc = -6;
    prepare_lin(f);
    if (rc == 0 && !encode4_matches(f)) rc = -7;
    f->e4m3_arith = 0;
    if (rc == 0 && f->float8 && f->bits == 8) {
        int32_t zero_free = !f->is_signed;
        if (e4m3_matches(f, zero_free)) f->e4m3_arith = 1 + zero_free;
    }
    if (rc == 0) prepare_planes(f);
    return rc;
}

/* float8 formats: codes by arithmetic, one block */
static void e4m3_pass(const float *restrict x, int64_t n, float safe, int32_t zero_free, uint8_t *restrict codes) {
    int64_t i = 0;
#ifdef LBT_AVX512
    const __m512 vs16 = _mm512_set1_ps(safe);
    for (; i + 16 <= n; i += 16)
        _mm_storeu_si128((__m128i *)(codes + i),
                         _mm512_cvtepi32_epi8(e4m3_code16(_mm512_div_ps(_mm512_loadu_ps(x + i), vs16), zero_free)));
#endif
#ifdef __AVX2__
    const __m256 vs = _mm256_set1_ps(safe);
    for (; i + 32 <= n; i += 32)
        store_bytes32(codes + i, e4m3_code8(_mm256_div_ps(_mm256_loadu_ps(x + i), vs), zero_free),
                      e4m3_code8(_mm256_div_ps(_mm256_loadu_ps(x + i + 8), vs), zero_free),
                      e4m3_code8(_mm256_div_ps(_mm256_loadu_ps(x + i + 16), vs), zero_free),
                      e4m3_code8(_mm256_div_ps(_mm256_loadu_ps(x + i + 24), vs), zero_free));
    for (; i + 8 <= n; i += 8) store_bytes8(codes + i, e4m3_code8(_mm256_div_ps(_mm256_loadu_ps(x + i), vs), zero_free));
#endif
    for (; i < n; i++) codes[i] = (uint8_t)e4m3_code(x[i] / safe, zero_free);
}

/* rows[i] = packed[rows[i]]: the middle pass of an 8-bit encode, left to the
 * compiler, which reads the indices back from memory (stored a pass earlier: no
 * forwarding stall) instead of moving them out of vector registers */
static void gather_rows(int32_t *restrict rows, int64_t n, const uint32_t *restrict packed) {
    for (int64_t i = 0; i < n; i++) rows[i] = (int32_t)packed[rows[i]];
}

#ifdef __AVX2__
/* 8-bit table formats in one pass (mode 1 encodings): slot and bucket of each
 * lane, one range-table load per lane, code = (row + lane) >> 24. */
typedef struct {
    __m256 vs;
    __m256i kmin, kmax, elow, npos, adj, shv;
    const uint32_t *packed;
    int32_t sgn;
} table_consts;

/* row index (returned) and lane of 8 values */
static inline __m256i table_key8(__m256 x, const table_consts *T, __m256i *lane) {
    const __m256i abs = _mm256_set1_epi32(0x7FFFFFFF);
    __m256 v = _mm256_div_ps(x, T->vs);
    __m256i mag = _mm256_min_epi32(_mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(v), abs), T->kmin), T->kmax);
    __m256i k = _mm256_max_epi32(_mm256_srli_epi32(mag, 23), T->elow); /* slot: permutevar reads its low 3 bits */
    __m256i b = _mm256_srlv_epi32(_mm256_sub_epi32(mag, _mm256_permutevar8x32_epi32(T->adj, k)),
                                  _mm256_permutevar8x32_epi32(T->shv, k));
    if (T->sgn) {
        __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
        b = _mm256_add_epi32(b, _mm256_and_si256(neg, T->npos));
        *lane = _mm256_xor_si256(mag, neg);
    } else {
        *lane = mag;
    }
    return b;
}

/* codes of 8 values in one go (block tails) */
static inline __m256i table_codes8(__m256 x, const table_consts *T) {
    __m256i lane, b = table_key8(x, T, &lane);
    /* lane indices through 64-bit extracts (a vector store reloaded at once as
     * scalars stalls store-to-load forwarding) */
    const uint32_t *restrict packed = T->packed;
    __m128i blo = _mm256_castsi256_si128(b), bhi = _mm256_extracti128_si256(b, 1);
    uint64_t q0 = (uint64_t)_mm_cvtsi128_si64(blo), q1 = (uint64_t)_mm_extract_epi64(blo, 1);
    uint64_t q2 = (uint64_t)_mm_cvtsi128_si64(bhi), q3 = (uint64_t)_mm_extract_epi64(bhi, 1);
    __m256i e = _mm256_setr_epi32((int32_t)packed[(uint32_t)q0], (int32_t)packed[q0 >> 32],
                                  (int32_t)packed[(uint32_t)q1], (int32_t)packed[q1 >> 32],
                                  (int32_t)packed[(uint32_t)q2], (int32_t)packed[q2 >> 32],
                                  (int32_t)packed[(uint32_t)q3], (int32_t)packed[q3 >> 32]);
    return _mm256_srli_epi32(_mm256_add_epi32(e, lane), 24);
}

static void table_consts_init(table_consts *T, float safe, const lbt_format *f) {
    T->vs = _mm256_set1_ps(safe);
    T->kmin = _mm256_set1_epi32(f->rng_kmin), T->kmax = _mm256_set1_epi32(f->rng_kmax);
    T->elow = _mm256_set1_epi32(f->rng_elow), T->npos = _mm256_set1_epi32(f->rng_npos);
    T->adj = _mm256_loadu_si256((const __m256i *)f->rng_adj), T->shv = _mm256_loadu_si256((const __m256i *)f->rng_sh);
    T->packed = f->packed, T->sgn = f->is_signed;
}

/* Returns elements done. Whole 32s in three passes over the block (keys, table
 * rows, codes; ``rows``, ``lanes``: scratch of n), cheaper than one pass that
 * moves each lane's index from a vector register to a scalar one; then 8s. */
static int64_t table_codes_avx2(const float *restrict x, int64_t n, float safe, const lbt_format *f,
                                uint8_t *restrict codes, int32_t *restrict rows, int32_t *restrict lanes) {
    table_consts T;
    table_consts_init(&T, safe, f);
    const int64_t n32 = n / 32 * 32;
    for (int64_t i = 0; i < n32; i += 8) {
        __m256i lane, b = table_key8(_mm256_loadu_ps(x + i), &T, &lane);
        _mm256_storeu_si256((__m256i *)(rows + i), b);
        _mm256_storeu_si256((__m256i *)(lanes + i), lane);
    }
    gather_rows(rows, n32, T.packed);
#define LBT_CODE8(j) \
    _mm256_srli_epi32(_mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(rows + (j))), \
                                       _mm256_loadu_si256((const __m256i *)(lanes + (j)))), 24)
    for (int64_t i = 0; i < n32; i += 32)
        store_bytes32(codes + i, LBT_CODE8(i), LBT_CODE8(i + 8), LBT_CODE8(i + 16), LBT_CODE8(i + 24));
#undef LBT_CODE8
    int64_t i = n32;
    for (; i + 8 <= n; i += 8) store_bytes8(codes + i, table_codes8(_mm256_loadu_ps(x + i), &T));
    return i;
}
#endif

#ifdef LBT_AVX512
/* table_codes_avx2 on 16 lanes in one pass: the key (slot, bucket, lane) of each value, one
 * range-table gather, code = (row + lane) >> 24; the last values under a mask (masked-off lanes
 * load, gather and store nothing). Returns n. */
static int64_t table_codes_avx512(const float *restrict x, int64_t n, float safe, const lbt_format *f,
                                  uint8_t *restrict codes) {
    const __m512 vs = _mm512_set1_ps(safe);
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), kmin = _mm512_set1_epi32(f->rng_kmin);
    const __m512i kmax = _mm512_set1_epi32(f->rng_kmax), elow = _mm512_set1_epi32(f->rng_elow);
    const __m512i npos = _mm512_set1_epi32(f->rng_npos), ones = _mm512_set1_epi32(-1);
    /* the 8 slots twice: the permutes read the slot's low 4 bits, the slot is its low 3 */
    const __m512i adj = _mm512_broadcast_i32x8(_mm256_loadu_si256((const __m256i *)f->rng_adj));
    const __m512i shv = _mm512_broadcast_i32x8(_mm256_loadu_si256((const __m256i *)f->rng_sh));
    const int sgn = f->is_signed;
    const int *packed = (const int *)f->packed;
    for (int64_t i = 0; i < n; i += 16) {
        const int64_t r = n - i;
        const __mmask16 in = r >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << r) - 1);
        __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(in, x + i), vs);
        __m512i mag = _mm512_min_epi32(_mm512_max_epi32(_mm512_and_si512(_mm512_castps_si512(v), abs), kmin), kmax);
        __m512i k = _mm512_max_epi32(_mm512_srli_epi32(mag, 23), elow);
        __m512i b = _mm512_srlv_epi32(_mm512_sub_epi32(mag, _mm512_permutexvar_epi32(k, adj)),
                                      _mm512_permutexvar_epi32(k, shv));
        __m512i lane = mag;
        if (sgn) {
            const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
            b = _mm512_mask_add_epi32(b, neg, b, npos);
            lane = _mm512_mask_xor_epi32(mag, neg, mag, ones);
        }
        __m512i e = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), in, b, packed, 4);
        __m512i c = _mm512_srli_epi32(_mm512_add_epi32(e, lane), 24);
        _mm_mask_storeu_epi8(codes + i, in, _mm512_cvtepi32_epi8(c));
    }
    return n;
}
#endif

/* 8-bit formats without AVX2, block tails and encodings other than mode 1,
 * first of three passes: the range-table row of each x[i] / safe and its lane. */
static void bucket_pass(const float *restrict x, int64_t n, float safe, const lbt_format *f,
                        int32_t *restrict bucket, int32_t *restrict low) {
    for (int64_t i = 0; i < n; i++) range_key(x[i] / safe, f, bucket + i, low + i);
}

/* range-table rows + lane values -> code bytes */
static void code_pass(const int32_t *restrict entry, const int32_t *restrict low, int64_t n, const lbt_format *f,
                      uint8_t *restrict codes) {
    if (f->encode_mode == 1) {
        for (int64_t i = 0; i < n; i++) codes[i] = (uint8_t)row_index(entry[i], low[i]); /* bias: the code */
    } else if (f->encode_mode == 2) {
        const int32_t z = f->encode_arg;
        for (int64_t i = 0; i < n; i++) {
            int32_t k = row_index(entry[i], low[i]) - z;
            codes[i] = (uint8_t)(k > 0 ? k : 0x80 | -k);
        }
    } else {
        const uint8_t *restrict enc = f->encode;
        for (int64_t i = 0; i < n; i++) codes[i] = enc[row_index(entry[i], low[i])];
    }
}

/* 4-bit maps whose thresholds are evenly spaced, t_k = (k + c) / a with a a
 * power of two (linear4_unsigned: a = 16, c = 1.5): the number of thresholds
 * <= n is floor(n * a - (c - 1)), clamped to [0, last], NaN -> last.
 * lbt_prepare checks it against the thresholds (lin_matches). */
static inline int32_t lin_index(float q, float a, float b, float last) {
    float y = q * a - b;
    y = y < last ? y : last; /* also NaN */
    y = y > 0.0f ? y : 0.0f;
    return (int32_t)y;
}

static void lin_pass(const float *restrict x, int64_t n, float safe, const lbt_format *f, int32_t *restrict idx) {
    const float a = f->lin_a, b = f->lin_b, last = (float)f->last;
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 vs = _mm256_set1_ps(safe), va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b), vl = _mm256_set1_ps(last);
    for (; i + 8 <= n; i += 8) {
        __m256 y = _mm256_sub_ps(_mm256_mul_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vs), va), vb);
        y = _mm256_min_ps(y, vl); /* NaN -> last (minps returns its second operand) */
        __m256i k = _mm256_max_epi32(_mm256_cvttps_epi32(y), _mm256_setzero_si256()); /* trunc = floor for y >= 0 */
        _mm256_storeu_si256((__m256i *)(idx + i), k);
    }
#endif
    for (; i < n; i++) idx[i] = lin_index(x[i] / safe, a, b, last);
}

/* 4-bit formats: the index is the number of thresholds <= x[i] / safe (NaN ->
 * last), by 15 comparisons against constants: no table lookup. */
static void count_pass(const float *restrict x, int64_t n, float safe, const lbt_format *f, int32_t *restrict idx) {
    float t[15];
    for (int k = 0; k < 15; k++) t[k] = k < f->last ? f->sorted[k] : INFINITY;
    const float t0 = t[0], t1 = t[1], t2 = t[2], t3 = t[3], t4 = t[4], t5 = t[5], t6 = t[6], t7 = t[7];
    const float t8 = t[8], t9 = t[9], t10 = t[10], t11 = t[11], t12 = t[12], t13 = t[13], t14 = t[14];
    const int32_t last = f->last;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i] / safe;
        int32_t c = (v >= t0) + (v >= t1) + (v >= t2) + (v >= t3) + (v >= t4) + (v >= t5) + (v >= t6) + (v >= t7)
                  + (v >= t8) + (v >= t9) + (v >= t10) + (v >= t11) + (v >= t12) + (v >= t13) + (v >= t14);
        c = c > last ? last : c;
        idx[i] = v != v ? last : c;
    }
}

/* The scale of a block from the bits of its absmax (NaN / inf -> NaN). */
static inline float block_scale(int32_t amax, const lbt_format *f) {
    float am;
    memcpy(&am, &amax, 4);
    return amax >= 0x7F800000 ? NAN : am / f->divisor;
}

/* 4-bit indices idx[0..n) (each 0..15) -> n / 2 bytes, the even element in the
 * low nibble; an odd n leaves its last index in the low nibble of the last byte
 * (high nibble 0). */
static void pack_nibbles(const int32_t *restrict idx, int64_t n, uint8_t *restrict codes) {
    int64_t pairs = n / 2, j = 0;
#ifdef __AVX2__
    for (; 2 * j + 32 <= n; j += 16) {
        const int32_t *q = idx + 2 * j;
        __m256i b = _mm256_packus_epi16(
            _mm256_packus_epi32(_mm256_loadu_si256((const __m256i *)q), _mm256_loadu_si256((const __m256i *)(q + 8))),
            _mm256_packus_epi32(_mm256_loadu_si256((const __m256i *)(q + 16)), _mm256_loadu_si256((const __m256i *)(q + 24))));
        b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* 32 index bytes in order */
        /* 16-bit word w = idx[2i] | idx[2i+1] << 8 -> idx[2i] | idx[2i+1] << 4 */
        __m256i w = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi16(0x00FF)), _mm256_srli_epi16(b, 4));
        w = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0x08); /* qwords 0 and 2 */
        _mm_storeu_si128((__m128i *)(codes + j), _mm256_castsi256_si128(w));
    }
#endif
    for (; j < pairs; j++) codes[j] = (uint8_t)(idx[2 * j] | (idx[2 * j + 1] << 4));
    if (n & 1) codes[pairs] = (uint8_t)idx[n - 1];
}

#ifdef LBT_AVX512
/* 4-bit codes of x[0..n) / safe, 32 values (16 bytes) at a time, in one pass (no index
 * scratch): lin_pass's arithmetic index (f->lin), else count_pass's threshold count as a
 * branchless binary search over the thresholds held in one register (padded with +inf: the
 * count of a sorted table's entries <= v, the same number the 15 comparisons give; NaN ->
 * last), two indices a byte as pack_nibbles packs them. Returns the values done (a multiple
 * of 32); lbt_prepare checks both indices against the brute-force count. */
static int64_t encode4_avx512(const float *restrict x, int64_t n, float safe, const lbt_format *f,
                              uint8_t *restrict codes) {
    const __m512 vs = _mm512_set1_ps(safe), vl = _mm512_set1_ps((float)f->last);
    const __m512i il = _mm512_set1_epi32(f->last);
    const __m512 va = _mm512_set1_ps(f->lin_a), vb = _mm512_set1_ps(f->lin_b);
    float t[16];
    for (int k = 0; k < 16; k++) t[k] = k < f->last ? f->sorted[k] : INFINITY;
    const __m512 tv = _mm512_loadu_ps(t);
    const int lin = f->lin;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512i idx[2];
        for (int h = 0; h < 2; h++) {
            __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i + 16 * h), vs);
            if (lin) {
                __m512 y = _mm512_min_ps(_mm512_sub_ps(_mm512_mul_ps(v, va), vb), vl); /* NaN -> last */
                idx[h] = _mm512_max_epi32(_mm512_cvttps_epi32(y), _mm512_setzero_si512());
            } else {
                __m512i c = _mm512_setzero_si512();
                for (int step = 8; step >= 1; step >>= 1) { /* c += step where t[c + step - 1] <= v */
                    __m512i cand = _mm512_add_epi32(c, _mm512_set1_epi32(step));
                    __m512 tk = _mm512_permutexvar_ps(_mm512_sub_epi32(cand, _mm512_set1_epi32(1)), tv);
                    c = _mm512_mask_mov_epi32(c, _mm512_cmp_ps_mask(tk, v, _CMP_LE_OQ), cand);
                }
                c = _mm512_min_epi32(c, il);
                idx[h] = _mm512_mask_mov_epi32(c, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), il);
            }
        }
        /* index pairs (even, odd) in 64-bit lanes -> even | odd << 4 in the low byte */
        __m128i lo = _mm512_cvtepi64_epi8(_mm512_or_si512(idx[0], _mm512_srli_epi64(idx[0], 28)));
        __m128i hi = _mm512_cvtepi64_epi8(_mm512_or_si512(idx[1], _mm512_srli_epi64(idx[1], 28)));
        _mm_storeu_si128((__m128i *)(codes + i / 2), _mm_unpacklo_epi64(lo, hi));
    }
    return i;
}

/* 4-bit decode of np code bytes (2 * np values) from the 16-entry table in one register (one
 * permute a 16 values); returns the bytes done (a multiple of 8). */
static int64_t decode4_avx512(const uint8_t *restrict c, int64_t np, const float *restrict dec, float s,
                              float *restrict o) {
    const __m512 tab = _mm512_loadu_ps(dec), vs = _mm512_set1_ps(s);
    int64_t q = 0;
    for (; q + 8 <= np; q += 8) {
        /* byte B in a 64-bit lane; its dwords' low 4 bits: B's low nibble, then its high one */
        __m512i b = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(c + q)));
        __m512i idx = _mm512_or_si512(b, _mm512_slli_epi64(b, 28));
        _mm512_storeu_ps(o + 2 * q, _mm512_mul_ps(_mm512_permutexvar_ps(idx, tab), vs));
    }
    return q;
}
#endif

/* Codes of one block of already transformed values x[0..n) with scale s.
 * ``codes`` points at the block's first byte (4-bit: the block starts at an even
 * element; an odd n leaves the last byte's high nibble 0). s1, s2: scratch of n. */
static void encode_block(const float *restrict x, int64_t n, float s, const lbt_format *f, uint8_t *restrict codes,
                         int32_t *restrict s1, int32_t *restrict s2) {
    float safe = s > 0.0f ? s : 1.0f;
    if (f->bits == 4) {
        int64_t done = 0;
#ifdef LBT_AVX512
        done = encode4_avx512(x, n, safe, f, codes); /* an even count: the rest starts a byte */
#endif
        if (done < n) {
            if (f->lin) lin_pass(x + done, n - done, safe, f, s1);
            else count_pass(x + done, n - done, safe, f, s1);
            pack_nibbles(s1, n - done, codes + done / 2);
        }
    } else if (f->e4m3_arith) {
        e4m3_pass(x, n, safe, f->e4m3_arith == 2, codes);
    } else {
        int64_t done = 0;
#if defined(LBT_AVX512)
        if (f->encode_mode == 1) done = table_codes_avx512(x, n, safe, f, codes);
#elif defined(__AVX2__)
        if (f->encode_mode == 1) done = table_codes_avx2(x, n, safe, f, codes, s1, s2);
#endif
        if (done < n) { /* the rest, or all without AVX2, in three passes */
            bucket_pass(x + done, n - done, safe, f, s1, s2);
            gather_rows(s1, n - done, f->packed);
            code_pass(s1, s2, n - done, f, codes + done);
        }
    }
}

/* Transform x in place (unsigned: negative -> NaN, which sqrt also gives; sqrt)
 * and return the absmax on the bits of |x|: monotone for non-negative floats,
 * and NaN / inf have the largest bit patterns (either -> NaN scale). */
static int32_t transform_absmax(float *restrict xb, int64_t n, const lbt_format *f) {
    int32_t amax = 0;
    if (f->sqrt_) {
        for (int64_t j = 0; j < n; j++) {
            float t = sqrtf(xb[j]);
            xb[j] = t;
            int32_t a = f2i(t) & 0x7FFFFFFF;
            amax = a > amax ? a : amax;
        }
    } else if (!f->is_signed) {
        for (int64_t j = 0; j < n; j++) {
            float t = xb[j] < 0.0f ? NAN : xb[j];
            xb[j] = t;
            int32_t a = f2i(t) & 0x7FFFFFFF;
            amax = a > amax ? a : amax;
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            int32_t a = f2i(xb[j]) & 0x7FFFFFFF;
            amax = a > amax ? a : amax;
        }
    }
    return amax;
}

/* Quantize x[0..len) of one row segment that starts at a block boundary:
 * transforms x in place, writes the scales of its blocks and its codes (4-bit:
 * the segment starts at an even element; codes point at its first byte).
 * ``s1``, ``s2``: scratch of len int32 each. */
static void quantize_segment(float *restrict x, int64_t len, int64_t bs, const lbt_format *f,
                             uint8_t *restrict codes, float *restrict scale, int32_t *restrict s1,
                             int32_t *restrict s2) {
    const int32_t odd4 = f->bits == 4 && (bs & 1); /* blocks start mid-byte: pack at the end */
    for (int64_t b0 = 0, blk = 0; b0 < len; b0 += bs, blk++) {
        int64_t n = b0 + bs < len ? bs : len - b0;
        float s = block_scale(transform_absmax(x + b0, n, f), f);
        scale[blk] = s;
        if (odd4 && f->lin) lin_pass(x + b0, n, s > 0.0f ? s : 1.0f, f, s1 + b0);
        else if (odd4) count_pass(x + b0, n, s > 0.0f ? s : 1.0f, f, s1 + b0);
        else encode_block(x + b0, n, s, f, codes + (f->bits == 4 ? b0 / 2 : b0), s1, s2);
    }
    if (odd4) pack_nibbles(s1, len, codes); /* an odd len: high nibble of the last byte 0 (padding) */
}

#ifdef __AVX2__
/* 4-bit decode of np code bytes (2 * np values) from a 16-entry table held in two
 * registers (vpermps + blend: no memory gathers); returns the bytes done. */
static int64_t decode4_avx2(const uint8_t *restrict c, int64_t np, const float *restrict dec, float s,
                            float *restrict o) {
    const __m256 lo = _mm256_loadu_ps(dec), hi = _mm256_loadu_ps(dec + 8), vs = _mm256_set1_ps(s);
    const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4), nib = _mm256_set1_epi32(0x0F);
    int64_t q = 0;
    for (; q + 8 <= np; q += 8) {
        __m128i b = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(c + q)), dup);
        for (int h = 0; h < 2; h++) {
            __m256i w = _mm256_cvtepu8_epi32(h ? _mm_unpackhi_epi64(b, b) : b);
            __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(w, shifts), nib);
            __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                                        _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
            _mm256_storeu_ps(o + 2 * q + 8 * h, _mm256_mul_ps(v, vs));
        }
    }
    return q;
}
#endif

/* e4m3 codes -> value * s (squared when sq) */
static void decode_e4m3_block(const uint8_t *restrict codes, int64_t n, float s, int32_t sq, float *restrict out) {
    int64_t j = 0;
#ifdef LBT_AVX512
    const __m512 vs16 = _mm512_set1_ps(s);
    for (; j + 16 <= n; j += 16) {
        __m512 t = _mm512_mul_ps(e4m3_value16(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + j)))), vs16);
        _mm512_storeu_ps(out + j, sq ? _mm512_mul_ps(t, t) : t);
    }
#endif
#ifdef __AVX2__
    const __m256 vs = _mm256_set1_ps(s);
    for (; j + 8 <= n; j += 8) {
        __m256 t = _mm256_mul_ps(e4m3_value8(load_bytes8(codes + j)), vs);
        _mm256_storeu_ps(out + j, sq ? _mm256_mul_ps(t, t) : t);
    }
#endif
    for (; j < n; j++) {
        float t = e4m3_value(codes[j]) * s;
        out[j] = sq ? t * t : t;
    }
}

/* 8-bit table decode, 64 codes at a time, without a load per code: each byte of the
 * decoded floats comes from its plane (four 64-byte registers: two 128-entry byte permutes
 * and a blend on the code's top bit), and byte unpacks put the four bytes of each float
 * together. The unpacks work within 128-bit lanes, so the codes are first permuted into
 * the order that makes the floats come out in the codes' order. Then times s, squared
 * when sq: the bits of decode[c] * s (and its square). Returns the codes done: all of them
 * (0 without AVX-512 VBMI). */
static int64_t decode8_planes(const uint8_t *restrict c, int64_t n, const uint8_t *restrict planes, float s,
                              int32_t sq, float *restrict o) {
    int64_t j = 0;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    /* code byte 16 L + 4 k + q (lane L, float register k, place q) is code 16 k + 4 L + q */
    static const uint8_t order[64] = {
        0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39,
        52, 53, 54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30,
        31, 44, 45, 46, 47, 60, 61, 62, 63};
    const __m512i perm = _mm512_loadu_si512((const void *)order);
    __m512i P[4][4];
    for (int k = 0; k < 4; k++)
        for (int q = 0; q < 4; q++) P[k][q] = _mm512_loadu_si512((const void *)(planes + 256 * k + 64 * q));
    const __m512 vs = _mm512_set1_ps(s);
    for (; j < n; j += 64) {
        /* the last codes under a mask (the floats too): the masked-off lanes read and write nothing */
        const int64_t r = n - j;
        const __mmask64 in = r >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << r) - 1);
        const __m512i x = _mm512_permutexvar_epi8(perm, _mm512_maskz_loadu_epi8(in, (const void *)(c + j)));
        const __mmask64 top = _mm512_movepi8_mask(x);
        __m512i b[4];
        for (int k = 0; k < 4; k++)
            b[k] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(P[k][0], x, P[k][1]),
                                          _mm512_permutex2var_epi8(P[k][2], x, P[k][3]));
        const __m512i l01 = _mm512_unpacklo_epi8(b[0], b[1]), h01 = _mm512_unpackhi_epi8(b[0], b[1]);
        const __m512i l23 = _mm512_unpacklo_epi8(b[2], b[3]), h23 = _mm512_unpackhi_epi8(b[2], b[3]);
        const __m512i w[4] = {_mm512_unpacklo_epi16(l01, l23), _mm512_unpackhi_epi16(l01, l23),
                              _mm512_unpacklo_epi16(h01, h23), _mm512_unpackhi_epi16(h01, h23)};
        for (int k = 0; k < 4; k++) {
            __m512 t = _mm512_mul_ps(_mm512_castsi512_ps(w[k]), vs);
            _mm512_mask_storeu_ps(o + j + 16 * k, (__mmask16)(in >> (16 * k)), sq ? _mm512_mul_ps(t, t) : t);
        }
    }
    j = n;
#else
    (void)c, (void)n, (void)planes, (void)s, (void)sq, (void)o;
#endif
    return j;
}

/* out[i] = decode(code i) * scale of its block (squared for sqrt formats), for a
 * segment starting at a block boundary (4-bit: at an even element). */
static void dequantize_segment(const uint8_t *restrict codes, const float *restrict scale, int64_t len,
                               int64_t bs, const lbt_format *f, float *restrict out) {
    const float *restrict dec = f->decode;
    for (int64_t b0 = 0, blk = 0; b0 < len; b0 += bs, blk++) {
        int64_t n = b0 + bs < len ? bs : len - b0;
        float s = scale[blk];
        if (f->bits == 4 && (b0 & 1)) { /* odd block size: generic nibble select */
            for (int64_t j = b0; j < b0 + n; j++) out[j] = dec[(codes[j >> 1] >> ((j & 1) << 2)) & 0x0F] * s;
        } else if (f->bits == 4) {
            /* b0 even: pairs of nibbles, then an odd tail */
            const uint8_t *restrict c = codes + (b0 >> 1);
            float *restrict o = out + b0;
            int64_t np = n >> 1, q = 0;
#ifdef LBT_AVX512
            q = decode4_avx512(c, np, dec, s, o);
#endif
#ifdef __AVX2__
            q += decode4_avx2(c + q, np - q, dec, s, o + 2 * q);
#endif
            for (; q < np; q++) {
                uint8_t cq = c[q];
                o[2 * q] = dec[cq & 0x0F] * s;
                o[2 * q + 1] = dec[cq >> 4] * s;
            }
            if (n & 1) o[n - 1] = dec[c[np] & 0x0F] * s;
        } else if (f->e4m3_arith) {
            decode_e4m3_block(codes + b0, n, s, f->sqrt_, out + b0);
        } else {
            int64_t j = b0;
            if (f->planes) j += decode8_planes(codes + b0, n, f->planes, s, f->sqrt_, out + b0);
#ifdef __AVX2__
            /* 8 codes read as one word: table loads without vector-to-scalar moves */
            const __m256 vs = _mm256_set1_ps(s);
            for (; j + 8 <= b0 + n; j += 8) {
                uint64_t w;
                memcpy(&w, codes + j, 8);
                __m256 t = _mm256_mul_ps(_mm256_setr_ps(dec[w & 0xFF], dec[(w >> 8) & 0xFF], dec[(w >> 16) & 0xFF],
                                                        dec[(w >> 24) & 0xFF], dec[(w >> 32) & 0xFF], dec[(w >> 40) & 0xFF],
                                                        dec[(w >> 48) & 0xFF], dec[w >> 56]), vs);
                _mm256_storeu_ps(out + j, f->sqrt_ ? _mm256_mul_ps(t, t) : t);
            }
#endif
            for (; j < b0 + n; j++) {
                float t = dec[codes[j]] * s;
                out[j] = f->sqrt_ ? t * t : t;
            }
        }
    }
    if (f->sqrt_ && f->bits == 4) {
        for (int64_t j = 0; j < len; j++) out[j] = out[j] * out[j];
    }
}

static int64_t gcd64(int64_t a, int64_t b) { while (b) { int64_t t = a % b; a = b; b = t; } return a; }

/* Tile: a multiple of both block sizes and of 2 (4-bit nibble pairs), >= ~2048. */
static int64_t tile_size(int64_t bs_a, int64_t bs_b) {
    int64_t l = bs_a / gcd64(bs_a, bs_b) * bs_b;
    l = l / gcd64(l, 2) * 2;
    int64_t k = (2048 + l - 1) / l;
    return l * k;
}

static int64_t code_cols(const lbt_format *f, int64_t R) { return f->bits == 4 ? (R + 1) / 2 : R; }

void lbt_quantize(int64_t rows, int64_t R, const float *x, uint8_t *codes, float *scale,
                  const lbt_format *f, int64_t bs, int nthreads) {
    int64_t T = tile_size(bs, bs);
    int64_t tiles = (R + T - 1) / T, nb = (R + bs - 1) / bs, cc = code_cols(f, R);
    #pragma omp parallel num_threads(nthreads)
    {
        float *buf = (float *)malloc(sizeof(float) * T);
        int32_t *s1 = (int32_t *)malloc(sizeof(int32_t) * 2 * T);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < rows * tiles; t++) {
            int64_t r = t / tiles, j0 = (t % tiles) * T;
            int64_t len = R - j0 < T ? R - j0 : T;
            memcpy(buf, x + r * R + j0, sizeof(float) * len);
            uint8_t *c = codes + r * cc + (f->bits == 4 ? j0 / 2 : j0);
            quantize_segment(buf, len, bs, f, c, scale + r * nb + j0 / bs, s1, s1 + T);
        }
        free(buf);
        free(s1);
    }
}

void lbt_dequantize(int64_t rows, int64_t R, const uint8_t *codes, const float *scale, float *out,
                    const lbt_format *f, int64_t bs, int nthreads) {
    int64_t T = tile_size(bs, bs);
    int64_t tiles = (R + T - 1) / T, nb = (R + bs - 1) / bs, cc = code_cols(f, R);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < rows * tiles; t++) {
        int64_t r = t / tiles, j0 = (t % tiles) * T;
        int64_t len = R - j0 < T ? R - j0 : T;
        dequantize_segment(codes + r * cc + (f->bits == 4 ? j0 / 2 : j0), scale + r * nb + j0 / bs, len, bs, f,
                           out + r * R + j0);
    }
}

/* ------------------------------------------------------------------------
 * Rank-1 normalized 4-bit records (lowbit_tree/rank1.py): element (i, j) of the
 * row view is coded by the count of thresholds <= x / safe, safe = min(row_max[i],
 * col_max[j]) if that is > 0 (NaN if either is), else 1, and decodes to
 * decode(code) * min(row_max[i], col_max[j]). A step of such a record takes two jobs, because
 * a shard's maxima are completed across shards between them: a maxima job (LBT_MAXIMA) computes
 * the new values' maxima and writes nothing else (rank1_maxima_tile), then the step encodes each
 * tile's new values with the completed maxima as it goes (quantized_tile): the new values are
 * never stored whole.
 * ------------------------------------------------------------------------ */
#define LBT_NAN_BITS 0x7FC00000

static inline float rank1_norm(float rm, float cm) { return (rm != rm || cm != cm) ? NAN : (cm < rm ? cm : rm); }

/* n values of one row from its codes (starting at an even element), its row maximum
 * and the column maxima of its elements */
static void rank1_decode_run(const uint8_t *restrict c, int64_t n, float rm, const float *restrict cm,
                             const float *restrict dec, float *restrict o) {
    int64_t q = 0, np = n >> 1;
#ifdef LBT_AVX512
    q = decode4_avx512(c, np, dec, 1.0f, o); /* the values times 1: exact */
#endif
#ifdef __AVX2__
    q += decode4_avx2(c + q, np - q, dec, 1.0f, o + 2 * q);
#endif
    for (; q < np; q++) o[2 * q] = dec[c[q] & 0x0F], o[2 * q + 1] = dec[c[q] >> 4];
    if (n & 1) o[n - 1] = dec[c[np] & 0x0F];
    for (int64_t j = 0; j < n; j++) o[j] = o[j] * rank1_norm(rm, cm[j]);
}

/* The codes of n values of one row (from an even element: two a byte) with its row maximum and
 * the column maxima of its elements; buf and idx: scratch of n */
static void rank1_encode_run(const float *restrict xi, int64_t n, float rm, const float *restrict cm,
                             const lbt_format *f, uint8_t *codes, float *restrict buf, int32_t *restrict idx) {
#ifdef LBT_AVX512
    if (f->lin) { /* the loop below on 16 lanes, 32 values (16 code bytes) at a time, packed as it goes */
        const __m512 va = _mm512_set1_ps(f->lin_a), vb = _mm512_set1_ps(f->lin_b), vl = _mm512_set1_ps((float)f->last);
        const __m512 rmv = _mm512_set1_ps(rm), one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
        const __m512 nan = _mm512_set1_ps(NAN);
        int64_t j = 0;
        for (; j + 32 <= n; j += 32) {
            __m512i k[2];
            for (int h = 0; h < 2; h++) {
                const __m512 cmv = _mm512_loadu_ps(cm + j + 16 * h), x = _mm512_loadu_ps(xi + j + 16 * h);
                __m512 nm = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(cmv, rmv, _CMP_LT_OQ), rmv, cmv);
                nm = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(rmv, cmv, _CMP_UNORD_Q), nm, nan); /* rank1_norm */
                const __m512 safe = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(nm, zero, _CMP_GT_OQ), one, nm);
                __m512 q = _mm512_div_ps(x, safe);
                q = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), q, nan); /* negative: NaN */
                __m512 y = _mm512_min_ps(_mm512_sub_ps(_mm512_mul_ps(q, va), vb), vl); /* y < last ? y : last */
                y = _mm512_max_ps(y, zero);                                              /* y > 0 ? y : 0 */
                k[h] = _mm512_cvttps_epi32(y);
            }
            __m128i lo = _mm512_cvtepi64_epi8(_mm512_or_si512(k[0], _mm512_srli_epi64(k[0], 28)));
            __m128i hi = _mm512_cvtepi64_epi8(_mm512_or_si512(k[1], _mm512_srli_epi64(k[1], 28)));
            _mm_storeu_si128((__m128i *)(codes + j / 2), _mm_unpacklo_epi64(lo, hi));
        }
        if (j == n) return;
        xi += j, cm += j, codes += j / 2, n -= j; /* the rest (from an even element) below */
    }
#endif
    if (f->lin) { /* lin_pass's index of q = x / safe, in the same loop (one division) */
        const float a = f->lin_a, b = f->lin_b, last = (float)f->last;
        for (int64_t j = 0; j < n; j++) {
            float nm = rank1_norm(rm, cm[j]);
            idx[j] = lin_index(xi[j] < 0.0f ? NAN : xi[j] / (nm > 0.0f ? nm : 1.0f), a, b, last); /* negative: NaN */
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            float nm = rank1_norm(rm, cm[j]);
            buf[j] = xi[j] < 0.0f ? NAN : xi[j] / (nm > 0.0f ? nm : 1.0f);
        }
        count_pass(buf, n, 1.0f, f, idx); /* x / 1 == x: the threshold count of q */
    }
    pack_nibbles(idx, n, codes);
}

/* codes (uint8 (rows, ceil(R / 2)), two a byte) of x with the given maxima */
void lbt_rank1_encode(int64_t rows, int64_t R, const float *x, const float *row_max, const float *col_max,
                      const lbt_format *f, uint8_t *codes, int nthreads) {
    const int64_t T = 2048, tiles = (R + T - 1) / T, cc = (R + 1) / 2;
    #pragma omp parallel num_threads(nthreads)
    {
        float *buf = (float *)malloc(sizeof(float) * T);
        int32_t *idx = (int32_t *)malloc(sizeof(int32_t) * T);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < rows * tiles; t++) {
            const int64_t i = t / tiles, j0 = (t % tiles) * T, len = R - j0 < T ? R - j0 : T;
            rank1_encode_run(x + i * R + j0, len, row_max[i], col_max + j0, f, codes + i * cc + j0 / 2, buf, idx);
        }
        free(buf);
        free(idx);
    }
}

/* ------------------------------------------------------------------------
 * Update rules: one transition per rule, for every state format and param dtype.
 *
 * A job is one leaf (a parameter's view (rows, R)) and up to three states. Its
 * step, per element, in float32 and in this order (the torch backend,
 * lowbit_tree/kernels/torch_backend.py, does the same operations):
 *   prologue  g = -g (maximize); g = g + l2 * p (L2 decay link before the rule)
 *   rule      ADAM      m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*(g*g);
 *                       [amsgrad: w = max(w, v), the root below of w]
 *                       u = (m * (1/bc1)) / (sqrt(v) * (1/sqrt(bc2)) + eps)
 *             ADEMAMIX  ADAM's m, v and a slow EMA s = b3*s + (1-b3)*g;
 *                       u = (m * (1/bc1) + alpha * s) / (sqrt(v) * (1/sqrt(bc2)) + eps)
 *             LION      c = b1*m + (1-b1)*g; u = sign(c) (0 for 0 and NaN);
 *                       m = b2*m + (1-b2)*g
 *             MOMENTUM  b = mu*b + g; u = b, or g + mu*b (nesterov)
 *             MUON      b = lerp(b, g, 1-mu); u = b, or lerp(g, b, mu) (nesterov), with
 *                       torch.lerp's float32 bits: |w| < 0.5 ? fma(w, c-a, a) : fma(w-1, c-a, c)
 *                       (the fused multiply-adds of these rules: torch.optim.Muon's bits)
 *             RMSPROP   v = b2*v + (1-b2)*(g*g); [centered: a = lerp(a, g, 1-b2), d = sqrt(v - a*a) + eps]
 *                       else d = sqrt(v) + eps; u = g/d, or [momentum] b = b1*b + g/d, u = b
 *             ADAGRAD   s = max(s, b1) + g*g; u = g / (sqrt(s) + eps)
 *             ADAMAX    e = max(b2*e, |g| + eps) (NaN if either is); m = b1*m + (1-b1)*g; u = (m * (1/bc1)) / e
 *             ADADELTA  v = b2*v + (1-b2)*(g*g); u = (sqrt(a + eps) / sqrt(v + eps)) * g; a = b2*a + (1-b2)*(u*u)
 *             RADAM     v = b2*v + (1-b2)*(g*g); m = b1*m + (1-b1)*g; u = (m * cm) / (sqrt(v) + eps) if rect,
 *                       else m * cm (cm, rect: spec.radam_terms)
 *             NADAM     v = b2*v + (1-b2)*(g*g); m = b1*m + (1-b1)*g; u = (cg*g + cm*m) / (sqrt(v) * (1/sqrt(bc2)) + eps)
 *                       (cg, cm: spec.nadam_terms)
 *   epilogue  u = u + wd * p (decoupled decay link); u = (-lr) * u (lr link)
 *   output    out = u (float32 update), or the param p + u rounded once to its
 *             dtype (to nearest even, or stochastically for bfloat16); with LBT_NEW_PARAM
 *             both: u to out, p + u (to nearest even) to pout
 * States are dequantized before and requantized after (codes bit-identical to
 * the reference quantizer of the new float32 states); plain float32 / bfloat16
 * states are read and written as such.
 * ------------------------------------------------------------------------ */
/* The rule ids (LBT_ADAM...), dtype ids (LBT_F32...), flag bits (LBT_MAXIMIZE...), LBT_RANK1,
 * the hyperparameter vector's indices (hyper[LBT_H_B1]...) and the job row's layout come from a
 * header generated from lowbit_tree/kernels/spec.py (native.abi_header) and force-included by
 * the build: this file writes none of those numbers itself. */
#ifndef LBT_JOB_INT64S
#error "cpu.c is compiled with the header lowbit_tree/kernels/native.py generates (-include)"
#endif

/* One state of a job. Every field is 8 bytes wide (jobs are passed as int64 rows).
 * A rank-1 record (bs == LBT_RANK1): in its codes, scale_in its row maxima, scale_out
 * its column maxima (read only), out its new codes (may be ``in``), rmax_new / cmax_new the
 * row and column maxima of its new values: written by a maxima job (LBT_MAXIMA), then, once
 * the caller has completed them across shards, read by the step that encodes with them. */
typedef struct {
    void *in;                /* codes (row layout) or plain values */
    void *out;               /* where the new state goes; may be ``in`` (in place) */
    const float *scale_in;   /* quantized: block scales (rows, ceil(R / bs)) */
    float *scale_out;        /* may be ``scale_in`` */
    const lbt_format *f;     /* NULL: plain values */
    int64_t bs;              /* quantized: block size; plain: LBT_F32 or LBT_BF16 */
    float *rmax_new;         /* rank-1: the row maxima of the new values (a negative or NaN value: NaN) */
    float *cmax_new;         /* rank-1: their column maxima */
} lbt_state;

typedef struct {
    int64_t rows, R;
    const void *p;           /* param (dtype pdt); NULL if the step needs none */
    const void *g;           /* gradient (dtype gdt) */
    void *out;               /* LBT_WRITE_PARAM: the param itself (updated in place); else float32 u */
    void *pout;              /* LBT_NEW_PARAM: p + u in the param's dtype (a new buffer) */
    int64_t rule, flags, pdt, gdt;
    const float *hyper;
    int64_t sr_hash;         /* LBT_STOCHASTIC: the key's hash (see lowbit_tree/update.py) */
    int8_t *corr;            /* LBT_PARAM_CORRECTION: the param's correction, read and written in place */
    int64_t nstates;
    lbt_state st[LBT_STATE_SLOTS];
} lbt_job;

/* The job row Python builds (native.job_row) is this struct: every field one int64 at 8 * its
 * index in spec.py, the states right after the header. A field added to, removed from or moved
 * in either side without the other stops the build here. */
#define LBT_AT(type, member, index) \
    _Static_assert(offsetof(type, member) == 8 * (index) && sizeof(((type *)0)->member) == 8, \
                   #type "." #member " is not the int64 at index " #index " of spec.py's job row");
#define LBT_JOB_AT(member, index) LBT_AT(lbt_job, member, index)
#define LBT_STATE_AT(member, index) LBT_AT(lbt_state, member, index)
LBT_JOB_LAYOUT(LBT_JOB_AT)
LBT_STATE_LAYOUT(LBT_STATE_AT)
#undef LBT_JOB_AT
#undef LBT_STATE_AT
#undef LBT_AT
_Static_assert(sizeof(lbt_state) == 8 * LBT_STATE_FIELDS, "lbt_state has fields spec.STATE_FIELDS lacks");
_Static_assert(offsetof(lbt_job, st) == 8 * LBT_JOB_FIELDS, "lbt_job has fields spec.JOB_HEADER lacks");
_Static_assert(sizeof(lbt_job) == 8 * LBT_JOB_INT64S, "lbt_job is not spec.JOB_ROW int64 long");

/* The layout this build has, for the loader to compare with spec.py (native.abi_layout):
 * sizeof(lbt_job), the offset of each header field, the offset of st, sizeof(lbt_state), the
 * offset of each state field. Writes at most cap values; returns how many there are. */
int64_t lbt_abi_layout(int64_t *out, int64_t cap) {
    int64_t v[2 + LBT_JOB_FIELDS + 1 + LBT_STATE_FIELDS], n = 0;
    v[n++] = (int64_t)sizeof(lbt_job);
#define LBT_OFFSET(member, index) v[n++] = (int64_t)offsetof(lbt_job, member);
    LBT_JOB_LAYOUT(LBT_OFFSET)
#undef LBT_OFFSET
    v[n++] = (int64_t)offsetof(lbt_job, st);
    v[n++] = (int64_t)sizeof(lbt_state);
#define LBT_OFFSET(member, index) v[n++] = (int64_t)offsetof(lbt_state, member);
    LBT_STATE_LAYOUT(LBT_OFFSET)
#undef LBT_OFFSET
    for (int64_t i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}

static inline float bf16_value(uint16_t h) { uint32_t u = (uint32_t)h << 16; float x; memcpy(&x, &u, 4); return x; }

/* torch's float -> bfloat16: to nearest even, NaN -> 0x7FC0 */
static inline uint16_t bf16_round(float x) {
    uint32_t u = (uint32_t)f2i(x);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(x != x ? 0x7FC0u : r); /* a select, not a branch: the loops vectorize */
}

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

/* lowbit_tree.update.stochastic_round for element ``idx`` of a leaf whose key hashes to h */
static inline uint16_t bf16_stochastic(float x, int64_t idx, uint32_t h) {
    uint32_t c = mix32((uint32_t)(((uint64_t)idx >> 32) + h)) + h;
    uint32_t r = mix32(mix32((uint32_t)idx) ^ c) & 0xFFFFu;
    uint32_t u = (uint32_t)f2i(x);
    if ((u & 0x7F800000u) == 0x7F800000u) return bf16_round(x);
    return (uint16_t)(((u + r) & 0xFFFF0000u) >> 16);
}

static void load_plain(const void *src, int64_t dt, int64_t n, float *restrict dst) {
    if (dt == LBT_BF16) {
        const uint16_t *restrict s = (const uint16_t *)src;
        for (int64_t k = 0; k < n; k++) dst[k] = bf16_value(s[k]);
    } else if (dt == LBT_F16) {
        const _Float16 *restrict s = (const _Float16 *)src;
        for (int64_t k = 0; k < n; k++) dst[k] = (float)s[k];
    } else {
        memcpy(dst, src, sizeof(float) * n);
    }
}

/* float32 values -> dtype dt (round to nearest even; bf16 stochastically with sr) */
static void store_plain(const float *restrict x, int64_t n, int64_t dt, void *dst, int sr, int64_t idx0, uint32_t h) {
    if (dt == LBT_BF16) {
        uint16_t *restrict d = (uint16_t *)dst;
        if (!sr) {
            for (int64_t k = 0; k < n; k++) d[k] = bf16_round(x[k]);
        } else if (((uint64_t)idx0 >> 32) == ((uint64_t)(idx0 + n - 1) >> 32)) {
            /* bf16_stochastic with the high word of the index hoisted (one per run):
             * integer ops and selects only, so the loop vectorizes */
            const uint32_t c = mix32((uint32_t)(((uint64_t)idx0 >> 32) + h)) + h, lo0 = (uint32_t)idx0;
            for (int64_t k = 0; k < n; k++) {
                uint32_t u = (uint32_t)f2i(x[k]);
                uint32_t r = mix32(mix32(lo0 + (uint32_t)k) ^ c) & 0xFFFFu;
                uint32_t s = (u + r) >> 16, rne = bf16_round(x[k]);
                d[k] = (uint16_t)((u & 0x7F800000u) != 0x7F800000u ? s : rne);
            }
        } else {
            for (int64_t k = 0; k < n; k++) d[k] = bf16_stochastic(x[k], idx0 + k, h);
        }
    } else if (dt == LBT_F16) {
        _Float16 *restrict d = (_Float16 *)dst;
        for (int64_t k = 0; k < n; k++) d[k] = (_Float16)x[k];
    } else if ((const void *)x != dst) {
        memcpy(dst, x, sizeof(float) * n);
    }
}

static inline int64_t dt_size(int64_t dt) { return dt == LBT_F32 ? 4 : 2; }

/* The power of two of v's binade as float32 bits: v's exponent field, at least EMIN's (the param
 * dtype's smallest normal exponent: zeros and subnormals share its spacing) and at most 2 ** 127
 * (infinity and NaN get a finite power; what it scales stays non-finite). */
static inline int32_t binade_bits(float v, const int32_t EMIN) {
    int32_t b = f2i(v) & 0x7F800000;
    const int32_t lo = (EMIN + 127) << 23;
    b = b < lo ? lo : b;
    return b > 0x7F000000 ? 0x7F000000 : b;
}

/* The corrected write (LBT_PARAM_CORRECTION; lowbit_tree/correction.py) of n elements: pv the param's
 * float32 values, d the update, c the int8 corrections (in place), q the bfloat16 (F16: float16)
 * param's bits. x = (p + c * scale(p)) + d: the master value is exact, the sum rounds once (no
 * contraction); p' = x to nearest even, or the neighbour above where c' would be +128;
 * c' = rint((x - p') / scale(p')) clamped to [-128, 127], 0 where p' is not finite. scale(p) = ulp(p) / 256 = 2 ** e * 2 ** -(MANT + 8) for p's binade e (MANT:
 * the dtype's mantissa bits): a product of powers of two, exact (a float32 subnormal below
 * 2 ** -126), so its bits are correction.correction_scale's for every finite p. The division by
 * scale(p') is two multiplications by powers of two, 2 ** (1 - e) (a normal float32 for every
 * binade) then 2 ** (MANT + 7), neither of which rounds: nothing overflows (|x - p'| is at most
 * half an ulp of p'), and where the first factor shrinks (e >= 2), x - p' is 0 or at least
 * 2 ** (e - 24), an ulp of float32 in the binade below p', so the product stays normal. So the
 * quotient's bits are the division's, at less cost (float16's path). bfloat16 (corrected_bf16)
 * gets the same bits from integer ops on x's bits alone. float16 (corrected_run): GCC does not
 * vectorize the float <-> _Float16 conversions on a CPU without AVX512-FP16
 * (-fopt-info-vec-missed: "conversion not supported by target"), so it keeps two passes and
 * converts the neighbour above only where the rest is +128. */
/* float16's step of one element on its slow path: where the rest against p' would be +128, p' is the
 * neighbour above (split_master), whose rest fits int8. x is the new master value, hb p''s 16-bit
 * pattern (nearest even), y its value, both finite. Returns the new correction; *q the pattern. */
static int8_t corrected_above(float x, uint32_t hb, float y, uint16_t *q, const int F16, const int32_t emin,
                              const float steps) {
    const uint32_t hu = (hb & 0x8000u) ? (hb == 0x8000u ? 1u : hb - 1u) : hb + 1u;
    float yu;
    if (F16) {
        const uint16_t b = (uint16_t)hu;
        _Float16 t;
        memcpy(&t, &b, 2);
        yu = (float)t;
    } else {
        yu = bits2f((int32_t)(hu << 16));
    }
    float r;
    if ((f2i(yu) & 0x7F800000) == 0x7F800000) { /* no finite neighbour above: keep p' (the rest clamps) */
        r = 127.0f;
    } else {
        *q = (uint16_t)hu;
        r = rintf(((x - yu) * bits2f(0x7F800000 - binade_bits(yu, emin))) * steps);
        r = r < -128.0f ? -128.0f : (r > 127.0f ? 127.0f : r);
    }
    (void)y;
    return (int8_t)(int32_t)r;
}

/* The fast path of corrected_run over m elements (float16; scalar, see above): p' to nearest even, its rest
 * clamped; rest[k] the rest before the clamp (0 where p' is not finite), +128 (one element in
 * about 512) for the slow path. ci: the old corrections, co: the new. */
static inline __attribute__((always_inline)) void corrected_fast(const float *restrict pv, const float *restrict d,
                                                                 const int8_t *restrict ci, int8_t *restrict co,
                                                                 float *restrict rest, int64_t m,
                                                                 uint16_t *restrict q, const int F16) {
    const int32_t emin = F16 ? -14 : -126;
    const float unit = F16 ? 0x1p-18f : 0x1p-15f, steps = F16 ? 0x1p17f : 0x1p14f; /* 2 ** -(MANT + 8), 2 ** (MANT + 7) */
    for (int64_t k = 0; k < m; k++) {
        const float p = pv[k];
        const float x = (p + (float)ci[k] * (bits2f(binade_bits(p, emin)) * unit)) + d[k];
        float y;
        if (F16) {
            _Float16 h = (_Float16)x;
            memcpy(q + k, &h, 2);
            y = (float)h;
        } else {
            uint16_t h = bf16_round(x);
            q[k] = h;
            y = bf16_value(h);
        }
        float r = rintf(((x - y) * bits2f(0x7F800000 - binade_bits(y, emin))) * steps);
        r = (f2i(y) & 0x7F800000) != 0x7F800000 ? r : 0.0f;
        rest[k] = r; /* above 127: the slow path's */
        r = r < -128.0f ? -128.0f : (r > 127.0f ? 127.0f : r);
        co[k] = (int8_t)(int32_t)r;
    }
}

/* float16's corrected write: corrected_fast a chunk at a time, then the slow path where the rest is +128 */
#define LBT_CORRECTION_CHUNK 1024
static inline __attribute__((always_inline)) void corrected_run(const float *restrict pv, const float *restrict d,
                                                                int8_t *restrict c, int64_t n,
                                                                uint16_t *restrict q, const int F16) {
    const int32_t emin = F16 ? -14 : -126;
    const float unit = F16 ? 0x1p-18f : 0x1p-15f, steps = F16 ? 0x1p17f : 0x1p14f;
    int8_t c0[LBT_CORRECTION_CHUNK];
    float rest[LBT_CORRECTION_CHUNK];
    for (int64_t k0 = 0; k0 < n; k0 += LBT_CORRECTION_CHUNK) {
        const int64_t m = n - k0 < LBT_CORRECTION_CHUNK ? n - k0 : LBT_CORRECTION_CHUNK;
        memcpy(c0, c + k0, (size_t)m);
        corrected_fast(pv + k0, d + k0, c0, c + k0, rest, m, q + k0, F16);
        int32_t any = 0; /* an integer reduction (a float max would not vectorize): rest > 127 as bits */
        for (int64_t k = 0; k < m; k++) any |= f2i(rest[k]) > 0x42FE0000; /* 127.0f */
        if (!any) continue;
        for (int64_t k = 0; k < m; k++) {  /* the slow path: the neighbour above */
            if (!(rest[k] > 127.0f)) continue;
            const int64_t i = k0 + k;
            const float p = pv[i];
            const float x = (p + (float)c0[k] * (bits2f(binade_bits(p, emin)) * unit)) + d[i];
            uint32_t hb = q[i];
            float y;
            if (F16) {
                _Float16 h;
                memcpy(&h, q + i, 2);
                y = (float)h;
            } else {
                y = bf16_value(q[i]);
            }
            c[i] = corrected_above(x, hb, y, q + i, F16, emin, steps);
        }
    }
}

/* bfloat16's split of the new master value x (float32) into p' (q, bfloat16 bits) and c' (c), with
 * integer ops on x's bits alone, no branches: the loop calling it vectorizes. With m = |x|'s bits,
 * |p'| is the bfloat16 value (bits hm) under m rounded up from a threshold: m's low 16 bits at least
 * 32640 for x >= 0 (rest >= 127.5 units would round to +128: the neighbour above instead), above 32896
 * for x < 0 (the neighbour above is the smaller magnitude; rests to -128.5 units round to -128), and
 * at least 32768, nearest even, for x < 0 where rounding |x| up crosses into the next binade (its unit
 * is twice as large: the rest is at most 64 units, so nearest never gives +128). That is x to nearest
 * even, or the neighbour above where c' would be +128, with nothing more to correct. Where |x| and |p'|
 * share a binade (float32's subnormals share the smallest one), x - p' in units of scale(p') is
 * exactly sdm / 256 for sdm = m - (hm << 16) with x's sign: 256 float32 steps per unit; where
 * rounding went up into the next binade (cross), a unit is 512 steps. c' = rint of that (ties to
 * even: an integer shift). The largest finite value: for x >= 0 above it by less than the midpoint
 * to infinity, p' stays the largest and c' clamps to 127. Non-finite p' (|x| at or above that midpoint:
 * infinity; NaN x -> 0x7FC0, torch's) keeps c' = 0. Every float32 x gives the bits of the float formula
 * (the float16 path's, split_master's): checked exhaustively when this was written. */
/* sdm >> sh rounds towards -inf for a negative sdm: C leaves a negative value's right shift to the
 * compiler; GCC and Clang shift in the sign */
_Static_assert((-3 >> 1) == -2, "the corrected write needs an arithmetic right shift of negative ints");
static inline __attribute__((always_inline)) void bf16_split(float x, int8_t *restrict c, uint16_t *restrict q) {
    const int32_t u = f2i(x);
    const int32_t neg = u >> 31; /* all ones where x < 0 (or -0, -NaN) */
    const int32_t m = u & 0x7FFFFFFF;
    const int32_t normal = m > 0x007FFFFF;
    const int32_t wrap = normal & ((m & 0x007F0000) == 0x007F0000); /* |x| rounded up is the next binade's first */
    int32_t hm = (int32_t)(((uint32_t)m + (uint32_t)(neg ? (wrap ? 32768 : 32639) : 32896)) >> 16);
    hm = hm < 0x7F7F ? hm : 0x7F7F;
    const int32_t ym = hm << 16;
    const int32_t sdm = ((m - ym) ^ neg) - neg;
    const int32_t cross = ((ym ^ m) > 0x007FFFFF) & normal;
    const int32_t sh = 8 + cross;
    int32_t r = (sdm + (127 | (cross << 7)) + ((sdm >> sh) & 1)) >> sh;
    r = r > 127 ? 127 : r;
    const int32_t fin = m < 0x7F7F8000; /* p' finite: |x| below the midpoint of the largest value and infinity */
    *c = (int8_t)(fin ? r : 0);
    *q = (uint16_t)(m > 0x7F800000 ? 0x7FC0 : ((fin ? hm : 0x7F80) | (neg & 0x8000)));
}

/* bfloat16's corrected write: the new master value, then bf16_split */
static void corrected_bf16(const float *restrict pv, const float *restrict d,
                           int8_t *restrict c, int64_t n, uint16_t *restrict q) {
    const int32_t emin = -126;
    const float unit = 0x1p-15f; /* 2 ** -(MANT + 8) */
    for (int64_t k = 0; k < n; k++) {
        const float p = pv[k];
        bf16_split((p + (float)c[k] * (bits2f(binade_bits(p, emin)) * unit)) + d[k], c + k, q + k);
    }
}

static void corrected_store(const float *pv, const float *d, int8_t *c, int64_t n, int64_t dt, uint16_t *q) {
    if (dt == LBT_F16) corrected_run(pv, d, c, n, q, 1);
    else corrected_bf16(pv, d, c, n, q);
}

/* The per-element rule on one run of n elements. g: the prologue's gradient
 * (float32); s0..s2: the states' old float32 values, overwritten by the new ones,
 * transformed for storage when TR (1: sqrt, 2: negative -> NaN, of the
 * second-moment states), with their absmax bits in amax. DEC: ADAM's two (three
 * with amsgrad) or ADEMAMIX's three states decoded from 8-bit table codes in the
 * loop (D) instead of read from s0..s2.
 * EPW 0: u goes to o; 1: o (the param, in place) += (-lr) * u; 2: o += (-lr) *
 * (u + wd * o); 3: o = (-lr) * u; 4: o = (-lr) * (u + wd * p) (the functional
 * API's update). Flags are literals in the callers, so each combination is
 * compiled (and vectorized) on its own; the combinations without an
 * instantiation in rule_dispatch run EPW 0 and a second pass over the run
 * (epilogue_pass). */
/* rule_run, its callers and the scratch (4 + LBT_STATE_SLOTS runs) name three state runs */
_Static_assert(LBT_STATE_SLOTS == 3, "rule_run takes three state runs: extend it with spec.STATE_SLOTS");

typedef struct {
    const uint8_t *mc, *vc, *wc;
    const float *dm, *dv, *dw;
    float sm, sv, sw;
} block_codes;

/* Adam's (and AdEMAMix's) new second moment, and amsgrad's running max of it: one definition for
 * rule_run and for the maxima job (rank1_maxima_tile), which must compute the same bits */
static inline float adam_second_moment(float b2, float omb2, float v0, float g) { return b2 * v0 + omb2 * (g * g); }
static inline float amsgrad_max(float v, float w0) { return (v > w0 || v != v) ? v : w0; }

static inline __attribute__((always_inline)) void rule_run(
    const float *restrict hyper, int64_t n, const float *restrict g, const float *restrict p, float *restrict o,
    float *restrict s0, float *restrict s1, float *restrict s2, const int RULE, const int VAR, const int TR,
    const int DEC, const int EPW, const block_codes *D, int32_t *amax, const int SEP,
    const float *restrict i0, const float *restrict i1, const float *restrict i2) {
    /* SEP: plain states read from i0..i2 (the old states, another buffer) and written to s0..s2,
     * instead of read and written in s0..s2 (OLD: the literal SEP picks the pointer, so no two
     * restrict pointers ever name one buffer) */
#define OLD(j) (SEP ? i##j[k] : s##j[k])
    const float b1 = hyper[LBT_H_B1], omb1 = hyper[LBT_H_OMB1], b2 = hyper[LBT_H_B2], omb2 = hyper[LBT_H_OMB2];
    const float rbc1 = hyper[LBT_H_RBC1], rsbc2 = hyper[LBT_H_RSBC2], eps = hyper[LBT_H_EPS];
    const float nlr = -hyper[LBT_H_LR], wd = hyper[LBT_H_WD];
    const uint8_t *restrict mc = DEC ? D->mc : NULL, *restrict vc = DEC ? D->vc : NULL;
    const int W = VAR || RULE == LBT_ADEMAMIX; /* a third decoded state: amsgrad's max, ademamix's slow EMA */
    const uint8_t *restrict wc = DEC && W ? D->wc : NULL;
    const float *restrict dm = DEC ? D->dm : NULL, *restrict dv = DEC ? D->dv : NULL;
    const float *restrict dw = DEC && W ? D->dw : NULL;
    const float sm = DEC ? D->sm : 0.0f, svs = DEC ? D->sv : 0.0f, sws = DEC && W ? D->sw : 0.0f;
    int32_t a0 = 0, a1 = 0, a2 = 0;
    for (int64_t k = 0; k < n; k++) {
        const float gi = g[k];
        float u, t0, t1 = 0.0f, t2 = 0.0f;
        if (RULE == LBT_ADAM || RULE == LBT_ADEMAMIX) {
            /* one body: AdEMAMix is Adam's m and v plus a slow EMA s in the numerator; the
             * literal RULE leaves each its own operations, so the bits are those of two bodies */
            float m0, v0;
            if (DEC) {
                float t = dv[vc[k]] * svs;
                m0 = dm[mc[k]] * sm;
                v0 = TR == 1 ? t * t : t;
            } else {
                m0 = OLD(0), v0 = OLD(1);
            }
            float m = b1 * m0 + omb1 * gi, v = adam_second_moment(b2, omb2, v0, gi);
            float sv = sqrtf(v), sr = sv; /* sqrt(v): the update's root, and the sqrt formats' transform */
            float num = m * rbc1;
            if (RULE == LBT_ADEMAMIX) { /* third state: the slow EMA (signed, stored as is) */
                const float b3 = hyper[LBT_H_B3], omb3 = hyper[LBT_H_OMB3], alpha = hyper[LBT_H_ALPHA];
                float l0 = DEC ? dw[wc[k]] * sws : OLD(2);
                float sl = b3 * l0 + omb3 * gi;
                num = num + alpha * sl;
                t2 = sl;
                s2[k] = t2;
            } else if (VAR) { /* amsgrad's third state: the running max of v, the root's argument */
                float w0;
                if (DEC) {
                    float t = dw[wc[k]] * sws;
                    w0 = TR == 1 ? t * t : t;
                } else {
                    w0 = OLD(2);
                }
                float w = amsgrad_max(v, w0);
                sr = sqrtf(w);
                t2 = TR == 1 ? sr : (TR == 2 && w < 0.0f ? NAN : w);
                s2[k] = t2;
            }
            u = num / (sr * rsbc2 + eps);
            t0 = m;
            t1 = TR == 1 ? sv : (TR == 2 && v < 0.0f ? NAN : v);
            s0[k] = t0;
            s1[k] = t1;
        } else if (RULE == LBT_LION) {
            float m0 = OLD(0), c = b1 * m0 + omb1 * gi;
            u = (float)((c > 0.0f) - (c < 0.0f)); /* torch.sign, with 0 for NaN */
            t0 = b2 * m0 + omb2 * gi;
            s0[k] = t0;
        } else if (RULE == LBT_MUON) { /* torch.optim.Muon's momentum: torch.lerp's fused multiply-adds */
            float b0 = OLD(0);
            float b = fabsf(omb1) < 0.5f ? fmaf(omb1, gi - b0, b0) : fmaf(omb1 - 1.0f, gi - b0, gi);
            u = VAR ? (fabsf(b1) < 0.5f ? fmaf(b1, b - gi, gi) : fmaf(b1 - 1.0f, b - gi, b)) : b;
            t0 = b;
            s0[k] = t0;
        } else if (RULE == LBT_RMSPROP) { /* torch.optim.RMSprop: v, [momentum buffer b], [centered: grad avg a] */
            const int MOM = VAR & 1, CEN = VAR & 2;
            float v = adam_second_moment(b2, omb2, OLD(0), gi), d;
            if (CEN) { /* a = torch.lerp(a, g, 1 - alpha); the root of v - a*a */
                float a0 = MOM ? OLD(2) : OLD(1);
                float a = fabsf(omb2) < 0.5f ? fmaf(omb2, gi - a0, a0) : fmaf(omb2 - 1.0f, gi - a0, gi);
                d = sqrtf(v - a * a) + eps;
                if (MOM) t2 = a, s2[k] = a;
                else t1 = a, s1[k] = a;
            } else {
                d = sqrtf(v) + eps;
            }
            u = gi / d;
            if (MOM) { /* b = momentum * b + g / d, the update */
                u = b1 * OLD(1) + u;
                t1 = u, s1[k] = u;
            }
            t0 = v;
            s0[k] = t0;
        } else if (RULE == LBT_ADAGRAD) { /* torch.optim.Adagrad: b1 the initial accumulator value */
            float s = OLD(0);
            s = (s < b1 ? b1 : s) + gi * gi; /* max(s, b1), NaN kept: lifts a fresh state at the first step */
            u = gi / (sqrtf(s) + eps);
            t0 = s;
            s0[k] = t0;
        } else if (RULE == LBT_ADAMAX) { /* torch.optim.Adamax: e the infinity norm (first), m */
            float e = amsgrad_max(b2 * OLD(0), fabsf(gi) + eps), m = b1 * OLD(1) + omb1 * gi;
            u = (m * rbc1) / e;
            t0 = e, t1 = m;
            s0[k] = t0;
            s1[k] = t1;
        } else if (RULE == LBT_ADADELTA) { /* torch.optim.Adadelta: v square_avg, a acc_delta; b2 its rho */
            float a0 = OLD(1), v = adam_second_moment(b2, omb2, OLD(0), gi);
            u = (sqrtf(a0 + eps) / sqrtf(v + eps)) * gi;
            t0 = v, t1 = adam_second_moment(b2, omb2, a0, u);
            s0[k] = t0;
            s1[k] = t1;
        } else if (RULE == LBT_RADAM) { /* torch.optim.RAdam: v, m; cm, rect this step's (spec.radam_terms) */
            const float cm = hyper[LBT_H_CM], rect = hyper[LBT_H_RECT];
            float v = adam_second_moment(b2, omb2, OLD(0), gi), m = b1 * OLD(1) + omb1 * gi, num = m * cm;
            u = rect != 0.0f ? num / (sqrtf(v) + eps) : num;
            t0 = v, t1 = m;
            s0[k] = t0;
            s1[k] = t1;
        } else if (RULE == LBT_NADAM) { /* torch.optim.NAdam: v, m; cg, cm this step's (spec.nadam_terms) */
            const float cg = hyper[LBT_H_CG], cm = hyper[LBT_H_CM];
            float v = adam_second_moment(b2, omb2, OLD(0), gi), m = b1 * OLD(1) + omb1 * gi;
            u = (cg * gi + cm * m) / (sqrtf(v) * rsbc2 + eps);
            t0 = v, t1 = m;
            s0[k] = t0;
            s1[k] = t1;
        } else { /* momentum */
            float b = b1 * OLD(0) + gi;
            u = VAR ? gi + b1 * b : b;
            t0 = b;
            s0[k] = t0;
        }
        if (EPW == 0) o[k] = u;
        else if (EPW == 1) o[k] = o[k] + nlr * u;
        else if (EPW == 2) o[k] = o[k] + nlr * (u + wd * o[k]);
        else if (EPW == 3) o[k] = nlr * u;
        else o[k] = nlr * (u + wd * p[k]);
        int32_t c0 = f2i(t0) & 0x7FFFFFFF, c1 = f2i(t1) & 0x7FFFFFFF, c2 = f2i(t2) & 0x7FFFFFFF;
        a0 = c0 > a0 ? c0 : a0;
        a1 = c1 > a1 ? c1 : a1;
        a2 = c2 > a2 ? c2 : a2;
    }
    amax[0] = a0, amax[1] = a1, amax[2] = a2;
}
#undef OLD

/* The epilogue on u (float32): EPI 0 u; 1 (-lr) u; 2 (-lr) (u + wd p); 3 u + wd p;
 * then o = d, or o = p + d when writing the param (o then holds p). One loop per
 * case, each over restrict pointers, so that every one is vectorized. */
static void epi_write(const float *restrict u, float *restrict o, int64_t n, float nlr, float wd, int epi) {
    switch (epi) {
    case 0: for (int64_t k = 0; k < n; k++) o[k] = o[k] + u[k]; break;
    case 1: for (int64_t k = 0; k < n; k++) o[k] = o[k] + nlr * u[k]; break;
    case 2: for (int64_t k = 0; k < n; k++) { float pi = o[k]; o[k] = pi + nlr * (u[k] + wd * pi); } break;
    default: for (int64_t k = 0; k < n; k++) { float pi = o[k]; o[k] = pi + (u[k] + wd * pi); } break;
    }
}

static void epi_out(const float *restrict u, const float *restrict p, float *restrict o, int64_t n, float nlr,
                    float wd, int epi) {
    switch (epi) {
    case 0: for (int64_t k = 0; k < n; k++) o[k] = u[k]; break;
    case 1: for (int64_t k = 0; k < n; k++) o[k] = nlr * u[k]; break;
    case 2: for (int64_t k = 0; k < n; k++) o[k] = nlr * (u[k] + wd * p[k]); break;
    default: for (int64_t k = 0; k < n; k++) o[k] = u[k] + wd * p[k]; break;
    }
}

static void epilogue_pass(const float *hyper, int64_t n, const float *u, const float *p, float *o, int epi,
                          int write) {
    if (write) epi_write(u, o, n, -hyper[LBT_H_LR], hyper[LBT_H_WD], epi);
    else epi_out(u, p, o, n, -hyper[LBT_H_LR], hyper[LBT_H_WD], epi);
}

typedef struct {
    const float *g, *p;
    float *o, *u, *s[LBT_STATE_SLOTS];
    const float *in[LBT_STATE_SLOTS]; /* sep: the old plain states, read from here (s[] gets the new ones) */
    int sep;
    int32_t amax[LBT_STATE_SLOTS];
} run_io;

/* The rule's variant as rule_run's VAR (the generated header's LBT_JOB_VARIANT: bit i is the
 * rule's i-th declared variant flag, e.g. RMSPROP has_momentum 1 and centered 2) */
static inline int job_variant(const lbt_job *J) { return LBT_JOB_VARIANT((int)J->rule, (int)J->flags); }

/* Every instantiated (rule, variant, transform, decoded, epilogue) combination is the generated
 * header's LBT_ALL_RULES (spec.INSTANCES), in terms of LBT_RUN, which each rule_variant* defines
 * before expanding it. */

/* The plain float32 combinations with their old states read from io->in (SEP). A function of
 * its own, not inlined: with these instantiations beside the others in one function, GCC's
 * code for the quantized rules got slower (kernel_ab, 8-bit SGD momentum in place: 1.14 ->
 * 1.70 ns/element; AdEMAMix 1.31 -> 1.83). */
static __attribute__((noinline)) int rule_variant_sep(const lbt_job *J, int64_t n, run_io *io, int tr, int epw,
                                                      float *uo) {
    const int rule = (int)J->rule, var = job_variant(J);
    const float *h = J->hyper, *g = io->g, *p = io->p;
    float *s0 = io->s[0], *s1 = io->s[1], *s2 = io->s[2];
    const float *i0 = io->in[0], *i1 = io->in[1], *i2 = io->in[2];
    int32_t *am = io->amax;
#define LBT_RUN(R, V, T, DC, E)                                                                  \
    if (!(DC) && (T) == 0 && rule == R && var == V && tr == T && epw == E) {                     \
        rule_run(h, n, g, p, uo, s0, s1, s2, R, V, T, DC, E, NULL, am, 1, i0, i1, i2);            \
        return 1;                                                                                \
    }
    LBT_ALL_RULES
#undef LBT_RUN
    return 0;
}

/* rule_run with literal flags, if this combination is instantiated: 1 if it ran. */
static int rule_variant(const lbt_job *J, int64_t n, run_io *io, int tr, const block_codes *D, int epw,
                        float *uo) {
    if (io->sep) return !D && rule_variant_sep(J, n, io, tr, epw, uo);
    const int rule = (int)J->rule, var = job_variant(J);
    const float *h = J->hyper, *g = io->g, *p = io->p;
    float *s0 = io->s[0], *s1 = io->s[1], *s2 = io->s[2];
    int32_t *am = io->amax;
#define LBT_RUN(R, V, T, DC, E)                                                                  \
    if (rule == R && var == V && tr == T && !!D == DC && epw == E) {                             \
        rule_run(h, n, g, p, uo, s0, s1, s2, R, V, T, DC, E, D, am, 0, NULL, NULL, NULL);         \
        return 1;                                                                                \
    }
    LBT_ALL_RULES
#undef LBT_RUN
    return 0;
}
#undef LBT_ALL_RULES

/* The rule with its epilogue fused where an instantiation exists, else the rule
 * (EPW 0, into a scratch run) and epilogue_pass. */
static void rule_dispatch(const lbt_job *J, int64_t n, run_io *io, int tr, const block_codes *D) {
    const int flags = (int)J->flags;
    const int epi = (flags & LBT_LR) ? ((flags & LBT_DECAY) ? 2 : 1) : ((flags & LBT_DECAY) ? 3 : 0);
    /* a corrected write (LBT_PARAM_CORRECTION) takes the update as its output: run_elements adds it to the
     * master value (corrected_store) */
    const int write = (flags & (LBT_WRITE_PARAM | LBT_PARAM_CORRECTION)) == LBT_WRITE_PARAM;
    if ((epi == 1 || epi == 2) && rule_variant(J, n, io, tr, D, write ? epi : epi + 2, io->o)) return;
    if (!epi && !write) { /* no epilogue: u is the output */
        if (rule_variant(J, n, io, tr, D, 0, io->o)) return;
        abort(); /* unreachable: every rule has its EPW 0 */
    }
    if (!rule_variant(J, n, io, tr, D, 0, io->u)) abort();
    epilogue_pass(J->hyper, n, io->u, io->p, io->o, epi, write);
}

/* Per-thread scratch, sized for the largest tile of the call. */
typedef struct {
    float *g, *p, *o, *u, *s[LBT_STATE_SLOTS];
    int32_t *s1, *s2;
    int32_t *r1;                /* rank-1 maxima of this thread's tiles (bits), at r1off[state] */
    const int64_t *r1off;       /* the current job's offsets into r1, one per state slot */
} scratch;

static inline int state_tr(const lbt_format *f) { return !f ? 0 : (f->sqrt_ ? 1 : (!f->is_signed ? 2 : 0)); }

static int64_t state_cols(const lbt_state *S, int64_t R) { return S->f->bits == 4 ? (R + 1) / 2 : R; }

/* A job's work is cut into tiles: for quantized states, pieces of one row (a
 * multiple of every block size) when rows are long, runs of whole rows when
 * they are short; for plain states, runs of LBT_PLAIN_TILE elements. */
#define LBT_PLAIN_TILE 2048

static int job_quantized(const lbt_job *J) { return J->nstates > 0 && J->st[0].f != NULL; }

static int64_t job_tile(const lbt_job *J) {
    if (!job_quantized(J)) return LBT_PLAIN_TILE;
    int64_t l = 2;
    for (int64_t i = 0; i < J->nstates; i++) {
        if (!J->st[i].f || J->st[i].bs == LBT_RANK1) continue; /* plain values beside quantized states */
        int64_t b = J->st[i].bs;
        l = l / gcd64(l, b) * b;
    }
    return l * ((2048 + l - 1) / l);
}

static int64_t job_tiles(const lbt_job *J) {
    int64_t n = J->rows * J->R;
    if (n == 0) return 0;
    if (!job_quantized(J)) return (n + LBT_PLAIN_TILE - 1) / LBT_PLAIN_TILE;
    int64_t T = job_tile(J);
    if (J->R >= T) return J->rows * ((J->R + T - 1) / T);
    int64_t k = T / J->R;
    return (J->rows + k - 1) / k;
}

/* The prologue on elements [off, off + n): g as float32 (negated, plus l2 * p),
 * pointing into the job's gradient when nothing changes it. p: float32 values of
 * the param at off (only read here). */
static const float *prologue(const lbt_job *J, int64_t off, int64_t n, const float *p, float *restrict buf) {
    const int flags = (int)J->flags;
    if (J->gdt == LBT_F32 && !(flags & (LBT_MAXIMIZE | LBT_L2))) return (const float *)J->g + off;
    load_plain((const char *)J->g + off * dt_size(J->gdt), J->gdt, n, buf);
    if (flags & LBT_MAXIMIZE) for (int64_t k = 0; k < n; k++) buf[k] = -buf[k];
    if (flags & LBT_L2) {
        const float l2 = J->hyper[LBT_H_L2];
        for (int64_t k = 0; k < n; k++) buf[k] = buf[k] + l2 * p[k];
    }
    return buf;
}

/* dst[0..n) = src[0..n), with non-temporal stores from dst's first 32-byte boundary: a new state
 * or update written out of place goes to memory without first reading its lines (a read-for-ownership of
 * memory about to be overwritten; measured on this VM: writing a fresh buffer costs 2.5x writing
 * back a line just read). Ordered before the parallel region ends (lbt_step_jobs' sfence). */
static void stream_store(float *restrict dst, const float *restrict src, int64_t n) {
    int64_t k = 0;
#ifdef __AVX2__
    if (((uintptr_t)dst & 3) == 0) {
        for (; k < n && ((uintptr_t)(dst + k) & 31); k++) dst[k] = src[k]; /* up to a 32-byte boundary */
        for (; k + 8 <= n; k += 8) _mm256_stream_ps(dst + k, _mm256_loadu_ps(src + k));
    }
#endif
    for (; k < n; k++) dst[k] = src[k];
}

/* dst[0..n) = p + u rounded once to pdt (to nearest even): apply_updates' sum, float32 streamed
 * to its new buffer (stream_store's reason), other dtypes through buf (n floats; may be p). */
static void sum_store(const float *p, const float *restrict u, int64_t n, int64_t pdt, void *dst, float *buf) {
    if (pdt == LBT_F32) {
        float *restrict oo = (float *)dst;
        int64_t k = 0;
#ifdef __AVX2__
        if (((uintptr_t)oo & 3) == 0) {
            for (; k < n && ((uintptr_t)(oo + k) & 31); k++) oo[k] = p[k] + u[k];
            for (; k + 8 <= n; k += 8)
                _mm256_stream_ps(oo + k, _mm256_add_ps(_mm256_loadu_ps(p + k), _mm256_loadu_ps(u + k)));
        }
#endif
        for (; k < n; k++) oo[k] = p[k] + u[k];
    } else {
        for (int64_t k = 0; k < n; k++) buf[k] = p[k] + u[k];
        store_plain(buf, n, pdt, dst, 0, 0, 0);
    }
}

/* Elements [off, off + n) of a job: param in and out, gradient, then the rule on
 * states already in io->s; the states' stores are the caller's. */
static void run_elements(const lbt_job *J, int64_t off, int64_t n, run_io *io, scratch *B, int tr,
                         const block_codes *D, int stream) {
    const int flags = (int)J->flags, write = !!(flags & LBT_WRITE_PARAM);
    const int corrected = write && (flags & LBT_PARAM_CORRECTION);
    const int needs_p = write || (flags & (LBT_L2 | LBT_DECAY | LBT_NEW_PARAM));
    const float *p = NULL;
    float *o;
    if (corrected) { /* p the param's values, o the update (rule_dispatch), then corrected_store */
        load_plain((const char *)J->p + off * dt_size(J->pdt), J->pdt, n, B->p);
        p = B->p;
        o = B->o;
    } else if (write) { /* o holds the param, updated in place */
        o = J->pdt == LBT_F32 ? (float *)J->out + off : B->o;
        if (J->pdt != LBT_F32) load_plain((const char *)J->p + off * dt_size(J->pdt), J->pdt, n, o);
        p = o;
    } else { /* the update (stream: computed in scratch, streamed to its new buffer) */
        o = stream ? B->o : (float *)J->out + off;
        if (needs_p) {
            if (J->pdt == LBT_F32) p = (const float *)J->p + off;
            else { load_plain((const char *)J->p + off * dt_size(J->pdt), J->pdt, n, B->p); p = B->p; }
        }
    }
    io->g = prologue(J, off, n, p, B->g);
    io->p = p;
    io->o = o;
    io->u = B->u;
    rule_dispatch(J, n, io, tr, D);
    if (!write && stream) stream_store((float *)J->out + off, o, n);
    if (flags & LBT_NEW_PARAM) sum_store(p, o, n, J->pdt, (char *)J->pout + off * dt_size(J->pdt), B->u);
    if (corrected) corrected_store(p, o, J->corr + off, n, J->pdt, (uint16_t *)J->out + off);
    else if (write && J->pdt != LBT_F32)
        store_plain(o, n, J->pdt, (char *)J->out + off * dt_size(J->pdt), !!(flags & LBT_STOCHASTIC), off,
                    (uint32_t)J->sr_hash);
}

/* Plain float32 / bfloat16 states: a run of whole elements. */
static void plain_tile(const lbt_job *J, int64_t t, scratch *B) {
    const int64_t N = J->rows * J->R, off = t * LBT_PLAIN_TILE, n = N - off < LBT_PLAIN_TILE ? N - off : LBT_PLAIN_TILE;
    run_io io;
    io.sep = J->nstates > 0;
    for (int64_t i = 0; i < J->nstates; i++) io.sep &= J->st[i].bs == LBT_F32 && J->st[i].in != J->st[i].out;
    for (int64_t i = 0; i < LBT_STATE_SLOTS; i++) io.s[i] = B->s[i], io.in[i] = NULL;
    for (int64_t i = 0; i < J->nstates; i++) {
        const lbt_state *S = &J->st[i];
        if (io.sep) io.in[i] = (const float *)S->in + off; /* out of place: read where they are */
        else if (S->bs == LBT_F32 && S->in == S->out) io.s[i] = (float *)S->out + off; /* in place */
        else load_plain((const char *)S->in + off * dt_size(S->bs), S->bs, n, io.s[i]);
    }
    run_elements(J, off, n, &io, B, 0, NULL, 1);
    for (int64_t i = 0; i < J->nstates; i++) {
        const lbt_state *S = &J->st[i];
        float *dst = (float *)S->out + off;
        if (S->bs == LBT_F32 && S->in != S->out) stream_store(dst, io.s[i], n);
        else store_plain(io.s[i], n, S->bs, (char *)S->out + off * dt_size(S->bs), 0, 0, 0);
    }
}

/* Quantized states sharing one even block size: block by block, while the
 * block is in L1 (dequantize, rule with the new states' transform and absmax
 * in the same loop, requantize). */
static int job_block_path(const lbt_job *J) {
    const int64_t bs = J->st[0].bs;
    if (bs % 2) return 0;
    for (int64_t i = 1; i < J->nstates; i++) if (J->st[i].bs != bs) return 0; /* also plain and rank-1 ones */
    return J->st[0].f->is_signed && !J->st[0].f->sqrt_; /* the first state is a signed first moment */
}

typedef struct {
    const uint8_t *ci[LBT_STATE_SLOTS];
    uint8_t *co[LBT_STATE_SLOTS];
    const float *si[LBT_STATE_SLOTS];
    float *so[LBT_STATE_SLOTS];
} row_ptrs;

/* Blocks of bs elements (the last may be shorter) from element off of the job, at the codes and
 * scales in RP: one row's (bs the states' block size), or several whole rows of R <= the block
 * size, one block a row (bs = R: their codes and scales are contiguous too). */
static void quantized_blocks(const lbt_job *J, const row_ptrs *RP, int64_t off, int64_t len, int64_t bs,
                             scratch *B) {
    const int64_t ns = J->nstates;
    const lbt_format *f0 = J->st[0].f, *f1 = ns > 1 ? J->st[1].f : NULL, *f2 = ns > 2 ? J->st[2].f : NULL;
    const int tr = state_tr(f1);
    /* ADAM's and ADEMAMIX's states in 8-bit table formats: decoded inside the rule
     * loop, whose vector work then overlaps the table loads, unless their decodes have
     * byte planes (decode8_planes in dequantize_segment: no load a code) */
    const int table8 = f0->bits == 8 && !f0->e4m3_arith && ns >= 2 && f1->bits == 8 && !f1->e4m3_arith &&
                       (!f2 || (f2->bits == 8 && !f2->e4m3_arith));
    const int planes = table8 && f0->planes && f1->planes && (!f2 || f2->planes);
    const int dec = table8 && !planes && ((J->rule == LBT_ADAM && (!f2 || state_tr(f2) == tr)) ||
                               (J->rule == LBT_ADEMAMIX && ns == 3 && state_tr(f2) == 0));
    for (int64_t b0 = 0, blk = 0; b0 < len; b0 += bs, blk++) {
        int64_t n = b0 + bs < len ? bs : len - b0;
        run_io io;
        io.sep = 0;
        for (int64_t i = 0; i < LBT_STATE_SLOTS; i++) io.s[i] = B->s[i], io.in[i] = NULL;
        block_codes D;
#ifdef __AVX2__
        { /* the gradient and param 512 elements ahead (see below) */
            const int64_t e = off + b0 + 512, gs = dt_size(J->gdt), ps = dt_size(J->pdt);
            const char *gp = (const char *)J->g + e * gs, *pp = J->p ? (const char *)J->p + e * ps : NULL;
            for (int64_t q = 0; q < n * gs; q += 64) _mm_prefetch(gp + q, _MM_HINT_T0);
            if (pp) for (int64_t q = 0; q < n * ps; q += 64) _mm_prefetch(pp + q, _MM_HINT_T0);
        }
#endif
        if (dec) {
            D = (block_codes){RP->ci[0] + b0, RP->ci[1] + b0, f2 ? RP->ci[2] + b0 : NULL,
                              f0->decode, f1->decode, f2 ? f2->decode : NULL,
                              RP->si[0][blk], RP->si[1][blk], f2 ? RP->si[2][blk] : 0.0f};
        } else {
#ifdef __AVX2__
            /* the codes 512 elements (two 8-bit blocks) ahead, like the gradient and param above (a
             * prefetch never faults, past the end either): the decode pass and the rule would wait
             * for their lines, first touched here. kernel_ab, 2048x2048 in place, 1 thread: AdamW 8bit
             * 1.69 -> 1.50, fp8 1.60 -> 1.37, 4bit 1.46 -> 1.29 ns/element against the codes
             * alone 256 bytes ahead (which had been ~15% faster than none); 1024 ahead gained
             * less, 2048 nothing. */
            for (int64_t i = 0; i < ns; i++)
                for (int64_t q = 0; q < n; q += 64) _mm_prefetch((const char *)(RP->ci[i] + b0 + 512 + q), _MM_HINT_T0);
#endif
            for (int64_t i = 0; i < ns; i++) {
                const lbt_format *f = J->st[i].f;
                dequantize_segment(RP->ci[i] + (f->bits == 4 ? b0 / 2 : b0), RP->si[i] + blk, n, bs, f, io.s[i]);
            }
        }
        run_elements(J, off + b0, n, &io, B, tr, dec ? &D : NULL, 0);
        for (int64_t i = 0; i < ns; i++) {
            const lbt_format *f = J->st[i].f;
            float s = block_scale(io.amax[i], f);
            RP->so[i][blk] = s;
            encode_block(io.s[i], n, s, f, RP->co[i] + (f->bits == 4 ? b0 / 2 : b0), B->s1, B->s2);
        }
    }
}

/* A tile's contribution to a rank-1 state's maxima, on the bits of the values (monotone for
 * non-negative floats; a negative or NaN value counts as NaN, whose bits are above all): nr rows
 * r0.. of len elements from column j0; m holds the rows' maxima, then the columns'. */
static void rank1_tile_maxima(const float *restrict v, int64_t r0, int64_t nr, int64_t j0, int64_t len,
                              int32_t *restrict m, int64_t rows) {
    int32_t *restrict cm = m + rows + j0;
    for (int64_t q = 0; q < nr; q++) {
        const float *restrict vq = v + q * len;
        int32_t rb = m[r0 + q];
        for (int64_t j = 0; j < len; j++) {
            float x = vq[j];
            int32_t b = (x >= 0.0f) ? (f2i(x) & 0x7FFFFFFF) : LBT_NAN_BITS; /* false for NaN and x < 0 */
            rb = b > rb ? b : rb;
            cm[j] = b > cm[j] ? b : cm[j];
        }
        m[r0 + q] = rb;
    }
}

/* State i's values at the tile (nr rows r0.. of len elements from column j0; nr > 1 only with
 * j0 == 0 and len == R) into io->s[i], or io->s[i] pointed at them (plain float32 in place) */
static void decode_state(const lbt_job *J, int64_t i, int64_t r0, int64_t nr, int64_t j0, int64_t len,
                         run_io *io) {
    const lbt_state *S = &J->st[i];
    const int64_t R = J->R, off = r0 * R + j0;
    if (!S->f) {
        if (S->bs == LBT_F32 && S->in == S->out) io->s[i] = (float *)S->out + off;
        else load_plain((const char *)S->in + off * dt_size(S->bs), S->bs, nr * len, io->s[i]);
        return;
    }
    if (S->bs == LBT_RANK1) {
        for (int64_t q = 0; q < nr; q++)
            rank1_decode_run((const uint8_t *)S->in + (r0 + q) * ((R + 1) / 2) + j0 / 2, len, S->scale_in[r0 + q],
                             S->scale_out + j0, S->f->decode, io->s[i] + q * len);
        return;
    }
    const int64_t cc = state_cols(S, R), nb = (R + S->bs - 1) / S->bs;
    const int64_t cj = S->f->bits == 4 ? j0 / 2 : j0;
    for (int64_t q = 0; q < nr; q++) {
        int64_t r = r0 + q;
        dequantize_segment((const uint8_t *)S->in + r * cc + cj, S->scale_in + r * nb + j0 / S->bs, len, S->bs,
                           S->f, io->s[i] + q * len);
    }
}

/* A maxima job's tile (LBT_MAXIMA): the new second moment of Adam and AdEMAMix (state 1),
 * v = b2 * v + (1 - b2) * (g * g) after the prologue, and amsgrad's running max (state 2),
 * w = max(w, v), with rule_run's float operations (so the step that follows computes the same
 * values), into the tile's maxima of the rank-1 ones among them. Nothing is written. */
static void rank1_maxima_tile(const lbt_job *J, int64_t r0, int64_t nr, int64_t j0, int64_t len, scratch *B) {
    const int64_t off = r0 * J->R + j0, n = nr * len;
    const int flags = (int)J->flags;
    run_io io;
    for (int64_t i = 0; i < LBT_STATE_SLOTS; i++) io.s[i] = B->s[i], io.in[i] = NULL;
    const float *p = NULL;
    if (flags & LBT_L2) {
        load_plain((const char *)J->p + off * dt_size(J->pdt), J->pdt, n, B->p);
        p = B->p;
    }
    const float *restrict g = prologue(J, off, n, p, B->g);
    const int ams = J->rule == LBT_ADAM && job_variant(J) && J->st[2].bs == LBT_RANK1;
    decode_state(J, 1, r0, nr, j0, len, &io);
    if (ams) decode_state(J, 2, r0, nr, j0, len, &io);
    const float b2 = J->hyper[LBT_H_B2], omb2 = J->hyper[LBT_H_OMB2];
    float *restrict v = B->u; /* io.s[1] may be a plain state's own memory: the new values go to scratch */
    const float *restrict v0 = io.s[1];
    for (int64_t k = 0; k < n; k++) v[k] = adam_second_moment(b2, omb2, v0[k], g[k]);
    if (J->st[1].bs == LBT_RANK1) rank1_tile_maxima(v, r0, nr, j0, len, B->r1 + B->r1off[1], J->rows);
    if (ams) {
        float *restrict w = io.s[2]; /* decoded into scratch (a rank-1 record) */
        for (int64_t k = 0; k < n; k++) w[k] = amsgrad_max(v[k], w[k]);
        rank1_tile_maxima(w, r0, nr, j0, len, B->r1 + B->r1off[2], J->rows);
    }
}

static void quantized_tile(const lbt_job *J, int64_t t, scratch *B) {
    const int64_t R = J->R, T = job_tile(J), ns = J->nstates;
    int64_t r0, nr, j0, len;
    if (R >= T) {
        int64_t tpr = (R + T - 1) / T;
        r0 = t / tpr, nr = 1, j0 = (t % tpr) * T;
        len = R - j0 < T ? R - j0 : T;
    } else {
        int64_t k = T / R;
        r0 = t * k, nr = J->rows - r0 < k ? J->rows - r0 : k, j0 = 0, len = R;
    }
    if (J->flags & LBT_MAXIMA) {
        rank1_maxima_tile(J, r0, nr, j0, len, B);
        return;
    }
    const int block = job_block_path(J);
    /* rows of one block each (R <= bs; 4-bit: R even, so each row starts a byte): the tile's
     * rows in one call, as blocks of R elements */
    const int merge = block && nr > 1 && R <= J->st[0].bs && (R % 2 == 0 || J->st[0].f->bits == 8);
    if (block) {
        for (int64_t r = r0; r < r0 + nr; r += merge ? nr : 1) {
            row_ptrs P;
            for (int64_t i = 0; i < ns; i++) {
                const lbt_state *S = &J->st[i];
                const int64_t cc = state_cols(S, R), nb = (R + S->bs - 1) / S->bs;
                const int64_t cj = S->f->bits == 4 ? j0 / 2 : j0;
                P.ci[i] = (const uint8_t *)S->in + r * cc + cj;
                P.co[i] = (uint8_t *)S->out + r * cc + cj;
                P.si[i] = S->scale_in + r * nb + j0 / S->bs;
                P.so[i] = S->scale_out + r * nb + j0 / S->bs;
            }
            quantized_blocks(J, &P, r * R + j0, merge ? nr * R : len, merge ? R : J->st[0].bs, B);
        }
        return;
    }
    /* any block sizes: each state a pass over the tile (nr > 1 only with j0 == 0,
     * len == R: the tile's elements are contiguous); plain states are read and written at
     * the tile's elements, rank-1 records encoded with their completed new maxima */
    run_io io;
    io.sep = 0;
    const int64_t off = r0 * R + j0;
    for (int64_t i = 0; i < LBT_STATE_SLOTS; i++) io.s[i] = B->s[i], io.in[i] = NULL;
    for (int64_t i = 0; i < ns; i++) decode_state(J, i, r0, nr, j0, len, &io);
    run_elements(J, off, nr * len, &io, B, 0, NULL, 0); /* raw states: quantize_segment transforms */
    for (int64_t i = 0; i < ns; i++) {
        const lbt_state *S = &J->st[i];
        if (!S->f) {
            store_plain(io.s[i], nr * len, S->bs, (char *)S->out + off * dt_size(S->bs), 0, 0, 0);
            continue;
        }
        if (S->bs == LBT_RANK1) { /* B->u and B->s1: scratch again once run_elements is done */
            for (int64_t q = 0; q < nr; q++)
                rank1_encode_run(io.s[i] + q * len, len, S->rmax_new[r0 + q], S->cmax_new + j0, S->f,
                                 (uint8_t *)S->out + (r0 + q) * ((R + 1) / 2) + j0 / 2, B->u, B->s1);
            continue;
        }
        const int64_t cc = state_cols(S, R), nb = (R + S->bs - 1) / S->bs;
        const int64_t cj = S->f->bits == 4 ? j0 / 2 : j0;
        for (int64_t q = 0; q < nr; q++) {
            int64_t r = r0 + q;
            quantize_segment(io.s[i] + q * len, len, S->bs, S->f, (uint8_t *)S->out + r * cc + cj,
                             S->scale_out + r * nb + j0 / S->bs, B->s1, B->s2);
        }
    }
}

/* The steps of many leaves in one parallel region: the tiles of all jobs are
 * shared out among the threads (results do not depend on who runs which tile). */
void lbt_step_jobs(int64_t njobs, const lbt_job *jobs, int nthreads) {
    if (njobs <= 0) return;
    int64_t *start = (int64_t *)malloc(sizeof(int64_t) * (njobs + 1));
    int64_t Tmax = LBT_PLAIN_TILE;
    start[0] = 0;
    for (int64_t j = 0; j < njobs; j++) {
        start[j + 1] = start[j] + job_tiles(&jobs[j]);
        int64_t T = job_tile(&jobs[j]);
        Tmax = T > Tmax ? T : Tmax;
    }
    const int64_t total = start[njobs];
    if (total < 2) nthreads = 1;
    /* maxima jobs' rank-1 states: each thread's maxima (bits; 0 is neutral for non-negative
     * values), rows then columns of each, merged after the tiles */
    int64_t *r1off = (int64_t *)malloc(sizeof(int64_t) * LBT_STATE_SLOTS * njobs), r1n = 0;
    for (int64_t j = 0; j < njobs; j++)
        for (int64_t i = 0; i < LBT_STATE_SLOTS; i++) {
            int r1 = (jobs[j].flags & LBT_MAXIMA) && i < jobs[j].nstates && jobs[j].st[i].bs == LBT_RANK1;
            r1off[LBT_STATE_SLOTS * j + i] = r1 ? r1n : 0;
            r1n += r1 ? jobs[j].rows + jobs[j].R : 0;
        }
    int32_t *r1all = r1n ? (int32_t *)calloc((size_t)nthreads * (size_t)r1n, sizeof(int32_t)) : NULL;
    #pragma omp parallel num_threads(nthreads)
    {
        scratch B;
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        B.r1 = r1all ? r1all + (int64_t)tid * r1n : NULL;
        /* the 4 + LBT_STATE_SLOTS scratch runs staggered by 80 floats (320 bytes): runs a multiple
         * of 4 KiB apart alias in the L1 and in store-to-load forwarding, and the rule loop stores to
         * one while it loads the next (with stream_store, measured on the functional fp32 step: 1.80 ->
         * 1.56 ns an element) */
        const int64_t St = Tmax + 80;
        float *mem = (float *)malloc(sizeof(float) * (4 + LBT_STATE_SLOTS) * St);
        B.g = mem, B.p = mem + St, B.o = mem + 2 * St, B.u = mem + 3 * St;
        for (int i = 0; i < LBT_STATE_SLOTS; i++) B.s[i] = mem + (4 + i) * St;
        B.s1 = (int32_t *)malloc(sizeof(int32_t) * 2 * Tmax);
        B.s2 = B.s1 + Tmax;
        int64_t j = 0;
        #pragma omp for schedule(dynamic, 4)
        for (int64_t t = 0; t < total; t++) {
            if (t < start[j] || t >= start[j + 1]) { /* binary search for the job holding tile t */
                int64_t lo = 0, hi = njobs - 1;
                while (lo < hi) {
                    int64_t mid = (lo + hi + 1) / 2;
                    if (start[mid] <= t) lo = mid; else hi = mid - 1;
                }
                j = lo;
            }
            B.r1off = r1off + LBT_STATE_SLOTS * j;
            if (job_quantized(&jobs[j])) quantized_tile(&jobs[j], t - start[j], &B);
            else plain_tile(&jobs[j], t - start[j], &B);
        }
#ifdef __AVX2__
        _mm_sfence(); /* this thread's non-temporal stores (stream_store) before the region ends */
#endif
        free(mem);
        free(B.s1);
    }
    for (int64_t j = 0; r1all && j < njobs; j++)
        for (int64_t i = 0; i < jobs[j].nstates; i++) {
            const lbt_state *S = &jobs[j].st[i];
            if (S->bs != LBT_RANK1 || !(jobs[j].flags & LBT_MAXIMA)) continue;
            const int64_t rows = jobs[j].rows, n = rows + jobs[j].R;
            for (int64_t k = 0; k < n; k++) {
                int32_t m = 0;
                for (int t = 0; t < nthreads; t++) {
                    int32_t b = r1all[(int64_t)t * r1n + r1off[LBT_STATE_SLOTS * j + i] + k];
                    m = b > m ? b : m;
                }
                if (k < rows) S->rmax_new[k] = bits2f(m);
                else S->cmax_new[k - rows] = bits2f(m);
            }
        }
    free(r1all);
    free(r1off);
    free(start);
}

/* apply_updates on the CPU: out = p + u (u float32; p float32 or bfloat16, the sum float32,
 * rounded once to p's dtype as torch.add does), out a new buffer: streamed (stream_store). */
void lbt_apply(int64_t n, const void *p, int64_t pdt, const float *u, void *out, int nthreads) {
    const int64_t T = LBT_PLAIN_TILE, tiles = (n + T - 1) / T;
    #pragma omp parallel num_threads(nthreads)
    {
        float buf[LBT_PLAIN_TILE];
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t off = t * T, len = n - off < T ? n - off : T;
            const float *pp = (const float *)p + off;
            if (pdt != LBT_F32) {
                load_plain((const char *)p + off * dt_size(pdt), pdt, len, buf);
                pp = buf;
            }
            sum_store(pp, u + off, len, pdt, (char *)out + off * dt_size(pdt), buf);
        }
#ifdef __AVX2__
        _mm_sfence();
#endif
    }
}

/* Muon's low-rank factor product (lowbit_tree/lowrank.py, lowrank_expand): out[i][j] = sum over
 * k of p[i][k] * rt[k][j], from k = 0 in order, each addition rounded once (-ffp-contract=off),
 * the products exact (bfloat16 values held as float32): the bits of the torch ops there, on any
 * row or column slice. p is (m, K), rt the column factor transposed, (K, n), both float32. */
void lbt_lowrank_expand(int64_t m, int64_t n, int64_t K, const float *p, const float *rt, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < m; i++) {
        float *restrict o = out + i * n;
        const float *restrict pi = p + i * K;
        const float p0 = pi[0];
        const float *restrict r0 = rt;
        for (int64_t j = 0; j < n; j++) o[j] = p0 * r0[j];
        for (int64_t k = 1; k < K; k++) {
            const float pk = pi[k];
            const float *restrict rk = rt + k * n;
            for (int64_t j = 0; j < n; j++) o[j] = o[j] + pk * rk[j];
        }
    }
}
