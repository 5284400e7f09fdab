/* The projection y [M, N] = x [M, K] W^T + b on Intel AMX (the BF16 tile unit of Sapphire
 * Rapids and later), as exact as linear.c's float32 FMA chains: included by linear.c, which
 * takes it for every product where the CPU has the unit, Linux grants its tiles and the caller
 * gives W's parts (cpu_linear_split).
 *
 * Exact by splitting, not by rounding: a float32 value is the sum of three bfloat16 values,
 * v = h + m + l (h = bf16(v), m = bf16(v - h), l = bf16(v - h - m): each difference is exact,
 * and 3 x 8 bits of significand hold float32's 24). The product of two bf16 values is exact in
 * float32 and the unit adds the products in float32. Of the nine products of x's and W's parts
 * the six down to 2^-16 of the whole are taken (hh, hm, hl, mh, mm, lh); the three left out are
 * below 2^-24, float32's own rounding. On SmolLM2-135M's logits against a float64 forward: as
 * far as float32 is (7e-5); the three largest products alone ("bf16x3") are 9x as far (6.5e-4).
 *
 * Why: a 16 x 16 x 32 tile product is 8,192 multiply-adds in 16 cycles where an AVX-512 core
 * does 32 a cycle, so six of them still beat the FMAs 2.7x; what bounds it is loading tiles (a
 * tile from L2 costs about two tile products), hence amx_quad's 2 x 2 tiles. W's parts are made
 * once (1.5x the panels' bytes): split per call, even by truncation, they cost more than the
 * FMAs of a 16-row step. Measured on SmolLM2's shapes (weights in cache), GFLOP/s FMA -> AMX:
 * 32 rows 276-293 -> 343-389, 64 rows 261-285 -> 384-416, 512 rows 265-276 -> 430-530.
 *
 * Every product takes the unit, however few its rows, though below ~32 rows the FMA tiles
 * stream the float32 panels (4 bytes a value, where the parts are 6) a little faster: each
 * y[r, j] is then the same sum in the same order whatever M or the tile its row falls in, so a
 * row's values do not depend on the other rows of its step (DESIGN: a sampled row's output is
 * the same whatever batch it ran in; a resumed job writes the same file), and the argmax entry
 * sees the values the product writes.
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

/* Tiles (literal numbers: the intrinsics paste them into the instruction). amx_tile: the y
 * tile, x's parts h, m, l, W's parts h, m, l. amx_quad: y tiles 0-3 (rows a, b x panels a, b),
 * x's part of rows a, b in 4, 5, W's part of panels a, b in 6, 7. */
#define T_Y 0
#define T_XH 1
#define T_XM 2
#define T_XL 3
#define T_WH 4
#define T_WM 5
#define T_WL 6

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

/* The six products, in this order for every output (both paths below): x part i times W
 * part j for (i, j) = hh, hm, hl, mh, mm, lh. Where every l of W is zero (wl = 0: its values
 * hold 16 bits of significand, as a checkpoint dequantized from 4 or 8 bits, or from float16,
 * does) hl adds only zeros and is skipped with its loads: the same sums, bit for bit, from 4
 * bytes a weight instead of 6 and five products instead of six. The callers pass wl as a
 * literal, so each form is compiled without the test in its loop. */

/* out [16, 16] = bias + x rows [m, m + 16) . panel, from their parts (xs: [3][Mp][Kp],
 * ws: [2 + wl][Kp / 2][32]) */
static inline __attribute__((always_inline)) void amx_tile(const uint16_t *xs, int64_t Mp,
                                                           int64_t Kp, int64_t m,
                                                           const uint16_t *ws, int wl,
                                                           const float *bias_tile, float *out) {
    const int64_t plane = Mp * Kp, wplane = Kp * 16;
    const int64_t ld = Kp * 2; /* bytes between x rows */
    _tile_loadd(T_Y, bias_tile, 64);
    for (int64_t k = 0; k < Kp; k += AMX_K) {
        const uint16_t *x = xs + m * Kp + k, *w = ws + k * 16;
        _tile_loadd(T_XH, x, ld);
        _tile_loadd(T_XM, x + plane, ld);
        _tile_loadd(T_XL, x + 2 * plane, ld);
        _tile_loadd(T_WH, w, 64);
        _tile_loadd(T_WM, w + wplane, 64);
        if (wl) _tile_loadd(T_WL, w + 2 * wplane, 64);
        _tile_dpbf16ps(T_Y, T_XH, T_WH);
        _tile_dpbf16ps(T_Y, T_XH, T_WM);
        if (wl) _tile_dpbf16ps(T_Y, T_XH, T_WL);
        _tile_dpbf16ps(T_Y, T_XM, T_WH);
        _tile_dpbf16ps(T_Y, T_XM, T_WM);
        _tile_dpbf16ps(T_Y, T_XL, T_WH);
    }
    _tile_stored(T_Y, out, 64);
}

/* four y tiles at once: rows [m, m + 32) x panels a, b (their parts wa, wb), into
 * out[0..3] = (rows 1st, a), (1st, b), (2nd, a), (2nd, b), each [16, 16]: each part of x loaded
 * once for two panels and each part of W once for two row tiles where amx_tile loads both for
 * one (a tile load from L2 costs two tile products) */
static inline __attribute__((always_inline)) void amx_quad(const uint16_t *xs, int64_t Mp,
                                                           int64_t Kp, int64_t m,
                                                           const uint16_t *wa,
                                                           const uint16_t *wb, int wl,
                                                           const float *bias_a,
                                                           const float *bias_b, float *out) {
    const int64_t plane = Mp * Kp, wplane = Kp * 16;
    const int64_t ld = Kp * 2, next = 16 * Kp; /* bytes between x rows; the next row tile */
    _tile_loadd(0, bias_a, 64);
    _tile_loadd(1, bias_b, 64);
    _tile_loadd(2, bias_a, 64);
    _tile_loadd(3, bias_b, 64);
#define PRODUCTS(j)                                    \
    _tile_loadd(6, wa + k * 16 + (j) * wplane, 64);    \
    _tile_loadd(7, wb + k * 16 + (j) * wplane, 64);    \
    _tile_dpbf16ps(0, 4, 6);                           \
    _tile_dpbf16ps(1, 4, 7);                           \
    _tile_dpbf16ps(2, 5, 6);                           \
    _tile_dpbf16ps(3, 5, 7);
    for (int64_t k = 0; k < Kp; k += AMX_K) {
        const uint16_t *x = xs + m * Kp + k;
        _tile_loadd(4, x, ld);
        _tile_loadd(5, x + next, ld);
        PRODUCTS(0) PRODUCTS(1)
        if (wl) { PRODUCTS(2) }
        _tile_loadd(4, x + plane, ld);
        _tile_loadd(5, x + plane + next, ld);
        PRODUCTS(0) PRODUCTS(1)
        _tile_loadd(4, x + 2 * plane, ld);
        _tile_loadd(5, x + 2 * plane + next, ld);
        PRODUCTS(0)
    }
#undef PRODUCTS
    _tile_stored(0, out, 64);
    _tile_stored(1, out + 256, 64);
    _tile_stored(2, out + 512, 64);
    _tile_stored(3, out + 768, 64);
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
        for (int64_t j = 0; j < NR; j++) tile[r * NR + j] = bias ? bias[j] : 0.f;
}

/* The product on the tile unit, W's parts split once at load (cpu_linear_split; wl: whether
 * they hold l, [count][2 + wl][Kp / 2][32]): x split once a call; the panels taken two at a time by the threads, a block of rows at a time (rows whose
 * parts fit in L2), amx_quad over two row tiles at a time. Returns 0 where x's parts do not fit
 * in memory (then the FMA tiles run). */
static int amx_product(const float *x, int64_t M, int64_t lda, int64_t K, const uint16_t *parts,
                       int wl, const float *bias, int64_t N, float *y, Best *bests) {
    static __thread void *buffer;
    static __thread size_t size;
    const int64_t count = (N + NR - 1) / NR, pairs = (count + 1) / 2;
    const int64_t Mp = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    const int64_t Kp = (K + AMX_K - 1) / AMX_K * AMX_K;
    const int64_t w_parts = (2 + wl) * Kp * NR; /* bf16 values of a panel's parts */
    uint16_t *xs = thread_buffer(&buffer, &size, 3 * Mp * Kp * sizeof(uint16_t));
    if (!xs) return 0;
    split_rows(x, M, lda, K, Mp, Kp, xs);
    int64_t block = AMX_L2 / (3 * Kp * 2) / (2 * AMX_ROWS) * (2 * AMX_ROWS);
    if (block < 2 * AMX_ROWS) block = 2 * AMX_ROWS;
#pragma omp parallel if (M * count * NR * K >= PARALLEL_MACS)
    {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        float bias_a[AMX_ROWS * NR] __attribute__((aligned(64)));
        float bias_b[AMX_ROWS * NR] __attribute__((aligned(64)));
        float out[4 * AMX_ROWS * NR] __attribute__((aligned(64)));
        Best *best = bests ? bests + thread : 0;
        amx_configure();
        for (int64_t m0 = 0; m0 < M; m0 += block) {
            const int64_t m1 = m0 + block < M ? m0 + block : M;
#pragma omp for schedule(static) nowait
            for (int64_t q = 0; q < pairs; q++) {
                const int64_t pa = 2 * q, pb = pa + 1 < count ? pa + 1 : -1;
                const int64_t cols_a = N - pa * NR < NR ? N - pa * NR : NR;
                const int64_t cols_b = pb < 0 ? 0 : N - pb * NR < NR ? N - pb * NR : NR;
                const uint16_t *wa = parts + pa * w_parts;
                const uint16_t *wb = parts + (pb < 0 ? pa : pb) * w_parts;
                fill_bias(bias_a, bias ? bias + pa * NR : 0);
                if (pb >= 0) fill_bias(bias_b, bias ? bias + pb * NR : 0);
                for (int64_t m = m0; m < m1;) {
                    const int64_t rows = m1 - m < AMX_ROWS ? m1 - m : AMX_ROWS;
                    if (pb >= 0 && m + AMX_ROWS < m1) { /* two row tiles, two panels */
                        const int64_t next = m1 - m - AMX_ROWS < AMX_ROWS ? m1 - m - AMX_ROWS
                                                                          : AMX_ROWS;
                        if (wl)
                            amx_quad(xs, Mp, Kp, m, wa, wb, 1, bias_a, bias_b, out);
                        else
                            amx_quad(xs, Mp, Kp, m, wa, wb, 0, bias_a, bias_b, out);
                        emit(out, AMX_ROWS, cols_a, m, pa, y, N, best);
                        emit(out + 256, AMX_ROWS, cols_b, m, pb, y, N, best);
                        emit(out + 512, next, cols_a, m + AMX_ROWS, pa, y, N, best);
                        emit(out + 768, next, cols_b, m + AMX_ROWS, pb, y, N, best);
                        m += 2 * AMX_ROWS;
                        continue;
                    }
                    if (wl)
                        amx_tile(xs, Mp, Kp, m, wa, 1, bias_a, out);
                    else
                        amx_tile(xs, Mp, Kp, m, wa, 0, bias_a, out);
                    emit(out, rows, cols_a, m, pa, y, N, best);
                    if (pb >= 0) {
                        if (wl)
                            amx_tile(xs, Mp, Kp, m, wb, 1, bias_b, out);
                        else
                            amx_tile(xs, Mp, Kp, m, wb, 0, bias_b, out);
                        emit(out, rows, cols_b, m, pb, y, N, best);
                    }
                    m += AMX_ROWS;
                }
            }
        }
        _tile_release();
    }
    return 1;
}
#endif /* AMX */
#endif
