/* The projection on the tile unit from W's 4-bit blocks (q4_blocks.h) instead of its parts:
 * included by linear.c after amx.h, whose sums it computes, bit for bit, from 0.625 bytes a
 * weight instead of 4, for products of up to Q4_ROWS rows (cpu_linear given the blocks).
 *
 * Why: a decode step of few rows is bound by the weights' stream (SmolLM2's 425 MB of parts a
 * step, 15-17 ms at this machine's 25-28 GB/s), and the tile unit's L2-fed work for the row
 * tiles after the first does not overlap it (amx.h). Neither does making the parts: on this
 * CPU the tile unit and the AVX-512 units do not work at once (a step of a tile's loads and
 * products interleaved with q4_rows took their two times' sum), so a step from the blocks costs
 * the tile unit's work plus the making, ~12.6 ms at 1 row against ~19 ms from the parts (C
 * harness). Here each thread makes a group's parts from its blocks into L2 (q4_rows) and runs
 * every row tile against them there: 66 MB streamed a step.
 *
 * W is the tile unit's A operand here and x its B, where amx.h has them the other way: a row
 * of A is one column's 32 k, which share their (d, m), so that q4_rows makes it by a table
 * lookup. The output tiles are then y's transpose ([16 columns][16 rows]), turned in registers
 * on their way to y, and x's parts are laid out as B ([Kp / 2][16 rows][2]: k pairs of 16 rows).
 * Each y value is the same sum as amx.h's: the same products (a b = b a exactly: products of
 * bf16 are exact in float32) added in the same order, hh, mh, lh, hm, mm a tile step. That the
 * unit sums an element alike whichever operand holds which factor is its documented semantics,
 * checked bit for bit against amx.h by tests/test_q4_blocks.py on the CPU it runs on. */
#ifndef BATCHLLM_CPU_AMX_Q4_H
#define BATCHLLM_CPU_AMX_Q4_H

#ifdef HAVE_AMX
#include "q4_blocks.h"

/* Rows up to which a product takes W's blocks where it has them; above, its parts. A step of
 * SmolLM2's projections (C harness, weights from memory), ms from the parts / the blocks: 1
 * row 19.0 / 12.6, 16 rows 20.0 / 14.2, 32 rows 25.5 / 23.6, 48 rows 30.1 / 29.9, 64 rows 35.6
 * / 34.4-39.6, 512 rows 231 / 268. From three row tiles on, the tile unit's L2-fed work bounds
 * both; at 512 each block of rows makes the group's parts again. */
#define Q4_ROWS 48

/* The calling thread's buffer of `each` bf16 values for every thread of its team (the parts
 * of a group made from its blocks: 8 KB a 32 of K), 64-byte aligned; NULL when memory is
 * short */
static uint16_t *group_buffers(int64_t each) {
    static __thread void *buffer;
    static __thread size_t size;
    int team = 1;
#ifdef _OPENMP
    team = omp_get_max_threads();
#endif
    return thread_buffer(&buffer, &size, team * each * sizeof(uint16_t));
}

/* rows [16][16] of 32-bit values (src_ld bytes apart) transposed into dst (dst_ld bytes apart) */
static inline void transpose16(const void *src, int64_t src_ld, void *dst, int64_t dst_ld) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const char *)src + i * src_ld);
    for (int g = 0; g < 4; g++) { /* within 128-bit lanes: t[4g + c] lane L = column 4L + c */
        const __m512i a = _mm512_unpacklo_epi32(r[4 * g], r[4 * g + 1]);
        const __m512i b = _mm512_unpackhi_epi32(r[4 * g], r[4 * g + 1]);
        const __m512i c = _mm512_unpacklo_epi32(r[4 * g + 2], r[4 * g + 3]);
        const __m512i d = _mm512_unpackhi_epi32(r[4 * g + 2], r[4 * g + 3]);
        t[4 * g] = _mm512_unpacklo_epi64(a, c);
        t[4 * g + 1] = _mm512_unpackhi_epi64(a, c);
        t[4 * g + 2] = _mm512_unpacklo_epi64(b, d);
        t[4 * g + 3] = _mm512_unpackhi_epi64(b, d);
    }
    for (int c = 0; c < 4; c++) { /* column 4L + c: lane g from t[4g + c]'s lane L */
        const __m512i e01 = _mm512_shuffle_i32x4(t[c], t[4 + c], 0x88);
        const __m512i o01 = _mm512_shuffle_i32x4(t[c], t[4 + c], 0xDD);
        const __m512i e23 = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0x88);
        const __m512i o23 = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0xDD);
        char *out = (char *)dst + c * dst_ld;
        _mm512_storeu_si512(out, _mm512_shuffle_i32x4(e01, e23, 0x88));
        _mm512_storeu_si512(out + 4 * dst_ld, _mm512_shuffle_i32x4(o01, o23, 0x88));
        _mm512_storeu_si512(out + 8 * dst_ld, _mm512_shuffle_i32x4(e01, e23, 0xDD));
        _mm512_storeu_si512(out + 12 * dst_ld, _mm512_shuffle_i32x4(o01, o23, 0xDD));
    }
}

/* x [M, K] (stride lda) as the B operand, its three parts [3][Mp / 16][Kp / 32][16][32] bf16 (a
 * tile a part, row tile and tile step: row i the pairs k = 2i, 2i + 1 of its 16 rows), in the
 * calling thread's buffer (zero past M and K); NULL when memory is short */
static const uint16_t *x_pairs(const float *x, int64_t M, int64_t lda, int64_t K, int64_t Mp,
                               int64_t Kp) {
    static __thread void *buffer;
    static __thread size_t size;
    const uint16_t *rows = x_parts(x, M, lda, K, Mp, Kp);
    uint16_t *pairs = thread_buffer(&buffer, &size, 3 * Mp * Kp * sizeof(uint16_t));
    if (!rows || !pairs) return 0;
    const int64_t tiles = 3 * (Mp / AMX_ROWS) * (Kp / AMX_K);
    for (int64_t i = 0; i < tiles; i++) { /* (part, row tile) blocks of 16 rows, a step each */
        const int64_t block = i / (Kp / AMX_K), step = i % (Kp / AMX_K);
        transpose16(rows + block * AMX_ROWS * Kp + step * AMX_K, Kp * 2, pairs + i * 512, 64);
    }
    return pairs;
}

/* amx_group's tiles with W as A: tile t [16 columns][16 rows] = bias tile t (or zeros) +
 * panel t's parts (A: [2][Kp / 32][16][32] at w + t * w_panel) against row tile mt of x's parts
 * (B: xb from x_pairs, mtiles row tiles), stored at out + t * 256. Given the panels' blocks
 * (panel t's at blocks + t * Kp / 32 * Q4_BYTES), each tile step first makes its parts there
 * from them, so that its tile loads hit L1 (1 / 16 rows: 12.6 / 14.2 ms a step, 14.2 / 16.5
 * where the whole group was made first; the making itself does not overlap the tile unit's
 * work, see the top). */
static inline void amx_group_q4(const uint16_t *xb, int64_t mtiles, int64_t Kp, int64_t mt,
                                const uint8_t *blocks, uint16_t *w, int64_t w_panel, int np,
                                const float *bias, float *out) {
    const int64_t steps = Kp / AMX_K, part = mtiles * steps * 512, wplane = Kp * 16;
    amx_start(bias, np);
    for (int64_t s = 0; s < steps; s++) {
        const uint16_t *xs = xb + (mt * steps + s) * 512;
        _tile_loadd(4, xs, 64);
        _tile_loadd(5, xs + part, 64);
        _tile_loadd(6, xs + 2 * part, 64);
#define PANEL_PRODUCTS(t)                                       \
        if (np > (t)) {                                         \
            uint16_t *wt = w + (t) * w_panel + s * 512;         \
            if (blocks)                                         \
                q4_rows(blocks + ((t) * steps + s) * Q4_BYTES,  \
                        wt, wt + wplane);                       \
            _tile_loadd(7, wt, 64);                             \
            _tile_dpbf16ps(t, 7, 4);                            \
            _tile_dpbf16ps(t, 7, 5);                            \
            _tile_dpbf16ps(t, 7, 6);                            \
            _tile_loadd(7, wt + wplane, 64);                    \
            _tile_dpbf16ps(t, 7, 4);                            \
            _tile_dpbf16ps(t, 7, 5);                            \
        }
        PANEL_PRODUCTS(0)
        PANEL_PRODUCTS(1)
        PANEL_PRODUCTS(2)
        PANEL_PRODUCTS(3)
#undef PANEL_PRODUCTS
    }
    amx_finish(out, 256, 64, np);
}

/* The product from W's blocks ([count][Kp / 32][Q4_BYTES], cpu_linear_q4_pack), as amx_product
 * from its parts: the panels four at a time to whichever thread is free, their parts made
 * into L2 by the first row tile of a block of rows, every row tile of the block against them,
 * each output tile turned into y's rows. Returns 0 where the buffers do not fit in memory
 * (then the FMA tiles run). */
static int amx_product_q4(const float *x, int64_t M, int64_t lda, int64_t K,
                          const uint8_t *blocks, const float *bias, int64_t N, float *y) {
    const int64_t count = (N + NR - 1) / NR;
    const int64_t Mp = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    const int64_t Kp = (K + AMX_K - 1) / AMX_K * AMX_K, steps = Kp / AMX_K;
    const int64_t w_parts = 2 * Kp * NR; /* bf16 values of a panel's parts */
    const uint16_t *xb = x_pairs(x, M, lda, K, Mp, Kp);
    uint16_t *made = group_buffers(AMX_GROUP * w_parts);
    if (!xb || !made) return 0;
    int64_t block = AMX_L2 / (3 * Kp * 2) / AMX_ROWS * AMX_ROWS;
    if (block < AMX_ROWS) block = AMX_ROWS;
#pragma omp parallel if (M * count * NR * K >= PARALLEL_MACS)
    {
        const int thread = team_thread();
        float biases[AMX_GROUP * 256] __attribute__((aligned(64)));
        float out[AMX_GROUP * 256] __attribute__((aligned(64)));
        float rows_of[256] __attribute__((aligned(64)));
        uint16_t *mine = made + thread * AMX_GROUP * w_parts;
        amx_configure();
        for (int64_t m0 = 0; m0 < M; m0 += block) {
            const int64_t m1 = m0 + block < M ? m0 + block : M;
#pragma omp for schedule(dynamic, 1) nowait /* amx.h's panel_groups */
            for (int64_t g = 0; g < panel_groups(count); g++) {
                const int64_t p0 = g * AMX_GROUP;
                const int np = count - p0 < AMX_GROUP ? count - p0 : AMX_GROUP;
                for (int t = 0; bias && t < np; t++)
                    for (int j = 0; j < NR; j++) /* row j: column j's bias */
                        _mm512_store_ps(biases + t * 256 + j * NR,
                                        _mm512_set1_ps(bias[(p0 + t) * NR + j]));
                for (int64_t m = m0; m < m1; m += AMX_ROWS) {
                    const int64_t rows = m1 - m < AMX_ROWS ? m1 - m : AMX_ROWS;
                    /* the group's parts made by its first row tile, taken by the others */
                    amx_group_q4(xb, Mp / AMX_ROWS, Kp, m / AMX_ROWS,
                                 m == m0 ? blocks + p0 * steps * Q4_BYTES : 0, mine, w_parts,
                                 np, bias ? biases : 0, out);
                    for (int t = 0; t < np; t++) {
                        const int64_t p = p0 + t, cols = N - p * NR < NR ? N - p * NR : NR;
                        transpose16(out + t * 256, 64, rows_of, 64);
                        emit(rows_of, rows, cols, m, p, y, N, 0);
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
