/* Q8_0 weights served in the file's own blocks (`model/kernels/quant_blocks.py`), AVX2 + FMA; built into
 * the same library as qkernel.c by `model/kernels/build.py`.
 *
 * A weight row is k / 32 blocks of 34 bytes, as the GGUF stores them: a float16 d, then 32 int8
 * codes q; w = d q, the float32 product gguf's `Q8_0.dequantize_blocks` computes, and an exact one
 * (d's 11-bit mantissa times an 8-bit code fits float32's 24 bits), so every path here starts from
 * the file's weights bit for bit. Per channel int8 (`quant.Int8Part`, one scale a row) cannot hold
 * them: re-quantizing added ~4e-3 of the weight.
 *
 * - `q8_0_product`, float32 x: 1 row, per block sum x q in float32 (4 FMAs), times d; 2-8 rows,
 *   each block's w = d q once (exact) and R FMAs over it.
 * - the same with `quantize_x` (any rows, each as alone): x rounded to int8 per block of 32 (`quantize_blocks`, as
 *   the other kernels round it), |q| times x with q's sign by `maddubs` (llama.cpp's
 *   `ggml_vec_dot_q8_0_q8_0`), the integer sum exact, to float once per block (dx d).
 * - `q8_0_dequantize`: rows to float32 (prefill's blocks for a GEMM), gguf's values bit for bit.
 * Output rows are split over `threads` (OpenMP), each row one thread's sum: the same numbers at
 * any thread count.
 */
#include <stdlib.h>
#include <string.h>

#include "qkernel.h"

#define BLOCK_BYTES 34 /* d (float16), then 32 int8 codes */

/* One weight row against R rows of x (R == 1: d factored out of each block's float32 sum). */
static inline __attribute__((always_inline)) void q8_0_row(const int R, const float *x, int k, int n, int i,
                                                            const uint8_t *blocks, float *y) {
    const uint8_t *row = blocks + (size_t)i * (k / GROUP) * BLOCK_BYTES;
    if (R == 1) {
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int g = 0; g < k / GROUP; g++) {
            _mm_prefetch((const char *)row + (size_t)g * BLOCK_BYTES + PREFETCH, _MM_HINT_T0);
            const int8_t *c = (const int8_t *)(row + (size_t)g * BLOCK_BYTES + 2);
            const float *xg = x + g * GROUP;
            __m256 s = _mm256_mul_ps(i8_to_ps(c), _mm256_loadu_ps(xg));
            for (int j = 1; j < 4; j++) s = _mm256_fmadd_ps(i8_to_ps(c + 8 * j), _mm256_loadu_ps(xg + 8 * j), s);
            acc[g & 1] = _mm256_fmadd_ps(s, _mm256_set1_ps(fp16_to_float(row + (size_t)g * BLOCK_BYTES)), acc[g & 1]);
        }
        y[i] = hsum(_mm256_add_ps(acc[0], acc[1]));
        return;
    }
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < k / GROUP; g++) {
        const uint8_t *blk = row + (size_t)g * BLOCK_BYTES;
        __m256 d = _mm256_set1_ps(fp16_to_float(blk));
        for (int j = 0; j < 4; j++) {
            __m256 w = _mm256_mul_ps(i8_to_ps((const int8_t *)(blk + 2) + 8 * j), d);
            for (int r = 0; r < R; r++)
                acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (size_t)r * k + g * GROUP + 8 * j), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[(size_t)r * n + i] = hsum(acc[r]);
}

/* One weight row against int8 x: as `int8_row_q8` in qkernel.c, with the block's d beside dx. */
static inline void q8_0_row_q8(const int8_t *qx, const float *dx, int k, int i, const void *blocks, float *y) {
    const uint8_t *row = (const uint8_t *)blocks + (size_t)i * (k / GROUP) * BLOCK_BYTES;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int g = 0; g < k / GROUP; g++) {
        const uint8_t *blk = row + (size_t)g * BLOCK_BYTES;
        _mm_prefetch((const char *)blk + PREFETCH, _MM_HINT_T0);
        __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
        __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + g * GROUP));
        __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
        __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
        acc[g & 1] = _mm256_fmadd_ps(sum, _mm256_set1_ps(dx[g] * fp16_to_float(blk)), acc[g & 1]);
    }
    y[i] = hsum(_mm256_add_ps(acc[0], acc[1]));
}

void q8_0_product(const float *x, int rows, int k, int n, const uint8_t *blocks, float *y, int threads,
                  int quantize_x) {
    if (quantize_x) {
        q8_rows_each(x, rows, k, n, q8_0_row_q8, blocks, y, threads);
        return;
    }
#define ROW(R) q8_0_row(R, x, k, n, i, blocks, y)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < n; i++) {
        switch (rows) { ROWS_CASES_8(ROW) }
    }
#undef ROW
}

/* Rows to [rows][k], float32 or (`bf16`) bfloat16: w = d q per block, gguf's values bit for bit
 * (bfloat16: those rounded to nearest even). */
static inline void q8_0_dequantize_row(const uint8_t *row, int k, void *out, int bf16) {
    for (int g = 0; g < k / GROUP; g++) {
        const uint8_t *blk = row + (size_t)g * BLOCK_BYTES;
        __m256 d = _mm256_set1_ps(fp16_to_float(blk));
        for (int j = 0; j < 4; j++) store8(out, bf16, g * GROUP + 8 * j, _mm256_mul_ps(i8_to_ps((const int8_t *)(blk + 2) + 8 * j), d));
    }
}

void q8_0_dequantize(const uint8_t *blocks, int k, int rows, void *out, int threads, int bf16) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < rows; i++)
        q8_0_dequantize_row(blocks + (size_t)i * (k / GROUP) * BLOCK_BYTES, k, (char *)out + (size_t)i * k * (bf16 ? 2 : 4), bf16);
}

void q8_0_row_bf16(const uint8_t *row, int k, uint16_t *out) { q8_0_dequantize_row(row, k, out, 1); }
