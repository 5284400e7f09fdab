/* The greedy rows' argmax over a product's columns, folded in tile by tile as the tiles come
 * (linear.c's FMA tiles): each thread keeps its rows' best so far, and
 * cpu_linear_argmax merges the threads'. The first maximum on ties, NaN above everything, as
 * torch.argmax. */
#ifndef BATCHLLM_CPU_ARGMAX_H
#define BATCHLLM_CPU_ARGMAX_H

#include <math.h>
#include <stdint.h>

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

#endif
