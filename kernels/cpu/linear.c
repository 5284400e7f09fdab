/* y [M, N] = x [M, K] W^T + b on the CPU, float32, with W laid out once in column panels: built
 * and loaded by kernels/cpu/linear.py, whose twin (F.linear) it is checked against; and the
 * same product reduced to each row's argmax without writing y (the greedy rows' lm_head).
 *
 * Panels: W [N, K] as [ceil(N / 16), K, 16] (panel p, step k holds W[16p .. 16p + 15, k]; the
 * last panel's missing columns are zeros). A tile is mr rows x 16 columns of y against one
 * panel. With AVX-512 a panel step is one register, and a tile holds up to MR = 24 rows (24
 * accumulators + the panel's register of 32): a decode step of <= 24 rows reads each panel once,
 * with its FMAs overlapping the stream, where 6-row tiles read it from memory once and then
 * stalled on it, and at 16 rows ran at ~90 GFLOP/s. With AVX2 (no AVX-512) a tile is 12
 * accumulators of 8 lanes, 6 rows, the panel's two loads pinned in registers (else GCC reloads
 * them per row of a shorter tile). The rows are cut into tiles of even heights (13 = 7 + 6, not
 * 12 + 1). The panels are split between the threads (OpenMP, torch's own runtime), each panel
 * read from memory once and then reused from cache by every row tile; rows come in blocks of
 * about 256 KB of x so that larger products keep x in each core's L2 as well. x rows: stride
 * lda, contiguous within a row. Plain C where the compiler targets neither.
 *
 * Every y[r, j] is the same chain of FMAs over k whatever the tile height, so the argmax entry
 * sees exactly the values the product writes: its argmax is that of the written logits, the
 * first maximum on ties (NaN above everything, as torch.argmax).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "argmax.h"

#ifdef __AVX512F__
#define MR 24 /* rows per tile, at most */
#else
#define MR 6
#endif
#define X_BLOCK (256 * 1024) /* bytes of x rows a block of row tiles holds, at least 96 rows */
/* Lines of the panel asked for ahead of the tile, into L2 (one 64-byte line a step of K): 8 KB
 * ahead, where 1 KB into L1 left a single-thread step of 8 rows at 62 ms for 36 ms of weights
 * (measured: 43 ms; at 16 rows 60 -> 54 ms). */
#define PREFETCH_STEPS 128
/* Below this many multiply-adds a product runs on one thread: forking the team costs more than
 * it saves, and far more when another process holds the other core. */
#define PARALLEL_MACS (1 << 18)

/* out[r, j] = bias[j] + sum_k x[r, k] w[k, j] for r < mr, j < cols (cols < NR: the last panel);
 * each step of K asks for the panel's line PREFETCH_STEPS ahead (into the next panel at its
 * end: a thread's panels are contiguous) */
static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t lda,
                                                      const float *w, int64_t K, const float *bias,
                                                      float *out, int64_t ldo, int64_t cols) {
#if defined(__AVX512F__)
    __m512 acc[MR];
    const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
#pragma GCC unroll 24
    for (int r = 0; r < mr; r++) acc[r] = b;
    for (int64_t k = 0; k < K; k++) {
        _mm_prefetch((const char *)(w + (k + PREFETCH_STEPS) * NR), _MM_HINT_T1);
        __m512 wv = _mm512_loadu_ps(w + k * NR);
        __asm__("" : "+v"(wv)); /* kept in a register, not reloaded per row */
#pragma GCC unroll 24
        for (int r = 0; r < mr; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * lda + k]), wv, acc[r]);
    }
    const __mmask16 mask = (__mmask16)((1u << cols) - 1);
#pragma GCC unroll 24
    for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(out + r * ldo, mask, acc[r]);
#else
    float buffer[MR * NR];
    float *o = out;
    int64_t ld = ldo;
    if (cols < NR) {
        o = buffer;
        ld = NR;
    }
#if defined(__AVX2__)
    __m256 lo[MR], hi[MR];
    const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        lo[r] = b0;
        hi[r] = b1;
    }
    for (int64_t k = 0; k < K; k++) {
        _mm_prefetch((const char *)(w + (k + PREFETCH_STEPS) * NR), _MM_HINT_T1);
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
        _mm256_storeu_ps(o + r * ld, lo[r]);
        _mm256_storeu_ps(o + r * ld + 8, hi[r]);
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
    for (int r = 0; r < mr; r++) memcpy(o + r * ld, acc[r], sizeof(acc[r]));
#endif
    if (cols < NR)
        for (int r = 0; r < mr; r++) memcpy(out + r * ldo, buffer + r * NR, cols * sizeof(float));
#endif
}

#define TILE(n) \
    case n: tile(n, x, lda, w, K, bias, out, ldo, cols); break;

/* tile() with mr a constant, for 1 <= rows <= MR */
static void any_tile(int64_t rows, const float *x, int64_t lda, const float *w, int64_t K,
                     const float *bias, float *out, int64_t ldo, int64_t cols) {
    switch (rows) {
        TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#if MR > 6
        TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12) TILE(13) TILE(14) TILE(15)
        TILE(16) TILE(17) TILE(18) TILE(19) TILE(20) TILE(21) TILE(22) TILE(23) TILE(24)
#endif
        default: break;
    }
}

/* rows m0 .. m1 - 1 of y against panel p: written to y (best NULL), or folded into best */
static void panel_rows(const float *x, int64_t lda, int64_t K, const float *panel,
                       const float *bias, float *y, Best *best, int64_t N, int64_t p, int64_t m0,
                       int64_t m1) {
    const int64_t cols = N - p * NR < NR ? N - p * NR : NR;
    const int64_t tiles = (m1 - m0 + MR - 1) / MR;
    float buffer[MR * NR];
    for (int64_t i = 0, m = m0; i < tiles; i++) { /* tiles of as even heights as can be */
        const int64_t rows = (m1 - m) / (tiles - i) + ((m1 - m) % (tiles - i) != 0);
        const float *xm = x + m * lda;
        if (!best) {
            any_tile(rows, xm, lda, panel, K, bias, y + m * N + p * NR, N, cols);
        } else {
            any_tile(rows, xm, lda, panel, K, bias, buffer, NR, cols);
            fold(best, buffer, rows, cols, m, p);
        }
        m += rows;
    }
}

/* The product over every panel, in parallel over panels (per-thread bests in bests[thread]) */
static void product(const float *x, int64_t M, int64_t lda, int64_t K, const float *panels,
                    const float *bias, int64_t N, float *y, Best *bests) {
    const int64_t count = (N + NR - 1) / NR;
    int64_t block = X_BLOCK / (K * (int64_t)sizeof(float)) / MR * MR;
    if (block < 96) block = 96;
#pragma omp parallel if (M * count * NR * K >= PARALLEL_MACS)
    {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        for (int64_t m0 = 0; m0 < M; m0 += block) {
            const int64_t m1 = m0 + block < M ? m0 + block : M;
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < count; p++)
                panel_rows(x, lda, K, panels + p * K * NR, bias ? bias + p * NR : 0, y,
                           bests ? bests + thread : 0, N, p, m0, m1);
        }
    }
}

/* x [M, K] (row stride lda), panels [ceil(N / 16), K, 16] (32-byte aligned), bias
 * [16 ceil(N / 16)] or NULL, y [M, N] contiguous */
void cpu_linear(const float *x, int64_t M, int64_t lda, int64_t K, const float *panels,
                const float *bias, int64_t N, float *y) {
    product(x, M, lda, K, panels, bias, N, y, 0);
}

/* ids [M] = argmax over j of (x W^T + b)[r, j], y never written: the first maximum, NaN
 * highest. Same arguments as cpu_linear otherwise. */
void cpu_linear_argmax(const float *x, int64_t M, int64_t lda, int64_t K, const float *panels,
                       const float *bias, int64_t N, int64_t *ids) {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    float *val = malloc(sizeof(float) * threads * M);
    int64_t *at = malloc(sizeof(int64_t) * threads * M);
    Best *bests = malloc(sizeof(Best) * threads);
    for (int t = 0; t < threads; t++) bests[t] = (Best){val + t * M, at + t * M};
    for (int64_t i = 0; i < threads * M; i++) at[i] = -1;
    product(x, M, lda, K, panels, bias, N, 0, bests);
    for (int64_t r = 0; r < M; r++) {
        float v = val[r];
        int64_t id = at[r];
        for (int t = 1; t < threads; t++)
            if (at[t * M + r] >= 0 && beats(val[t * M + r], at[t * M + r], v, id)) {
                v = val[t * M + r];
                id = at[t * M + r];
            }
        ids[r] = id;
    }
    free(val);
    free(at);
    free(bests);
}
