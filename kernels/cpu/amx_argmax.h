/* The greedy rows' argmax on the tile unit from W's high parts, the exact product taken only
 * where the argmax can be: included by linear.c after amx.h.
 *
 * A decode step's lm_head (SmolLM2: 49,152 x 576, three parts, 170 MB) streams every part of
 * every column for one index a row. Here a first pass takes W's h part alone against x's h and
 * m (two products, a third of the bytes): a[r, v] = (xh + xm) . wh_v. It is within E[r, v] of
 * the exact kernel's value z[r, v] (amx.h's six products, what cpu_linear writes), with
 *
 *   |a - z| <= |(xh + xm) . (wh - w)| + |(x - xh - xm) . w| + rounding of both sums
 *           <= ||x|| (1 + 2^-15) ||w_v - wh_v|| + ((8K + 8) 2^-24 1.02 + 2^-16) ||x|| ||w_v||
 *
 * (Cauchy-Schwarz on each; |x - xh - xm| <= 2^-16 |x| from two round-to-nearest splits; each
 * product the unit adds is rounded once: 2K for a, 6K for z; the norms of W's columns are made
 * once, bounds[], rounded up), taken 1.25 times over so that the float32 arithmetic of the
 * bound itself is inside it. Every column whose a + E reaches the row's highest a - E may hold
 * the row's maximum; no other can (its z is below that column's). The second pass computes, on
 * the tile unit with all parts, every panel that holds such a column for any row of a row tile,
 * exactly as amx_product does (each y value is its own sum in a fixed order, whatever panels or
 * rows its tile holds), and folds those values: the same index as the whole product, the first
 * maximum on ties (a tied column's z equals the maximum, so it is a candidate too). Values the
 * unit flushes to zero (below 2^-126) add a last, absolute term (row_coefficients). Measured on
 * SmolLM2 over the short job's 1,917 greedy rows in 148 row tiles: 6.1 panels of 3,072 exact a
 * row tile; the lm_head's time in that run 0.56 -> 0.22 s (decode steps of <= 16 rows 5.9 ->
 * 2.2 ms: the h part's 57 MB).
 *
 * A row with a non-finite x or a (NaN, an infinity, an overflow) has no such bound: the whole
 * product runs instead (returns 0), as does a weight with a bias (the lm_heads here have none).
 */
#ifndef BATCHLLM_CPU_AMX_ARGMAX_H
#define BATCHLLM_CPU_AMX_ARGMAX_H

#ifdef HAVE_AMX
#include <float.h>

#define BOUND_MARGIN 1.25f

/* bounds [2][16 count]: for each column v of W (a lane of its panel), ||w_v - bf16(w_v)|| and
 * ||w_v|| (float32 sums of K squares, within K 2^-24 of themselves: rounded up by 2^-12) */
static void amx_bounds(const float *panels, int64_t count, int64_t K, float *bounds) {
    const __m512 up = _mm512_set1_ps(1.f + 1.f / 4096.f);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < count; p++) {
        __m512 d2 = _mm512_setzero_ps(), w2 = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k++) {
            const __m512 v = _mm512_loadu_ps(panels + (p * K + k) * NR);
            const __m512 d = _mm512_sub_ps(v, bf16_float(_mm512_cvtneps_pbh(v)));
            d2 = _mm512_fmadd_ps(d, d, d2);
            w2 = _mm512_fmadd_ps(v, v, w2);
        }
        _mm512_storeu_ps(bounds + p * NR, _mm512_mul_ps(_mm512_sqrt_ps(d2), up));
        _mm512_storeu_ps(bounds + count * NR + p * NR, _mm512_mul_ps(_mm512_sqrt_ps(w2), up));
    }
}

/* y tiles of x rows [m, m + 16) against panels t < np <= 4 of a group from W's h part alone:
 * out[t] = (xh + xm) . wh (two products, one tile load of W a panel and step of k) */
static inline __attribute__((always_inline)) void amx_group_high(const uint16_t *xs, int64_t Mp,
                                                                 int64_t Kp, int64_t m,
                                                                 const uint16_t *w,
                                                                 int64_t w_panel, int np,
                                                                 float *out) {
    const int64_t plane = Mp * Kp, ld = Kp * 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < Kp; k += AMX_K) {
        const uint16_t *x = xs + m * Kp + k;
        _tile_loadd(4, x, ld);
        _tile_loadd(5, x + plane, ld);
#define HIGH_PRODUCTS(t)                                        \
        if (np > (t)) {                                         \
            _tile_loadd(7, w + (t) * w_panel + k * 16, 64);     \
            _tile_dpbf16ps(t, 4, 7);                            \
            _tile_dpbf16ps(t, 5, 7);                            \
        }
        HIGH_PRODUCTS(0)
        HIGH_PRODUCTS(1)
        HIGH_PRODUCTS(2)
        HIGH_PRODUCTS(3)
#undef HIGH_PRODUCTS
    }
    _tile_stored(0, out, 64);
    if (np > 1) _tile_stored(1, out + 256, 64);
    if (np > 2) _tile_stored(2, out + 512, 64);
    if (np > 3) _tile_stored(3, out + 768, 64);
}

/* Each row's bound coefficients: E[r, v] = c[r] D_v + c[M + r] W_v + c[2M + r], the last for
 * the values the unit flushes to zero (bf16 inputs below 2^-126, and such products: at most
 * 2^-126 |x_k| or 2^-126 each, <= sqrt(K) ||x|| 2^-126 + 6K 2^-126 in all); 0 where a row's x
 * is not finite (its norm overflows or is NaN) */
static int row_coefficients(const float *x, int64_t M, int64_t lda, int64_t K, float *c) {
    const double rounding = (8.0 * K + 8.0) * 1.02 / 16777216.0 + 1.0 / 65536.0;
    const double flushed = ldexp(1.0, -120); /* 2^-126, 64 times over */
    for (int64_t r = 0; r < M; r++) {
        double s = 0;
        for (int64_t k = 0; k < K; k++) s += (double)x[r * lda + k] * x[r * lda + k];
        const double norm = sqrt(s) * (1 + 1e-6);
        if (!(norm < 1e30)) return 0;
        c[r] = (float)(BOUND_MARGIN * norm * (1 + 1.0 / 32768.0));
        c[M + r] = (float)(BOUND_MARGIN * norm * rounding);
        c[2 * M + r] = (float)(BOUND_MARGIN * flushed * (sqrt((double)K) * norm + 6.0 * K));
    }
    return 1;
}

/* One output tile's bounds: upper[r][p] = max over its columns of a + E, low[r] raised to the
 * highest a - E; 0 where some a is not finite */
static int tile_bounds(const float *out, int64_t rows, int64_t cols, int64_t m, int64_t p,
                       int64_t count, const float *c, int64_t M, const float *bounds,
                       float *upper, float *low) {
    const __mmask16 mask = cols >= NR ? 0xFFFF : (1u << cols) - 1;
    const __m512 d = _mm512_loadu_ps(bounds + p * NR);
    const __m512 w = _mm512_loadu_ps(bounds + (count + p) * NR);
    for (int64_t r = 0; r < rows; r++) {
        const __m512 a = _mm512_loadu_ps(out + r * NR);
        if (_mm512_mask_fpclass_ps_mask(mask, a, 0x99)) return 0; /* NaN or an infinity */
        const __m512 flushed = _mm512_set1_ps(c[2 * M + m + r]);
        const __m512 e = _mm512_fmadd_ps(_mm512_set1_ps(c[m + r]), d,
                                         _mm512_fmadd_ps(_mm512_set1_ps(c[M + m + r]), w, flushed));
        const float hi = _mm512_mask_reduce_max_ps(mask, _mm512_add_ps(a, e));
        const float lo = _mm512_mask_reduce_max_ps(mask, _mm512_sub_ps(a, e));
        upper[(m + r) * count + p] = hi;
        if (lo > low[m + r]) low[m + r] = lo;
    }
    return 1;
}

/* The first pass, over every panel in parallel (each thread an even share, four at a time):
 * upper [M][count] and each row's highest a - E in low[thread][M]; 0 where some a is not finite */
static int high_pass(const uint16_t *xs, int64_t M, int64_t Mp, int64_t Kp, const uint16_t *parts,
                     int64_t w_parts, int64_t N, const float *c, const float *bounds,
                     float *upper, float *low) {
    const int64_t count = (N + NR - 1) / NR;
    int ok = 1;
#pragma omp parallel if (M * count * NR * Kp >= PARALLEL_MACS) reduction(& : ok)
    {
        int thread = 0, team = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        const int64_t first = count * thread / team, last = count * (thread + 1) / team;
        float out[AMX_GROUP * AMX_ROWS * NR] __attribute__((aligned(64)));
        amx_configure();
        for (int64_t p0 = first; ok && p0 < last; p0 += AMX_GROUP) {
            const int np = last - p0 < AMX_GROUP ? last - p0 : AMX_GROUP;
            for (int64_t m = 0; ok && m < M; m += AMX_ROWS) {
                const int64_t rows = M - m < AMX_ROWS ? M - m : AMX_ROWS;
                amx_group_high(xs, Mp, Kp, m, parts + p0 * w_parts, w_parts, np, out);
                for (int t = 0; ok && t < np; t++) {
                    const int64_t p = p0 + t, cols = N - p * NR < NR ? N - p * NR : NR;
                    ok = tile_bounds(out + t * 256, rows, cols, m, p, count, c, M, bounds, upper,
                                     low + thread * M);
                }
            }
        }
        _tile_release();
    }
    return ok;
}

/* The second pass, on the calling thread: for each row tile, every panel where one of its rows
 * has a column with a + E >= the row's highest a - E (low), exactly (all of W's parts, as
 * amx_product), folded into best */
static void exact_pass(const uint16_t *xs, int64_t M, int64_t Mp, int64_t Kp,
                       const uint16_t *parts, int wp, int64_t N, const float *upper,
                       const float *low, Best *best) {
    const int64_t count = (N + NR - 1) / NR, w_parts = wp * Kp * NR;
    float zeros[AMX_ROWS * NR] __attribute__((aligned(64))) = {0};
    float out[AMX_ROWS * NR] __attribute__((aligned(64)));
    amx_configure();
    for (int64_t m = 0; m < M; m += AMX_ROWS) {
        const int64_t rows = M - m < AMX_ROWS ? M - m : AMX_ROWS;
        for (int64_t p = 0; p < count; p++) {
            int64_t r = 0;
            while (r < rows && upper[(m + r) * count + p] < low[m + r]) r++;
            if (r == rows) continue;
            const uint16_t *w = parts + p * w_parts;
            if (wp == 3)
                amx_group(xs, Mp, Kp, m, w, w_parts, 1, 3, zeros, out);
            else if (wp == 2)
                amx_group(xs, Mp, Kp, m, w, w_parts, 1, 2, zeros, out);
            else
                amx_group(xs, Mp, Kp, m, w, w_parts, 1, 1, zeros, out);
            fold(best, out, rows, N - p * NR < NR ? N - p * NR : NR, m, p);
        }
    }
    _tile_release();
}

/* ids [M] = the argmax of x W^T over W's N columns (no bias), as cpu_linear_argmax's whole
 * product gives it; W's parts [count][wp][Kp / 2][32], bounds from amx_bounds. Returns 0
 * where it gives no answer (memory short, a value not finite): then the whole product runs. */
static int amx_argmax(const float *x, int64_t M, int64_t lda, int64_t K, const uint16_t *parts,
                      int wp, const float *bounds, int64_t N, int64_t *ids) {
    const int64_t count = (N + NR - 1) / NR;
    const int64_t Mp = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    const int64_t Kp = (K + AMX_K - 1) / AMX_K * AMX_K;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    float *c = malloc(sizeof(float) * 3 * M), *upper = malloc(sizeof(float) * M * count);
    float *low = malloc(sizeof(float) * threads * M);
    const uint16_t *xs = 0;
    int ok = c && upper && low && row_coefficients(x, M, lda, K, c);
    if (ok) xs = x_parts(x, M, lda, K, Mp, Kp);
    if (ok && xs) {
        for (int64_t i = 0; i < threads * M; i++) low[i] = -FLT_MAX;
        ok = high_pass(xs, M, Mp, Kp, parts, wp * Kp * NR, N, c, bounds, upper, low);
    }
    ok = ok && xs;
    if (ok) {
        for (int t = 1; t < threads; t++)
            for (int64_t r = 0; r < M; r++)
                if (low[t * M + r] > low[r]) low[r] = low[t * M + r];
        for (int64_t r = 0; r < M; r++) ids[r] = -1;
        Best best = {c, ids}; /* the coefficients are spent: c holds the best values */
        exact_pass(xs, M, Mp, Kp, parts, wp, N, upper, low, &best);
    }
    free(c);
    free(upper);
    free(low);
    return ok;
}

#endif /* HAVE_AMX */
#endif
