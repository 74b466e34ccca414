/* Q6_K weights served in the file's own blocks (`model/quant_q6k.py`), AVX2 + FMA; built into the
 * same library as qkernel.c by `model/qkernel.py`.
 *
 * A weight row is k / 256 blocks of 210 bytes, as the GGUF stores them: ql[128], qh[64], int8
 * scales[16], float16 d. Per half h (128 weights) of a block, weight e (0..127) has the 6-bit code
 * q = (ql[64 h + e % 64] >> 4 (e / 64)) & 15 | ((qh[32 h + e % 32] >> 2 (e / 32)) & 3) << 4,
 * and w = (d scales[e' / 16]) (q - 32), e' its index in the block: the float32 products gguf's
 * `Q6_K.dequantize_blocks` computes, and exact ones (d's 11-bit mantissa times an 8-bit scale times
 * a 6-bit code fit float32's 24 bits), so every path here starts from the file's weights bit for bit.
 *
 * - `q6k_product`, float32 x, 1-8 rows: each block's codes unpacked to bytes (llama.cpp's AVX2
 *   shifts and masks), converted to w in float32 and FMA'd into each row's sum.
 * - the same with `quantize_x` (one row): x rounded to int8 per block of 32 (`quantize_blocks`, as
 *   the int4 and int8 kernels round it), llama.cpp's `ggml_vec_dot_q6_K_q8_K` way: the unsigned
 *   codes 0..63 against signed x by `maddubs` (pairs <= 2 * 63 * 127: no int16 overflow), the 16
 *   scales by `madd_epi16`, the -32 offset through per-16 sums of qx (one `madd_epi16` per block);
 *   integer sums exact, to float once per block of 32 (its dx) and once per block of 256 (d).
 * - `q6k_dequantize`: rows to float32 (prefill's blocks for a GEMM), gguf's values bit for bit.
 * Output rows are split over `threads` (OpenMP), each row one thread's sum: the same numbers at
 * any thread count.
 */
#include <string.h>

#include "qkernel.h"

#define QK 256         /* weights per block */
#define BLOCK_BYTES 210 /* ql[128], qh[64], scales[16], d (float16) */

static inline float fp16_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, u;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24, exact in float32 */
        float f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    u = exp == 31 ? sign | 0x7F800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Half h of a block's codes, unsigned 0..63, as 4 x 32 bytes: q[j] holds weights 32 j .. 32 j + 31
 * of the half, in order (llama.cpp's unpacking: q[0], q[1] the low nibbles of ql[0..31], ql[32..63],
 * q[2], q[3] their high nibbles; qh's 2-bit pairs 0, 1, 2, 3 above them). */
static inline void q6k_codes(const uint8_t *blk, int h, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
    __m256i l2 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
    __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    /* (bits & 3) << 4 within 16-bit lanes: values < 64, so no bit crosses into the next byte. */
    __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4);
    __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4);
    __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4);
    __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4);
    q[0] = _mm256_or_si256(_mm256_and_si256(l1, m4), h0);
    q[1] = _mm256_or_si256(_mm256_and_si256(l2, m4), h1);
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), h2);
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m4), h3);
}

/* A block's 256 codes minus 32, as int8 in weight order. */
static inline void q6k_unpack(const uint8_t *blk, int8_t *out) {
    const __m256i offset = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        __m256i q[4];
        q6k_codes(blk, h, q);
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(out + 128 * h + 32 * j), _mm256_sub_epi8(q[j], offset));
    }
}

static inline __m256 i8_to_ps(const int8_t *c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
}

/* Weight row i against R rows of float32 x: per 8 weights, w = (d sc) (q - 32) in float32 and one
 * FMA per row of x. R == 1 keeps 4 accumulators (independent FMA chains). */
static inline __attribute__((always_inline)) void q6k_row(const int R, const float *x, int k, int n, int i,
                                                          const uint8_t *blocks, float *y) {
    const uint8_t *row = blocks + (size_t)i * (k / QK) * BLOCK_BYTES;
    __m256 acc[MAX_ROWS > 4 ? MAX_ROWS : 4];
    for (int r = 0; r < (R > 4 ? R : 4); r++) acc[r] = _mm256_setzero_ps();
    int8_t q[QK];
    for (int b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + (size_t)b * BLOCK_BYTES;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = fp16_to_float(blk + 208);
        q6k_unpack(blk, q);
        for (int j = 0; j < QK / 16; j++) {
            const __m256 ds = _mm256_set1_ps(d * (float)sc[j]);
            const __m256 w0 = _mm256_mul_ps(i8_to_ps(q + 16 * j), ds), w1 = _mm256_mul_ps(i8_to_ps(q + 16 * j + 8), ds);
            const float *xc = x + (size_t)b * QK + 16 * j;
            if (R == 1) {
                acc[2 * (j & 1)] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xc), acc[2 * (j & 1)]);
                acc[2 * (j & 1) + 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xc + 8), acc[2 * (j & 1) + 1]);
            } else {
                for (int r = 0; r < R; r++) {
                    acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xc + (size_t)r * k), acc[r]);
                    acc[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xc + (size_t)r * k + 8), acc[r]);
                }
            }
        }
    }
    if (R == 1) {
        y[i] = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
        return;
    }
    for (int r = 0; r < R; r++) y[(size_t)r * n + i] = hsum(acc[r]);
}

/* Weight row i against int8 x (qx, dx per block of 32, bsums: sums of qx per 16). Per block of
 * 32 weights (two sub-blocks of 16): maddubs(q, qx) into 16 int16 pair sums, madd_epi16 with the
 * two sub-blocks' scales into 8 int32, to float times dx. Per block of 256, the -32 offset:
 * 32 sum_s sc_s bsum_s per block of 32 (one madd_epi16: lane i pairs sub-blocks 2i and 2i + 1,
 * <= 2 * 128 * 2032 * 32 < 2^24, exact in float32), times its dx; then times d. */
static inline void q6k_row_q8(const int8_t *qx, const float *dx, const int16_t *bsums, int k, int i,
                              const uint8_t *blocks, float *y) {
    const uint8_t *row = blocks + (size_t)i * (k / QK) * BLOCK_BYTES;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + (size_t)b * BLOCK_BYTES;
        const int8_t *sc = (const int8_t *)(blk + 192);
        __m256 part[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6k_codes(blk, h, q);
            for (int j = 0; j < 4; j++) {
                const int s = 8 * h + 2 * j, g = 8 * b + 4 * h + j;
                __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + (size_t)b * QK + 128 * h + 32 * j));
                __m256i p16 = _mm256_maddubs_epi16(q[j], xq);
                __m256i scales = _mm256_set_m128i(_mm_set1_epi16(sc[s + 1]), _mm_set1_epi16(sc[s]));
                __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(scales, p16));
                part[j & 1] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(dx + g), part[j & 1]);
            }
        }
        __m256i off = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc)),
                                        _mm256_loadu_si256((const __m256i *)(bsums + (size_t)b * 16)));
        __m256 sum = _mm256_add_ps(part[0], part[1]);
        sum = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(off), _mm256_set1_ps(32.0f)),
                               _mm256_loadu_ps(dx + (size_t)b * 8), sum);
        acc = _mm256_fmadd_ps(sum, _mm256_set1_ps(fp16_to_float(blk + 208)), acc);
    }
    y[i] = hsum(acc);
}

/* x float32 [rows][k] (k a multiple of 256, rows <= MAX_ROWS) times the weight `blocks` [n][k / 256
 * blocks]: y float32 [rows][n]. */
void q6k_product(const float *x, int rows, int k, int n, const uint8_t *blocks, float *y, int threads,
                 int quantize_x) {
    if (rows == 1 && quantize_x) {
        int8_t qx[k];
        float dx[k / GROUP];
        int16_t bsums[k / 16];
        quantize_blocks(x, k, qx, dx);
        for (int s = 0; s < k / 16; s++) {
            int sum = 0;
            for (int c = 0; c < 16; c++) sum += qx[16 * s + c];
            bsums[s] = (int16_t)sum;
        }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int i = 0; i < n; i++) q6k_row_q8(qx, dx, bsums, k, i, blocks, y);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < n; i++) {
        switch (rows) {
            ROWS_CASE(1, q6k_row(1, x, k, n, i, blocks, y))
            ROWS_CASE(2, q6k_row(2, x, k, n, i, blocks, y))
            ROWS_CASE(3, q6k_row(3, x, k, n, i, blocks, y))
            ROWS_CASE(4, q6k_row(4, x, k, n, i, blocks, y))
            ROWS_CASE(5, q6k_row(5, x, k, n, i, blocks, y))
            ROWS_CASE(6, q6k_row(6, x, k, n, i, blocks, y))
            ROWS_CASE(7, q6k_row(7, x, k, n, i, blocks, y))
            ROWS_CASE(8, q6k_row(8, x, k, n, i, blocks, y))
        }
    }
}

/* `rows` weight rows from `blocks` (the first of them) as float32 [rows][k]: gguf's values. */
void q6k_dequantize(const uint8_t *blocks, int k, int rows, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < rows; i++) {
        int8_t q[QK];
        for (int b = 0; b < k / QK; b++) {
            const uint8_t *blk = blocks + ((size_t)i * (k / QK) + b) * BLOCK_BYTES;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = fp16_to_float(blk + 208);
            float *o = out + (size_t)i * k + (size_t)b * QK;
            q6k_unpack(blk, q);
            for (int j = 0; j < QK / 16; j++) {
                const __m256 ds = _mm256_set1_ps(d * (float)sc[j]);
                _mm256_storeu_ps(o + 16 * j, _mm256_mul_ps(i8_to_ps(q + 16 * j), ds));
                _mm256_storeu_ps(o + 16 * j + 8, _mm256_mul_ps(i8_to_ps(q + 16 * j + 8), ds));
            }
        }
    }
}
