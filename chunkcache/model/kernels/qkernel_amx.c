/* Prefill's bfloat16 GEMMs on AMX (Intel's tile units), built into the same library as qkernel.c by
 * `model/kernels/qkernel.py`: y = x w^T for a bfloat16 x [m][k] and a dequantized bfloat16 block of weight
 * rows w [n][k] (`dequant.blockwise_product`, where the CPU has AMX-BF16).
 *
 * Why not torch's GEMM: each call of it over a freshly dequantized block repacks the block into
 * the tiles' pair-interleaved layout first, and a prefill step multiplies every weight once, so
 * that repacking is paid per weight per step: 0.43-0.96 TFLOP/s at 100-267 rows of x on the
 * 1.5B's shapes (one thread). Here the weights are the tiles' A operand as they lie (16 rows of 32
 * inputs, row stride k) and x, small, is packed once per product as the B operand
 * (`amx_pack_x`): 0.80-1.13 TFLOP/s on the same shapes. The C tiles hold y transposed (weight
 * rows by x rows), written out as bfloat16 rounded to nearest even, as torch's GEMM rounds its
 * float32 sums.
 *
 * `amx_blocks_product` takes the file's blocks themselves where k fits one pass: each thread
 * dequantizes 32 weight rows at a time into a scratch that stays in L2 and runs every x row over
 * them, so the dequantized weight never goes through memory (the 1.5B's gate alone, at 100 rows
 * of x: 5.2 -> 3.8 ms against dequantized 2,048-row blocks and `amx_product`, at 267 rows 8.6 ->
 * 7.4; in the engine ~3% of a prefill).
 *
 * Blocking: 2 A tiles (32 weight rows) x 2 B tiles (32 x rows) -> 4 C tiles (the 8 tile
 * registers); the inputs in passes of `KSEG` so that a pass's x tiles and weight rows stay in L2
 * (k = 8,960: 0.69 -> 1.02 TFLOP/s), partial sums kept in float32 between passes. Weight rows are
 * split over `threads` (OpenMP), each C tile one thread's sums: the same numbers at any count.
 */
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <omp.h>

#include "qkernel.h"

#if HAS_AMX
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#define KSEG 1536 /* inputs per pass */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 1 where the CPU has AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24, 22) and AVX512-BF16, and the
 * kernel lets this process use the tile registers (Linux asks each process to request them). */
int amx_ready(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return 0;
    if (!__builtin_cpu_supports("avx512bf16")) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* x bf16 [m][k] -> xp: per 16 rows (zero past m) and 32 inputs, one B tile of 16 x 16 dwords,
 * dword (p, j) = x[16 t + j][32 c + 2 p .. + 1]: each tile a 16 x 16 dword transpose in registers
 * (unpacks of dwords and qwords within 128-bit lanes, then the lanes): 267 x 1,536 0.066 -> 0.029
 * ms against a scalar copy. */
AMX void amx_pack_x(const uint16_t *x, int m, int k, uint32_t *xp) {
    const int tiles = (m + 15) / 16, chunks = k / 32;
    for (int t = 0; t < tiles; t++)
        for (int ch = 0; ch < chunks; ch++) {
            __m512i r[16], a[16], b[16];
            for (int j = 0; j < 16; j++)
                r[j] = 16 * t + j < m ? _mm512_loadu_si512(x + (size_t)(16 * t + j) * k + 32 * ch) : _mm512_setzero_si512();
            for (int i = 0; i < 8; i++) {
                a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
                a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
            }
            for (int i = 0; i < 4; i++) { /* b[4 i + q], lane L: rows 4 i .. 4 i + 3 at dword 4 L + q */
                b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
                b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
                b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
                b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
            }
            uint32_t *tile = xp + ((size_t)t * chunks + ch) * 256;
            for (int q = 0; q < 4; q++) { /* dword p = 4 L + q: lane L of b[q], b[4 + q], b[8 + q], b[12 + q] */
                const __m512i c0 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0x44), c1 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0xEE);
                const __m512i d0 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0x44);
                const __m512i d1 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0xEE);
                _mm512_storeu_si512(tile + 16 * q, _mm512_shuffle_i32x4(c0, d0, 0x88));
                _mm512_storeu_si512(tile + 16 * (4 + q), _mm512_shuffle_i32x4(c0, d0, 0xDD));
                _mm512_storeu_si512(tile + 16 * (8 + q), _mm512_shuffle_i32x4(c1, d1, 0x88));
                _mm512_storeu_si512(tile + 16 * (12 + q), _mm512_shuffle_i32x4(c1, d1, 0xDD));
            }
        }
}

/* A C tile c [16 weight rows][16 x rows] (float32) as y[j][0..15] in bfloat16 for x rows j < rows_m. */
static AMX void store_transposed(const float *c, int rows_m, uint16_t *y, int ldy) {
    for (int j = 0; j < rows_m; j++) {
        __m512 col = _mm512_i32gather_ps(_mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240), c + j, 4);
        _mm256_storeu_si256((__m256i *)(y + (size_t)j * ldy), (__m256i)_mm512_cvtneps_pbh(col));
    }
}

/* The next 32 weight rows' dequantization, spread over this group's tile products a row at a time
 * (`amx_blocks_product`): the tile unit runs a group's products while the vector units dequantize
 * the next group (done one after the other, a group's dequantization cost as much as its products
 * at 100 rows of x). `due`: the chunk count after which the next row is due. */
typedef struct {
    void (*row)(const uint8_t *, int, uint16_t *);
    const uint8_t *blocks; /* the next group's first row's blocks */
    int row_bytes, k, rows_done, chunks_done, chunks_total, due; /* k: a row's inputs in this pass */
    uint16_t *out; /* the next group's rows [32][k] */
} pipeline;

static inline void pipeline_row(pipeline *p) {
    p->row(p->blocks + (size_t)p->rows_done * p->row_bytes, p->k, p->out + (size_t)p->rows_done * p->k);
    p->rows_done++;
}

/* The rows not yet dequantized (all of them before a thread's first group; after a group's
 * products, those left when it had fewer chunk passes than rows). */
static void pipeline_finish(pipeline *p) {
    while (p->row && p->rows_done < 32) pipeline_row(p);
}

static inline __attribute__((always_inline)) void pipeline_step(pipeline *p) {
    if (!p || ++p->chunks_done < p->due) return;
    pipeline_row(p);
    p->due = p->rows_done < 32 ? (int)((long)(p->rows_done + 1) * p->chunks_total / 32) : 0x7fffffff;
}

/* C tiles of weight rows n0..n0+31 against x tiles mt (and mt + 1 where `two`) over chunks
 * [c0, c1) (`w0`: the first row's chunk c0, rows `lda` apart): accumulated from `acc` unless the
 * first pass; stored to `acc`, or as bf16 into y on the last pass (`acc` is read only between
 * passes). */
static inline __attribute__((always_inline)) AMX void tile_pass(const int two, const uint32_t *xp, int m, int k, const uint16_t *w0,
                                                   int lda, int n0, int mt, int mtiles, int c0, int c1, float *acc, uint16_t *y, int ldy,
                                                   float (*c)[256], pipeline *p) {
    const int chunks = k / 32;
    const uint16_t *w1 = w0 + (size_t)16 * lda;
    const uint32_t *b0 = xp + (size_t)mt * chunks * 256, *b1 = b0 + (size_t)chunks * 256;
    const size_t a00 = ((size_t)(n0 / 16) * mtiles + mt) * 256, a10 = a00 + (size_t)mtiles * 256;
    if (c0 == 0) {
        _tile_zero(0); _tile_zero(2);
        if (two) { _tile_zero(1); _tile_zero(3); }
    } else {
        _tile_loadd(0, acc + a00, 64); _tile_loadd(2, acc + a10, 64);
        if (two) { _tile_loadd(1, acc + a00 + 256, 64); _tile_loadd(3, acc + a10 + 256, 64); }
    }
    for (int ch = c0; ch < c1; ch++) {
        _tile_loadd(4, w0 + 32 * (ch - c0), 2 * lda);
        _tile_loadd(5, w1 + 32 * (ch - c0), 2 * lda);
        _tile_loadd(6, b0 + 256 * ch, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
            _tile_loadd(7, b1 + 256 * ch, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        pipeline_step(p);
    }
    if (c1 < chunks) {
        _tile_stored(0, acc + a00, 64); _tile_stored(2, acc + a10, 64);
        if (two) { _tile_stored(1, acc + a00 + 256, 64); _tile_stored(3, acc + a10 + 256, 64); }
        return;
    }
    _tile_stored(0, c[0], 64); _tile_stored(2, c[2], 64);
    const int m0 = 16 * mt, r0 = m - m0 < 16 ? m - m0 : 16;
    store_transposed(c[0], r0, y + (size_t)m0 * ldy + n0, ldy);
    store_transposed(c[2], r0, y + (size_t)m0 * ldy + n0 + 16, ldy);
    if (two) {
        _tile_stored(1, c[1], 64); _tile_stored(3, c[3], 64);
        const int r1 = m - m0 - 16 < 16 ? m - m0 - 16 : 16;
        store_transposed(c[1], r1, y + (size_t)(m0 + 16) * ldy + n0, ldy);
        store_transposed(c[3], r1, y + (size_t)(m0 + 16) * ldy + n0 + 16, ldy);
    }
}

/* Every x tile (in pairs, then a last one) against 32 weight rows from `w0` (`tile_pass`), over chunks [c0, c1). */
static inline __attribute__((always_inline)) AMX void x_tiles(const uint32_t *xp, int m, int k, const uint16_t *w0, int lda, int n0,
                                                 int c0, int c1, float *acc, uint16_t *y, int ldy, float (*c)[256],
                                                 pipeline *p) {
    const int mtiles = (m + 15) / 16;
    int mt = 0;
    for (; mt + 1 < mtiles; mt += 2) tile_pass(1, xp, m, k, w0, lda, n0, mt, mtiles, c0, c1, acc, y, ldy, c, p);
    if (mt < mtiles) tile_pass(0, xp, m, k, w0, lda, n0, mt, mtiles, c0, c1, acc, y, ldy, c, p);
}

/* This thread's tiles: all 8 of 16 rows of 64 bytes (palette 1). */
static AMX void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* y [m][0..n) (row stride ldy, bfloat16) = x w^T: w bfloat16 [n][k] row-major, n and k multiples
 * of 32; xp is x packed by `amx_pack_x`. */
AMX void amx_product(const uint32_t *xp, int m, int k, const uint16_t *w, int n, uint16_t *y, int ldy, int threads) {
    const int chunks = k / 32, mtiles = (m + 15) / 16, seg = KSEG / 32;
    float *acc = chunks > seg ? aligned_alloc(64, (size_t)(n / 16) * mtiles * 1024) : NULL;
    for (int c0 = 0; c0 < chunks; c0 += seg) {
        const int c1 = c0 + seg < chunks ? c0 + seg : chunks;
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            configure_tiles();
            float c[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
            for (int n0 = 0; n0 < n; n0 += 32) x_tiles(xp, m, k, w + (size_t)n0 * k + 32 * c0, k, n0, c0, c1, acc, y, ldy, c, NULL);
            _tile_release();
        }
    }
    free(acc);
}

/* The library's dequantizations by block type (`qtype`: 0 Q4_K, 1 Q6_K, 2 Q8_0, 3 Q4_1, 4 Q4_0), each writing
 * bfloat16 rows when its last argument is 1; `ROW_BF16`: one row without OpenMP, where written. */
typedef void (*dequantize_fn)(const uint8_t *, int, int, void *, int, int);
static const dequantize_fn DEQUANTIZE[] = {q4k_dequantize, q6k_dequantize, q8_0_dequantize, q4_1_dequantize,
                                            q4_0_dequantize};
static void (*const ROW_BF16[])(const uint8_t *, int, uint16_t *) = {q4k_row_bf16, q6k_row_bf16, q8_0_row_bf16, NULL,
                                                                      NULL};

/* The next group's rows' inputs [c0, c1) (chunks) into `out` [32][32 (c1 - c0)]: a row at a time
 * over the `pairs` x tile pairs' chunk passes of this group's products where the type has a
 * `ROW_BF16` (`pipeline`), else at once. `blocks`: the group's first row. */
static void next_group(pipeline *p, int qtype, const uint8_t *blocks, int row_bytes, int k, int c0, int c1, int pairs,
                       uint16_t *out) {
    const int seg = 32 * (c1 - c0), total = pairs * (c1 - c0);
    *p = (pipeline){ROW_BF16[qtype], blocks + (size_t)row_bytes * 32 * c0 / k, row_bytes, seg, 0, 0, total, total / 32, out};
    if (!p->row) DEQUANTIZE[qtype](blocks, k, 32, out, 1, 1); /* one pass only (`amx_blocks_product`) */
}

/* y [m][0..n) (row stride ldy, bfloat16) = x w^T for a weight held as `qtype`'s blocks (`blocks`
 * [n] rows of `row_bytes`; n a multiple of 32, k of 32; beyond KSEG inputs only for a type with a
 * `ROW_BF16`, its blocks within a pass); xp is x packed by `amx_pack_x`. The inputs go in passes of
 * KSEG (partial sums in float32 between them, as `amx_product`); in a pass each thread takes a
 * range of groups of 32 weight rows, dequantized into one of two L2-sized scratches: the next
 * group's rows between this group's tile products (`pipeline`), else at once before them (the
 * same sums in the same order either way). */
AMX void amx_blocks_product(int qtype, const uint32_t *xp, int m, int k, const uint8_t *blocks, int row_bytes, int n,
                            uint16_t *y, int ldy, int threads) {
    const int groups = n / 32, chunks = k / 32, mtiles = (m + 15) / 16, pairs = (mtiles + 1) / 2, seg = KSEG / 32;
    float *acc = chunks > seg ? aligned_alloc(64, (size_t)(n / 16) * mtiles * 1024) : NULL;
    for (int c0 = 0; c0 < chunks; c0 += seg) {
        const int c1 = c0 + seg < chunks ? c0 + seg : chunks;
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            configure_tiles(); /* the dequantizations use no tiles */
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int g0 = (int)((long)groups * t / nt), g1 = (int)((long)groups * (t + 1) / nt);
            uint16_t *scratch[2] = {aligned_alloc(64, (size_t)32 * KSEG * 2), aligned_alloc(64, (size_t)32 * KSEG * 2)};
            float c[4][256] __attribute__((aligned(64)));
            pipeline p;
            if (g0 < g1) {
                next_group(&p, qtype, blocks + (size_t)g0 * 32 * row_bytes, row_bytes, k, c0, c1, pairs, scratch[0]);
                pipeline_finish(&p);
            }
            for (int g = g0; g < g1; g++) {
                uint16_t *now = scratch[(g - g0) & 1];
                const int more = g + 1 < g1;
                if (more)
                    next_group(&p, qtype, blocks + (size_t)(g + 1) * 32 * row_bytes, row_bytes, k, c0, c1, pairs,
                               scratch[(g - g0 + 1) & 1]);
                x_tiles(xp, m, k, now, 32 * (c1 - c0), 32 * g, c0, c1, acc, y, ldy, c, more && p.row ? &p : NULL);
                if (more) pipeline_finish(&p);
            }
            _tile_release();
            free(scratch[0]);
            free(scratch[1]);
        }
    }
    free(acc);
}
#endif /* HAS_AMX */
