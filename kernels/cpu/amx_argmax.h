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
 * product the unit adds is rounded once, to nearest (TDPBF16PS: round to nearest even, inputs
 * and results below 2^-126 taken as zero): 2K for a, 6K for z; the norms of W's columns are
 * made once, bounds[], in float64 and rounded up), taken 1.25 times over so that the float32
 * arithmetic of the bound itself is inside it. Every column whose a + E reaches the row's
 * highest a - E may hold the row's maximum; no other can (its z is below that column's). The
 * second pass computes, on the tile unit with all parts, every panel that holds such a column
 * for any row of a row tile, exactly as amx_product does (each y value is its own sum in a fixed
 * order, whatever panels or rows its tile holds), and folds those values: the same index as the
 * whole product, the first maximum on ties (a tied column's z equals the maximum, so it is a
 * candidate too). Values the unit flushes to zero (below 2^-126) add two more terms
 * (row_coefficients). Measured on
 * SmolLM2 over the short job's 1,917 greedy rows in 148 row tiles: 6.1 panels of 3,072 exact a
 * row tile; the lm_head's time in that run 0.56 -> 0.22 s (decode steps of <= 16 rows 5.9 ->
 * 2.2 ms: the h part's 57 MB).
 *
 * A call with a non-finite x or a (NaN, an infinity), or where ||x|| ||w_v|| reaches 2^120 (a
 * sum of z could overflow), has no such bound: the whole product runs instead (returns 0), as
 * it does for a weight with a bias (the lm_heads here have none).
 */
#ifndef BATCHLLM_CPU_AMX_ARGMAX_H
#define BATCHLLM_CPU_AMX_ARGMAX_H

#ifdef HAVE_AMX
#include <float.h>

#define BOUND_MARGIN 1.25

/* Exact panel tiles the last amx_argmax computed, -1 where it gave no answer (a test's view) */
static int64_t amx_argmax_exact = -1;

/* bounds [2][16 count]: for each column v of W (a lane of its panel), ||w_v - bf16(w_v)|| and
 * ||w_v||, summed in float64 (no square underflows) and rounded up to float32 */
static void amx_bounds(const float *panels, int64_t count, int64_t K, float *bounds) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < count; p++) {
        __m512d d2[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
        __m512d w2[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
        for (int64_t k = 0; k < K; k++) {
            const __m512 v = _mm512_loadu_ps(panels + (p * K + k) * NR);
            const __m512 d = _mm512_sub_ps(v, bf16_float(_mm512_cvtneps_pbh(v)));
            for (int half = 0; half < 2; half++) {
                const __m512d dh = _mm512_cvtps_pd(half ? _mm512_extractf32x8_ps(d, 1)
                                                        : _mm512_castps512_ps256(d));
                const __m512d vh = _mm512_cvtps_pd(half ? _mm512_extractf32x8_ps(v, 1)
                                                        : _mm512_castps512_ps256(v));
                d2[half] = _mm512_fmadd_pd(dh, dh, d2[half]);
                w2[half] = _mm512_fmadd_pd(vh, vh, w2[half]);
            }
        }
        double d[NR], w[NR];
        for (int half = 0; half < 2; half++) {
            _mm512_storeu_pd(d + 8 * half, _mm512_sqrt_pd(d2[half]));
            _mm512_storeu_pd(w + 8 * half, _mm512_sqrt_pd(w2[half]));
        }
        for (int j = 0; j < NR; j++) { /* (1 + 2^-20) covers the sum's and sqrt's rounding */
            bounds[p * NR + j] = nextafterf((float)(d[j] * (1 + 0x1p-20)), INFINITY);
            bounds[(count + p) * NR + j] = nextafterf((float)(w[j] * (1 + 0x1p-20)), INFINITY);
        }
    }
}

/* Each row's bound coefficients, E[r, v] = c[r] D_v + c[M + r] W_v + c[2M + r]; the last two
 * also hold what the unit flushes to zero (a part of x or of W below 2^-126, a product below
 * it: each at most 2^-126 |w_k|, 2^-126 |x_k| or 2^-126, so <= 2^-125 sqrt(K) W_v +
 * sqrt(K) ||x|| 2^-126 + 6K 2^-126 in all). 0 where a row's x is not finite, ||x|| reaches
 * 2^100 (the coefficients stay finite) or ||x|| max_v W_v reaches 2^120 (no sum overflows). */
static int row_coefficients(const float *x, int64_t M, int64_t lda, int64_t K, float max_w,
                            float *c) {
    const double rounding = (8.0 * K + 8.0) * 1.02 * 0x1p-24 + 0x1p-16, root = sqrt((double)K);
    for (int64_t r = 0; r < M; r++) {
        double s = 0;
        for (int64_t k = 0; k < K; k++) s += (double)x[r * lda + k] * x[r * lda + k];
        const double norm = sqrt(s) * (1 + 1e-6);
        if (!(norm < 0x1p100 && norm * max_w < 0x1p120)) return 0; /* also NaN, infinities */
        c[r] = (float)(BOUND_MARGIN * norm * (1 + 0x1p-15));
        c[M + r] = (float)(BOUND_MARGIN * (norm * rounding + root * 0x1p-125));
        c[2 * M + r] = (float)(BOUND_MARGIN * 0x1p-120 * (root * norm + 6.0 * K));
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
 * a = (xh + xm) . wh (amx_group with x's two parts and W's first), upper [M][count] and each
 * row's highest a - E in low[thread][M]; 0 where some a is not finite */
static int high_pass(const uint16_t *xs, int64_t M, int64_t Mp, int64_t Kp, const uint16_t *parts,
                     int64_t w_parts, int64_t N, const float *c, const float *bounds,
                     float *upper, float *low) {
    const int64_t count = (N + NR - 1) / NR;
    int ok = 1;
#pragma omp parallel if (M * count * NR * Kp >= PARALLEL_MACS) reduction(& : ok)
    {
        int64_t first, last;
        const int thread = team_share(count, &first, &last);
        float out[AMX_GROUP * AMX_ROWS * NR] __attribute__((aligned(64)));
        amx_configure();
        for (int64_t p0 = first; ok && p0 < last; p0 += AMX_GROUP) {
            const int np = last - p0 < AMX_GROUP ? last - p0 : AMX_GROUP;
            for (int64_t m = 0; ok && m < M; m += AMX_ROWS) {
                const int64_t rows = M - m < AMX_ROWS ? M - m : AMX_ROWS;
                amx_group(xs, Mp, Kp, m, parts + p0 * w_parts, w_parts, np, 1, 2, 0, out, 256,
                          64);
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

/* The second pass: every (row tile, panel) where one of the tile's rows has a column with
 * a + E >= the row's highest a - E (low), exactly (all parts, as amx_product), in parallel over
 * those pairs, each thread folding into its own bests[thread]. Returns how many it computed. */
static int64_t exact_pass(const uint16_t *xs, int64_t M, int64_t Mp, int64_t Kp,
                          const uint16_t *parts, int wp, int64_t N, const float *upper,
                          const float *low, int64_t *pairs, Best *bests) {
    const int64_t count = (N + NR - 1) / NR, w_parts = wp * Kp * NR;
    int64_t n = 0;
    for (int64_t m = 0; m < M; m += AMX_ROWS) {
        const int64_t rows = M - m < AMX_ROWS ? M - m : AMX_ROWS;
        for (int64_t p = 0; p < count; p++) {
            int64_t r = 0;
            while (r < rows && upper[(m + r) * count + p] < low[m + r]) r++;
            if (r < rows) pairs[n++] = m / AMX_ROWS * count + p;
        }
    }
#pragma omp parallel if (n * AMX_ROWS * NR * Kp >= PARALLEL_MACS)
    {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        float out[AMX_ROWS * NR] __attribute__((aligned(64)));
        amx_configure();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            const int64_t m = pairs[i] / count * AMX_ROWS, p = pairs[i] % count;
            const int64_t rows = M - m < AMX_ROWS ? M - m : AMX_ROWS;
            amx_group_exact(xs, Mp, Kp, m, parts + p * w_parts, w_parts, 1, wp, 0, out, 256, 64);
            fold(bests + thread, out, rows, N - p * NR < NR ? N - p * NR : NR, m, p);
        }
        _tile_release();
    }
    return n;
}

/* bests[0 .. threads) [M] (val, ids; ids -1 at first) = each thread's share of the argmax of
 * x W^T over W's N columns (no bias), to be merged as cpu_linear_argmax merges the whole
 * product's; W's parts [count][wp][Kp / 2][32], bounds from amx_bounds. Returns 0 where it
 * gives no answer (memory short, a value not finite, a sum that could overflow): then the
 * whole product runs. */
static int amx_argmax(const float *x, int64_t M, int64_t lda, int64_t K, const uint16_t *parts,
                      int wp, const float *bounds, int64_t N, int threads, Best *bests) {
    const int64_t count = (N + NR - 1) / NR;
    const int64_t Mp = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    const int64_t Kp = (K + AMX_K - 1) / AMX_K * AMX_K;
    float max_w = 0;
    for (int64_t j = 0; j < count * NR; j++)
        max_w = bounds[count * NR + j] > max_w ? bounds[count * NR + j] : max_w;
    float *c = malloc(sizeof(float) * 3 * M), *upper = malloc(sizeof(float) * M * count);
    float *low = malloc(sizeof(float) * threads * M);
    int64_t *pairs = malloc(sizeof(int64_t) * (Mp / AMX_ROWS) * count);
    const uint16_t *xs = 0;
    int ok = c && upper && low && pairs && row_coefficients(x, M, lda, K, max_w, c);
    if (ok) xs = x_parts(x, M, lda, K, Mp, Kp);
    if (ok && xs) {
        for (int64_t i = 0; i < threads * M; i++) low[i] = -FLT_MAX;
        ok = high_pass(xs, M, Mp, Kp, parts, wp * Kp * NR, N, c, bounds, upper, low);
    }
    ok = ok && xs;
    amx_argmax_exact = -1;
    if (ok) {
        for (int t = 1; t < threads; t++)
            for (int64_t r = 0; r < M; r++)
                if (low[t * M + r] > low[r]) low[r] = low[t * M + r];
        amx_argmax_exact = exact_pass(xs, M, Mp, Kp, parts, wp, N, upper, low, pairs, bests);
    }
    free(c);
    free(upper);
    free(low);
    free(pairs);
    return ok;
}

#endif /* HAVE_AMX */
#endif
