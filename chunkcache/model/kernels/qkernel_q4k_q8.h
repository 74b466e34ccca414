/* Q4_K's int8-x product (`qkernel_q4k.c`), included there once per dot product instruction:
 * `Q4K_DOT(q, xq)` gives 8 int32 lanes, each the sum of 4 consecutive products of unsigned codes q
 * and signed x: AVX2's `maddubs` + `madd` with ones (pairs <= 2 * 15 * 127: no saturation), or
 * AVX-VNNI's `dpbusd`, one instruction. Both sums are exact, so both builds give the same bits
 * (tests/test_qkernel_blocks.py); `Q4K_NAME(f)` names each build's functions, `Q4K_TARGET` its
 * instruction set. */

/* Weight row i against R rows of int8 x (qx, dx per block of 32) and their sums per 32 (xsum: dx
 * sum qx); each row k apart. Per block, each row's 8 factors dx sc (one vector); per sub-block the
 * integer sum to float times its factor, into A accumulators a row (4 for 1 row: one chain of
 * dependent FMAs measured ~1.5x slower). Each row's operations are those of R == 1 in the same
 * order (its bits those of its product alone); a chunk's codes are unpacked once for all R rows. */
static inline __attribute__((always_inline)) Q4K_TARGET void Q4K_NAME(row_q8)(const int R, const int8_t *qx,
                                                                             const float *dx, const float *xsum, int k,
                                                                             int n, int i, const uint8_t *blocks, float *y) {
    enum { A = 4 };
    const uint8_t *row = blocks + (size_t)i * (k / QK) * BLOCK_BYTES;
    const int groups = k / GROUP;
    const __m256i low = _mm256_set1_epi8(0x0F);
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
                    const __m256 p = _mm256_cvtepi32_ps(Q4K_DOT(q[h], xq));
                    part[r][s % A] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&f[r][s]), part[r][s % A]);
                }
            }
        }
        const __m256 d = _mm256_set1_ps(fp16_to_float(blk)), dm = _mm256_mul_ps(m, _mm256_set1_ps(fp16_to_float(blk + 2)));
        for (int r = 0; r < R; r++) {
            const __m256 sum = _mm256_add_ps(_mm256_add_ps(part[r][0], part[r][1]), _mm256_add_ps(part[r][2], part[r][3]));
            acc[r] = _mm256_fmadd_ps(sum, d, acc[r]);
            mins[r] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(xsum + (size_t)r * groups + (size_t)b * 8), mins[r]);
        }
    }
    for (int r = 0; r < R; r++) y[(size_t)r * n + i] = hsum(acc[r]) - hsum(mins[r]);
}

/* x float32 [rows][k] rounded to int8 per block of 32, each row as alone, times the weight:
 * y float32 [rows][n], runs of at most 4 rows sharing a chunk's codes. Exported, both builds, so
 * that tests compare their bits (`q4k_product` calls the one the CPU runs best). */
Q4K_TARGET void Q4K_NAME(rows_q8)(const float *x, int rows, int k, int n, const uint8_t *blocks, float *y,
                                          int threads) {
    const int groups = k / GROUP;
    int8_t *qx = malloc((size_t)rows * k);
    float *dx = malloc((size_t)rows * groups * sizeof *dx), *xsum = malloc((size_t)rows * groups * sizeof *xsum);
    quantize_rows(x, rows, k, qx, dx);
    for (int g = 0; g < rows * groups; g++) { /* the rounded x's sums: see qkernel_q4k.c */
        int s = 0;
        for (int c = 0; c < GROUP; c++) s += qx[(size_t)g * GROUP + c];
        xsum[g] = dx[g] * (float)s;
    }
#define ROW(R)                                                                                                    \
    Q4K_NAME(row_q8)(R, qx + (size_t)r * k, dx + (size_t)r * groups, xsum + (size_t)r * groups, k, n, i, blocks, \
                     y + (size_t)r * n)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int i = 0; i < n; i++)
        for (int r = 0; r < rows; r += 4) {
            switch (rows - r < 4 ? rows - r : 4) { ROWS_CASES_4(ROW) }
        }
#undef ROW
    free(qx), free(dx), free(xsum);
}
