/* Prefill's int4 blocks in bfloat16, for CPUs that multiply bfloat16 matrices natively (AMX,
 * AVX512-BF16), where torch packs int4 in tiles of 64 rows (its AVX512 packing); built into the
 * same library as qkernel.c by `model/kernels/build.py`.
 *
 * There torch's own int4 kernel serves decode (it reads that packing, 1-row products ~3x a dense
 * bfloat16 GEMV), and a prefill's products of 64+ rows ran as float32 GEMMs over blocks that torch
 * unpacked (`dequant.int4_block`): 4-7x slower than the bfloat16 GEMM the CPU has, and the
 * unpacking alone ~1 ns a weight. This writes the block as bfloat16 for that GEMM, from torch's
 * packing and its bfloat16 scale and zero per group of 32 (`Int4Part.scale_zeros`): the float32 w
 * = (q - 8) s + z that `dequant.int4_block` computes (the minimum m = z - 8 s, then a product and
 * a sum, two roundings, as its `addcmul`), rounded to bfloat16 to nearest even (torch's
 * conversion): `int4_block(...).bfloat16()` bit for bit (tests/test_qkernel_bf16.py).
 *
 * Plain AVX2 code (the rounding in integers), so it builds with the library's flags; it runs only
 * where the packing is torch's AVX512 one.
 */
#include "qkernel.h"

#define TILE64 64

/* Weight rows [start, start + rows) (whole tiles of 64) as bfloat16 [k][rows] (the GEMM's B).
 * `packed` [n][k / 2]: a tile's column c is 32 bytes, rows 0-31 in the low nibbles and 32-63 in
 * the high; `scale_zeros` bfloat16 [k / 32][n][2]. Tiles are split over `threads`. */
void int4_dequantize_bf16(const uint8_t *packed, const uint16_t *scale_zeros, int k, int n, int start, int rows,
                          uint16_t *out, int threads) {
    const int tiles = rows / TILE64;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int tl = 0; tl < tiles; tl++) {
        const int row0 = start + tl * TILE64;
        const uint8_t *p = packed + (size_t)row0 * (k / 2);
        const __m256i low = _mm256_set1_epi8(0x0F);
        for (int g = 0; g < k / GROUP; g++) {
            float s_buf[TILE64], m_buf[TILE64];
            const uint16_t *sz = scale_zeros + ((size_t)g * n + row0) * 2;
            for (int j = 0; j < TILE64; j++) {
                float s = bf16_to_float(sz[2 * j]), z = bf16_to_float(sz[2 * j + 1]);
                s_buf[j] = s;
                m_buf[j] = z - 8.0f * s;
            }
            for (int c = g * GROUP; c < (g + 1) * GROUP; c++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(p + (size_t)c * 32));
                __m256i half[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
                uint16_t *o = out + (size_t)c * rows + tl * TILE64;
                for (int h = 0; h < 2; h++) {
                    for (int j = 0; j < 4; j++) { /* rows 32 h + 8 j .. + 8 */
                        __m128i bytes = j < 2 ? _mm256_castsi256_si128(half[h]) : _mm256_extracti128_si256(half[h], 1);
                        if (j & 1) bytes = _mm_srli_si128(bytes, 8);
                        __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
                        const int r = 32 * h + 8 * j;
                        __m256 w = _mm256_add_ps(_mm256_mul_ps(q, _mm256_loadu_ps(s_buf + r)), _mm256_loadu_ps(m_buf + r));
                        _mm_storeu_si128((__m128i *)(o + r), to_bf16(w));
                    }
                }
            }
        }
    }
}
