/* Few-row weight-only products over the codes `model/quant.py` holds, with float32 activations
 * (AVX2 + FMA). Built and loaded by `model/qkernel.py`; see its docstring for why.
 *
 * int4: `packed` is torch's AVX2 int4 packing (`_convert_weight_to_int4pack_for_cpu`): tiles of
 * 32 output rows, one after another; within a tile, input column k is 16 bytes at k * 16, byte
 * b holding row b in its low nibble and row b + 16 in its high one. `scale` and `minimum` are
 * float32 [groups][n]: w = scale * q + minimum per group of 32 inputs (the file's own affine).
 * int8: `codes` [n][k] int8, `scales` [n] bfloat16 (raw bits): w = scale * code.
 * x is float32 [rows][k], y float32 [rows][n]; rows <= 8 (MAX_ROWS).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define GROUP 32
#define TILE 32
#define MAX_ROWS 8

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One row of x: per group, a = sum_k x_k q_k for the tile's 32 rows (8 accumulators: two
 * columns in flight, so the FMA chains do not wait on each other), then y += s * a + m * sum(x):
 * the group's minimum factored out, so each code costs one conversion and one FMA. A column's 16
 * bytes are loaded into both 128-bit lanes and spread to 32-bit lanes by in-lane byte shuffles
 * (`_mm256_shuffle_epi8`): the lane-crossing `_mm256_cvtepu8_epi32` measured ~1.5x slower here. */
static void int4_tile_1(const float *x, const float *xsum, int k, int n, int t, const uint8_t *packed,
                        const float *scale, const float *minimum, float *y) {
    const uint8_t *p = packed + (size_t)t * TILE * (k / 2);
    const __m256i low = _mm256_set1_epi8(0x0F);
    /* Bytes 0-3 of lane 0 and 4-7 of lane 1 into the low byte of each 32-bit lane (rows 0-7 of
     * the nibble half), and bytes 8-11 / 12-15 (rows 8-15); -1 zeroes a byte. */
    const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1, 4, -1, -1,
                                           -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(8));
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int g = 0; g < k / GROUP; g++) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (int c = g * GROUP; c < (g + 1) * GROUP; c += 2) {
            for (int h = 0; h < 2; h++) {
                __m256 xb = _mm256_broadcast_ss(x + c + h);
                __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + (size_t)(c + h) * 16)));
                __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                a[4 * h + 0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, first)), xb, a[4 * h + 0]);
                a[4 * h + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, second)), xb, a[4 * h + 1]);
                a[4 * h + 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, first)), xb, a[4 * h + 2]);
                a[4 * h + 3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, second)), xb, a[4 * h + 3]);
            }
        }
        const float *s = scale + (size_t)g * n + t * TILE, *m = minimum + (size_t)g * n + t * TILE;
        __m256 sx = _mm256_broadcast_ss(xsum + g);
        for (int j = 0; j < 4; j++) {
            acc[j] = _mm256_fmadd_ps(_mm256_add_ps(a[j], a[4 + j]), _mm256_loadu_ps(s + 8 * j), acc[j]);
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(m + 8 * j), sx, acc[j]);
        }
    }
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(y + t * TILE + 8 * j, acc[j]);
}

/* R rows of x: each code converted once to w = s q + m (one FMA) and used by R FMAs, 8 output
 * rows of the tile at a time (R accumulators, the group's s and m, w: at most 12 registers). */
static inline __attribute__((always_inline)) void int4_tile_r(const int R, const float *x, int k, int n, int t,
                                                               const uint8_t *packed, const float *scale,
                                                               const float *minimum, float *y) {
    const uint8_t *p = packed + (size_t)t * TILE * (k / 2);
    const __m256i low = _mm256_set1_epi32(0x0F);
    for (int sub = 0; sub < 4; sub++) {
        const uint8_t *ps = p + (sub & 1) * 8;
        const __m128i shift = _mm_cvtsi32_si128((sub >> 1) * 4);
        __m256 acc[MAX_ROWS];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int g = 0; g < k / GROUP; g++) {
            __m256 s = _mm256_loadu_ps(scale + (size_t)g * n + t * TILE + sub * 8);
            __m256 m = _mm256_loadu_ps(minimum + (size_t)g * n + t * TILE + sub * 8);
            for (int c = g * GROUP; c < (g + 1) * GROUP; c++) {
                __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ps + (size_t)c * 16)));
                q = _mm256_and_si256(_mm256_srl_epi32(q, shift), low);
                __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, m);
                for (int r = 0; r < R; r++)
                    acc[r] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + (size_t)r * k + c), acc[r]);
            }
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (size_t)r * n + t * TILE + sub * 8, acc[r]);
    }
}

#define ROWS_CASE(R, call) \
    case R:                \
        call;              \
        break;

void int4_product(const float *x, int rows, int k, int n, const uint8_t *packed, const float *scale,
                  const float *minimum, float *y, int threads) {
    float xsum[k / GROUP];
    if (rows == 1)
        for (int g = 0; g < k / GROUP; g++) {
            float s = 0;
            for (int c = 0; c < GROUP; c++) s += x[g * GROUP + c];
            xsum[g] = s;
        }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < n / TILE; t++) {
        switch (rows) {
            ROWS_CASE(1, int4_tile_1(x, xsum, k, n, t, packed, scale, minimum, y))
            ROWS_CASE(2, int4_tile_r(2, x, k, n, t, packed, scale, minimum, y))
            ROWS_CASE(3, int4_tile_r(3, x, k, n, t, packed, scale, minimum, y))
            ROWS_CASE(4, int4_tile_r(4, x, k, n, t, packed, scale, minimum, y))
            ROWS_CASE(5, int4_tile_r(5, x, k, n, t, packed, scale, minimum, y))
            ROWS_CASE(6, int4_tile_r(6, x, k, n, t, packed, scale, minimum, y))
            ROWS_CASE(7, int4_tile_r(7, x, k, n, t, packed, scale, minimum, y))
            ROWS_CASE(8, int4_tile_r(8, x, k, n, t, packed, scale, minimum, y))
        }
    }
}

static inline __m256 i8_to_ps(const int8_t *c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
}

static inline float bf16_to_float(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One weight row against R rows of x; R == 1 keeps 4 accumulators (independent FMA chains). */
static inline __attribute__((always_inline)) void int8_row(const int R, const float *x, int k, int n, int i,
                                                           const int8_t *codes, const uint16_t *scales,
                                                           float *y) {
    const int8_t *c = codes + (size_t)i * k;
    float scale = bf16_to_float(scales[i]);
    int j = 0;
    if (R == 1) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (; j + 32 <= k; j += 32) {
            a0 = _mm256_fmadd_ps(i8_to_ps(c + j), _mm256_loadu_ps(x + j), a0);
            a1 = _mm256_fmadd_ps(i8_to_ps(c + j + 8), _mm256_loadu_ps(x + j + 8), a1);
            a2 = _mm256_fmadd_ps(i8_to_ps(c + j + 16), _mm256_loadu_ps(x + j + 16), a2);
            a3 = _mm256_fmadd_ps(i8_to_ps(c + j + 24), _mm256_loadu_ps(x + j + 24), a3);
        }
        float sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for (; j < k; j++) sum += x[j] * c[j];
        y[i] = sum * scale;
        return;
    }
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (; j + 8 <= k; j += 8) {
        __m256 w = i8_to_ps(c + j);
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (size_t)r * k + j), acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float sum = hsum(acc[r]);
        for (int jj = j; jj < k; jj++) sum += x[(size_t)r * k + jj] * c[jj];
        y[(size_t)r * n + i] = sum * scale;
    }
}

void int8_product(const float *x, int rows, int k, int n, const int8_t *codes, const uint16_t *scales, float *y,
                  int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < n; i++) {
        switch (rows) {
            ROWS_CASE(1, int8_row(1, x, k, n, i, codes, scales, y))
            ROWS_CASE(2, int8_row(2, x, k, n, i, codes, scales, y))
            ROWS_CASE(3, int8_row(3, x, k, n, i, codes, scales, y))
            ROWS_CASE(4, int8_row(4, x, k, n, i, codes, scales, y))
            ROWS_CASE(5, int8_row(5, x, k, n, i, codes, scales, y))
            ROWS_CASE(6, int8_row(6, x, k, n, i, codes, scales, y))
            ROWS_CASE(7, int8_row(7, x, k, n, i, codes, scales, y))
            ROWS_CASE(8, int8_row(8, x, k, n, i, codes, scales, y))
        }
    }
}
