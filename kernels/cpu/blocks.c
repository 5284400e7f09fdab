/* y [M, N] = x [M, K] W^T + b on the CPU, float32 sums, with W as a GGUF file's quantized
 * blocks, read as they lie in the file: N rows of K / 32 blocks each (GGML's Q8_0, Q4_0, Q4_1),
 * built and loaded by kernels/cpu/blocks.py; and the same product reduced to each row's argmax.
 *
 * Blocks of 32 weights along k:
 *   Q8_0  34 bytes: fp16 d, 32 int8 q             w = d * q
 *   Q4_0  18 bytes: fp16 d, 16 bytes of nibbles   w = d * (q - 8)
 *   Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes      w = d * q + m
 * (byte j's low nibble is weight j, its high nibble weight j + 16): the values, bit for bit, of
 * gguf.quants.dequantize in float32, which transformers loads.
 *
 * Each thread takes 16 rows of W at a time (one panel of tile.h), dequantizes their blocks
 * whole into a panel [K, 16] float32 of its own (8 rows at a time, their bytes transposed by
 * AVX2 shuffles, with AVX-512 too) and runs linear.c's FMA tiles over it as linear.c runs them
 * over its own panels: every y[r, j] is the same chain of FMAs over k, bias first, as
 * cpu_linear's over the dequantized weights, so the two products are equal bit for bit. The
 * weight stream from memory is the blocks': 5/32 (Q4_1) to 17/64 (Q8_0) of the float32 panels'
 * bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "tile.h"

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 }; /* GGML's type ids */
#define QK 32                             /* weights a block */
/* bytes of x rows one dequantized panel serves before it is dequantized again (1 MB: in L2
 * or L3 while the panel is in L2) */
#define X_ROWS (1 << 20)

static int64_t block_bytes(int type) { return type == Q8_0 ? 34 : type == Q4_1 ? 20 : 18; }

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits = sign;
    float f;
    if (exp == 31) {
        bits |= 0x7f800000u | (man << 13);
    } else if (exp) {
        bits |= ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: man 2^-24, exact */
        f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

#if defined(__AVX2__) /* AVX-512 builds too: the tiles are 16 wide there, this 8 */
#define LANES 8
static inline __m256 halves(__m256i v) { /* the low 16 bits of each lane as fp16 */
    const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, lo), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(words));
}
#define srli _mm256_srli_epi32
#define and_ _mm256_and_si256
#define cvt _mm256_cvtepi32_ps
#define mul _mm256_mul_ps
#define store _mm256_store_ps
#endif

#ifdef LANES
/* Without gathers (microcoded on AMD's Zen 2 and 3, where they cost more than these shuffles
 * here): c[g] = 16 bytes at p[r] + at of 8 rows transposed, dword t of lane 0 holding byte
 * 4g + t of rows 0-3, of lane 1 rows 4-7 */
static inline void transpose8x16(const uint8_t *const p[8], int64_t at, __m256i c[4]) {
    __m256i a[4];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_loadu2_m128i((const __m128i *)(p[i + 4] + at),
                                   (const __m128i *)(p[i] + at));
    const __m256i b0 = _mm256_unpacklo_epi8(a[0], a[1]), b1 = _mm256_unpackhi_epi8(a[0], a[1]);
    const __m256i b2 = _mm256_unpacklo_epi8(a[2], a[3]), b3 = _mm256_unpackhi_epi8(a[2], a[3]);
    c[0] = _mm256_unpacklo_epi16(b0, b2);
    c[1] = _mm256_unpackhi_epi16(b0, b2);
    c[2] = _mm256_unpacklo_epi16(b1, b3);
    c[3] = _mm256_unpackhi_epi16(b1, b3);
}

/* byte 4g + t of the 8 rows (c[g] of transpose8x16) as 8 dwords: in the low byte (zero
 * extended), or in the high byte (high: the dword is 2^24 times the signed byte) */
static inline __m256i byte_of(__m256i c, int t, int high) {
    int8_t m[16];
    for (int i = 0; i < 16; i++) m[i] = (int8_t)0x80;
    for (int i = 0; i < 4; i++) m[4 * i + (high ? 3 : 0)] = (int8_t)(4 * t + i);
    const __m128i mask = _mm_loadu_si128((const __m128i *)m);
    return _mm256_shuffle_epi8(c, _mm256_broadcastsi128_si256(mask));
}

/* 8 rows' blocks (row r's at p[r]) dequantized into out[k * NR + r], k < 32 */
static inline void dequant_rows8(int type, const uint8_t *const p[8], float *out) {
    int32_t head[8];
    for (int r = 0; r < 8; r++) memcpy(&head[r], p[r], 4);
    const __m256i h = _mm256_loadu_si256((const __m256i *)head);
    const __m256 d = halves(h);
    __m256i c[4];
    /* Each weight one product or FMA: d q is exact in float32 (11 bits of d by 4 or 8 of q), so
     * d q + m fused rounds once as the file's d q, then + m does; 2^24 q by 2^-24 d is d q. */
    if (type == Q8_0) {
        const __m256 d24 = mul(d, _mm256_set1_ps(0x1p-24f));
        for (int half = 0; half < 2; half++) {
            transpose8x16(p, 2 + 16 * half, c);
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++)
                store(out + (16 * half + j) * NR, mul(d24, cvt(byte_of(c[j / 4], j % 4, 1))));
        }
        return;
    }
    const int q4_1 = type == Q4_1;
    const __m256 m = q4_1 ? halves(srli(h, 16)) : mul(d, _mm256_set1_ps(-8.f));
    const __m256i nib = _mm256_set1_epi8(15);
    transpose8x16(p, q4_1 ? 4 : 2, c);
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        const __m256i lo = and_(c[g], nib), hi = and_(_mm256_srli_epi16(c[g], 4), nib);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            const __m256i ql = byte_of(lo, t, 0), qh = byte_of(hi, t, 0);
            store(out + (4 * g + t) * NR, _mm256_fmadd_ps(d, cvt(ql), m)); /* m: -8 d (Q4_0) */
            store(out + (16 + 4 * g + t) * NR, _mm256_fmadd_ps(d, cvt(qh), m));
        }
    }
}
#endif

#ifdef LANES
/* Products of few rows (a decode step's) fused with the dequantization: a panel dequantized
 * whole into memory and read back by tile.h's tiles costs more than the float32 panels' stream
 * it saves when only M <= SMALL rows use it, so here each block's weights of 8 rows of W are
 * dequantized step of k by step of k into a register and multiplied straight into the M rows'
 * accumulators: for k in order, acc[r] = fma(x[r, k], w[k], acc[r]) from the bias, as tile.h's
 * tiles do; y[r, j] is the same chain of FMAs, so the same value bit for bit. 256-bit lanes in
 * the AVX-512 build too (the sums are lane by lane, the width changes no bit). The 8 rows are
 * rb bytes apart (two base pointers and two strides address them all, no table of pointers in
 * general registers), their block heads gathered, and x comes interleaved, xt[k * mr + r]: every
 * step's broadcasts are constant offsets from one pointer. */
#ifdef __AVX512F__
#define SMALL 8 /* 32 vector registers: 8 accumulators and the dequantization's 9 fit */
#else
#define SMALL 5 /* 16: 5 accumulators, 4 transposed blocks, d, m, the mask, the gather index, w, x
                  * (at 6 GCC spilled them: 37 ms a step at 6 rows against 21 at 1) */
#endif

/* transpose8x16 of the rows at p0 + j rb (p4 = p0 + 4 rb, r3 = 3 rb) */
static inline __attribute__((always_inline)) void transpose_strided(const uint8_t *p0,
                                                                   const uint8_t *p4,
                                                                   int64_t rb, int64_t r3,
                                                                   int64_t at, __m256i c[4]) {
    const uint8_t *const p[8] = {p0, p0 + rb, p0 + 2 * rb, p0 + r3,
                                 p4, p4 + rb, p4 + 2 * rb, p4 + r3};
    transpose8x16(p, at, c);
}

/* acc[r] += x[r, k] w for r < mr: one step of k */
#define STEP(k, w)                                                                     \
    do {                                                                               \
        __m256 w_ = (w);                                                               \
        __asm__("" : "+v"(w_)); /* -ffast-math: no dequant product fused into these */ \
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; r++) acc[r] =                  \
            _mm256_fmadd_ps(_mm256_broadcast_ss(xk + (k) * mr + r), w_, acc[r]);       \
    } while (0)

/* out[r * NR + j] = (x W^T + b)[r, j] for r < mr, j < 8, over the 8 rows of W at w + j rb;
 * xt [K, mr] x interleaved; next: the bytes of the next rows to ask into L2 meanwhile */
static inline __attribute__((always_inline)) void fused_rows8(
    const int mr, const int type, const float *xt, int64_t K, const uint8_t *w, int64_t rb,
    const uint8_t *next, const float *bias, float *out) {
    const int64_t bb = block_bytes(type), r3 = 3 * rb;
    __m256 acc[SMALL];
    const __m256 b = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) acc[r] = b;
    const __m256i nib = _mm256_set1_epi8(15);
    const __m256i rows = _mm256_mullo_epi32(_mm256_set1_epi32((int)rb),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int64_t kb = 0; kb < K / QK; kb++) {
        for (int64_t at = kb * LANES * bb; at < (kb + 1) * LANES * bb; at += 64)
            _mm_prefetch((const char *)(next + at), _MM_HINT_T1);
        const uint8_t *p0 = w + kb * bb, *p4 = p0 + 4 * rb;
        const float *xk = xt + kb * QK * mr;
        const __m256i h = _mm256_i32gather_epi32((const int *)p0, rows, 1);
        const __m256 d = halves(h);
        __m256i c[4];
        if (type == Q8_0) {
            const __m256 d24 = mul(d, _mm256_set1_ps(0x1p-24f));
            for (int half = 0; half < 2; half++) {
                transpose_strided(p0, p4, rb, r3, 2 + 16 * half, c);
#pragma GCC unroll 16
                for (int j = 0; j < 16; j++)
                    STEP(16 * half + j, mul(d24, cvt(byte_of(c[j / 4], j % 4, 1))));
            }
            continue;
        }
        const __m256 m = type == Q4_1 ? halves(srli(h, 16)) : mul(d, _mm256_set1_ps(-8.f));
        transpose_strided(p0, p4, rb, r3, type == Q4_1 ? 4 : 2, c);
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            const __m256i lo = and_(c[g], nib);
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++)
                STEP(4 * g + t, _mm256_fmadd_ps(d, cvt(byte_of(lo, t, 0)), m));
        }
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            const __m256i hi = and_(_mm256_srli_epi16(c[g], 4), nib);
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++)
                STEP(16 + 4 * g + t, _mm256_fmadd_ps(d, cvt(byte_of(hi, t, 0)), m));
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) _mm256_storeu_ps(out + r * NR, acc[r]);
}
#undef STEP

#define FUSED(n, t) \
    case n: fused_rows8(n, t, xt, K, w, rb, next, bias, out); break;
#if SMALL > 6
#define FUSED_TYPE(t) \
    switch (mr) { FUSED(1, t) FUSED(2, t) FUSED(3, t) FUSED(4, t) FUSED(5, t) FUSED(6, t) \
                  FUSED(7, t) FUSED(8, t) default: break; }
#else
#define FUSED_TYPE(t) \
    switch (mr) { FUSED(1, t) FUSED(2, t) FUSED(3, t) FUSED(4, t) FUSED(5, t) default: break; }
#endif

/* fused_rows8 with mr (1 .. SMALL) and the type constants */
static void fused_any(int64_t mr, int type, const float *xt, int64_t K, const uint8_t *w,
                      int64_t rb, const uint8_t *next, const float *bias, float *out) {
    if (type == Q8_0) {
        FUSED_TYPE(Q8_0)
    } else if (type == Q4_1) {
        FUSED_TYPE(Q4_1)
    } else {
        FUSED_TYPE(Q4_0)
    }
}
#undef FUSED_TYPE
#undef FUSED

/* The product of M <= SMALL rows, fused: in parallel over the panels of 16 rows of W, each in
 * two halves of 8 (a last panel of fewer rows copied first, its last row repeated, so that
 * its halves too are 8 rows rb bytes apart) */
static void small_product(const float *x, int64_t M, int64_t lda, int64_t K, const uint8_t *w,
                          int type, const float *bias, int64_t N, float *y, Best *bests) {
    const int64_t count = (N + NR - 1) / NR, rb = K / QK * block_bytes(type);
    float *xt = malloc(sizeof(float) * K * M);
    if (!xt) abort();
    for (int64_t r = 0; r < M; r++)
        for (int64_t k = 0; k < K; k++) xt[k * M + r] = x[r * lda + k];
#pragma omp parallel if (M * count * NR * K >= PARALLEL_MACS)
    {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        float out[SMALL * NR] __attribute__((aligned(64)));
        uint8_t *last = 0;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < count; p++) {
            const int64_t cols = N - p * NR < NR ? N - p * NR : NR;
            const uint8_t *panel = w + p * NR * rb;
            if (cols < NR) {
                if (!last && !(last = malloc(NR * rb))) abort();
                for (int64_t i = 0; i < NR; i++)
                    memcpy(last + i * rb, panel + (i < cols ? i : cols - 1) * rb, rb);
                panel = last;
            }
            for (int half = 0; half * LANES < cols; half++)
                /* the next panel's half as far into it as this half is into this panel */
                fused_any(M, type, xt, K, panel + half * LANES * rb, rb,
                          w + (p + 1) * NR * rb + half * LANES * rb,
                          bias ? bias + p * NR + half * LANES : 0, out + half * LANES);
            if (bests) {
                fold(bests + thread, out, M, cols, 0, p);
            } else {
                for (int64_t r = 0; r < M; r++)
                    memcpy(y + r * N + p * NR, out + r * NR, cols * sizeof(float));
            }
        }
        free(last);
    }
    free(xt);
}
#endif

/* blocks kb0 .. kb0 + kbn - 1 of rows 0 .. cols - 1 of w (rb bytes a row) dequantized into
 * panel [32 kbn, 16] (64-byte aligned); the columns past cols repeat the last row (never
 * written out: tile.h). The next panel's rows are asked for into L2 meanwhile, as far into
 * them as these blocks are into these rows. */
static void dequant_panel(const uint8_t *w, int type, int64_t rb, int64_t kb0, int64_t kbn,
                          int64_t cols, float *panel) {
    const int64_t bb = block_bytes(type);
#ifdef LANES
    int64_t off[NR];
    for (int i = 0; i < NR; i++) off[i] = (i < cols ? i : cols - 1) * rb;
    const uint8_t *next = w + NR * rb;
    for (int64_t kb = kb0; kb < kb0 + kbn; kb++) {
        for (int64_t at = kb * NR * bb; at < (kb + 1) * NR * bb; at += 64)
            _mm_prefetch((const char *)(next + at), _MM_HINT_T1);
        for (int h = 0; h < NR / LANES; h++) {
            const uint8_t *p[LANES];
            for (int r = 0; r < LANES; r++) p[r] = w + kb * bb + off[h * LANES + r];
            dequant_rows8(type, p, panel + (kb - kb0) * QK * NR + h * LANES);
        }
    }
#else
    for (int i = 0; i < NR; i++) {
        const uint8_t *row = w + (i < cols ? i : cols - 1) * rb;
        for (int64_t kb = kb0; kb < kb0 + kbn; kb++) {
            const uint8_t *b = row + kb * bb;
            const float d = half_to_float(u16(b));
            float *out = panel + (kb - kb0) * QK * NR + i;
            if (type == Q8_0) {
                for (int k = 0; k < QK; k++) out[k * NR] = d * (float)(int8_t)b[2 + k];
                continue;
            }
            const float m = type == Q4_1 ? half_to_float(u16(b + 2)) : 0.f;
            const uint8_t *qs = b + (type == Q4_1 ? 4 : 2);
            for (int k = 0; k < QK; k++) {
                const int q = k < 16 ? qs[k] & 15 : qs[k - 16] >> 4;
                out[k * NR] = type == Q4_1 ? d * (float)q + m : d * (float)(q - 8);
            }
        }
    }
#endif
}

/* The product over every panel of 16 rows of W, in parallel over them (per-thread bests in
 * bests[thread]). Each panel is dequantized whole, [K, 16] into a buffer of the thread's
 * (36 KB at K = 576, in L2), once for every X_ROWS bytes of x rows, and then runs linear.c's
 * panel_rows over those rows as linear.c runs it over a panel of its own: the same call on the
 * same values. Panels outside, rows inside: a prefill step's rows reuse a dequantized panel
 * (where linear.c, rows outside, streams its float32 panels again every ~100 rows), and its
 * blocks are read from memory once a step. */
static void product(const float *x, int64_t M, int64_t lda, int64_t K, const uint8_t *w,
                    int type, const float *bias, int64_t N, float *y, Best *bests) {
#ifdef LANES
    if (M <= SMALL) {
        small_product(x, M, lda, K, w, type, bias, N, y, bests);
        return;
    }
#endif
    const int64_t count = (N + NR - 1) / NR, rb = K / QK * block_bytes(type);
    int64_t block = X_ROWS / (K * (int64_t)sizeof(float)) / MR * MR;
    if (block < 96) block = 96;
#pragma omp parallel if (M * count * NR * K >= PARALLEL_MACS)
    {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        float *panel = aligned_alloc(64, (size_t)K * NR * sizeof(float));
        if (!panel) abort(); /* K * 64 bytes */
        for (int64_t m0 = 0; m0 < M; m0 += block) {
            const int64_t m1 = m0 + block < M ? m0 + block : M;
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < count; p++) {
                const int64_t cols = N - p * NR < NR ? N - p * NR : NR;
                dequant_panel(w + p * NR * rb, type, rb, 0, K / QK, cols, panel);
                panel_rows(x, lda, K, panel, 0, K, 0, bias ? bias + p * NR : 0, y,
                           bests ? bests + thread : 0, N, p, m0, m1);
            }
        }
        free(panel);
    }
}

/* x [M, K] (row stride lda, K a multiple of 32), w [N, K / 32] blocks of GGML type `type`,
 * contiguous, bias [16 ceil(N / 16)] or NULL, y [M, N] contiguous */
void cpu_blocks_linear(const float *x, int64_t M, int64_t lda, int64_t K, const uint8_t *w,
                       int64_t type, const float *bias, int64_t N, float *y) {
    product(x, M, lda, K, w, (int)type, bias, N, y, 0);
}

/* ids [M] = argmax over j of (x W^T + b)[r, j], y never written (linear.c's rule) */
void cpu_blocks_linear_argmax(const float *x, int64_t M, int64_t lda, int64_t K,
                              const uint8_t *w, int64_t type, const float *bias, int64_t N,
                              int64_t *ids) {
    Bests b = bests_new(M);
    product(x, M, lda, K, w, (int)type, bias, N, 0, b.best);
    bests_merge(&b, M, ids);
}

/* panels [ceil(N / 16), K, 16] = W's blocks dequantized, as the products see them */
void cpu_blocks_dequantize(const uint8_t *w, int64_t type, int64_t K, int64_t N,
                           float *panels) {
    const int64_t rb = K / QK * block_bytes((int)type);
    for (int64_t p = 0; p < (N + NR - 1) / NR; p++)
        dequant_panel(w + p * NR * rb, (int)type, rb, 0, K / QK,
                      N - p * NR < NR ? N - p * NR : NR, panels + p * K * NR);
}
