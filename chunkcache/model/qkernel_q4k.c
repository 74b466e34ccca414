/* Q4_K weights served in the file's own blocks (`model/quant_blocks.py`), AVX2 + FMA; built into the
 * same library as qkernel.c by `model/qkernel.py`.
 *
 * A weight row is k / 256 blocks of 144 bytes, as the GGUF stores them: float16 d, float16 dmin,
 * 12 bytes of 6-bit scales sc and minimums m for 8 sub-blocks of 32 (llama.cpp's
 * `get_scale_min_k4` packing), qs[128]: in chunk j (0..3) of 64 weights, byte l's low nibble is
 * weight 64 j + l (sub-block 2 j) and its high nibble weight 64 j + 32 + l (sub-block 2 j + 1).
 * w = (d sc) q - (dmin m): gguf's `Q4_K.dequantize_blocks` in float32, where d sc q is exact (an
 * 11-bit mantissa times a 6-bit and a 4-bit integer), so an FMA rounds w exactly as gguf's subtraction
 * does and every path here starts from the file's weights bit for bit.
 *
 * Torch's int4 packing with a bfloat16 scale and zero per 32 weights holds 5 bits a weight; these
 * blocks hold 4.5, and a batch-1 decode step reads every weight once.
 *
 * - `q4k_product` with `quantize_x` (any rows, each as alone): x rounded to int8 per block of 32
 *   (`quantize_blocks`, one block a sub-block), llama.cpp's `ggml_vec_dot_q4_K_q8_K` way: the
 *   unsigned codes against signed x by `maddubs` (pairs <= 2 * 15 * 127), the sub-block's scale by
 *   `madd_epi16` (<= 16 * 3810 * 63 < 2^24: exact in float32), to float times dx per sub-block,
 *   times d per block; the minimums' term dmin sum_s m_s sum(x_s) over the rounded x too (dx times
 *   the integer sum of qx, llama.cpp's `bsums`): w = (d sc) q - dmin m is a small difference of
 *   large terms, and rounding x in one term only measured 3x the error of rounding it in both
 *   (1.6e-2 against 5.1e-3 of the exact product, relative; random x on the 1.5B's gate).
 * - float32 x (a prompt's few rows): w in float32 (gguf's values) and one FMA per row of x.
 * - `q4k_dequantize`: rows to float32 or bfloat16 (prefill's blocks for a GEMM), gguf's values
 *   bit for bit (bfloat16: those rounded to nearest even).
 * Output rows are split over `threads` (OpenMP), each row one thread's sum: the same numbers at
 * any thread count.
 */
#include <stdlib.h>
#include <string.h>

#include "qkernel.h"

#define QK 256          /* weights per block */
#define BLOCK_BYTES 144 /* d, dmin (float16), scales[12], qs[128] */

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h); /* F16C: exact */
}

/* The block's 8 sub-block scales (bytes 0-7) and minimums (bytes 8-15), llama.cpp's unpacking of
 * the 12 bytes (`get_scale_min_k4` for all 8 at once), built in a register: through a stack array,
 * a vector load of four scalar stores stalls store forwarding. */
static inline __m128i scale_mins(const uint8_t *blk) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    uint32_t u0, u1, u2;
    memcpy(&u0, blk + 4, 4), memcpy(&u1, blk + 8, 4), memcpy(&u2, blk + 12, 4);
    const uint32_t m_high = ((u2 >> 4) & kmask2) | (((u1 >> 6) & kmask3) << 4);
    const uint32_t s_high = (u2 & kmask2) | (((u0 >> 6) & kmask3) << 4);
    return _mm_setr_epi32((int)(u0 & kmask1), (int)s_high, (int)(u1 & kmask1), (int)m_high);
}

/* The 8 d sc and dmin m of a block in float32 (gguf's products, exact). */
static inline void block_factors(const uint8_t *blk, __m256 *dsc, __m256 *dm) {
    const __m128i b = scale_mins(blk);
    *dsc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_set1_ps(half_at(blk)));
    *dm = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))), _mm256_set1_ps(half_at(blk + 2)));
}

/* Weight row i against R rows of int8 x (qx, dx per block of 32) and their sums per 32 (xsum: dx
 * sum qx); each row k apart. Per block, each row's 8 factors dx sc (one vector); per sub-block the
 * integer sum to float times its factor, into A accumulators a row (4 for 1 row: one chain of
 * dependent FMAs measured ~1.5x slower). Each row's operations are those of R == 1 in the same
 * order (its bits those of its product alone); a chunk's codes are unpacked once for all R rows. */
static inline __attribute__((always_inline)) void q4k_row_q8(const int R, const int8_t *qx, const float *dx,
                                                             const float *xsum, int k, int n, int i,
                                                             const uint8_t *blocks, float *y) {
    enum { A = 4 };
    const uint8_t *row = blocks + (size_t)i * (k / QK) * BLOCK_BYTES;
    const int groups = k / GROUP;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[MAX_ROWS], mins[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = mins[r] = _mm256_setzero_ps();
    for (int b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + (size_t)b * BLOCK_BYTES;
        for (int l = 0; l < 3; l++) _mm_prefetch((const char *)blk + PREFETCH + 64 * l, _MM_HINT_T0);
        const __m128i sm = scale_mins(blk);
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm));
        const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
        float f[MAX_ROWS][8];
        __m256 part[MAX_ROWS][A];
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(f[r], _mm256_mul_ps(sc, _mm256_loadu_ps(dx + (size_t)r * groups + (size_t)b * 8)));
            for (int a = 0; a < A; a++) part[r][a] = _mm256_setzero_ps();
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * j));
            const __m256i q[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const int s = 2 * j + h;
                for (int r = 0; r < R; r++) {
                    const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + (size_t)r * k + (size_t)b * QK + 32 * s));
                    const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q[h], xq), ones));
                    part[r][s % A] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&f[r][s]), part[r][s % A]);
                }
            }
        }
        const __m256 d = _mm256_set1_ps(half_at(blk)), dm = _mm256_mul_ps(m, _mm256_set1_ps(half_at(blk + 2)));
        for (int r = 0; r < R; r++) {
            const __m256 sum = _mm256_add_ps(_mm256_add_ps(part[r][0], part[r][1]), _mm256_add_ps(part[r][2], part[r][3]));
            acc[r] = _mm256_fmadd_ps(sum, d, acc[r]);
            mins[r] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(xsum + (size_t)r * groups + (size_t)b * 8), mins[r]);
        }
    }
    for (int r = 0; r < R; r++) y[(size_t)r * n + i] = hsum(acc[r]) - hsum(mins[r]);
}

/* 8 codes (bytes c .. c + 7 of a chunk, low or high nibbles) as float32. */
static inline __m256 codes8(const uint8_t *c, int high) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    return _mm256_cvtepi32_ps(_mm256_and_si256(high ? _mm256_srli_epi32(q, 4) : q, _mm256_set1_epi32(0x0F)));
}

/* Weight row i against R rows of float32 x: per 8 weights, w = (d sc) q - dmin m by one FMA
 * (gguf's value) and one FMA per row of x, 2 accumulators a row. */
static inline __attribute__((always_inline)) void q4k_row(const int R, const float *x, int k, int n, int i,
                                                          const uint8_t *blocks, float *y) {
    const uint8_t *row = blocks + (size_t)i * (k / QK) * BLOCK_BYTES;
    __m256 acc[MAX_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + (size_t)b * BLOCK_BYTES;
        __m256 dsc, dm;
        block_factors(blk, &dsc, &dm);
        float fs[8], fm[8];
        _mm256_storeu_ps(fs, dsc), _mm256_storeu_ps(fm, dm);
        for (int s = 0; s < 8; s++) {
            const __m256 a = _mm256_set1_ps(fs[s]), m = _mm256_set1_ps(-fm[s]);
            const uint8_t *c = blk + 16 + 32 * (s / 2);
            for (int u = 0; u < 4; u++) {
                const __m256 w = _mm256_fmadd_ps(codes8(c + 8 * u, s & 1), a, m);
                const float *xc = x + (size_t)b * QK + 32 * s + 8 * u;
                for (int r = 0; r < R; r++) acc[r][u & 1] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xc + (size_t)r * k), acc[r][u & 1]);
            }
        }
    }
    for (int r = 0; r < R; r++) y[(size_t)r * n + i] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

/* x float32 [rows][k] (k a multiple of 256, rows <= MAX_ROWS) times the weight `blocks` [n][k / 256
 * blocks]: y float32 [rows][n]. */
void q4k_product(const float *x, int rows, int k, int n, const uint8_t *blocks, float *y, int threads,
                 int quantize_x) {
    if (quantize_x) { /* each row as alone, runs of at most 4 rows sharing a chunk's codes */
        const int groups = k / GROUP;
        int8_t *qx = malloc((size_t)rows * k);
        float *dx = malloc((size_t)rows * groups * sizeof *dx), *xsum = malloc((size_t)rows * groups * sizeof *xsum);
        quantize_rows(x, rows, k, qx, dx);
        for (int g = 0; g < rows * groups; g++) { /* the rounded x's sums: see the header */
            int s = 0;
            for (int c = 0; c < GROUP; c++) s += qx[(size_t)g * GROUP + c];
            xsum[g] = dx[g] * (float)s;
        }
#define ROW(R) q4k_row_q8(R, qx + (size_t)r * k, dx + (size_t)r * groups, xsum + (size_t)r * groups, k, n, i, blocks, y + (size_t)r * n)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int i = 0; i < n; i++)
            for (int r = 0; r < rows; r += 4) {
                switch (rows - r < 4 ? rows - r : 4) { ROWS_CASES_4(ROW) }
            }
#undef ROW
        free(qx), free(dx), free(xsum);
        return;
    }
#define ROW(R) q4k_row(R, x, k, n, i, blocks, y)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < n; i++) {
        switch (rows) { ROWS_CASES_8(ROW) }
    }
#undef ROW
}

/* `rows` weight rows from `blocks` (the first of them) as [rows][k], float32 or (`bf16`) bfloat16:
 * gguf's values, in order. */
void q4k_dequantize(const uint8_t *blocks, int k, int rows, void *out, int threads, int bf16) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < rows; i++) {
        for (int b = 0; b < k / QK; b++) {
            const uint8_t *blk = blocks + ((size_t)i * (k / QK) + b) * BLOCK_BYTES;
            __m256 dsc, dm;
            block_factors(blk, &dsc, &dm);
            float fs[8], fm[8];
            _mm256_storeu_ps(fs, dsc), _mm256_storeu_ps(fm, dm);
            for (int s = 0; s < 8; s++) {
                const __m256 a = _mm256_set1_ps(fs[s]), m = _mm256_set1_ps(-fm[s]);
                const uint8_t *c = blk + 16 + 32 * (s / 2);
                for (int u = 0; u < 4; u++)
                    store8(out, bf16, (size_t)i * k + (size_t)b * QK + 32 * s + 8 * u,
                           _mm256_fmadd_ps(codes8(c + 8 * u, s & 1), a, m));
            }
        }
    }
}
