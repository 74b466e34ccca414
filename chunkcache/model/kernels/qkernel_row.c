/* A decode row's work between its products, in bfloat16 or float32 (`bf16`): the RMSNorm, one
 * sequence's RoPE, KV write and attention, and a product's residual add or SwiGLU; built into the
 * same library as qkernel.c by `model/kernels/build.py`.
 *
 * In eager PyTorch a SmolLM2 decode step runs ~55 small operators a layer around its 4 products,
 * each ~5-40 us in the engine (its dispatch, an output allocated, the weights' stream evicting
 * what it touches): a norm alone 13 us in a loop, ~40 in the engine. One call here does each part.
 *
 * Bits: the RoPE and the residual add are torch's (in bfloat16 every product of two values is
 * exact in float32, so each operator rounds once, here too; in float32 the RoPE's multiply-add is
 * fused, as torch's `addcmul_`); the norm, SwiGLU and the
 * attention round where torch does (in bfloat16: the normalised x before the weight; softmax's
 * probabilities before they weigh V, as torch's CPU flash attention does) but sum or exponentiate
 * in another order: a bfloat16 output one unit off now and then, float32 ones in the last bits
 * (tests/test_qkernel_row.py measures both).
 */
#include <math.h>

#include "qkernel.h"

/* f rounded to bfloat16, to nearest even (finite values), as a float. */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    f = round_bf16(f);
    memcpy(&u, &f, sizeof u);
    return (uint16_t)(u >> 16);
}

/* 8 bfloat16 at p as float32. */
static inline __m256 load8_bf16(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* Element i of a row of bfloat16 (raw bits) or float32 values; 8 from i; f rounded to the type;
 * element i set. Inlined with `bf16` a constant (the `_t` functions below), so no branch is left. */
static inline float get(const void *p, size_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline __m256 get8(const void *p, size_t i, int bf16) {
    return bf16 ? load8_bf16((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}
static inline float rounded(float f, int bf16) { return bf16 ? round_bf16(f) : f; }
static inline void set(void *p, size_t i, float f, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = bf16_bits(f);
    else
        ((float *)p)[i] = f;
}

static inline __m256 rounded8(__m256 v, int bf16) { return bf16 ? round8_bf16(v) : v; }

/* e^x of 8 floats: 2^n e^r with n = round(x / ln 2), r in [-ln 2 / 2, ln 2 / 2] (ln 2 in two
 * parts) and e^r by its degree-6 Taylor polynomial, within 2 units in the last place of expf;
 * 2^n applied in two halves, so that it overflows to infinity past x = 88.72 and goes to
 * denormals and 0 below -87.3 as expf does (torch's silu of a gate below -88.72 is -0). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 e = _mm256_set1_ps(1.0f / 720);
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 120));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 24));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 6));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(0.5f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(e, a), b);
}

/* y = w * round(x / sqrt(mean(x^2) + eps)) per row of x [rows][k], transformers' LlamaRMSNorm
 * (the sum of squares in double: exact for bfloat16 x). */
static inline __attribute__((always_inline)) void rms_norm_t(const void *x, int rows, int k, const void *w,
                                                             float eps, void *y, const int bf16) {
    for (int r = 0; r < rows; r++) {
        const size_t row = (size_t)r * k;
        double s[4] = {0, 0, 0, 0};
        int i = 0;
        for (; i + 4 <= k; i += 4)
            for (int j = 0; j < 4; j++) {
                float v = get(x, row + i + j, bf16);
                s[j] += (double)v * v;
            }
        for (; i < k; i++) {
            float v = get(x, row + i, bf16);
            s[0] += (double)v * v;
        }
        const float inv = 1.0f / sqrtf((float)(s[0] + s[1] + s[2] + s[3]) / (float)k + eps);
        for (i = 0; i < k; i++) set(y, row + i, get(w, i, bf16) * rounded(get(x, row + i, bf16) * inv, bf16), bf16);
    }
}

void row_rms_norm(const void *x, int rows, int k, const void *w, float eps, void *y, int bf16) {
    if (bf16)
        rms_norm_t(x, rows, k, w, eps, y, 1);
    else
        rms_norm_t(x, rows, k, w, eps, y, 0);
}

/* A product's float32 y [rows][n] as a Linear's output in the model's type: rounded, then
 * silu(gate) * up of its halves where `gated` ([rows][n / 2] out; torch's silu: x / (1 + e^-x)
 * in float32, rounded), or plus `residual` where given. */
static inline __attribute__((always_inline)) void epilogue_t(const float *yf, int rows, int n, const void *residual,
                                                             int gated, void *y, const int bf16) {
    const int out = gated ? n / 2 : n;
    for (int r = 0; r < rows; r++) {
        const float *row = yf + (size_t)r * n;
        const size_t at = (size_t)r * out;
        int i = 0;
        for (; i + 8 <= out; i += 8) {
            __m256 v = rounded8(_mm256_loadu_ps(row + i), bf16);
            if (gated) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
                __m256 silu = rounded8(_mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), bf16);
                v = _mm256_mul_ps(silu, rounded8(_mm256_loadu_ps(row + out + i), bf16));
            } else if (residual) {
                v = _mm256_add_ps(v, get8(residual, at + i, bf16));
            }
            store8(y, bf16, at + i, v);
        }
        for (; i < out; i++) {
            float v = rounded(row[i], bf16);
            if (gated)
                v = rounded(v / (1.0f + expf(-v)), bf16) * rounded(row[out + i], bf16);
            else if (residual)
                v = v + get(residual, at + i, bf16);
            set(y, at + i, v, bf16);
        }
    }
}

void row_epilogue(const float *yf, int rows, int n, const void *residual, int gated, void *y, int bf16) {
    if (bf16)
        epilogue_t(yf, rows, n, residual, gated, y, 1);
    else
        epilogue_t(yf, rows, n, residual, gated, y, 0);
}

/* One head of x (d values) rotated as `rope._rotated`: round(fma(-/+x', sin, round(x cos))), as
 * torch's product and its `addcmul_` (a fused multiply-add in float32; in bfloat16 the product of
 * two values is exact, so the same). */
static void rotate(const void *x, size_t at, const void *cos, const void *sin, int d, float *out, int bf16) {
    const int half = d / 2;
    for (int i = 0; i < d; i++) {
        float a = rounded(get(x, at + i, bf16) * get(cos, i, bf16), bf16);
        float other = i < half ? -get(x, at + i + half, bf16) : get(x, at + i - half, bf16);
        out[i] = rounded(fmaf(other, get(sin, i, bf16), a), bf16);
    }
}

/* 8 vectors' sums as one vector (lane t: the sum of v[t]'s lanes). */
static inline __m256 sums8(const __m256 *v) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* Query head q's scores (d floats) against the KV list's keys of KV head g, times `scale`, into
 * s [length]; their maximum returned. Eight keys at a time, their dot products summed across lanes
 * together. */
static inline __attribute__((always_inline)) float scores_t(const float *q, int d, int hk, int g, const void *k_cache,
                                                            const int64_t *slots, int length, float scale, float *s,
                                                            const int bf16) {
    float max = -INFINITY;
    int j = 0;
    for (; j + 8 <= length; j += 8) {
        __m256 dot[8];
        for (int t = 0; t < 8; t++) {
            const size_t kr = ((size_t)slots[j + t] * hk + g) * d;
            dot[t] = _mm256_setzero_ps();
            for (int i = 0; i < d; i += 8)
                dot[t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), get8(k_cache, kr + i, bf16), dot[t]);
        }
        _mm256_storeu_ps(s + j, _mm256_mul_ps(sums8(dot), _mm256_set1_ps(scale)));
    }
    for (; j < length; j++) {
        const size_t kr = ((size_t)slots[j] * hk + g) * d;
        __m256 dot = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) dot = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), get8(k_cache, kr + i, bf16), dot);
        s[j] = hsum(dot) * scale;
    }
    for (j = 0; j < length; j++) max = s[j] > max ? s[j] : max;
    return max;
}

/* sum_j p[j] v_j over the KV list's values of KV head g, times r, into o [d] from element `at`:
 * 64 of the d outputs at a time in registers. */
static inline __attribute__((always_inline)) void weigh_values_t(const float *p, int d, int hk, int g,
                                                                 const void *v_cache, const int64_t *slots, int length,
                                                                 float r, void *o, size_t at, const int bf16) {
    for (int i0 = 0; i0 < d; i0 += 64) {
        const int n = d - i0 < 64 ? (d - i0) / 8 : 8;
        __m256 acc[8];
        for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
        for (int j = 0; j < length; j++) {
            const size_t vr = ((size_t)slots[j] * hk + g) * d + i0;
            const __m256 w = _mm256_set1_ps(p[j]);
            if (n == 8) {
                for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(w, get8(v_cache, vr + 8 * u, bf16), acc[u]);
            } else {
                for (int u = 0; u < n; u++) acc[u] = _mm256_fmadd_ps(w, get8(v_cache, vr + 8 * u, bf16), acc[u]);
            }
        }
        for (int u = 0; u < n; u++) store8(o, bf16, at + i0 + 8 * u, _mm256_mul_ps(acc[u], _mm256_set1_ps(r)));
    }
}

/* The attention of query head q (d floats, rotated) over the KV list `slots` [length] of KV head
 * g in caches [slots][hk][d]: into o from element `at`; p [length] scratch. In bfloat16 the
 * probabilities weigh V rounded to bfloat16 (their sum is of the unrounded ones), as torch's. */
static inline __attribute__((always_inline)) void attend_head_t(const float *q, int d, int hk, int g,
                                                                const void *k_cache, const void *v_cache,
                                                                const int64_t *slots, int length, float scale,
                                                                float *p, void *o, size_t at, const int bf16) {
    const float max = scores_t(q, d, hk, g, k_cache, slots, length, scale, p, bf16);
    __m256 sum8 = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= length; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(max)));
        sum8 = _mm256_add_ps(sum8, e);
        _mm256_storeu_ps(p + j, rounded8(e, bf16));
    }
    float sum = hsum(sum8);
    for (; j < length; j++) {
        float e = expf(p[j] - max);
        sum += e;
        p[j] = rounded(e, bf16);
    }
    weigh_values_t(p, d, hk, g, v_cache, slots, length, 1.0f / sum, o, at, bf16);
}

static void attend_head(const float *q, int d, int hk, int g, const void *k_cache, const void *v_cache,
                        const int64_t *slots, int length, float scale, float *p, void *o, size_t at, int bf16) {
    if (bf16)
        attend_head_t(q, d, hk, g, k_cache, v_cache, slots, length, scale, p, o, at, 1);
    else
        attend_head_t(q, d, hk, g, k_cache, v_cache, slots, length, scale, p, o, at, 0);
}

/* One sequence's decode token: its merged projection qkv [(hq + 2 hk) d] (q, k, v heads), RoPE's
 * cos and sin [d] of its position; K (rotated) and V go to the caches' slot slots[length - 1],
 * the last of its KV list `slots` [length]; o [hq d] its attention over that list (query head h
 * reads KV head h / (hq / hk)). Every tensor in the model's type; d a multiple of 8. */
void row_attend(const void *qkv, const void *cos, const void *sin, int hq, int hk, int d, void *k_cache,
                void *v_cache, const int64_t *slots, int length, float scale, void *o, int bf16) {
    const int group = hq / hk;
    const size_t bytes = bf16 ? sizeof(uint16_t) : sizeof(float);
    float *q = malloc(sizeof(float) * ((size_t)hq * d + (size_t)length + d));
    float *p = q + (size_t)hq * d, *k = p + length;
    const size_t at = (size_t)slots[length - 1] * hk * d;
    for (int h = 0; h < hq; h++) rotate(qkv, (size_t)h * d, cos, sin, d, q + (size_t)h * d, bf16);
    for (int h = 0; h < hk; h++) {
        rotate(qkv, (size_t)(hq + h) * d, cos, sin, d, k, bf16);
        for (int i = 0; i < d; i++) set(k_cache, at + (size_t)h * d + i, k[i], bf16);
    }
    memcpy((char *)v_cache + at * bytes, (const char *)qkv + (size_t)(hq + hk) * d * bytes, bytes * hk * d);
    for (int h = 0; h < hq; h++)
        attend_head(q + (size_t)h * d, d, hk, h / group, k_cache, v_cache, slots, length, scale, p, o, (size_t)h * d,
                    bf16);
    free(q);
}
