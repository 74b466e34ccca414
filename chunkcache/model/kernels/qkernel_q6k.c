/* Q6_K weights served in the file's own blocks (`model/kernels/quant_blocks.py`), AVX2 + FMA; built into the
 * same library as qkernel.c by `model/kernels/build.py`.
 *
 * A weight row is k / 256 blocks of 210 bytes, as the GGUF stores them: ql[128], qh[64], int8
 * scales[16], float16 d. Per half h (128 weights) of a block, weight e (0..127) has the 6-bit code
 * q = (ql[64 h + e % 64] >> 4 (e / 64)) & 15 | ((qh[32 h + e % 32] >> 2 (e / 32)) & 3) << 4,
 * and w = (d scales[e' / 16]) (q - 32), e' its index in the block: the float32 products gguf's
 * `Q6_K.dequantize_blocks` computes, and exact ones (d's 11-bit mantissa times an 8-bit scale times
 * a 6-bit code fit float32's 24 bits), so every path here starts from the file's weights bit for bit.
 *
 * - `q6k_product`, float32 x, 2-8 rows: each block's codes unpacked to bytes (llama.cpp's AVX2
 *   shifts and masks), converted to w in float32 (gguf's values) and FMA'd into each row's sum;
 *   1 row: per chunk of 32, sum x q over the unsigned codes, times d sc, and the -32 offset
 *   through per-16 sums of x (32 d sum_s sc_s xsum_s): a conversion and an FMA per 8 codes,
 *   where w per code (a sign extension and a multiply more) measured ~1.3x slower.
 * - the same with `quantize_x` (any rows, each as alone): x rounded to int8 per block of 32 (`quantize_blocks`, as
 *   the int4 and int8 kernels round it), llama.cpp's `ggml_vec_dot_q6_K_q8_K` way: the unsigned
 *   codes 0..63 against signed x by `maddubs` (pairs <= 2 * 63 * 127: no int16 overflow), the 16
 *   scales by `madd_epi16`, the -32 offset through per-16 sums of qx (one `madd_epi16` per block);
 *   integer sums exact, to float once per block of 32 (its dx) and once per block of 256 (d).
 * - `q6k_dequantize`: rows to float32 (prefill's blocks for a GEMM), gguf's values bit for bit.
 * Output rows are split over `threads` (OpenMP), each row one thread's sum: the same numbers at
 * any thread count.
 */
#include <stdlib.h>
#include <string.h>

#include "qkernel.h"

#define QK 256         /* weights per block */
#define BLOCK_BYTES 210 /* ql[128], qh[64], scales[16], d (float16) */

/* Half h of a block's codes, unsigned 0..63, as 4 x 32 bytes: q[j] holds weights 32 j .. 32 j + 31
 * of the half, in order (llama.cpp's unpacking: q[0], q[1] the low nibbles of ql[0..31], ql[32..63],
 * q[2], q[3] their high nibbles; qh's 2-bit pairs 0, 1, 2, 3 above them). */
static inline void q6k_codes(const uint8_t *blk, int h, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
    __m256i l2 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
    __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    /* qh's pair j moved to bits 4-5 of its byte and masked there: the bits a 16-bit shift carries
     * across the byte boundary land outside 0x30 (7 operations where shift, mask, shift took 11). */
    __m256i h0 = _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30);
    __m256i h1 = _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30);
    __m256i h2 = _mm256_and_si256(hb, m30);
    __m256i h3 = _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30);
    q[0] = _mm256_or_si256(_mm256_and_si256(l1, m4), h0);
    q[1] = _mm256_or_si256(_mm256_and_si256(l2, m4), h1);
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), h2);
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m4), h3);
}

/* The 1-8 row float32 products read x permuted per 32 inputs (`permute_x`) so that a block's
 * bytes reach 32-bit lanes by in-lane shuffles: vector j (0..3) of a chunk of 32 codes holds codes
 * 4j..4j+3 in its low 128-bit lane and 16+4j..16+4j+3 in its high one (`SPREAD`: each byte into
 * the top byte of its 32-bit lane, then an arithmetic shift sign-extends it). The lane-crossing
 * `cvtepi8_epi32` and a stack buffer of unpacked codes measured ~2x slower. */
static inline __m256i spread(int j) {
    const int b = 4 * j;
    return _mm256_setr_epi8(-1, -1, -1, b, -1, -1, -1, b + 1, -1, -1, -1, b + 2, -1, -1, -1, b + 3,
                            -1, -1, -1, b, -1, -1, -1, b + 1, -1, -1, -1, b + 2, -1, -1, -1, b + 3);
}

static inline __m256i spread_low(int j) {
    const int b = 4 * j;
    return _mm256_setr_epi8(b, -1, -1, -1, b + 1, -1, -1, -1, b + 2, -1, -1, -1, b + 3, -1, -1, -1,
                            b, -1, -1, -1, b + 1, -1, -1, -1, b + 2, -1, -1, -1, b + 3, -1, -1, -1);
}

static void permute_x(const float *x, int k, float *xp) {
    for (int c = 0; c < k; c += 32)
        for (int j = 0; j < 4; j++)
            for (int t = 0; t < 4; t++) {
                xp[c + 8 * j + t] = x[c + 4 * j + t];
                xp[c + 8 * j + 4 + t] = x[c + 16 + 4 * j + t];
            }
}

/* A block's 16 sub-block scales d sc in float32 (gguf's products), 8 and 8. */
static inline void block_scales(const uint8_t *blk, __m256 ds[2]) {
    const __m128i s8 = _mm_loadu_si128((const __m128i *)(blk + 192));
    const __m256 d = _mm256_set1_ps(fp16_to_float(blk + 208));
    ds[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)), d);
    ds[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))), d);
}

/* Weight row i against R rows of permuted float32 x (`xp`): per 8 weights, w = (d sc) (q - 32) in
 * float32 (gguf's value) and one FMA per row of x; R == 1 as the header says (`xsum`: x's sums
 * per 16 inputs), 4 accumulators (independent FMA chains). */
static inline __attribute__((always_inline)) void q6k_row(const int R, const float *xp, const float *xsum, int k, int n, int i,
                                                          const uint8_t *blocks, float *y) {
    const uint8_t *row = blocks + (size_t)i * (k / QK) * BLOCK_BYTES;
    const __m256i offset = _mm256_set1_epi8(32);
    __m256 acc[MAX_ROWS > 4 ? MAX_ROWS : 4];
    for (int r = 0; r < (R > 4 ? R : 4); r++) acc[r] = _mm256_setzero_ps();
    __m256 off = _mm256_setzero_ps();
    for (int b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + (size_t)b * BLOCK_BYTES;
        __m256 ds[2];
        block_scales(blk, ds);
        if (R == 1)
            off = _mm256_fmadd_ps(ds[0], _mm256_loadu_ps(xsum + (size_t)b * 16),
                                  _mm256_fmadd_ps(ds[1], _mm256_loadu_ps(xsum + (size_t)b * 16 + 8), off));
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6k_codes(blk, h, q);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const int c = 4 * h + j; /* chunk of 32: sub-blocks 2c (low lane) and 2c + 1 (high) */
                const __m256i v = _mm256_sub_epi8(q[j], offset);
                const __m256i pick = _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                                       2 * j + 1);
                const __m256 scale = _mm256_permutevar8x32_ps(ds[h], pick);
                if (R == 1) { /* the chunk's sums of x q per lane, then times d sc: no multiply per code */
                    __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(q[j], spread_low(0))),
                                             _mm256_loadu_ps(xp + (size_t)b * QK + 32 * c));
#pragma GCC unroll 4
                    for (int u = 1; u < 4; u++) {
                        const __m256 code = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(q[j], spread_low(u)));
                        a = _mm256_fmadd_ps(code, _mm256_loadu_ps(xp + (size_t)b * QK + 32 * c + 8 * u), a);
                    }
                    acc[j] = _mm256_fmadd_ps(a, scale, acc[j]);
                    continue;
                }
#pragma GCC unroll 4
                for (int u = 0; u < 4; u++) {
                    const __m256 w = _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(v, spread(u)), 24)), scale);
                    const float *xc = xp + (size_t)b * QK + 32 * c + 8 * u;
                    for (int r = 0; r < R; r++)
                        acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xc + (size_t)r * k), acc[r]);
                }
            }
        }
    }
    if (R == 1) {
        y[i] = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) - 32 * hsum(off);
        return;
    }
    for (int r = 0; r < R; r++) y[(size_t)r * n + i] = hsum(acc[r]);
}

/* Weight row i against R rows of int8 x (qx, dx per block of 32, bsums: sums of qx per 16; each
 * row k apart). Per block of 32 weights (two sub-blocks of 16): maddubs(q, qx) into 16 int16 pair
 * sums, madd_epi16 with the two sub-blocks' scales (llama.cpp's scale shuffle: bytes 0-7 the
 * first, 8-15 the second, widened) into 8 int32, to float times dx. Per block of 256, the -32
 * offset: 32 sum_s sc_s bsum_s per block of 32 (one madd_epi16: lane i pairs sub-blocks 2i and
 * 2i + 1, <= 2 * 128 * 2032 * 32 < 2^24, exact in float32), times its dx; then times d. Each
 * row's operations are those of R == 1 in the same order (its bits those of its product alone);
 * a half block's codes are unpacked and each chunk's scales widened once for all R rows (a
 * product per row did it R times). */
static inline __attribute__((always_inline)) void q6k_row_q8(const int R, const int8_t *qx, const float *dx,
                                                             const int16_t *bsums, int k, int n, int i,
                                                             const uint8_t *blocks, float *y) {
    const uint8_t *row = blocks + (size_t)i * (k / QK) * BLOCK_BYTES;
    const int groups = k / GROUP;
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + (size_t)b * BLOCK_BYTES;
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)blk + PREFETCH + 64 * l, _MM_HINT_T0);
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        __m256 part[MAX_ROWS][2];
        for (int r = 0; r < R; r++) part[r][0] = part[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6k_codes(blk, h, q);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const int s = 8 * h + 2 * j, g = 8 * b + 4 * h + j;
                const __m128i pick = _mm_setr_epi8(s, s, s, s, s, s, s, s, s + 1, s + 1, s + 1, s + 1, s + 1, s + 1,
                                                   s + 1, s + 1);
                const __m256i scales = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, pick));
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = qx + (size_t)r * k;
                    __m256i xq = _mm256_loadu_si256((const __m256i *)(xr + (size_t)b * QK + 128 * h + 32 * j));
                    __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(scales, _mm256_maddubs_epi16(q[j], xq)));
                    part[r][j & 1] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(dx + (size_t)r * groups + g), part[r][j & 1]);
                }
            }
        }
        const __m256 d = _mm256_set1_ps(fp16_to_float(blk + 208));
        for (int r = 0; r < R; r++) {
            const int16_t *bs = bsums + (size_t)r * (k / 16) + (size_t)b * 16;
            __m256i off = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc), _mm256_loadu_si256((const __m256i *)bs));
            __m256 sum = _mm256_add_ps(part[r][0], part[r][1]);
            sum = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(off), _mm256_set1_ps(32.0f)),
                                   _mm256_loadu_ps(dx + (size_t)r * groups + (size_t)b * 8), sum);
            acc[r] = _mm256_fmadd_ps(sum, d, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[(size_t)r * n + i] = hsum(acc[r]);
}

/* x float32 [rows][k] (k a multiple of 256, rows <= MAX_ROWS) times the weight `blocks` [n][k / 256
 * blocks]: y float32 [rows][n]. */
void q6k_product(const float *x, int rows, int k, int n, const uint8_t *blocks, float *y, int threads,
                 int quantize_x) {
    if (quantize_x) { /* each row as alone (qkernel.c's `int4_rows_q8`), the weight row from cache */
        int8_t *qx = malloc((size_t)rows * k);
        int16_t *bsums = malloc((size_t)rows * (k / 16) * sizeof *bsums);
        float *dx = malloc((size_t)rows * (k / GROUP) * sizeof *dx);
        quantize_rows(x, rows, k, qx, dx);
        for (int s = 0; s < rows * (k / 16); s++) {
            int sum = 0;
            for (int c = 0; c < 16; c++) sum += qx[16 * s + c];
            bsums[s] = (int16_t)sum;
        }
#define ROW(R) q6k_row_q8(R, q, d, bs, k, n, i, blocks, yr)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int i = 0; i < n; i++)
            for (int r = 0; r < rows; r += 4) { /* runs of at most 4 rows */
                const int8_t *q = qx + (size_t)r * k;
                const float *d = dx + (size_t)r * (k / GROUP);
                const int16_t *bs = bsums + (size_t)r * (k / 16);
                float *yr = y + (size_t)r * n;
                switch (rows - r < 4 ? rows - r : 4) { ROWS_CASES_4(ROW) }
            }
#undef ROW
        free(qx), free(bsums), free(dx);
        return;
    }
    float *xp = malloc((size_t)rows * k * sizeof *xp);
    for (int r = 0; r < rows; r++) permute_x(x + (size_t)r * k, k, xp + (size_t)r * k);
    float *xsum = malloc((size_t)k / 16 * sizeof *xsum);
    for (int s = 0; s < k / 16; s++) {
        float sum = 0;
        for (int c = 0; c < 16; c++) sum += x[16 * s + c];
        xsum[s] = sum;
    }
#define ROW(R) q6k_row(R, xp, R == 1 ? xsum : NULL, k, n, i, blocks, y)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < n; i++) {
        switch (rows) { ROWS_CASES_8(ROW) }
    }
#undef ROW
    free(xp), free(xsum);
}

/* `rows` weight rows from `blocks` (the first of them) as [rows][k], float32 or (`bf16`) bfloat16:
 * gguf's values, in order (each chunk's 32 codes widened by 128-bit halves, no stack round trip);
 * AVX2 (the bfloat16 rounding in integers). */
void q6k_dequantize_avx2(const uint8_t *blocks, int k, int rows, void *out, int threads, int bf16) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < rows; i++) {
        const __m256i offset = _mm256_set1_epi8(32);
        for (int b = 0; b < k / QK; b++) {
            const uint8_t *blk = blocks + ((size_t)i * (k / QK) + b) * BLOCK_BYTES;
            const size_t o = (size_t)i * k + (size_t)b * QK;
            __m256 dv[2];
            block_scales(blk, dv);
            for (int h = 0; h < 2; h++) {
                __m256i q[4];
                q6k_codes(blk, h, q);
                for (int j = 0; j < 4; j++) {
                    const __m256i v = _mm256_sub_epi8(q[j], offset);
                    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
                    const __m256 a = _mm256_permutevar8x32_ps(dv[h], _mm256_set1_epi32(2 * j));
                    const __m256 c = _mm256_permutevar8x32_ps(dv[h], _mm256_set1_epi32(2 * j + 1));
                    const size_t oc = o + 128 * h + 32 * j;
                    store8(out, bf16, oc, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), a));
                    store8(out, bf16, oc + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), a));
                    store8(out, bf16, oc + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), c));
                    store8(out, bf16, oc + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), c));
                }
            }
        }
    }
}

#if HAS_AVX512_BF16
/* `block_scales` into memory, not inlined: `q6k_row_bf16`'s multiplies then broadcast them from
 * memory (as `q4k_row_bf16`'s factors): 0.095 -> 0.080 ns a weight. */
static __attribute__((noinline)) void block_scales_in_memory(const uint8_t *blk, float ds[16]) {
    __m256 dv[2];
    block_scales(blk, dv);
    _mm256_storeu_ps(ds, dv[0]), _mm256_storeu_ps(ds + 8, dv[1]);
}

/* The same rows as bfloat16 by AVX512-BF16 (as `q4k_dequantize_bf16`): a chunk's 32 codes widened
 * 16 at a time, `vcvtne2ps2bf16` rounding 32 weights at once (the AVX2 path's bits); one row:
 * `q6k_row_bf16`. */
AVX512_BF16 void q6k_row_bf16(const uint8_t *row, int k, uint16_t *out) {
    const __m256i offset = _mm256_set1_epi8(32);
    for (int b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + (size_t)b * BLOCK_BYTES;
        uint16_t *o = out + (size_t)b * QK;
        float ds[16];
        block_scales_in_memory(blk, ds);
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6k_codes(blk, h, q);
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_sub_epi8(q[j], offset);
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
                const __m512 a = _mm512_mul_ps(lo, _mm512_set1_ps(ds[8 * h + 2 * j]));
                const __m512 c = _mm512_mul_ps(hi, _mm512_set1_ps(ds[8 * h + 2 * j + 1]));
                _mm512_storeu_si512(o + 128 * h + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(c, a));
            }
        }
    }
}

AVX512_BF16 void q6k_dequantize_bf16(const uint8_t *blocks, int k, int rows, uint16_t *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < rows; i++) q6k_row_bf16(blocks + (size_t)i * (k / QK) * BLOCK_BYTES, k, out + (size_t)i * k);
}

#endif

/* `rows` weight rows as float32 or (`bf16`) bfloat16, gguf's values (bfloat16: rounded to nearest
 * even), the AVX512-BF16 path where the CPU has it. */
void q6k_dequantize(const uint8_t *blocks, int k, int rows, void *out, int threads, int bf16) {
#if HAS_AVX512_BF16
    if (bf16 && bf16_dequantize()) {
        q6k_dequantize_bf16(blocks, k, rows, out, threads);
        return;
    }
#endif
    q6k_dequantize_avx2(blocks, k, rows, out, threads, bf16);
}
