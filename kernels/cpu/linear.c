/* y [M, N] = x [M, K] W^T + b on the CPU, float32, with W laid out once in column panels: built
 * and loaded by kernels/cpu/linear.py, whose twin (F.linear) it is checked against.
 *
 * Panels: W [N, K] as [ceil(N / 16), K, 16] (panel p, step k holds W[16p .. 16p + 15, k]; the
 * last panel's missing columns are zeros), so a 6-row x 16-column tile of y is 12 AVX2
 * accumulators fed by two aligned loads of the panel and 6 broadcasts of x per step of K (the
 * loads pinned in registers and the row loop unrolled: else GCC reloads the panel for every row
 * of a shorter tile, which then took as long as a full one or longer). The rows are cut into
 * tiles of even heights (13 = 5 + 4 + 4, not 6 + 6 + 1), since a tile of 1 to 4 rows takes
 * about as long as one of 4 (~70% of a 6-row one). The panels are split between the threads
 * (OpenMP, torch's own runtime), each panel read from memory once and then reused from cache by
 * every row tile; rows come in blocks of about 256 KB of x so that larger products keep x in
 * each core's L2 as well. x rows: stride lda, contiguous
 * within a row. Plain C where the compiler does not target AVX2 + FMA.
 */
#include <stdint.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#define NR 16           /* panel width: y columns per tile */
#define MR 6            /* rows per tile */
#define X_BLOCK (256 * 1024) /* bytes of x rows a block of row tiles holds, at least 96 rows */
#define PREFETCH_STEPS 16    /* steps of K ahead in the panel (one 64-byte line a step) */

/* y[r, j] = bias[j] + sum_k x[r, k] w[k, j] for r < mr, j < cols (cols < NR on the last panel:
 * written through a buffer) */
static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t lda,
                                                      const float *w, int64_t K, const float *bias,
                                                      float *y, int64_t ldy, int64_t cols) {
    float buffer[MR * NR];
    float *out = y;
    int64_t ldo = ldy;
    if (cols < NR) {
        out = buffer;
        ldo = NR;
    }
#ifdef __AVX2__
    __m256 lo[MR], hi[MR];
    const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        lo[r] = b0;
        hi[r] = b1;
    }
    for (int64_t k = 0; k < K; k++) {
        _mm_prefetch((const char *)(w + (k + PREFETCH_STEPS) * NR), _MM_HINT_T0);
        __m256 w0 = _mm256_load_ps(w + k * NR), w1 = _mm256_load_ps(w + k * NR + 8);
        __asm__("" : "+x"(w0), "+x"(w1)); /* kept in registers, not reloaded per row */
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * lda + k);
            lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
            hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(out + r * ldo, lo[r]);
        _mm256_storeu_ps(out + r * ldo + 8, hi[r]);
    }
#else
    float acc[MR][NR];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < NR; j++) acc[r][j] = bias ? bias[j] : 0.f;
    for (int64_t k = 0; k < K; k++)
        for (int r = 0; r < mr; r++) {
            const float xv = x[r * lda + k];
            for (int j = 0; j < NR; j++) acc[r][j] += xv * w[k * NR + j];
        }
    for (int r = 0; r < mr; r++) memcpy(out + r * ldo, acc[r], sizeof(acc[r]));
#endif
    if (cols < NR)
        for (int r = 0; r < mr; r++) memcpy(y + r * ldy, buffer + r * NR, cols * sizeof(float));
}

/* rows m0 .. m1 - 1 of y against panel p */
static void panel_rows(const float *x, int64_t lda, int64_t K, const float *panel,
                       const float *bias, float *y, int64_t N, int64_t p, int64_t m0,
                       int64_t m1) {
    const int64_t cols = N - p * NR < NR ? N - p * NR : NR;
    y += p * NR;
    const int64_t tiles = (m1 - m0 + MR - 1) / MR;
    for (int64_t i = 0, m = m0; i < tiles; i++) { /* tiles of as even heights as can be */
        const int64_t rows = (m1 - m) / (tiles - i) + ((m1 - m) % (tiles - i) != 0);
        const float *xm = x + m * lda;
        float *ym = y + m * N;
        switch (rows) {
            case 6: tile(6, xm, lda, panel, K, bias, ym, N, cols); break;
            case 5: tile(5, xm, lda, panel, K, bias, ym, N, cols); break;
            case 4: tile(4, xm, lda, panel, K, bias, ym, N, cols); break;
            case 3: tile(3, xm, lda, panel, K, bias, ym, N, cols); break;
            case 2: tile(2, xm, lda, panel, K, bias, ym, N, cols); break;
            default: tile(1, xm, lda, panel, K, bias, ym, N, cols); break;
        }
        m += rows;
    }
}

/* x [M, K] (row stride lda), panels [ceil(N / 16), K, 16] (32-byte aligned), bias
 * [16 ceil(N / 16)] or NULL, y [M, N] contiguous */
void cpu_linear(const float *x, int64_t M, int64_t lda, int64_t K, const float *panels,
                const float *bias, int64_t N, float *y) {
    const int64_t count = (N + NR - 1) / NR;
    int64_t block = X_BLOCK / (K * (int64_t)sizeof(float)) / MR * MR;
    if (block < 96) block = 96;
#pragma omp parallel
    for (int64_t m0 = 0; m0 < M; m0 += block) {
        const int64_t m1 = m0 + block < M ? m0 + block : M;
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < count; p++)
            panel_rows(x, lda, K, panels + p * K * NR, bias ? bias + p * NR : 0, y, N, p, m0,
                       m1);
    }
}
