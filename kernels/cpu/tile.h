/* The FMA tiles of the CPU products (linear.c's float32 panels, blocks.c's GGUF blocks, each
 * dequantized into a panel first): y rows against one 16-column panel [K, 16] of W^T. linear.c
 * says why the tiles are shaped as they are. Every y[r, j] is the same chain of FMAs over k,
 * bias first, whatever the tile height: the products of both files give the same values on the
 * same panel values.
 */
#ifndef BATCHLLM_CPU_TILE_H
#define BATCHLLM_CPU_TILE_H

#include <stdint.h>
#include <string.h>

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

/* out[r, j] = init[r, j] + sum_k x[r, k] w[k, j] for r < mr, j < cols (cols < NR: the last
 * panel), init [mr, NR] the running sums of earlier steps of k, or NULL: bias[j] (or 0); each
 * step of K asks for the panel's line PREFETCH_STEPS ahead (into the next panel at its
 * end: a thread's panels are contiguous) */
static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t lda,
                                                      const float *w, int64_t K, const float *init,
                                                      const float *bias, float *out, int64_t ldo,
                                                      int64_t cols) {
#if defined(__AVX512F__)
    __m512 acc[MR];
    const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
#pragma GCC unroll 24
    for (int r = 0; r < mr; r++) acc[r] = init ? _mm512_loadu_ps(init + r * NR) : b;
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
        lo[r] = init ? _mm256_loadu_ps(init + r * NR) : b0;
        hi[r] = init ? _mm256_loadu_ps(init + r * NR + 8) : b1;
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
        for (int j = 0; j < NR; j++) acc[r][j] = init ? init[r * NR + j] : bias ? bias[j] : 0.f;
    for (int64_t k = 0; k < K; k++) {
        for (int r = 0; r < mr; r++) {
            const float xv = x[r * lda + k];
            for (int j = 0; j < NR; j++) acc[r][j] += xv * w[k * NR + j];
        }
        __asm__("" : "+m"(acc)); /* step by step: -ffast-math may not regroup the sums over k */
    }
    for (int r = 0; r < mr; r++) memcpy(o + r * ld, acc[r], sizeof(acc[r]));
#endif
    if (cols < NR)
        for (int r = 0; r < mr; r++) memcpy(out + r * ldo, buffer + r * NR, cols * sizeof(float));
#endif
}

#define TILE(n) \
    case n: tile(n, x, lda, w, K, init, bias, out, ldo, cols); break;

/* tile() with mr a constant, for 1 <= rows <= MR */
static void any_tile(int64_t rows, const float *x, int64_t lda, const float *w, int64_t K,
                     const float *init, const float *bias, float *out, int64_t ldo,
                     int64_t cols) {
    switch (rows) {
        TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#if MR > 6
        TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12) TILE(13) TILE(14) TILE(15)
        TILE(16) TILE(17) TILE(18) TILE(19) TILE(20) TILE(21) TILE(22) TILE(23) TILE(24)
#endif
        default: break;
    }
}

/* rows m0 .. m1 - 1 of y against steps k0 .. k0 + kn - 1 of panel p (`panel` holds those
 * steps' rows [kn, NR]). With acc NULL, the whole product (k0 = 0, kn = K) written to y (best
 * NULL) or folded into best; else acc [m1 - m0, NR] keeps the rows' running sums between calls
 * (from the bias at k0 = 0), the last steps (k0 + kn = K) write or fold them. Either way each
 * y[r, j] is the one chain of FMAs over k. */
static void panel_rows(const float *x, int64_t lda, int64_t K, const float *panel, int64_t k0,
                       int64_t kn, float *acc, const float *bias, float *y, Best *best,
                       int64_t N, int64_t p, int64_t m0, int64_t m1) {
    const int64_t cols = N - p * NR < NR ? N - p * NR : NR;
    const int64_t tiles = (m1 - m0 + MR - 1) / MR;
    float buffer[MR * NR];
    for (int64_t i = 0, m = m0; i < tiles; i++) { /* tiles of as even heights as can be */
        const int64_t rows = (m1 - m) / (tiles - i) + ((m1 - m) % (tiles - i) != 0);
        const float *xm = x + m * lda + k0;
        float *sums = acc ? acc + (m - m0) * NR : 0;
        const float *init = acc && k0 ? sums : 0;
        if (acc && k0 + kn < K) {
            any_tile(rows, xm, lda, panel, kn, init, bias, sums, NR, NR);
        } else if (!best) {
            any_tile(rows, xm, lda, panel, kn, init, bias, y + m * N + p * NR, N, cols);
        } else {
            any_tile(rows, xm, lda, panel, kn, init, bias, buffer, NR, cols);
            fold(best, buffer, rows, cols, m, p);
        }
        m += rows;
    }
}

#endif
