/* Few-row weight-only products over the codes `model/quant.py` holds, with float32 activations
 * (AVX2 + FMA). Built and loaded by `model/kernels/build.py`; `model/kernels/qkernel.py` says why.
 *
 * int4: `packed` is torch's AVX2 int4 packing (`_convert_weight_to_int4pack_for_cpu`): tiles of
 * 32 output rows, one after another; within a tile, input column k is 16 bytes at k * 16, byte
 * b holding row b in its low nibble and row b + 16 in its high one. w = scale * q + minimum per
 * group of 32 inputs (the file's own affine), the factors in one of two forms (`Factors`):
 * - `mult` NULL: `f` is float32 [tiles][groups][2][32], per tile and group the 32 rows' scales
 *   then their minimums;
 * - Q4_K's own (k a multiple of 256): `f` float32 [tiles][k / 256][2][32], per 256 inputs the
 *   rows' d then -dmin, and `mult` uint8 [tiles][groups][2][32], per group the 6-bit sc then m:
 *   scale = d sc, minimum = -dmin m, the same float32 products the loader computes (exact: an
 *   11-bit mantissa times a 6-bit integer), at 3 bytes per 32 weights instead of 8.
 * Tile-major and interleaved so a tile reads its factors as sequential streams: laid out
 * [groups][n] (a 128-byte read per group, n * 4 bytes apart), a 1.5B step's products measured
 * 110 against 84 ms.
 * int8: `codes` [n][k] int8, `scales` [n] bfloat16 (raw bits): w = scale * code.
 * x is float32 [rows][k], y float32 [rows][n]; rows <= 8 (MAX_ROWS).
 *
 * `quantize_x` (k a multiple of 32): each row of x rounded to int8 per block of 32 inputs,
 * x ~ dx * qx with dx = max|x| / 127 (llama.cpp's Q8_0 activations, dx kept in float32), and the
 * products summed as integers (`_mm256_maddubs_epi16`: u8 x s8 pairs into int16), one float
 * multiply-add per block: ~3x fewer vector operations per code than converting codes to float.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "qkernel.h"

#define TILE 32

typedef struct {
    const float *f;
    const uint8_t *mult;
} Factors;

#define SUPER 256

/* Group g's factors for tile t: 32 scales then 32 minimums, read in place or computed into buf. */
static inline const float *group_factors(Factors fa, int k, int t, int g, float *buf) {
    if (!fa.mult) return fa.f + ((size_t)t * (k / GROUP) + g) * 2 * TILE;
    const float *d = fa.f + ((size_t)t * (k / SUPER) + g / (SUPER / GROUP)) * 2 * TILE;
    const uint8_t *u = fa.mult + ((size_t)t * (k / GROUP) + g) * 2 * TILE;
    for (int j = 0; j < 8; j++) {
        __m256 multiple = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 8 * j))));
        _mm256_storeu_ps(buf + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(d + 8 * j), multiple));
    }
    return buf;
}

/* One row of x: per group, a = sum_k x_k q_k for the tile's 32 rows (8 accumulators: two
 * columns in flight, so the FMA chains do not wait on each other), then y += s * a + m * sum(x):
 * the group's minimum factored out, so each code costs one conversion and one FMA. A column's 16
 * bytes are loaded into both 128-bit lanes and spread to 32-bit lanes by in-lane byte shuffles
 * (`_mm256_shuffle_epi8`): the lane-crossing `_mm256_cvtepu8_epi32` measured ~1.5x slower here. */
static void int4_tile_1(const float *x, const float *xsum, int k, int n, int t, const uint8_t *packed,
                        Factors fa, float *y) {
    float buf[2 * TILE];
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
        const float *s = group_factors(fa, k, t, g, buf), *m = s + TILE;
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
                                                               const uint8_t *packed, Factors fa, float *y) {
    float buf[2 * TILE];
    const uint8_t *p = packed + (size_t)t * TILE * (k / 2);
    const __m256i low = _mm256_set1_epi32(0x0F);
    for (int sub = 0; sub < 4; sub++) {
        const uint8_t *ps = p + (sub & 1) * 8;
        const __m128i shift = _mm_cvtsi32_si128((sub >> 1) * 4);
        __m256 acc[MAX_ROWS];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int g = 0; g < k / GROUP; g++) {
            const float *f = group_factors(fa, k, t, g, buf) + sub * 8;
            __m256 s = _mm256_loadu_ps(f), m = _mm256_loadu_ps(f + TILE);
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

/* x [k] (k a multiple of 32) as int8 per block of 32: qx = round(x / dx), dx = max|x| / 127
 * (declared in qkernel.h: qkernel_q6k.c rounds x the same way). */
void quantize_blocks(const float *x, int k, int8_t *qx, float *dx) {
    for (int g = 0; g < k / GROUP; g++) {
        float amax = 0;
        for (int c = 0; c < GROUP; c++) amax = fmaxf(amax, fabsf(x[g * GROUP + c]));
        float d = amax / 127, inv = amax > 0 ? 127 / amax : 0;
        dx[g] = d;
        for (int c = 0; c < GROUP; c++) qx[g * GROUP + c] = (int8_t)lrintf(x[g * GROUP + c] * inv);
    }
}

/* Group g's term of output rows 8 j .. 8 j + 7 of tile t, added to `acc`, from one x row's int16
 * pair sums `a` (`int4_tile_q8`'s a[j]) and its dx d and sum(x) sx: y += dx s sum(qx q) + m
 * sum(x). `s`: the group's float32 factors (NULL with Q4_K's own, read here). One function for
 * every row count, so each row's float operations are the 1-row kernel's, in its order. */
static inline __attribute__((always_inline)) __m256 q8_group_term(__m256i a, int j, __m256 d, __m256 sx, Factors fa,
                                                                  int k, int t, int g, const float *s, __m256 acc) {
    __m256i sum = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(a)),
                                   _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a, 1)));
    if (fa.mult) {
        /* Q4_K's factors in registers: sum * sc stays an exact integer (<= 60960 * 63 < 2^24),
         * times dx d; the minimum's term (-dmin) m sum(x). */
        const float *f = fa.f + ((size_t)t * (k / SUPER) + g / (SUPER / GROUP)) * 2 * TILE;
        const uint8_t *u = fa.mult + ((size_t)t * (k / GROUP) + g) * 2 * TILE;
        __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 8 * j)));
        __m256i mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + TILE + 8 * j)));
        __m256 scaled = _mm256_cvtepi32_ps(_mm256_mullo_epi32(sum, sc));
        acc = _mm256_fmadd_ps(scaled, _mm256_mul_ps(_mm256_loadu_ps(f + 8 * j), d), acc);
        return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(mn), _mm256_loadu_ps(f + TILE + 8 * j)), sx, acc);
    }
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), d), _mm256_loadu_ps(s + 8 * j), acc);
    return _mm256_fmadd_ps(_mm256_loadu_ps(s + TILE + 8 * j), sx, acc);
}

/* One row of int8 x against a tile. Per 4 input columns c..c+3 the tile's 64 bytes are two
 * 32-byte loads, [c | c+1] and [c+2 | c+3]; after the nibble split, `unpack{lo,hi}_epi8` pairs
 * row b's code at column c with its code at c+2 (lane 0) and c+1 with c+3 (lane 1), so one
 * `maddubs` against xv = [x_c, x_c+2] x 8 | [x_c+1, x_c+3] x 8 (built once per call) gives 16
 * int16 partial sums of 8 rows. A group's 8 steps sum at most 8 * 2 * 15 * 127 = 30480 per
 * int16 (|qx| <= 127): no overflow. Per group, y += dx s sum(qx q) + m sum(x). */
static void int4_tile_q8(const int8_t *xv, const float *dx, const float *xsum, int k, int n, int t,
                         const uint8_t *packed, Factors fa, float *y) {
    const uint8_t *p = packed + (size_t)t * TILE * (k / 2);
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int g = 0; g < k / GROUP; g++) {
        __m256i a[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                        _mm256_setzero_si256()};
        for (int c = g * GROUP; c < (g + 1) * GROUP; c += 4) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(p + (size_t)c * 16));
            __m256i w = _mm256_loadu_si256((const __m256i *)(p + (size_t)(c + 2) * 16));
            __m256i vl = _mm256_and_si256(v, low), vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            __m256i wl = _mm256_and_si256(w, low), wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
            __m256i xq = _mm256_loadu_si256((const __m256i *)(xv + (size_t)c * 8));
            a[0] = _mm256_add_epi16(a[0], _mm256_maddubs_epi16(_mm256_unpacklo_epi8(vl, wl), xq));
            a[1] = _mm256_add_epi16(a[1], _mm256_maddubs_epi16(_mm256_unpackhi_epi8(vl, wl), xq));
            a[2] = _mm256_add_epi16(a[2], _mm256_maddubs_epi16(_mm256_unpacklo_epi8(vh, wh), xq));
            a[3] = _mm256_add_epi16(a[3], _mm256_maddubs_epi16(_mm256_unpackhi_epi8(vh, wh), xq));
        }
        float buf[2 * TILE];
        const float *s = fa.mult ? NULL : group_factors(fa, k, t, g, buf);
        __m256 d = _mm256_broadcast_ss(dx + g), sx = _mm256_broadcast_ss(xsum + g);
        for (int j = 0; j < 4; j++) acc[j] = q8_group_term(a[j], j, d, sx, fa, k, t, g, s, acc[j]);
    }
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(y + t * TILE + 8 * j, acc[j]);
}

/* R rows of int8 x against a tile, each row's numbers `int4_tile_q8`'s for it alone: the same
 * integer sums (exact, in any order) and `q8_group_term` per group and 8 output rows. A half of
 * the tile at a time (the low nibbles: its rows 0-15; the high: 16-31), so a column pair's
 * codes are split and paired once for all R rows (two accumulators a row; runs of up to 4 rows),
 * where calling the 1-row kernel per row split them R times (~half its operations). */
static inline __attribute__((always_inline)) void int4_tile_q8_rows(const int R, const int8_t *xv, const float *dx,
                                                                    const float *xsum, int k, int n, int t,
                                                                    const uint8_t *packed, Factors fa, float *y) {
    const uint8_t *p = packed + (size_t)t * TILE * (k / 2);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const int groups = k / GROUP;
    for (int half = 0; half < 2; half++) {
        __m256 acc[MAX_ROWS][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int g = 0; g < groups; g++) {
            __m256i a[MAX_ROWS][2];
            for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
            for (int c = g * GROUP; c < (g + 1) * GROUP; c += 4) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(p + (size_t)c * 16));
                __m256i w = _mm256_loadu_si256((const __m256i *)(p + (size_t)(c + 2) * 16));
                if (half) v = _mm256_srli_epi16(v, 4), w = _mm256_srli_epi16(w, 4);
                v = _mm256_and_si256(v, low), w = _mm256_and_si256(w, low);
                __m256i lo = _mm256_unpacklo_epi8(v, w), hi = _mm256_unpackhi_epi8(v, w);
                for (int r = 0; r < R; r++) {
                    __m256i xq = _mm256_loadu_si256((const __m256i *)(xv + (size_t)r * k * 8 + (size_t)c * 8));
                    a[r][0] = _mm256_add_epi16(a[r][0], _mm256_maddubs_epi16(lo, xq));
                    a[r][1] = _mm256_add_epi16(a[r][1], _mm256_maddubs_epi16(hi, xq));
                }
            }
            float buf[2 * TILE];
            const float *s = fa.mult ? NULL : group_factors(fa, k, t, g, buf);
            for (int r = 0; r < R; r++) {
                __m256 d = _mm256_broadcast_ss(dx + (size_t)r * groups + g);
                __m256 sx = _mm256_broadcast_ss(xsum + (size_t)r * groups + g);
                for (int j = 0; j < 2; j++)
                    acc[r][j] = q8_group_term(a[r][j], 2 * half + j, d, sx, fa, k, t, g, s, acc[r][j]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 2; j++)
                _mm256_storeu_ps(y + (size_t)r * n + t * TILE + 8 * (2 * half + j), acc[r][j]);
    }
}

/* xv for `int4_tile_q8`: per 4 columns, 32 bytes [x_c, x_c+2] x 8 then [x_c+1, x_c+3] x 8. */
static void pair_columns(const int8_t *qx, int k, int8_t *xv) {
    for (int c = 0; c < k; c += 4)
        for (int b = 0; b < 16; b += 2) {
            xv[c * 8 + b] = qx[c], xv[c * 8 + b + 1] = qx[c + 2];
            xv[c * 8 + 16 + b] = qx[c + 1], xv[c * 8 + 16 + b + 1] = qx[c + 3];
        }
}

/* sum(x) per group of one row: the minimum's term of the 1-row paths. */
static void group_sums(const float *x, int k, float *xsum) {
    for (int g = 0; g < k / GROUP; g++) {
        float s = 0;
        for (int c = 0; c < GROUP; c++) s += x[g * GROUP + c];
        xsum[g] = s;
    }
}

void quantize_rows(const float *x, int rows, int k, int8_t *qx, float *dx) {
    for (int r = 0; r < rows; r++) quantize_blocks(x + (size_t)r * k, k, qx + (size_t)r * k, dx + (size_t)r * (k / GROUP));
}

/* int8 x, any rows: each row is the 1-row product's computation (the same integer sums and float
 * operations in the same order, so the same bits as that row alone: a sequence's decode does
 * not depend on the batch it runs in), runs of up to 4 rows sharing a tile's unpacked codes
 * (`int4_tile_q8_rows`). 2-8 rows of float32 x cost ~5x a 1-row step (each code converted to
 * float, R FMAs); these ~1.6-3.9x (RESULTS.md, "Q8_0 in its own blocks, int8 activations ..."). */
static void int4_rows_q8(const float *x, int rows, int k, int n, const uint8_t *packed, Factors fa, float *y,
                         int threads) {
    const int groups = k / GROUP;
    int8_t *qx = malloc((size_t)rows * k), *xv = malloc((size_t)rows * k * 8);
    float *dx = malloc((size_t)rows * groups * sizeof *dx), *xsum = malloc((size_t)rows * groups * sizeof *xsum);
    quantize_rows(x, rows, k, qx, dx);
    for (int r = 0; r < rows; r++) {
        group_sums(x + (size_t)r * k, k, xsum + (size_t)r * groups);
        pair_columns(qx + (size_t)r * k, k, xv + (size_t)r * k * 8);
    }
#define ROW(R) (R == 1 ? int4_tile_q8(v, d, xs, k, n, t, packed, fa, yr) : int4_tile_q8_rows(R, v, d, xs, k, n, t, packed, fa, yr))
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < n / TILE; t++) {
        /* Rows in runs of at most 4 (a run's accumulators in registers). */
        for (int r = 0; r < rows; r += 4) {
            const int8_t *v = xv + (size_t)r * k * 8;
            const float *d = dx + (size_t)r * groups, *xs = xsum + (size_t)r * groups;
            float *yr = y + (size_t)r * n;
            switch (rows - r < 4 ? rows - r : 4) { ROWS_CASES_4(ROW) }
        }
    }
#undef ROW
    free(qx), free(xv), free(dx), free(xsum);
}

void int4_product(const float *x, int rows, int k, int n, const uint8_t *packed, const float *factors,
                  const uint8_t *multipliers, float *y, int threads, int quantize_x) {
    Factors fa = {factors, multipliers};
    if (quantize_x) {
        int4_rows_q8(x, rows, k, n, packed, fa, y, threads);
        return;
    }
    float xsum[k / GROUP];
    if (rows == 1) group_sums(x, k, xsum);
#define ROW(R) (R == 1 ? int4_tile_1(x, xsum, k, n, t, packed, fa, y) : int4_tile_r(R, x, k, n, t, packed, fa, y))
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < n / TILE; t++) {
        switch (rows) { ROWS_CASES_8(ROW) }
    }
#undef ROW
}

/* Prefill's B: weight rows [start, start + rows) (whole tiles) as float32 [k][rows], w = s q + m
 * per group with the part's factors, as `dequant.int4_block` lays it out and with its values bit
 * for bit (a product, then a sum: two roundings, as its `addcmul`). A column's 16 bytes are the
 * tile's 32 rows in order once split into nibbles (low: rows 0-15, high: 16-31), so each column
 * writes 32 contiguous floats. torch's unpacking passes took ~1 ns a weight: a prefill piece
 * dequantizes every weight again: 16% of a 1.5B prefill in pieces of 256 tokens (py-spy). */
void int4_dequantize(const uint8_t *packed, const float *factors, const uint8_t *multipliers, int k, int start,
                     int rows, float *out, int threads) {
    Factors fa = {factors, multipliers};
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int tl = 0; tl < rows / TILE; tl++) {
        float buf[2 * TILE];
        const int t = start / TILE + tl;
        const uint8_t *p = packed + (size_t)t * TILE * (k / 2);
        const __m128i low = _mm_set1_epi8(0x0F);
        for (int g = 0; g < k / GROUP; g++) {
            const float *f = group_factors(fa, k, t, g, buf);
            __m256 s[4], m[4];
            for (int j = 0; j < 4; j++) s[j] = _mm256_loadu_ps(f + 8 * j), m[j] = _mm256_loadu_ps(f + TILE + 8 * j);
            for (int c = g * GROUP; c < (g + 1) * GROUP; c++) {
                __m128i v = _mm_loadu_si128((const __m128i *)(p + (size_t)c * 16));
                __m128i half[2] = {_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low)};
                float *o = out + (size_t)c * rows + tl * TILE;
                for (int j = 0; j < 4; j++) {
                    __m128i bytes = j & 1 ? _mm_srli_si128(half[j / 2], 8) : half[j / 2];
                    __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
                    _mm256_storeu_ps(o + 8 * j, _mm256_add_ps(_mm256_mul_ps(q, s[j]), m[j]));
                }
            }
        }
    }
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

/* One weight row against int8 x: |code| (unsigned) times x with the code's sign, pairs summed by
 * `maddubs` (at most 2 * 128 * 127 = 32512: no saturation), then to int32 and one float
 * multiply-add per block of 32 (its dx); two accumulators, so the chains overlap. */
typedef struct {
    const int8_t *codes;
    const uint16_t *scales;
} Int8Weights;

static inline void int8_row_q8(const int8_t *qx, const float *dx, int k, int i, const void *weights, float *y) {
    const Int8Weights *w8 = weights;
    const int8_t *c = w8->codes + (size_t)i * k;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int g = 0; g < k / GROUP; g++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(c + g * GROUP));
        __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + g * GROUP));
        __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
        __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
        acc[g & 1] = _mm256_fmadd_ps(sum, _mm256_broadcast_ss(dx + g), acc[g & 1]);
    }
    y[i] = hsum(_mm256_add_ps(acc[0], acc[1])) * bf16_to_float(w8->scales[i]);
}

void int8_product(const float *x, int rows, int k, int n, const int8_t *codes, const uint16_t *scales, float *y,
                  int threads, int quantize_x) {
    if (quantize_x) {
        q8_rows_each(x, rows, k, n, int8_row_q8, &(Int8Weights){codes, scales}, y, threads);
        return;
    }
#define ROW(R) int8_row(R, x, k, n, i, codes, scales, y)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < n; i++) {
        switch (rows) { ROWS_CASES_8(ROW) }
    }
#undef ROW
}

/* The file's blocks' products (qkernel_q4k.c, qkernel_q6k.c, qkernel_q8_0.c, qkernel_q4_1.c) by
 * type code (`qkernel.py`'s `BLOCK_CODES`: 0 Q4_K, 1 Q6_K, 2 Q8_0, 3 Q4_1, 4 Q4_0). */
typedef void (*blocks_product_fn)(const float *, int, int, int, const uint8_t *, float *, int, int);
static const blocks_product_fn BLOCKS_PRODUCT[] = {q4k_product, q6k_product, q8_0_product, q4_1_product, q4_0_product};

/* `BLOCKS_PRODUCT[qtype]` for x and y in the model's type (`bf16`: raw bfloat16 bits, x widened
 * to float32, exact, and y rounded to nearest even, torch's conversion of finite values: the
 * float32 call's bits and torch's `.to(torch.bfloat16)` of them), without the tensors a decode
 * step's Python made for each product (~120 products a SmolLM2 token); a `Linear`'s residual add
 * or SwiGLU after it where asked (`row_epilogue`, qkernel_row.c). */
void blocks_product_rows(int qtype, const void *x, int rows, int k, int n, const uint8_t *blocks, void *y, int threads,
                         int quantize_x, const void *residual, int gated, int bf16) {
    float *xf = NULL, *yf = malloc((size_t)rows * n * sizeof *yf);
    if (bf16) {
        xf = malloc((size_t)rows * k * sizeof *xf);
        for (size_t i = 0; i < (size_t)rows * k; i++) xf[i] = bf16_to_float(((const uint16_t *)x)[i]);
    }
    BLOCKS_PRODUCT[qtype](bf16 ? xf : (const float *)x, rows, k, n, blocks, yf, threads, quantize_x);
    row_epilogue(yf, rows, n, residual, gated, y, bf16);
    free(xf), free(yf);
}

/* The team a kernel's OpenMP region gets when passed `threads` (every region here opens with
 * `num_threads(threads) if (threads > 1)`, `threads` torch's count), and this library's OpenMP
 * default: tests check both equal torch's count, so one `threads.set_threads` sets torch's and ours. */
int omp_team(int threads) {
    int team = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp single
        team = omp_get_num_threads();
    }
    return team;
}

int omp_default_threads(void) { return omp_get_max_threads(); }
