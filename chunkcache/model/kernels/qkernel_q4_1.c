/* Q4_0 and Q4_1 weights served as the file's blocks regrouped in tiles of 16 rows
 * (`model/kernels/quant_blocks.py`), AVX2 + FMA, AVX512 where the CPU has it; built into the same library
 * as qkernel.c by `model/kernels/build.py`.
 *
 * The GGUF's block is 32 weights of one row: Q4_1 20 bytes (float16 d, float16 m, 16 bytes of
 * codes), Q4_0 18 (d, codes); byte j's low nibble is weight j, its high nibble weight j + 16.
 * Q4_1: w = d q + m, gguf's `Q4_1.dequantize_blocks` in float32, where d q is exact (an 11-bit
 * mantissa times a 4-bit integer), so an FMA rounds w as gguf's addition does; Q4_0: w = d (q - 8),
 * computed so (exact; d q - 8 d would give +0 where gguf gives -0). Every path here starts from
 * the file's weights bit for bit.
 *
 * Held regrouped (`q4_tile`, at load; the same bytes, 16 blocks in a record): per tile of 16 rows
 * and block of 32 inputs, the 16 rows' code bytes j = 0..15 as 16 runs of 16 (row r's byte j at
 * 16 j + r), then their 16 d, then (Q4_1) their 16 m; records in order of block within a tile,
 * tiles in order. A vector lane is a row: one 16-byte load widens to the 16 rows' codes of inputs
 * j (low nibbles) and j + 16 (high), w = d q + m comes out with d and m as vectors, and each row of
 * x multiplies it by one broadcast input: ~9 vector operations per 32 weights. In the file's own
 * order (a row's blocks one after another) every block needed its scalar d and m and a
 * horizontal sum: 10 Gw/s at most in cache, against 13-17 for torch's int4 kernel (a lane a row
 * too) and 21-24 here (RESULTS.md, "SmolLM2's decode on the AMX Xeon"). A decode step streams every
 * weight once from memory, prefetched `PREFETCH` bytes ahead.
 *
 * - `q4_1_product` / `q4_0_product`: float32 x [rows][k] (rows <= MAX_ROWS) times the weight,
 *   each row's sums in one fixed order (4 accumulators per row: inputs j even / odd, low / high),
 *   so a row's bits do not depend on the rows beside it; runs of `RUN` rows share a record's
 *   unpacked codes. With `quantize_x`, x is first rounded to int8 per block of 32 (`quantize_rows`,
 *   as the other kernels round it) and the product taken over the rounded values in float32.
 * - `q4_1_dequantize` / `q4_0_dequantize`: whole tiles to [rows][k] float32 or bfloat16 (prefill's
 *   blocks for a GEMM), gguf's values bit for bit (bfloat16: those rounded to nearest even).
 * Tiles are split over `threads` (OpenMP), each row one thread's sums: the same numbers at any
 * thread count.
 */
#include <stdlib.h>
#include <string.h>

#include "qkernel.h"

#define TROWS 16 /* rows per tile */
/* Bytes per record (16 blocks) and where its d and m start. */
#define RECORD(q41) ((q41) ? 320 : 288)
#define D_AT 256
#define M_AT 288
/* Rows of x sharing a record's unpacked codes: each row holds 4 accumulators a vector, and AVX2
 * has 16 vector registers, AVX512 32. */
#define RUN_AVX2 2
#define RUN_AVX512 4

/* `blocks` in the file's order (rows [n][k / 32] blocks) regrouped into tiles `out` (n a multiple
 * of 16): see the top of this file. */
static inline __attribute__((always_inline)) void q4_tile(const int q41, const uint8_t *blocks, int k, int n,
                                                          uint8_t *out) {
    const int groups = k / GROUP, bytes = q41 ? 20 : 18, codes = q41 ? 4 : 2;
    for (int t = 0; t < n / TROWS; t++)
        for (int g = 0; g < groups; g++) {
            uint8_t *rec = out + ((size_t)t * groups + g) * RECORD(q41);
            for (int r = 0; r < TROWS; r++) {
                const uint8_t *blk = blocks + ((size_t)(TROWS * t + r) * groups + g) * bytes;
                for (int j = 0; j < 16; j++) rec[16 * j + r] = blk[codes + j];
                memcpy(rec + D_AT + 2 * r, blk, 2);
                if (q41) memcpy(rec + M_AT + 2 * r, blk + 2, 2);
            }
        }
}

void q4_1_tile(const uint8_t *blocks, int k, int n, uint8_t *out) { q4_tile(1, blocks, k, n, out); }
void q4_0_tile(const uint8_t *blocks, int k, int n, uint8_t *out) { q4_tile(0, blocks, k, n, out); }

/* A record's lines, prefetched `PREFETCH` bytes ahead (a decode step streams every weight once). */
static inline __attribute__((always_inline)) void prefetch_record(const int q41, const uint8_t *rec) {
    for (int l = 0; l < RECORD(q41); l += 64) _mm_prefetch((const char *)rec + PREFETCH + l, _MM_HINT_T0);
}

/* x's sums per block of 32 (the minimums' term of a 1-row product). */
static void block_sums(const float *x, int k, float *xsum) {
    for (int g = 0; g < k / GROUP; g++) {
        float s = 0;
        for (int c = 0; c < GROUP; c++) s += x[g * GROUP + c];
        xsum[g] = s;
    }
}

/* 8 rows' weights from their codes (int32 lanes): gguf's values (see the top of this file). */
static inline __attribute__((always_inline)) __m256 weights8(const int q41, __m256i q, __m256 d, __m256 m) {
    if (q41) return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
    return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(8.0f)), d);
}

/* A half record's 8 d and 8 m (Q4_0: m = -8 d, exact) for the 1-row product's factored sums. */
static inline __attribute__((always_inline)) void factors8(const int q41, const uint8_t *rec, int h, __m256 *d, __m256 *m) {
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + D_AT + 16 * h)));
    *m = q41 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + M_AT + 16 * h))) : _mm256_mul_ps(*d, _mm256_set1_ps(-8.0f));
}

/* Rows 8 h .. 8 h + 7 of tile t against one row of x (AVX2: a half tile a vector), the block's
 * factors out of the sums: per block and lane s = sum_j q_j x_j (codes to float, one FMA each; 4
 * accumulators: inputs j even / odd, low / high nibble), then y += d s, plus m sum(x) per block. */
static inline __attribute__((always_inline)) void half1_avx2(const int q41, const float *x, const float *xsum, int k,
                                                             int t, int h, const uint8_t *blocks, float *y) {
    const __m256i low = _mm256_set1_epi32(0x0F);
    __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    for (int g = 0; g < k / GROUP; g++) {
        const uint8_t *rec = blocks + ((size_t)t * (k / GROUP) + g) * RECORD(q41);
        if (h == 0) prefetch_record(q41, rec);
        __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}, d, m;
#pragma GCC unroll 16 /* whole: each accumulator a register (a runtime index kept them in memory: half the speed) */
        for (int j = 0; j < 16; j++) {
            const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rec + 16 * j + 8 * h)));
            const int a = 2 * (j & 1);
            s[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, low)), _mm256_set1_ps(x[g * GROUP + j]), s[a]);
            s[a + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), _mm256_set1_ps(x[g * GROUP + 16 + j]), s[a + 1]);
        }
        factors8(q41, rec, h, &d, &m);
        acc = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])), d, acc);
        macc = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[g]), macc);
    }
    _mm256_storeu_ps(y + TROWS * t + 8 * h, _mm256_add_ps(acc, macc));
}

/* Rows 8 h .. 8 h + 7 of tile t against R (<= RUN_AVX2) rows of x: per 8 weights w (gguf's
 * values, `weights8`) once, and one FMA per row of x (4 accumulators a row, as above). */
static inline __attribute__((always_inline)) void half_avx2(const int q41, const int R, const float *x, int k, int n,
                                                            int t, int h, const uint8_t *blocks, float *y) {
    const __m256i low = _mm256_set1_epi32(0x0F);
    __m256 acc[RUN_AVX2][4];
    for (int r = 0; r < R; r++)
        for (int a = 0; a < 4; a++) acc[r][a] = _mm256_setzero_ps();
    for (int g = 0; g < k / GROUP; g++) {
        const uint8_t *rec = blocks + ((size_t)t * (k / GROUP) + g) * RECORD(q41);
        if (h == 0) prefetch_record(q41, rec);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + D_AT + 16 * h)));
        const __m256 m = q41 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + M_AT + 16 * h))) : d;
#pragma GCC unroll 16 /* whole: each accumulator a register (a runtime index kept them in memory: half the speed) */
        for (int j = 0; j < 16; j++) {
            const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rec + 16 * j + 8 * h)));
            const __m256 lo = weights8(q41, _mm256_and_si256(c, low), d, m), hi = weights8(q41, _mm256_srli_epi32(c, 4), d, m);
            const int a = 2 * (j & 1);
            for (int r = 0; r < R; r++) {
                const float *xr = x + (size_t)r * k + g * GROUP;
                acc[r][a] = _mm256_fmadd_ps(lo, _mm256_set1_ps(xr[j]), acc[r][a]);
                acc[r][a + 1] = _mm256_fmadd_ps(hi, _mm256_set1_ps(xr[16 + j]), acc[r][a + 1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        _mm256_storeu_ps(y + (size_t)r * n + TROWS * t + 8 * h,
                         _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
}

static void rows_avx2(const int q41, const float *x, const float *xsum, int rows, int k, int n, const uint8_t *blocks,
                      float *y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < n / TROWS; t++)
        for (int h = 0; h < 2; h++) {
            if (xsum) { /* each row alone, factored */
                for (int r = 0; r < rows; r++)
                    half1_avx2(q41, x + (size_t)r * k, xsum + (size_t)r * (k / GROUP), k, t, h, blocks, y + (size_t)r * n);
                continue;
            }
            for (int r = 0; r < rows; r += RUN_AVX2) {
                if (rows - r == 1)
                    half_avx2(q41, 1, x + (size_t)r * k, k, n, t, h, blocks, y + (size_t)r * n);
                else
                    half_avx2(q41, 2, x + (size_t)r * k, k, n, t, h, blocks, y + (size_t)r * n);
            }
        }
}

#if HAS_AVX512_BF16
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
/* `weights8` with 16 lanes. */
static inline __attribute__((always_inline)) AVX512 __m512 weights16(const int q41, __m512i q, __m512 d, __m512 m) {
    if (q41) return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, m);
    return _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(8.0f)), d);
}

/* `half1_avx2` with 16 lanes (a whole tile), its operations per lane in the same order: the same
 * bits. In cache ~24 Gw/s against ~13 in the form below (each code dequantized, then its FMA):
 * 512-bit operations have two ports, and this form takes 7 of them per 32 weights, that one 9-10. */
static inline __attribute__((always_inline)) AVX512 void tile1_avx512(const int q41, const float *x, const float *xsum,
                                                                      int k, int t, const uint8_t *blocks, float *y) {
    const __m512i low = _mm512_set1_epi32(0x0F);
    __m512 acc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
    for (int g = 0; g < k / GROUP; g++) {
        const uint8_t *rec = blocks + ((size_t)t * (k / GROUP) + g) * RECORD(q41);
        prefetch_record(q41, rec);
        __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 16 /* whole: each accumulator a register (a runtime index kept them in memory: half the speed) */
        for (int j = 0; j < 16; j++) {
            const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rec + 16 * j)));
            const int a = 2 * (j & 1);
            s[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(c, low)), _mm512_set1_ps(x[g * GROUP + j]), s[a]);
            s[a + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)), _mm512_set1_ps(x[g * GROUP + 16 + j]), s[a + 1]);
        }
        const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + D_AT)));
        const __m512 m16 = q41 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + M_AT)))
                               : _mm512_mul_ps(d16, _mm512_set1_ps(-8.0f)); /* `factors8`'s */
        acc = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3])), d16, acc);
        macc = _mm512_fmadd_ps(m16, _mm512_set1_ps(xsum[g]), macc);
    }
    _mm512_storeu_ps(y + TROWS * t, _mm512_add_ps(acc, macc));
}

/* `half_avx2` with 16 lanes (a whole tile), runs of `RUN_AVX512` rows of x. */
static inline __attribute__((always_inline)) AVX512 void tile_avx512(const int q41, const int R, const float *x, int k,
                                                                     int n, int t, const uint8_t *blocks, float *y) {
    const __m512i low = _mm512_set1_epi32(0x0F);
    __m512 acc[RUN_AVX512][4];
    for (int r = 0; r < R; r++)
        for (int a = 0; a < 4; a++) acc[r][a] = _mm512_setzero_ps();
    for (int g = 0; g < k / GROUP; g++) {
        const uint8_t *rec = blocks + ((size_t)t * (k / GROUP) + g) * RECORD(q41);
        prefetch_record(q41, rec);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + D_AT)));
        const __m512 m = q41 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + M_AT))) : d;
#pragma GCC unroll 16 /* whole: each accumulator a register (a runtime index kept them in memory: half the speed) */
        for (int j = 0; j < 16; j++) {
            const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rec + 16 * j)));
            const __m512 lo = weights16(q41, _mm512_and_si512(c, low), d, m), hi = weights16(q41, _mm512_srli_epi32(c, 4), d, m);
            const int a = 2 * (j & 1);
            for (int r = 0; r < R; r++) {
                const float *xr = x + (size_t)r * k + g * GROUP;
                acc[r][a] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xr[j]), acc[r][a]);
                acc[r][a + 1] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xr[16 + j]), acc[r][a + 1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(y + (size_t)r * n + TROWS * t,
                         _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}

static AVX512 void rows_avx512(const int q41, const float *x, const float *xsum, int rows, int k, int n,
                               const uint8_t *blocks, float *y, int threads) {
#define ROW(R) tile_avx512(q41, R, x + (size_t)r * k, k, n, t, blocks, y + (size_t)r * n)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < n / TROWS; t++) {
        if (xsum) { /* each row alone, factored */
            for (int r = 0; r < rows; r++)
                tile1_avx512(q41, x + (size_t)r * k, xsum + (size_t)r * (k / GROUP), k, t, blocks, y + (size_t)r * n);
            continue;
        }
        for (int r = 0; r < rows; r += RUN_AVX512) {
            switch (rows - r < RUN_AVX512 ? rows - r : RUN_AVX512) { ROWS_CASES_4(ROW) }
        }
    }
#undef ROW
}
#endif

/* Whether the CPU runs the AVX512 build (where it was compiled). */
static int q4_tiles_avx512(void) {
#if HAS_AVX512_BF16
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}

/* x float32 [rows][k] (k a multiple of 32) times the tiled weight `blocks` (n rows, a multiple of
 * 16): y float32 [rows][n]. One row, or with `quantize_x` every row (rounded first as the other
 * kernels round x, then multiplied as it is), each alone through the factored form: a row's bits
 * are its 1-row product's. 2-8 rows of float x: the codes dequantized once for a run of rows. */
static inline __attribute__((always_inline)) void q4_product(const int q41, const float *x, int rows, int k, int n,
                                                             const uint8_t *blocks, float *y, int threads,
                                                             int quantize_x, int avx512) {
    float *xr = NULL, *xsum = NULL;
    if (quantize_x) {
        int8_t *qx = malloc((size_t)rows * k);
        float *dx = malloc((size_t)rows * (k / GROUP) * sizeof *dx);
        xr = malloc((size_t)rows * k * sizeof *xr);
        quantize_rows(x, rows, k, qx, dx);
        for (size_t i = 0; i < (size_t)rows * k; i++) xr[i] = dx[i / GROUP] * (float)qx[i];
        free(qx), free(dx);
        x = xr;
    }
    if (quantize_x || rows == 1) {
        xsum = malloc((size_t)rows * (k / GROUP) * sizeof *xsum);
        for (int r = 0; r < rows; r++) block_sums(x + (size_t)r * k, k, xsum + (size_t)r * (k / GROUP));
    }
#if HAS_AVX512_BF16
    if (avx512)
        q41 ? rows_avx512(1, x, xsum, rows, k, n, blocks, y, threads) : rows_avx512(0, x, xsum, rows, k, n, blocks, y, threads);
    else
#endif
        q41 ? rows_avx2(1, x, xsum, rows, k, n, blocks, y, threads) : rows_avx2(0, x, xsum, rows, k, n, blocks, y, threads);
    free(xr), free(xsum);
}

void q4_1_product(const float *x, int rows, int k, int n, const uint8_t *blocks, float *y, int threads,
                  int quantize_x) {
    q4_product(1, x, rows, k, n, blocks, y, threads, quantize_x, q4_tiles_avx512());
}

void q4_0_product(const float *x, int rows, int k, int n, const uint8_t *blocks, float *y, int threads,
                  int quantize_x) {
    q4_product(0, x, rows, k, n, blocks, y, threads, quantize_x, q4_tiles_avx512());
}

/* `q4_1_product` by the AVX2 build (`avx512` 0) or the AVX512 one where the CPU has it: for tests
 * to compare their bits. */
void q4_1_product_isa(const float *x, int rows, int k, int n, const uint8_t *blocks, float *y, int avx512) {
    q4_product(1, x, rows, k, n, blocks, y, 1, 0, avx512 && q4_tiles_avx512());
}

/* The 16 x 16 code bytes of a record transposed: v[r] = tile row r's bytes j = 0..15 (inputs j and
 * j + 16). Four rounds of interleaving (8-, 16-, 32-, 64-bit) leave row r's byte j in lane
 * bitrev4(j)'s place; reading the input runs in that order puts it in lane j. */
static inline void transposed_codes(const uint8_t *rec, __m128i v[16]) {
    static const int bitrev4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    __m128i a[16], b[16];
    for (int i = 0; i < 16; i++) a[i] = _mm_loadu_si128((const __m128i *)(rec + 16 * bitrev4[i]));
    for (int i = 0; i < 8; i++) b[2 * i] = _mm_unpacklo_epi8(a[i], a[i + 8]), b[2 * i + 1] = _mm_unpackhi_epi8(a[i], a[i + 8]);
    for (int i = 0; i < 8; i++) a[2 * i] = _mm_unpacklo_epi16(b[i], b[i + 8]), a[2 * i + 1] = _mm_unpackhi_epi16(b[i], b[i + 8]);
    for (int i = 0; i < 8; i++) b[2 * i] = _mm_unpacklo_epi32(a[i], a[i + 8]), b[2 * i + 1] = _mm_unpackhi_epi32(a[i], a[i + 8]);
    for (int i = 0; i < 8; i++) v[2 * i] = _mm_unpacklo_epi64(b[i], b[i + 8]), v[2 * i + 1] = _mm_unpackhi_epi64(b[i], b[i + 8]);
}

/* Whole tiles (`rows` a multiple of 16, from the first tile of `blocks`) to [rows][k], float32 or
 * (`bf16`) bfloat16: gguf's values bit for bit (bfloat16: those rounded to nearest even), a row's
 * 32 weights of a block from its transposed codes. */
static inline __attribute__((always_inline)) void q4_dequantize(const int q41, const uint8_t *blocks, int k, int rows,
                                                                void *out, int threads, int bf16) {
    const int groups = k / GROUP;
    const __m128i low = _mm_set1_epi8(0x0F);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < rows / TROWS; t++)
        for (int g = 0; g < groups; g++) {
            const uint8_t *rec = blocks + ((size_t)t * groups + g) * RECORD(q41);
            __m128i v[16];
            transposed_codes(rec, v);
            for (int r = 0; r < TROWS; r++) {
                const float d = fp16_to_float(rec + D_AT + 2 * r), m = q41 ? fp16_to_float(rec + M_AT + 2 * r) : 0.0f;
                const __m128i lo = _mm_and_si128(v[r], low), hi = _mm_and_si128(_mm_srli_epi16(v[r], 4), low);
                const __m128i q[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                for (int e = 0; e < 4; e++)
                    store8(out, bf16, (size_t)(TROWS * t + r) * k + g * GROUP + 8 * e,
                           weights8(q41, _mm256_cvtepu8_epi32(q[e]), _mm256_set1_ps(d), _mm256_set1_ps(m)));
            }
        }
}

void q4_1_dequantize(const uint8_t *blocks, int k, int rows, void *out, int threads, int bf16) {
    q4_dequantize(1, blocks, k, rows, out, threads, bf16);
}

void q4_0_dequantize(const uint8_t *blocks, int k, int rows, void *out, int threads, int bf16) {
    q4_dequantize(0, blocks, k, rows, out, threads, bf16);
}
