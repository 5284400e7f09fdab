/* Prefill-chunk attention on the CPU over the paged KV cache: the C twin of the chunk half of
 * paged_attention_ref (kernels/reference.py), built and loaded by kernels/cpu_prefill.py.
 *
 * A sequence b of the step with n >= 2 queries (rows cu_q[b] .. cu_q[b+1] - 1, at positions
 * context_len - n .. context_len - 1) attends causally to its keys kv_start .. its own position.
 * Work item = (sequence, KV head, block of QB queries): its G query heads x QB queries form the
 * rows of a small matrix; keys are taken KB at a time out of the pages (keys transposed, values
 * as rows, into buffers of the thread), scores by a 6x16 register tile, online softmax with the
 * 8-wide exp, values by a 6x16 tile. Key blocks past the last query's position are skipped
 * (causal). Writes o[row] and lse[row] (natural-log sum-exp of the scaled scores; o = 0 and
 * lse = -inf for a query that sees no key).
 *
 * Shapes (float32, int32 indices, contiguous but q's rows, q_stride floats apart): q, o
 * [T, Hq, D]; lse [T, Hq];
 * k_cache, v_cache [num_pages, page_size, Hkv, D]; page_table [B, max_pages];
 * cu_q [B+1]; context_lens, kv_start [B]; seqs [n] (the sequences to attend).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_simd.h"

#define QB 32 /* queries per work item */
#define KB 64 /* keys per block, a multiple of 16 */
#define RT 6   /* tile rows; row counts are padded to a multiple of it */

typedef struct {
    float *q, *o, *s, *kt, *v, *m, *l;
} Buffers;

/* s[r][t] = q[r] . kt[:, t] for rows r0 .. r0+5, keys t0 .. t0+15 */
static inline void score_tile(const float *q, const float *kt, int64_t D, int64_t r0, int64_t t0,
                              float *s) {
#ifdef __AVX2__
    __m256 c[RT][2];
    for (int i = 0; i < RT; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * KB + t0);
        const __m256 k1 = _mm256_loadu_ps(kt + d * KB + t0 + 8);
        for (int i = 0; i < RT; i++) {
            const __m256 qv = _mm256_broadcast_ss(q + (r0 + i) * D + d);
            c[i][0] = _mm256_fmadd_ps(qv, k0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(qv, k1, c[i][1]);
        }
    }
    for (int i = 0; i < RT; i++) {
        _mm256_storeu_ps(s + (r0 + i) * KB + t0, c[i][0]);
        _mm256_storeu_ps(s + (r0 + i) * KB + t0 + 8, c[i][1]);
    }
#else
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < 16; j++) {
            float dot = 0.f;
            for (int64_t d = 0; d < D; d++) dot += q[(r0 + i) * D + d] * kt[d * KB + t0 + j];
            s[(r0 + i) * KB + t0 + j] = dot;
        }
#endif
}

/* o[r][d0 .. d0+15] += sum_t p[r][t] v[t][d0 .. d0+15] for rows r0 .. r0+5, t < nk */
static inline void value_tile(const float *p, const float *v, int64_t D, int64_t nk, int64_t r0,
                              int64_t d0, float *o) {
#ifdef __AVX2__
    __m256 a[RT][2];
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < 2; j++) a[i][j] = _mm256_loadu_ps(o + (r0 + i) * D + d0 + 8 * j);
    for (int64_t t = 0; t < nk; t++) {
        const __m256 v0 = _mm256_loadu_ps(v + t * D + d0), v1 = _mm256_loadu_ps(v + t * D + d0 + 8);
        for (int i = 0; i < RT; i++) {
            const __m256 pv = _mm256_broadcast_ss(p + (r0 + i) * KB + t);
            a[i][0] = _mm256_fmadd_ps(pv, v0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(pv, v1, a[i][1]);
        }
    }
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < 2; j++) _mm256_storeu_ps(o + (r0 + i) * D + d0 + 8 * j, a[i][j]);
#else
    for (int i = 0; i < RT; i++)
        for (int64_t d = d0; d < d0 + 16; d++) {
            float acc = o[(r0 + i) * D + d];
            for (int64_t t = 0; t < nk; t++) acc += p[(r0 + i) * KB + t] * v[t * D + d];
            o[(r0 + i) * D + d] = acc;
        }
#endif
}

/* the largest of s[0 .. len), at least `floor` */
static inline float row_max(const float *s, int64_t len, float floor) {
    int64_t t = 0;
    float top = floor;
#ifdef __AVX2__
    __m256 m = _mm256_set1_ps(floor);
    for (; t + 8 <= len; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
    float part[8];
    _mm256_storeu_ps(part, m);
    for (int j = 0; j < 8; j++) top = part[j] > top ? part[j] : top;
#endif
    for (; t < len; t++) top = s[t] > top ? s[t] : top;
    return top;
}

/* s[t] = e^(s[t] - top) for t < len; returns their sum */
static inline float exp_shift_sum(float *s, int64_t len, float top) {
    int64_t t = 0;
    float sum = 0.f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    const __m256 tv = _mm256_set1_ps(top);
    for (; t + 8 <= len; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), tv));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float part[8];
    _mm256_storeu_ps(part, acc);
    for (int j = 0; j < 8; j++) sum += part[j];
#endif
    for (; t < len; t++) {
        s[t] = expf(s[t] - top);
        sum += s[t];
    }
    return sum;
}

int cpu_prefill_supports(int64_t head_dim) { return head_dim % 16 == 0; }

/* One work item: sequence b, KV head h, queries qi0 .. qi0 + nq - 1 of the sequence. */
static void attend_block(const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache,
                         const int32_t *table, int64_t first_row, int64_t first_pos,
                         int64_t key_lo, int64_t qi0, int64_t nq, int64_t h, int64_t Hq,
                         int64_t Hkv, int64_t D, int64_t S, float scale, Buffers *w, float *o,
                         float *lse) {
    const int64_t G = Hq / Hkv, R = nq * G, Rp = (R + RT - 1) / RT * RT;
    const int64_t last_pos = first_pos + qi0 + nq - 1; /* the last query's position */
    for (int64_t r = 0; r < Rp; r++) {
        const int64_t qi = r / G, g = r % G;
        for (int64_t d = 0; d < D; d++) {
            const int64_t at = (first_row + qi0 + qi) * q_stride + (h * G + g) * D + d;
            w->q[r * D + d] = r < R ? q[at] * scale : 0.f;
            w->o[r * D + d] = 0.f;
        }
        w->m[r] = -INFINITY;
        w->l[r] = 0.f;
    }
    for (int64_t k0 = key_lo; k0 <= last_pos; k0 += KB) {
        const int64_t nk = last_pos + 1 - k0 < KB ? last_pos + 1 - k0 : KB;
        const int64_t nkp = (nk + 15) / 16 * 16;
        for (int64_t t = 0; t < nkp; t++) { /* the block's keys (transposed) and values */
            if (t < nk) {
                const int64_t pos = k0 + t;
                const int64_t slot = (int64_t)table[pos / S] * S + pos % S;
                const float *kp = k_cache + (slot * Hkv + h) * D;
                const float *vp = v_cache + (slot * Hkv + h) * D;
                for (int64_t d = 0; d < D; d++) {
                    w->kt[d * KB + t] = kp[d];
                    w->v[t * D + d] = vp[d];
                }
            } else {
                for (int64_t d = 0; d < D; d++) w->kt[d * KB + t] = w->v[t * D + d] = 0.f;
            }
        }
        for (int64_t r0 = 0; r0 < Rp; r0 += RT)
            for (int64_t t0 = 0; t0 < nkp; t0 += 16) score_tile(w->q, w->kt, D, r0, t0, w->s);
        for (int64_t r = 0; r < Rp; r++) { /* causal limit, online softmax */
            float *s = w->s + r * KB;
            const int64_t qpos = first_pos + qi0 + r / G;
            int64_t valid = r < R ? qpos - k0 + 1 : 0;
            valid = valid < 0 ? 0 : (valid > nk ? nk : valid);
            if (valid > 0) {
                const float top = row_max(s, valid, w->m[r]);
                const float rescale = expf(w->m[r] - top);
                if (rescale != 1.f)
                    for (int64_t d = 0; d < D; d++) w->o[r * D + d] *= rescale;
                w->l[r] = w->l[r] * rescale + exp_shift_sum(s, valid, top);
                w->m[r] = top;
            }
            for (int64_t t = valid; t < nkp; t++) s[t] = 0.f;
        }
        for (int64_t r0 = 0; r0 < Rp; r0 += RT)
            for (int64_t d0 = 0; d0 < D; d0 += 16) value_tile(w->s, w->v, D, nkp, r0, d0, w->o);
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t qi = r / G, g = r % G, row = first_row + qi0 + qi;
        const float l = w->l[r], inv = l > 0.f ? 1.f / l : 0.f;
        for (int64_t d = 0; d < D; d++) o[(row * Hq + h * G + g) * D + d] = w->o[r * D + d] * inv;
        lse[row * Hq + h * G + g] = l > 0.f ? w->m[r] + logf(l) : -INFINITY;
    }
}

void cpu_prefill_attention(const float *q, int64_t q_stride, const float *k_cache,
                           const float *v_cache,
                           const int32_t *page_table, int64_t max_pages, const int32_t *cu_q,
                           const int32_t *context_lens, const int32_t *kv_start,
                           const int32_t *seqs, int64_t n, int64_t num_q_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t page_size, float scale,
                           float *o, float *lse) {
    const int64_t Hq = num_q_heads, Hkv = num_kv_heads, D = head_dim;
    int64_t *first_item = malloc((n + 1) * sizeof(int64_t)); /* work items of seqs[0 .. i) */
    first_item[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = seqs[i], nq = cu_q[b + 1] - cu_q[b];
        first_item[i + 1] = first_item[i] + Hkv * ((nq + QB - 1) / QB);
    }
    const int64_t items = first_item[n], Rp = (QB * (Hq / Hkv) + RT - 1) / RT * RT;
#pragma omp parallel
    {
        Buffers w;
        float *mem = malloc(sizeof(float) * (2 * Rp * D + Rp * KB + 2 * KB * D + 2 * Rp));
        w.q = mem;
        w.o = w.q + Rp * D;
        w.s = w.o + Rp * D;
        w.kt = w.s + Rp * KB;
        w.v = w.kt + KB * D;
        w.m = w.v + KB * D;
        w.l = w.m + Rp;
        int64_t i = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            while (first_item[i + 1] <= item) i++; /* items ascend within a thread */
            while (first_item[i] > item) i--;
            const int64_t b = seqs[i], nq_all = cu_q[b + 1] - cu_q[b];
            const int64_t blocks = (nq_all + QB - 1) / QB, local = item - first_item[i];
            const int64_t h = local / blocks, qi0 = (local % blocks) * QB;
            const int64_t nq = nq_all - qi0 < QB ? nq_all - qi0 : QB;
            attend_block(q, q_stride, k_cache, v_cache, page_table + b * max_pages, cu_q[b],
                         context_lens[b] - nq_all, kv_start[b], qi0, nq, h, Hq, Hkv, D,
                         page_size, scale, &w, o, lse);
        }
        free(mem);
    }
    free(first_item);
}
