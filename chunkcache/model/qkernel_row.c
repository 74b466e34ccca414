/* A bfloat16 decode row's work between its products: the RMSNorm, and one sequence's RoPE, KV
 * write and attention; built into the same library as qkernel.c by `model/qkernel.py`.
 *
 * In eager PyTorch a SmolLM2 decode step runs ~55 small operators a layer around its 4 products,
 * each ~5-40 us in the engine (its dispatch, an output allocated, the weights' stream evicting
 * what it touches): a norm alone 13 us in a loop, ~40 in the engine. One call here does each part.
 *
 * Bits: the RoPE is torch's `rope._rotated` in bfloat16 exactly (every product of two bfloat16
 * values is exact in float32, so each of its operators rounds once, here too); the norm and the
 * attention round where torch does (the normalised x to bfloat16 before the weight; softmax's
 * probabilities to bfloat16 before they weigh V, as torch's CPU flash attention does for bfloat16)
 * but sum in another order: their float32 results differ in the last bits, so a bfloat16 output
 * differs by one unit in the last place now and then (tests/test_qkernel_row.py measures how often).
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
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* 8 bfloat16 at p as float32. */
static inline __m256 load8_bf16(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* y = w * bf16(x / sqrt(mean(x^2) + eps)) per row of x [rows][k], transformers' LlamaRMSNorm in
 * bfloat16 (the squares of bfloat16 values are exact; their sum is taken in double). */
void row_rms_norm_bf16(const uint16_t *x, int rows, int k, const uint16_t *w, float eps, uint16_t *y) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (size_t)r * k;
        uint16_t *yr = y + (size_t)r * k;
        double s[4] = {0, 0, 0, 0};
        int i = 0;
        for (; i + 4 <= k; i += 4)
            for (int j = 0; j < 4; j++) {
                float v = bf16_to_float(xr[i + j]);
                s[j] += (double)(v * v);
            }
        for (; i < k; i++) {
            float v = bf16_to_float(xr[i]);
            s[0] += (double)(v * v);
        }
        const float inv = 1.0f / sqrtf((float)(s[0] + s[1] + s[2] + s[3]) / (float)k + eps);
        for (i = 0; i < k; i++) yr[i] = bf16_bits(bf16_to_float(w[i]) * round_bf16(bf16_to_float(xr[i]) * inv));
    }
}

/* One head of x (d values) rotated as `rope._rotated`: bf16(bf16(x cos) -/+ x' sin). */
static void rotate(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, int d, float *out) {
    const int half = d / 2;
    for (int i = 0; i < d; i++) {
        float a = round_bf16(bf16_to_float(x[i]) * bf16_to_float(cos[i]));
        float other = i < half ? -bf16_to_float(x[i + half]) : bf16_to_float(x[i - half]);
        out[i] = round_bf16(a + other * bf16_to_float(sin[i]));
    }
}

/* e^x of 8 floats: 2^n e^r with n = round(x / ln 2), r in [-ln 2 / 2, ln 2 / 2] (ln 2 in two
 * parts) and e^r by its degree-6 Taylor polynomial, within 2 units in the last place of expf;
 * 2^n applied in two halves, so that it overflows to infinity past x = 88.72 and goes to
 * denormals and 0 below -87.3 as expf does (torch's silu of a bfloat16 gate below -88.72 is -0). */
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

/* 8 floats rounded to bfloat16 (nearest even), as floats. */
static inline __m256 round8_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 8 bfloat16 values (as floats) times 8 more, rounded: torch's bfloat16 product. */
static inline __m256 mul8_bf16(__m256 a, __m256 b) { return round8_bf16(_mm256_mul_ps(a, b)); }

void row_epilogue_bf16(const float *yf, int rows, int n, const uint16_t *residual, int gated, uint16_t *y) {
    const int out = gated ? n / 2 : n;
    for (int r = 0; r < rows; r++) {
        const float *row = yf + (size_t)r * n;
        uint16_t *o = y + (size_t)r * out;
        const uint16_t *res = residual ? residual + (size_t)r * out : NULL;
        int i = 0;
        for (; i + 8 <= out; i += 8) {
            __m256 v = round8_bf16(_mm256_loadu_ps(row + i));
            if (gated) { /* torch's silu in bfloat16: x / (1 + e^-x) in float32, rounded */
                __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
                v = mul8_bf16(round8_bf16(_mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e))),
                              round8_bf16(_mm256_loadu_ps(row + out + i)));
            } else if (res) {
                v = _mm256_add_ps(v, load8_bf16(res + i));
            }
            _mm_storeu_si128((__m128i *)(o + i), to_bf16(v));
        }
        for (; i < out; i++) {
            float v = round_bf16(row[i]);
            if (gated)
                v = round_bf16(round_bf16(v / (1.0f + expf(-v))) * round_bf16(row[out + i]));
            else if (res)
                v = v + bf16_to_float(res[i]);
            o[i] = bf16_bits(v);
        }
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
static float scores(const float *q, int d, int hk, int g, const uint16_t *k_cache, const int64_t *slots, int length,
                    float scale, float *s) {
    float max = -INFINITY;
    int j = 0;
    for (; j + 8 <= length; j += 8) {
        __m256 dot[8];
        for (int t = 0; t < 8; t++) {
            const uint16_t *kr = k_cache + ((size_t)slots[j + t] * hk + g) * d;
            dot[t] = _mm256_setzero_ps();
            for (int i = 0; i < d; i += 8) dot[t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8_bf16(kr + i), dot[t]);
        }
        _mm256_storeu_ps(s + j, _mm256_mul_ps(sums8(dot), _mm256_set1_ps(scale)));
    }
    for (; j < length; j++) {
        const uint16_t *kr = k_cache + ((size_t)slots[j] * hk + g) * d;
        __m256 dot = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) dot = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8_bf16(kr + i), dot);
        s[j] = hsum(dot) * scale;
    }
    for (j = 0; j < length; j++) max = s[j] > max ? s[j] : max;
    return max;
}

/* sum_j p[j] v_j over the KV list's values of KV head g into o [d] (bfloat16), times r: 64 of the
 * d outputs at a time in registers. */
static void weigh_values(const float *p, int d, int hk, int g, const uint16_t *v_cache, const int64_t *slots,
                         int length, float r, uint16_t *o) {
    for (int i0 = 0; i0 < d; i0 += 64) {
        const int n = d - i0 < 64 ? (d - i0) / 8 : 8;
        __m256 acc[8];
        for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
        for (int j = 0; j < length; j++) {
            const uint16_t *vr = v_cache + ((size_t)slots[j] * hk + g) * d + i0;
            const __m256 w = _mm256_set1_ps(p[j]);
            if (n == 8) {
                for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(w, load8_bf16(vr + 8 * u), acc[u]);
            } else {
                for (int u = 0; u < n; u++) acc[u] = _mm256_fmadd_ps(w, load8_bf16(vr + 8 * u), acc[u]);
            }
        }
        for (int u = 0; u < n; u++)
            _mm_storeu_si128((__m128i *)(o + i0 + 8 * u), to_bf16(_mm256_mul_ps(acc[u], _mm256_set1_ps(r))));
    }
}

/* The attention of query head q (d floats, rotated) over the KV list `slots` [length] of KV head
 * g in caches [slots][hk][d]: o [d] in bfloat16; p [length] scratch. */
static void attend_head(const float *q, int d, int hk, int g, const uint16_t *k_cache, const uint16_t *v_cache,
                        const int64_t *slots, int length, float scale, float *p, uint16_t *o) {
    const float max = scores(q, d, hk, g, k_cache, slots, length, scale, p);
    __m256 sum8 = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= length; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(max)));
        sum8 = _mm256_add_ps(sum8, e);
        _mm256_storeu_ps(p + j, round8_bf16(e));
    }
    float sum = hsum(sum8);
    for (; j < length; j++) {
        float e = expf(p[j] - max);
        sum += e;
        p[j] = round_bf16(e);
    }
    weigh_values(p, d, hk, g, v_cache, slots, length, 1.0f / sum, o);
}

/* One sequence's decode token: its merged projection qkv [(hq + 2 hk) d] (q, k, v heads) in
 * bfloat16, RoPE's cos and sin [d] of its position; K (rotated) and V go to the caches' slot
 * slots[length - 1], the last of its KV list `slots` [length]; o [hq d] its attention over that
 * list (query head h reads KV head h / (hq / hk)). d a multiple of 8. */
void row_attend_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, int hq, int hk, int d,
                     uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, int length, float scale,
                     uint16_t *o) {
    const int group = hq / hk;
    float *q = malloc(sizeof(float) * ((size_t)hq * d + (size_t)length + d));
    float *p = q + (size_t)hq * d, *k = p + length;
    const size_t at = (size_t)slots[length - 1] * hk * d;
    for (int h = 0; h < hq; h++) rotate(qkv + (size_t)h * d, cos, sin, d, q + (size_t)h * d);
    for (int h = 0; h < hk; h++) {
        rotate(qkv + (size_t)(hq + h) * d, cos, sin, d, k);
        for (int i = 0; i < d; i++) k_cache[at + (size_t)h * d + i] = bf16_bits(k[i]);
    }
    memcpy(v_cache + at, qkv + (size_t)(hq + hk) * d, sizeof(uint16_t) * hk * d);
    for (int h = 0; h < hq; h++)
        attend_head(q + (size_t)h * d, d, hk, h / group, k_cache, v_cache, slots, length, scale, p, o + (size_t)h * d);
    free(q);
}
