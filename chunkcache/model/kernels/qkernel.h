/* What the kernel's C files share (built into one library by `model/kernels/build.py`). */
#ifndef CHUNKCACHE_QKERNEL_H
#define CHUNKCACHE_QKERNEL_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32   /* inputs per int4 group and per block of int8 x */
#define MAX_ROWS 8 /* the most rows of x one call takes */
/* Bytes ahead of a row's block that the blocks' int8-x products prefetch: without it the 1.5B's
 * Q4_K gate product out of cache (a decode step's case) took 1.75 ms against 0.84 in cache; 1-2
 * KB ahead 1.0, 4-8 KB 0.82-0.84, 16 KB 0.96 (one thread, the AMX Xeon). */
#define PREFETCH 4096

/* The cases of a `switch (rows)` over 1..4 or 1..8 rows, each calling ROW(R) with R a constant, so
 * each case compiles its own body for its number of rows. */
#define ROWS_CASES_4(ROW) \
    case 1:               \
        ROW(1);           \
        break;            \
    case 2:               \
        ROW(2);           \
        break;            \
    case 3:               \
        ROW(3);           \
        break;            \
    case 4:               \
        ROW(4);           \
        break;
#define ROWS_CASES_8(ROW) \
    ROWS_CASES_4(ROW)     \
    case 5:               \
        ROW(5);           \
        break;            \
    case 6:               \
        ROW(6);           \
        break;            \
    case 7:               \
        ROW(7);           \
        break;            \
    case 8:               \
        ROW(8);           \
        break;

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The float16 stored at p (a block's d, dmin) as float32: F16C, exact. */
static inline float fp16_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* A bfloat16 bit pattern as float32 (exact). */
static inline float bf16_to_float(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 8 float32 rounded to bfloat16, to nearest even (torch's conversion for finite values), still
 * as float32 (their low 16 bits zero). */
static inline __m256 round8_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 8 float32 to bfloat16 bits, rounded as `round8_bf16` (the weights here). */
static inline __m128i to_bf16(__m256 v) {
    __m256i u = _mm256_srli_epi32(_mm256_castps_si256(round8_bf16(v)), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

/* 8 weights of a dequantized row block at element `at` of `out`: float32, or (`bf16`) bfloat16
 * for a CPU's native bfloat16 GEMM (the blocks' dequantize functions write either). */
static inline void store8(void *out, int bf16, size_t at, __m256 v) {
    if (bf16)
        _mm_storeu_si128((__m128i *)((uint16_t *)out + at), to_bf16(v));
    else
        _mm256_storeu_ps((float *)out + at, v);
}

/* Whether the compiler has AVX512-BF16's and AMX's intrinsics (GCC 10 and 11, clang 9 and 12):
 * where not, the library builds without the paths that use them and never takes them. */
#ifndef HAS_AVX512_BF16
#if defined(__clang__)
#define HAS_AVX512_BF16 (__clang_major__ >= 9)
#else
#define HAS_AVX512_BF16 (__GNUC__ >= 10)
#endif
#endif
#ifndef HAS_AMX
#if defined(__clang__)
#define HAS_AMX (__clang_major__ >= 12)
#else
#define HAS_AMX (__GNUC__ >= 11)
#endif
#endif

#if HAS_AVX512_BF16
/* Functions built for AVX512 with BF16 (bfloat16 conversions of 32 floats at once), called only
 * where `bf16_dequantize()`: the CPUs with a native bfloat16 GEMM, whose prefill takes bfloat16
 * blocks. The library's flags stay AVX2's; these carry their own target. */
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

static inline int bf16_dequantize(void) { return __builtin_cpu_supports("avx512bf16"); }
#endif

/* The file's blocks' products and dequantizations (qkernel_q4k.c, qkernel_q6k.c, qkernel_q8_0.c,
 * qkernel_q4_1.c), which qkernel.c's and qkernel_amx.c's tables index by type code. */
void q4k_product(const float *x, int rows, int k, int n, const uint8_t *blocks, float *y, int threads, int quantize_x);
void q6k_product(const float *x, int rows, int k, int n, const uint8_t *blocks, float *y, int threads, int quantize_x);
void q8_0_product(const float *x, int rows, int k, int n, const uint8_t *blocks, float *y, int threads, int quantize_x);
void q4_1_product(const float *x, int rows, int k, int n, const uint8_t *blocks, float *y, int threads, int quantize_x);
void q4_0_product(const float *x, int rows, int k, int n, const uint8_t *blocks, float *y, int threads, int quantize_x);
/* A product's float32 y [rows][n] as a Linear's output in bfloat16 (`bf16`) or float32
 * (qkernel_row.c): rounded, then silu(gate) * up of its halves where `gated` ([rows][n / 2] out),
 * or plus `residual` where given. */
void row_epilogue(const float *yf, int rows, int n, const void *residual, int gated, void *y, int bf16);
void q4k_dequantize(const uint8_t *blocks, int k, int rows, void *out, int threads, int bf16);
void q6k_dequantize(const uint8_t *blocks, int k, int rows, void *out, int threads, int bf16);
/* One weight row of k inputs (its blocks at `row`) as bfloat16 (Q4_K's and Q6_K's on CPUs with
 * AVX512-BF16): the `*_dequantize` functions' bits, without their OpenMP (qkernel_amx.c calls
 * them row by row). */
void q8_0_row_bf16(const uint8_t *row, int k, uint16_t *out);
#if HAS_AVX512_BF16
AVX512_BF16 void q4k_row_bf16(const uint8_t *row, int k, uint16_t *out);
AVX512_BF16 void q6k_row_bf16(const uint8_t *row, int k, uint16_t *out);
#endif
void q8_0_dequantize(const uint8_t *blocks, int k, int rows, void *out, int threads, int bf16);
void q4_1_dequantize(const uint8_t *blocks, int k, int rows, void *out, int threads, int bf16);
void q4_0_dequantize(const uint8_t *blocks, int k, int rows, void *out, int threads, int bf16);

/* 8 int8 codes as float32. */
static inline __m256 i8_to_ps(const int8_t *c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
}

/* x [k] (k a multiple of 32) as int8 per block of 32: qx = round(x / dx), dx = max|x| / 127. */
void quantize_blocks(const float *x, int k, int8_t *qx, float *dx);

/* `rows` rows of x [rows][k] so, each as `quantize_blocks` rounds it alone: qx [rows][k], dx
 * [rows][k / 32]. */
void quantize_rows(const float *x, int rows, int k, int8_t *qx, float *dx);

/* One output row `i` of a product against one row of int8 x (qx, dx: a row as `quantize_rows`
 * writes it), into y[i]. */
typedef void (*q8_row_fn)(const int8_t *qx, const float *dx, int k, int i, const void *weights, float *y);

/* The int8-x product of the kernels whose rows share no unpacking (int8 per channel, Q8_0): x
 * rounded row by row, each as alone (see `int4_rows_q8`), then every output row against every row
 * of x, the weight row read from cache after the first. Inlined into each caller with its own
 * `row` (a constant there), so the row function is inlined too, not called through the pointer. */
static inline __attribute__((always_inline)) void q8_rows_each(const float *x, int rows, int k, int n, q8_row_fn row,
                                                               const void *weights, float *y, int threads) {
    int8_t *qx = malloc((size_t)rows * k);
    float *dx = malloc((size_t)rows * (k / GROUP) * sizeof *dx);
    quantize_rows(x, rows, k, qx, dx);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < n; i++)
        for (int r = 0; r < rows; r++)
            row(qx + (size_t)r * k, dx + (size_t)r * (k / GROUP), k, i, weights, y + (size_t)r * n);
    free(qx), free(dx);
}

#endif
