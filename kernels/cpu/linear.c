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

#include "tile.h"

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
                panel_rows(x, lda, K, panels + p * K * NR, 0, K, 0, bias ? bias + p * NR : 0,
                           y, bests ? bests + thread : 0, N, p, m0, m1);
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
    Bests b = bests_new(M);
    product(x, M, lda, K, panels, bias, N, 0, b.best);
    bests_merge(&b, M, ids);
}
