/* The projection y [M, N] = x [M, K] W^T + b on Intel AMX (the BF16 tile unit of Sapphire
 * Rapids and later), as exact as linear.c's float32 FMA chains: included by linear.c, which
 * takes it for every product where the CPU has the unit, Linux grants its tiles and the caller
 * gives W's parts (cpu_linear_split).
 *
 * Exact by splitting, not by rounding: a float32 value is the sum of three bfloat16 values,
 * v = h + m + l (h = bf16(v), m = bf16(v - h), l = bf16(v - h - m): each difference is exact,
 * and 3 x 8 bits of significand hold float32's 24). The product of two bf16 values is exact in
 * float32 and the unit adds the products in float32. Of the nine products of x's and W's parts
 * the six down to 2^-16 of the whole are taken (hh, mh, lh, hm, mm, hl); the three left out are
 * below 2^-24, float32's own rounding. On SmolLM2-135M's logits against a float64 forward: as
 * far as float32 is (7e-5); the three largest products alone ("bf16x3") are 9x as far (6.5e-4).
 *
 * Why: a 16 x 16 x 32 tile product is 8,192 multiply-adds in 16 cycles where an AVX-512 core
 * does 32 a cycle, so six of them still beat the FMAs 2.7x; what bounds it is loading tiles (a
 * tile from L2 costs about two tile products), hence amx_group's x parts held for four panels.
 * W's parts are made once (1.5x the panels' bytes; 1x or 0.5x where l, or l and m, are all
 * zero: see the products' order below): split per call, even by truncation, they cost more than
 * the FMAs of a 16-row step.
 *
 * Every product takes the unit, however few its rows: each y[r, j] is then the same sum in the
 * same order whatever M or the tile its row falls in, so a row's values do not depend on the
 * other rows of its step (DESIGN: a sampled row's output is the same whatever batch it ran in; a
 * resumed job writes the same file), and the argmax entry sees the values the product writes.
 * A step of SmolLM2's 30 layers' projections (two parts: its Q4_1 weights), weights from memory,
 * ms for 1 / 16 / 17 / 32 / 48 / 64 / 128 rows: 18.2 / 18.7 / 24.1 / 25.5 / 30.0 / 35.3 / 58.4;
 * the stream alone (425 MB at ~21 GB/s) is ~20 ms.
 */
#ifndef BATCHLLM_CPU_AMX_H
#define BATCHLLM_CPU_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "argmax.h"
#include "bf16_split.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_ROWS 16 /* rows of a tile of x or y */
#define AMX_K 32    /* k of a tile step: 32 bf16 = 64 bytes */
#define AMX_L2 (1 << 20) /* bytes of x's parts a block of rows keeps in L2 (best of 0.5-4 MB) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;


static int amx_state = -1; /* -1: not asked yet, 0: refused, 1: granted */
static int amx_wanted = 1; /* cpu_linear_use_amx(0): the FMA tiles, for tests and comparisons */

/* Whether the kernel lets this process use the tile data (asked once; Linux >= 5.16) */
static int amx_granted(void) {
    if (amx_state < 0)
        amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_state;
}

static void amx_configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = AMX_ROWS;
    }
    _tile_loadconfig(&c);
}

/* The products, in this order for every output: x part i times W part j for (i, j) = hh, mh,
 * lh, hm, mm, hl (W's part h with x's three, then m with x's h and m, then l with x's h). W
 * keeps wp of its parts (cpu_linear_split): where every l is zero (wp = 2: values of 16 bits of
 * significand, as a checkpoint dequantized from 4 or 8 bits, or from float16, holds) hl, the
 * last, adds only zeros and is skipped with its load; where every m is zero too (wp = 1: values
 * that are bfloat16, as a bfloat16 checkpoint's) hm and mm are as well. The same sums, bit for
 * bit (but the sign of an exact zero: -0 + 0 is +0 where the product was taken), from 4 or 2
 * bytes a weight instead of 6 and five or three products instead of six. The caller passes wp
 * as a literal, so each form is compiled without the test in its loop. Tile numbers are
 * literals too (the intrinsics paste them into the instruction). */

#define AMX_GROUP 4 /* panels a call of amx_group takes: y tiles 0-3 */

/* The accumulator tiles t < np <= 4 of a group: from bias (a [16, 16] tile a panel, 256 floats
 * apart) or zeros (bias NULL); stored at out + t * out_step, rows out_ld bytes apart */
static inline __attribute__((always_inline)) void amx_start(const float *bias, int np) {
    if (bias) {
        _tile_loadd(0, bias, 64);
        if (np > 1) _tile_loadd(1, bias + 256, 64);
        if (np > 2) _tile_loadd(2, bias + 512, 64);
        if (np > 3) _tile_loadd(3, bias + 768, 64);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
}

static inline __attribute__((always_inline)) void amx_finish(float *out, int64_t out_step,
                                                             int64_t out_ld, int np) {
    _tile_stored(0, out, out_ld);
    if (np > 1) _tile_stored(1, out + out_step, out_ld);
    if (np > 2) _tile_stored(2, out + 2 * out_step, out_ld);
    if (np > 3) _tile_stored(3, out + 3 * out_step, out_ld);
}

/* y tiles [16, 16] of x rows [m, m + 16) against panels t < np <= 4 of a group, tile t = bias[t]
 * (tiles [16, 16] a panel, or NULL for zeros) + x . panel t, stored at out + t * out_step with
 * its rows out_ld bytes apart (a buffer of tiles, or y itself), from their parts (xs:
 * [3][Mp][Kp]; panel t's at w + t * w_panel, [wp][Kp / 2][32]): per step of k, x's parts loaded
 * once into tiles 4-6 for the group's four panels, each panel's parts one after another through
 * tile 7: 11 tile loads for 20 products with two parts of W, 15 for 24 with three, 7 for 12 with
 * one, where 2 x 2 output tiles took 18 for 24 (a tile load from L2 costs about two products).
 * xp = 2 takes x's h and m alone (with wp = 1: amx_argmax.h's first pass, hh and mh). */
static inline __attribute__((always_inline)) void amx_group(const uint16_t *xs, int64_t Mp,
                                                            int64_t Kp, int64_t m,
                                                            const uint16_t *w, int64_t w_panel,
                                                            int np, int wp, int xp,
                                                            const float *bias, float *out,
                                                            int64_t out_step, int64_t out_ld) {
    const int64_t plane = Mp * Kp, wplane = Kp * 16;
    const int64_t ld = Kp * 2; /* bytes between x rows */
    amx_start(bias, np);
    for (int64_t k = 0; k < Kp; k += AMX_K) {
        const uint16_t *x = xs + m * Kp + k;
        _tile_loadd(4, x, ld);
        _tile_loadd(5, x + plane, ld);
        if (xp > 2) _tile_loadd(6, x + 2 * plane, ld);
#define PANEL_PRODUCTS(t)                                           \
        if (np > (t)) {                                             \
            const uint16_t *wt = w + (t) * w_panel + k * 16;        \
            _tile_loadd(7, wt, 64);                                 \
            _tile_dpbf16ps(t, 4, 7);                                \
            _tile_dpbf16ps(t, 5, 7);                                \
            if (xp > 2) _tile_dpbf16ps(t, 6, 7);                    \
            if (wp > 1) {                                           \
                _tile_loadd(7, wt + wplane, 64);                    \
                _tile_dpbf16ps(t, 4, 7);                            \
                _tile_dpbf16ps(t, 5, 7);                            \
            }                                                       \
            if (wp > 2) {                                           \
                _tile_loadd(7, wt + 2 * wplane, 64);                \
                _tile_dpbf16ps(t, 4, 7);                            \
            }                                                       \
        }
        PANEL_PRODUCTS(0)
        PANEL_PRODUCTS(1)
        PANEL_PRODUCTS(2)
        PANEL_PRODUCTS(3)
#undef PANEL_PRODUCTS
    }
    amx_finish(out, out_step, out_ld, np);
}

/* amx_group with all of x's parts and W's wp (1-3, a variable here), each form compiled apart */
static inline __attribute__((always_inline)) void amx_group_exact(const uint16_t *xs,
                                                                  int64_t Mp, int64_t Kp,
                                                                  int64_t m, const uint16_t *w,
                                                                  int64_t w_panel, int np,
                                                                  int wp, const float *bias,
                                                                  float *out, int64_t out_step,
                                                                  int64_t out_ld) {
    if (wp == 3)
        amx_group(xs, Mp, Kp, m, w, w_panel, np, 3, 3, bias, out, out_step, out_ld);
    else if (wp == 2)
        amx_group(xs, Mp, Kp, m, w, w_panel, np, 2, 3, bias, out, out_step, out_ld);
    else
        amx_group(xs, Mp, Kp, m, w, w_panel, np, 1, 3, bias, out, out_step, out_ld);
}

/* A grow-only buffer of the calling thread's (x's parts), 64-byte aligned; NULL when memory is
 * short. */
static void *thread_buffer(void **buffer, size_t *size, size_t need) {
    if (need > *size) {
        free(*buffer);
        *buffer = aligned_alloc(64, (need + 63) / 64 * 64);
        *size = *buffer ? need : 0;
    }
    return *buffer;
}

/* x [M, K] (stride lda) split into its three parts [3][Mp][Kp] in the calling thread's buffer
 * (zero past M and K); NULL when memory is short */
static const uint16_t *x_parts(const float *x, int64_t M, int64_t lda, int64_t K, int64_t Mp,
                               int64_t Kp) {
    static __thread void *buffer;
    static __thread size_t size;
    uint16_t *xs = thread_buffer(&buffer, &size, 3 * Mp * Kp * sizeof(uint16_t));
    if (xs) split_rows(x, M, lda, K, Mp, Kp, xs);
    return xs;
}

/* The calling thread's number in its OpenMP team and its even share [first, last) of count
 * panels (36 panels in groups of 4 would split 5 : 4) */
static inline int team_share(int64_t count, int64_t *first, int64_t *last) {
    int thread = 0, team = 1;
#ifdef _OPENMP
    thread = omp_get_thread_num();
    team = omp_get_num_threads();
#endif
    *first = count * thread / team;
    *last = count * (thread + 1) / team;
    return thread;
}

/* The calling thread's number in its OpenMP team (0 outside one) */
static inline int team_thread(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Groups of AMX_GROUP panels of count: the products' work items, handed to whichever thread of
 * the team is free (omp for schedule(dynamic)) rather than split in halves up front. The halves
 * took the same time only on average: on this 2-core VM the two threads of one projection ended
 * 46-100 us apart (a 1-16-row step's projection takes ~130 us), either one last; dynamic, 16-30
 * us (C harness, SmolLM2's 120 products). A panel's outputs are still one thread's, in the same
 * order: the same values whichever thread takes it. */
static inline int64_t panel_groups(int64_t count) { return (count + AMX_GROUP - 1) / AMX_GROUP; }

/* out tile [16, 16] of rows m.. and panel p: its first rows x cols into y, or folded into best */
static inline void emit(const float *out, int64_t rows, int64_t cols, int64_t m, int64_t p,
                        float *y, int64_t N, Best *best) {
    if (best)
        fold(best, out, rows, cols, m, p);
    else
        for (int64_t r = 0; r < rows; r++)
            memcpy(y + (m + r) * N + p * NR, out + r * NR, cols * sizeof(float));
}

static inline void fill_bias(float *tile, const float *bias) {
    for (int64_t r = 0; r < AMX_ROWS; r++)
        for (int64_t j = 0; j < NR; j++) tile[r * NR + j] = bias[j];
}

/* The product on the tile unit, W's parts split once at load (cpu_linear_split; wp of them,
 * [count][wp][Kp / 2][32]): x split once a call; the panels four at a time to whichever thread
 * is free (panel_groups), a block of rows at a time (rows whose parts fit in L2), one row tile
 * after another against the four (their parts from L2 after the first), whole tiles stored
 * straight into y.
 * Returns 0 where x's parts do not fit in memory (then the FMA tiles run). */
static int amx_product(const float *x, int64_t M, int64_t lda, int64_t K, const uint16_t *parts,
                       int wp, const float *bias, int64_t N, float *y, Best *bests) {
    const int64_t count = (N + NR - 1) / NR;
    const int64_t Mp = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    const int64_t Kp = (K + AMX_K - 1) / AMX_K * AMX_K;
    const int64_t w_parts = wp * Kp * NR; /* bf16 values of a panel's parts */
    const uint16_t *xs = x_parts(x, M, lda, K, Mp, Kp);
    if (!xs) return 0;
    int64_t block = AMX_L2 / (3 * Kp * 2) / AMX_ROWS * AMX_ROWS;
    if (block < AMX_ROWS) block = AMX_ROWS;
#pragma omp parallel if (M * count * NR * K >= PARALLEL_MACS)
    {
        const int thread = team_thread();
        float biases[AMX_GROUP * AMX_ROWS * NR] __attribute__((aligned(64)));
        float out[AMX_GROUP * AMX_ROWS * NR] __attribute__((aligned(64)));
        Best *best = bests ? bests + thread : 0;
        amx_configure();
        for (int64_t m0 = 0; m0 < M; m0 += block) {
            const int64_t m1 = m0 + block < M ? m0 + block : M;
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t g = 0; g < panel_groups(count); g++) {
                const int64_t p0 = g * AMX_GROUP;
                const int np = count - p0 < AMX_GROUP ? count - p0 : AMX_GROUP;
                const uint16_t *w = parts + p0 * w_parts;
                for (int t = 0; bias && t < np; t++)
                    fill_bias(biases + t * 256, bias + (p0 + t) * NR);
                for (int64_t m = m0; m < m1; m += AMX_ROWS) {
                    const int64_t rows = m1 - m < AMX_ROWS ? m1 - m : AMX_ROWS;
                    /* whole tiles straight into y: a step of 64 rows 36.4 -> 33.2 ms, of 512
                     * rows 226-230 -> 191-203 ms, where they went through a buffer */
                    const int direct = !best && rows == AMX_ROWS && (p0 + np) * NR <= N;
                    amx_group_exact(xs, Mp, Kp, m, w, w_parts, np, wp, bias ? biases : 0,
                                    direct ? y + m * N + p0 * NR : out,
                                    direct ? NR : AMX_ROWS * NR,
                                    (direct ? N : NR) * sizeof(float));
                    if (direct) continue;
                    for (int t = 0; t < np; t++) {
                        const int64_t p = p0 + t, cols = N - p * NR < NR ? N - p * NR : NR;
                        emit(out + t * 256, rows, cols, m, p, y, N, best);
                    }
                }
            }
        }
        _tile_release();
    }
    return 1;
}
#endif /* AMX */
#endif
