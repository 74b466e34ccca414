/* What the kernel's C files share (built into one library by `model/qkernel.py`). */
#ifndef CHUNKCACHE_QKERNEL_H
#define CHUNKCACHE_QKERNEL_H
#include <immintrin.h>
#include <stdint.h>

#define GROUP 32   /* inputs per int4 group and per block of int8 x */
#define MAX_ROWS 8 /* the most rows of x one call takes */

#define ROWS_CASE(R, call) \
    case R:                \
        call;              \
        break;

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 int8 codes as float32. */
static inline __m256 i8_to_ps(const int8_t *c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
}

/* x [k] (k a multiple of 32) as int8 per block of 32: qx = round(x / dx), dx = max|x| / 127. */
void quantize_blocks(const float *x, int k, int8_t *qx, float *dx);

/* `rows` rows of x [rows][k] so, each as `quantize_blocks` rounds it alone: qx [rows][k], dx
 * [rows][k / 32]. */
void quantize_rows(const float *x, int rows, int k, int8_t *qx, float *dx);

#endif
