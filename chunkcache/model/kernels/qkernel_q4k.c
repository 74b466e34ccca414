/* Q4_K weights served in the file's own blocks (`model/kernels/quant_blocks.py`), AVX2 + FMA; built into the
 * same library as qkernel.c by `model/kernels/build.py`.
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
    *dsc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_set1_ps(fp16_to_float(blk)));
    *dm = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))), _mm256_set1_ps(fp16_to_float(blk + 2)));
}

/* The same as arrays: the 8 d sc in `fs`, the 8 dmin m in `fm` (broadcast per sub-block). */
static inline void block_floats(const uint8_t *blk, float fs[8], float fm[8]) {
    __m256 dsc, dm;
    block_factors(blk, &dsc, &dm);
    _mm256_storeu_ps(fs, dsc), _mm256_storeu_ps(fm, dm);
}

#define Q4K_NAME(f) q4k_##f
#define Q4K_TARGET
#define Q4K_DOT(q, xq) _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), _mm256_set1_epi16(1))
#include "qkernel_q4k_q8.h"
#undef Q4K_NAME
#undef Q4K_TARGET
#undef Q4K_DOT
#define Q4K_NAME(f) q4k_vnni_##f
#define Q4K_TARGET __attribute__((target("avxvnni")))
#define Q4K_DOT(q, xq) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, xq)
#include "qkernel_q4k_q8.h"

/* 8 codes (bytes c .. c + 7 of a chunk, low or high nibbles) as float32. */
static inline __m256 codes8(const uint8_t *c, int high) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    return _mm256_cvtepi32_ps(_mm256_and_si256(high ? _mm256_srli_epi32(q, 4) : q, _mm256_set1_epi32(0x0F)));
}

/* A block's weights 32 s + 8 u .. + 8 (sub-block s, u of its 4 eighths) in float32: (d sc) q - dmin
 * m by one FMA, gguf's values (`fs`, `fm`: the block's 8 d sc and dmin m, `block_factors`). */
static inline __m256 weights8(const uint8_t *blk, const float *fs, const float *fm, int s, int u) {
    return _mm256_fmadd_ps(codes8(blk + 16 + 32 * (s / 2) + 8 * u, s & 1), _mm256_set1_ps(fs[s]), _mm256_set1_ps(-fm[s]));
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
        float fs[8], fm[8];
        block_floats(blk, fs, fm);
        for (int s = 0; s < 8; s++) {
            for (int u = 0; u < 4; u++) {
                const __m256 w = weights8(blk, fs, fm, s, u);
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
    if (quantize_x) {
        if (__builtin_cpu_supports("avxvnni"))
            q4k_vnni_rows_q8(x, rows, k, n, blocks, y, threads);
        else
            q4k_rows_q8(x, rows, k, n, blocks, y, threads);
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
 * gguf's values, in order; AVX2 (the bfloat16 rounding in integers). */
void q4k_dequantize_avx2(const uint8_t *blocks, int k, int rows, void *out, int threads, int bf16) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < rows; i++) {
        for (int b = 0; b < k / QK; b++) {
            const uint8_t *blk = blocks + ((size_t)i * (k / QK) + b) * BLOCK_BYTES;
            float fs[8], fm[8];
            block_floats(blk, fs, fm);
            for (int s = 0; s < 8; s++)
                for (int u = 0; u < 4; u++)
                    store8(out, bf16, (size_t)i * k + (size_t)b * QK + 32 * s + 8 * u, weights8(blk, fs, fm, s, u));
        }
    }
}

#if HAS_AVX512_BF16
/* `block_floats` not inlined: the factors then reach `q4k_row_bf16`'s FMAs as broadcasts from
 * memory (a load), where inlined the compiler shuffled them out of registers, on the port
 * `vpermw` needs: 0.076 -> 0.053 ns a weight. */
static __attribute__((noinline)) void block_floats_in_memory(const uint8_t *blk, float fs[8], float fm[8]) {
    block_floats(blk, fs, fm);
}

/* The same rows as bfloat16 by AVX512-BF16 (`bf16_dequantize`'s CPUs: a native bfloat16 GEMM
 * takes them). A sub-block's 32 weights take only 16 values, (d sc) q - dmin m for q = 0..15: a
 * chunk's two sub-blocks compute theirs by two FMAs, round them to nearest even by one
 * `vcvtne2ps2bf16` into one 32-entry table, and look their 64 codes up in it (`vpermw`): the AVX2
 * path's bits (w is never denormal or NaN; fmsub rounds once, as fmadd of -dmin m). One row:
 * `q4k_row_bf16` (`amx_blocks_product` runs it between its tiles' products). A prefill step
 * dequantizes every weight: 0.18 (AVX2) -> 0.10 (a conversion per weight) -> 0.053 ns a weight
 * into L2 (the 1.5B's gate, 32 rows a call, one thread). */
AVX512_BF16 void q4k_row_bf16(const uint8_t *row, int k, uint16_t *out) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i low = _mm512_set1_epi16(0x0F), second = _mm512_set1_epi16(16);
    for (int b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + (size_t)b * BLOCK_BYTES;
        float fs[8], fm[8];
        block_floats_in_memory(blk, fs, fm);
        uint16_t *o = out + (size_t)b * QK;
        for (int j = 0; j < 4; j++) { /* chunk j: sub-blocks 2j (low nibbles) and 2j + 1 (high) */
            const __m512 w0 = _mm512_fmsub_ps(q, _mm512_set1_ps(fs[2 * j]), _mm512_set1_ps(fm[2 * j]));
            const __m512 w1 = _mm512_fmsub_ps(q, _mm512_set1_ps(fs[2 * j + 1]), _mm512_set1_ps(fm[2 * j + 1]));
            const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(w1, w0); /* entries 0-15: 2j, 16-31: 2j + 1 */
            const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * j)));
            _mm512_storeu_si512(o + 64 * j, _mm512_permutexvar_epi16(_mm512_and_si512(c, low), table));
            _mm512_storeu_si512(o + 64 * j + 32,
                                _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(c, 4), second), table));
        }
    }
}

AVX512_BF16 void q4k_dequantize_bf16(const uint8_t *blocks, int k, int rows, uint16_t *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < rows; i++) q4k_row_bf16(blocks + (size_t)i * (k / QK) * BLOCK_BYTES, k, out + (size_t)i * k);
}

#endif

/* `rows` weight rows as float32 or (`bf16`) bfloat16, gguf's values (bfloat16: rounded to nearest
 * even), the AVX512-BF16 path where the CPU has it. */
void q4k_dequantize(const uint8_t *blocks, int k, int rows, void *out, int threads, int bf16) {
#if HAS_AVX512_BF16
    if (bf16 && bf16_dequantize()) {
        q4k_dequantize_bf16(blocks, k, rows, out, threads);
        return;
    }
#endif
    q4k_dequantize_avx2(blocks, k, rows, out, threads, bf16);
}
