/* The greedy rows' argmax over a product's columns, folded in tile by tile as the tiles come
 * (linear.c's FMA tiles): each thread keeps its rows' best so far, and
 * cpu_linear_argmax merges the threads'. The first maximum on ties, NaN above everything, as
 * torch.argmax. */
#ifndef BATCHLLM_CPU_ARGMAX_H
#define BATCHLLM_CPU_ARGMAX_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define NR 16 /* panel width: y columns per tile */

/* Where a thread's greedy rows keep their best column so far: val[r], ids[r] (-1: none yet). */
typedef struct {
    float *val;
    int64_t *ids;
} Best;

/* whether value a at column ia comes before b at ib as an argmax (NaN highest, then the first) */
static inline int beats(float a, int64_t ia, float b, int64_t ib) {
    if (ib < 0) return 1;
    if (isnan(a) || isnan(b)) return isnan(a) && (!isnan(b) || ia < ib);
    return a > b || (a == b && ia < ib);
}

/* rows m .. m + rows - 1 of y's panel p, computed into buffer [rows, NR], folded into best
 * (columns ascend: only a strictly better value replaces) */
static inline void fold(Best *best, const float *buffer, int64_t rows, int64_t cols, int64_t m,
                 int64_t p) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols; j++)
            if (beats(buffer[r * NR + j], p * NR + j, best->val[m + r], best->ids[m + r])) {
                best->val[m + r] = buffer[r * NR + j];
                best->ids[m + r] = p * NR + j;
            }
}

/* One Best per thread of the team a product runs on, over M rows each */
typedef struct {
    Best *best; /* [threads] */
    int threads;
    float *val;
    int64_t *at;
} Bests;

static inline Bests bests_new(int64_t M) {
    Bests b = {0, 1, 0, 0};
#ifdef _OPENMP
    b.threads = omp_get_max_threads();
#endif
    b.val = malloc(sizeof(float) * b.threads * M);
    b.at = malloc(sizeof(int64_t) * b.threads * M);
    b.best = malloc(sizeof(Best) * b.threads);
    for (int t = 0; t < b.threads; t++) b.best[t] = (Best){b.val + t * M, b.at + t * M};
    for (int64_t i = 0; i < b.threads * M; i++) b.at[i] = -1;
    return b;
}

/* ids[r] = the best of the threads' bests of row r (the first maximum); frees b */
static inline void bests_merge(Bests *b, int64_t M, int64_t *ids) {
    for (int64_t r = 0; r < M; r++) {
        float v = b->val[r];
        int64_t id = b->at[r];
        for (int t = 1; t < b->threads; t++)
            if (b->at[t * M + r] >= 0 && beats(b->val[t * M + r], b->at[t * M + r], v, id)) {
                v = b->val[t * M + r];
                id = b->at[t * M + r];
            }
        ids[r] = id;
    }
    free(b->val);
    free(b->at);
    free(b->best);
}

#endif
