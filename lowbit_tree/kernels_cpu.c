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
    const float *thresholds;     /* last + 2 (ends with +inf) */
    const uint8_t *encode;       /* last + 1: index -> stored byte */
} lbt_format;

static inline int32_t f2i(float x) { int32_t i; memcpy(&i, &x, 4); return i; }

static inline int32_t nearest_index(float n, const lbt_format *f) {
    int32_t mag = f2i(n) & 0x7FFFFFFF;
    if (mag < f->key_min) mag = f->key_min;
    if (mag > f->key_max) mag = f->key_max;
    int32_t rel = mag - f->key_min;
    int32_t key = (f->is_signed && n < 0.0f) ? ~rel : rel;
    int32_t b = (key >> f->shift) - f->offset;
    if (b < 0) b = 0;
    if (b >= f->nbuckets) b = f->nbuckets - 1;
    int32_t base = f->base[b];
    int32_t idx = base + (n >= f->thresholds[base] ? 1 : 0);
    return idx > f->last ? f->last : idx;
}

/* Quantize x[0..len) of one row segment that starts at a block boundary:
 * transforms x in place (unsigned: negative -> NaN; sqrt), writes scales of its
 * blocks and codes (8-bit: codes[j]; 4-bit: start must be even, codes indexed by
 * j/2 relative to the segment). */
static void quantize_segment(float *x, int64_t len, int64_t bs, const lbt_format *f,
                             uint8_t *codes, float *scale) {
    if (!f->is_signed) {
        for (int64_t j = 0; j < len; j++) if (x[j] < 0.0f) x[j] = NAN;
    }
    if (f->sqrt_) {
        for (int64_t j = 0; j < len; j++) x[j] = sqrtf(x[j]);
    }
    for (int64_t b0 = 0, blk = 0; b0 < len; b0 += bs, blk++) {
        int64_t b1 = b0 + bs < len ? b0 + bs : len;
        float amax = 0.0f;
        int bad = 0;
        for (int64_t j = b0; j < b1; j++) {
            float a = fabsf(x[j]);
            bad |= !(a <= INFINITY) | (a == INFINITY); /* NaN or inf */
            amax = a > amax ? a : amax;
        }
        float s = bad ? NAN : amax / f->divisor;
        scale[blk] = s;
        float safe = s > 0.0f ? s : 1.0f;
        if (f->bits == 4) {
            for (int64_t j = b0; j < b1; j++) {
                int32_t idx = nearest_index(x[j] / safe, f);
                uint8_t *c = codes + (j >> 1);
                if (j & 1) *c = (uint8_t)((*c & 0x0F) | (idx << 4));
                else *c = (uint8_t)idx; /* high nibble set by j+1, or stays 0 (padding) */
            }
        } else if (f->float8) {
            for (int64_t j = b0; j < b1; j++) codes[j] = f->encode[nearest_index(x[j] / safe, f)];
        } else {
            for (int64_t j = b0; j < b1; j++) codes[j] = (uint8_t)nearest_index(x[j] / safe, f);
        }
    }
}

static inline float decode_at(const uint8_t *codes, int64_t j, const lbt_format *f) {
    uint8_t c = f->bits == 4 ? (uint8_t)((codes[j >> 1] >> ((j & 1) * 4)) & 0x0F) : codes[j];
    return f->decode[c];
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
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < rows * tiles; t++) {
            int64_t r = t / tiles, j0 = (t % tiles) * T;
            int64_t len = R - j0 < T ? R - j0 : T;
            memcpy(buf, x + r * R + j0, sizeof(float) * len);
            uint8_t *c = codes + r * cc + (f->bits == 4 ? j0 / 2 : j0);
            quantize_segment(buf, len, bs, f, c, scale + r * nb + j0 / bs);
        }
        free(buf);
    }
}

void lbt_dequantize(int64_t rows, int64_t R, const uint8_t *codes, const float *scale, float *out,
                    const lbt_format *f, int64_t bs, int nthreads) {
    int64_t nb = (R + bs - 1) / bs, cc = code_cols(f, R);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *c = codes + r * cc;
        for (int64_t j = 0; j < R; j++) {
            float v = decode_at(c, j, f) * scale[r * nb + j / bs];
            out[r * R + j] = f->sqrt_ ? v * v : v;
        }
    }
}

/* hyper: b1, 1-b1, b2, 1-b2, bc1, bc2, eps, lr, wd (float32).
 * p == NULL: out = u (the Adam direction); else out = p + (-lr) * (u + wd * p).
 * out may alias p; the *_out code/scale arrays may alias the inputs.
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
        float *mb = (float *)malloc(sizeof(float) * T);
        float *vb = (float *)malloc(sizeof(float) * T);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < rows * tiles; t++) {
            int64_t r = t / tiles, j0 = (t % tiles) * T;
            int64_t len = R - j0 < T ? R - j0 : T;
            const uint8_t *mcr = mc + r * ccm, *vcr = vc + r * ccv;
            const float *msr = ms + r * nbm, *vsr = vs + r * nbv;
            int64_t off = r * R + j0;
            for (int64_t i = 0; i < len; i++) {
                int64_t j = j0 + i;
                float m = decode_at(mcr, j, fm) * msr[j / bs_m];
                float v = decode_at(vcr, j, fv) * vsr[j / bs_v];
                if (fm->sqrt_) m = m * m;
                if (fv->sqrt_) v = v * v;
                float gi = g[off + i];
                m = b1 * m + omb1 * gi;
                v = b2 * v + omb2 * (gi * gi);
                mb[i] = m;
                vb[i] = v;
                float u = (m / bc1) / (sqrtf(v / bc2) + eps);
                if (p) {
                    float pi = p[off + i];
                    out[off + i] = pi + nlr * (u + wd * pi);
                } else {
                    out[off + i] = u;
                }
            }
            if (m_out) memcpy(m_out + off, mb, sizeof(float) * len);
            if (v_out) memcpy(v_out + off, vb, sizeof(float) * len);
            quantize_segment(mb, len, bs_m, fm, mc_out + r * ccm + (fm->bits == 4 ? j0 / 2 : j0), ms_out + r * nbm + j0 / bs_m);
            quantize_segment(vb, len, bs_v, fv, vc_out + r * ccv + (fv->bits == 4 ? j0 / 2 : j0), vs_out + r * nbv + j0 / bs_v);
        }
        free(mb);
        free(vb);
    }
}
