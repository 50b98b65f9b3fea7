/* CPU kernels for lowbit_tree (see kernels_cpu.py): quantize, dequantize and the
 * fused Adam step, one pass per tile of whole blocks, bit-identical to the
 * reference quantizer. Plain C99 + OpenMP, no Python or torch headers, so it
 * compiles in about a second. Must be built with -ffp-contract=off and without
 * -ffast-math: every float operation rounds exactly like torch's eager float32 ops.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t bits;       /* 8 or 4 */
    int32_t is_signed;  /* negative input valid */
    int32_t sqrt_;      /* store sqrt(x) */
    int32_t float8;     /* codes are e4m3 bytes (encode table) */
    float divisor;      /* scale = absmax / divisor */
    int32_t shift, key_min, key_max, offset, nbuckets, last;
    const float *decode;         /* 256: code byte -> normalized value */
    const int32_t *base;         /* nbuckets */
    const float *thresholds;     /* nbuckets: the threshold inside each bucket, +inf if none */
    const uint8_t *encode;       /* last + 1: index -> stored byte */
} lbt_format;

static inline int32_t f2i(float x) { int32_t i; memcpy(&i, &x, 4); return i; }

/* Nearest map index of each x[i] / safe (see kernels.py for the bucket scheme).
 * Branch-free so that GCC vectorizes it (AVX2 gathers for the two lookups). */
static void nearest_indices(const float *restrict x, int64_t n, float safe, const lbt_format *f,
                            int32_t *restrict idx) {
    const int32_t kmin = f->key_min, kmax = f->key_max, shift = f->shift, off = f->offset;
    const int32_t last = f->last, nbm1 = f->nbuckets - 1, sgn = f->is_signed;
    const int32_t *restrict base = f->base;
    const float *restrict thr = f->thresholds;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i] / safe;
        int32_t mag = f2i(v) & 0x7FFFFFFF;
        mag = mag < kmin ? kmin : mag;
        mag = mag > kmax ? kmax : mag;
        int32_t rel = mag - kmin;
        int32_t key = (sgn & (v < 0.0f)) ? ~rel : rel;
        int32_t b = (key >> shift) - off;
        b = b < 0 ? 0 : b;
        b = b > nbm1 ? nbm1 : b;
        int32_t k = base[b] + (v >= thr[b]);
        idx[i] = k > last ? last : k;
    }
}

/* Quantize x[0..len) of one row segment that starts at a block boundary:
 * transforms x in place (unsigned: negative -> NaN; sqrt), writes the scales of
 * its blocks and its codes (4-bit: the segment starts at an even element; codes
 * point at its first byte). ``idx``: scratch of len int32. */
static void quantize_segment(float *restrict x, int64_t len, int64_t bs, const lbt_format *f,
                             uint8_t *restrict codes, float *restrict scale, int32_t *restrict idx) {
    if (!f->is_signed) {
        for (int64_t j = 0; j < len; j++) x[j] = x[j] < 0.0f ? NAN : x[j];
    }
    if (f->sqrt_) {
        for (int64_t j = 0; j < len; j++) x[j] = sqrtf(x[j]);
    }
    for (int64_t b0 = 0, blk = 0; b0 < len; b0 += bs, blk++) {
        int64_t n = b0 + bs < len ? bs : len - b0;
        /* absmax on the bits of |x|: monotone for non-negative floats, and NaN /
         * inf have the largest bit patterns (either -> NaN scale) */
        int32_t amax = 0;
        for (int64_t j = 0; j < n; j++) {
            int32_t a = f2i(x[b0 + j]) & 0x7FFFFFFF;
            amax = a > amax ? a : amax;
        }
        float am;
        memcpy(&am, &amax, 4);
        float s = amax >= 0x7F800000 ? NAN : am / f->divisor;
        scale[blk] = s;
        nearest_indices(x + b0, n, s > 0.0f ? s : 1.0f, f, idx + b0);
    }
    if (f->bits == 4) {
        int64_t pairs = len / 2;
        for (int64_t j = 0; j < pairs; j++) codes[j] = (uint8_t)(idx[2 * j] | (idx[2 * j + 1] << 4));
        if (len & 1) codes[pairs] = (uint8_t)idx[len - 1]; /* high nibble: padding 0 */
    } else if (f->float8) {
        const uint8_t *restrict enc = f->encode;
        for (int64_t j = 0; j < len; j++) codes[j] = enc[idx[j]];
    } else {
        for (int64_t j = 0; j < len; j++) codes[j] = (uint8_t)idx[j];
    }
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
            int64_t np = n >> 1;
            for (int64_t q = 0; q < np; q++) {
                uint8_t cq = c[q];
                o[2 * q] = dec[cq & 0x0F] * s;
                o[2 * q + 1] = dec[cq >> 4] * s;
            }
            if (n & 1) o[n - 1] = dec[c[np] & 0x0F] * s;
        } else {
            for (int64_t j = b0; j < b0 + n; j++) out[j] = dec[codes[j]] * s;
        }
    }
    if (f->sqrt_) {
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
        int32_t *idx = (int32_t *)malloc(sizeof(int32_t) * T);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < rows * tiles; t++) {
            int64_t r = t / tiles, j0 = (t % tiles) * T;
            int64_t len = R - j0 < T ? R - j0 : T;
            memcpy(buf, x + r * R + j0, sizeof(float) * len);
            uint8_t *c = codes + r * cc + (f->bits == 4 ? j0 / 2 : j0);
            quantize_segment(buf, len, bs, f, c, scale + r * nb + j0 / bs, idx);
        }
        free(buf);
        free(idx);
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

/* hyper: b1, 1-b1, b2, 1-b2, bc1, bc2, eps, lr, wd (float32).
 * p == NULL: out = u (the Adam direction); else out = p + (-lr) * (u + wd * p).
 * out may alias p; the *_out code/scale arrays may alias the inputs (a tile is
 * read whole before it is written).
 * m_out / v_out (optional): the new float32 moments (before quantization). */
void lbt_adam(int64_t rows, int64_t R, const float *p, const float *g, float *out,
              const uint8_t *mc, const float *ms, const uint8_t *vc, const float *vs,
              uint8_t *mc_out, float *ms_out, uint8_t *vc_out, float *vs_out,
              float *m_out, float *v_out, const float *hyper,
              const lbt_format *fm, int64_t bs_m, const lbt_format *fv, int64_t bs_v, int nthreads) {
    const float b1 = hyper[0], omb1 = hyper[1], b2 = hyper[2], omb2 = hyper[3];
    const float bc1 = hyper[4], bc2 = hyper[5], eps = hyper[6], nlr = -hyper[7], wd = hyper[8];
    int64_t T = tile_size(bs_m, bs_v);
    int64_t tiles = (R + T - 1) / T;
    int64_t nbm = (R + bs_m - 1) / bs_m, nbv = (R + bs_v - 1) / bs_v;
    int64_t ccm = code_cols(fm, R), ccv = code_cols(fv, R);
    #pragma omp parallel num_threads(nthreads)
    {
        float *restrict mb = (float *)malloc(sizeof(float) * T);
        float *restrict vb = (float *)malloc(sizeof(float) * T);
        int32_t *idx = (int32_t *)malloc(sizeof(int32_t) * T);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < rows * tiles; t++) {
            int64_t r = t / tiles, j0 = (t % tiles) * T;
            int64_t len = R - j0 < T ? R - j0 : T;
            int64_t off = r * R + j0;
            int64_t cm = r * ccm + (fm->bits == 4 ? j0 / 2 : j0), cv = r * ccv + (fv->bits == 4 ? j0 / 2 : j0);
            int64_t sm = r * nbm + j0 / bs_m, sv = r * nbv + j0 / bs_v;
            dequantize_segment(mc + cm, ms + sm, len, bs_m, fm, mb);
            dequantize_segment(vc + cv, vs + sv, len, bs_v, fv, vb);
            const float *restrict gt = g + off;
            for (int64_t i = 0; i < len; i++) {
                float gi = gt[i];
                mb[i] = b1 * mb[i] + omb1 * gi;
                vb[i] = b2 * vb[i] + omb2 * (gi * gi);
            }
            if (p) {
                const float *restrict pt = p + off;
                float *ot = out + off; /* may alias pt: same element read then written */
                for (int64_t i = 0; i < len; i++) {
                    float u = (mb[i] / bc1) / (sqrtf(vb[i] / bc2) + eps);
                    float pi = pt[i];
                    ot[i] = pi + nlr * (u + wd * pi);
                }
            } else {
                float *restrict ot = out + off;
                for (int64_t i = 0; i < len; i++) ot[i] = (mb[i] / bc1) / (sqrtf(vb[i] / bc2) + eps);
            }
            if (m_out) memcpy(m_out + off, mb, sizeof(float) * len);
            if (v_out) memcpy(v_out + off, vb, sizeof(float) * len);
            quantize_segment(mb, len, bs_m, fm, mc_out + cm, ms_out + sm, idx);
            quantize_segment(vb, len, bs_v, fv, vc_out + cv, vs_out + sv, idx);
        }
        free(mb);
        free(vb);
        free(idx);
    }
}
