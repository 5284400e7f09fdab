/* Prefill-chunk and shared-prefix attention on the CPU over the paged KV cache: the C twin of the
 * chunk half of paged_attention_ref and of prefix_attention_ref + merge_states_ref
 * (kernels/reference/), built and loaded by kernels/cpu/prefill.py.
 *
 * A sequence b of the step with n >= 2 queries (rows cu_q[b] .. cu_q[b+1] - 1, at positions
 * context_len - n .. context_len - 1) attends causally to its keys kv_start .. its own position.
 * Work item = (sequence, KV head, block of <= QB queries): its G query heads x its queries form
 * the rows of a small matrix; keys are taken KB at a time out of the pages (keys transposed,
 * values as rows, into buffers of the thread), scores by a register tile of 6 rows x 32 keys
 * with AVX-512 (6 x 16 with AVX2), online softmax with the 8-wide exp, values by a tile of 6
 * rows x 64 of d (6 x 16). The wider tiles (12 and 24 accumulators where the 16-wide AVX-512
 * ones would hold only 6) took the contract job's prefix attention from 104 to ~120 GFLOP/s.
 * (The bfloat16 tile unit, with q, k, p and v split per block into bfloat16 parts, measured
 * slower: 1.5 -> 2.0 s on the contract job.) Key blocks past the last query's position are
 * skipped (causal). Writes o[row] and lse[row] (natural-log sum-exp of the scaled scores; o = 0
 * and lse = -inf for a query that sees no key). A sliding window skips the key blocks before a
 * block's first query's window and masks each row's earlier keys; soft-capping caps the scores
 * before the softmax; both only in their own inlined copy of the work item (attend_block's
 * PLAIN).
 *
 * Shapes (float32, int32 indices, contiguous but q's rows, q_stride floats apart): q, o
 * [T, Hq, D]; lse [T, Hq];
 * k_cache, v_cache [num_pages, page_size, Hkv, D]; page_table [B, max_pages];
 * cu_q [B+1]; context_lens, kv_start [B]; seqs [n] (the sequences to attend).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

#define QB 32 /* queries per work item, at most */
#define QB_MIN 4 /* queries per work item, at least, where a lone sequence is cut finer */
#define KB 64 /* keys per block, a multiple of 16 */
#define RT 6   /* tile rows; row counts are padded to a multiple of it */
#ifdef __AVX512F__
#define WIDE 2 /* 32 keys a score tile, 64 of d a value tile (12 and 24 accumulators) */
#else
#define WIDE 1
#endif

typedef struct {
    float *q, *o, *s, *kt, *v, *m, *l;
} Buffers;

/* s[r][t] = q[r] . kt[:, t] for rows r0 .. r0+5, keys t0 .. t0 + 16 nv - 1 (nv = 1 or 2 with
 * AVX-512, 1 otherwise; both tiles always inlined: with attend_block's two copies in run(), the
 * compiler would otherwise call them per tile). Each score is the same chain of FMAs over d
 * whatever the path, so the paths agree bit for bit. */
static inline __attribute__((always_inline)) void score_tile(
    const float *q, const float *kt, int64_t D, int64_t r0, int64_t t0, float *s, const int nv) {
#ifdef __AVX512F__
    __m512 c[RT][2];
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < nv; j++) c[i][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 k[2];
        for (int j = 0; j < nv; j++) k[j] = _mm512_loadu_ps(kt + d * KB + t0 + 16 * j);
        for (int i = 0; i < RT; i++) {
            const __m512 qv = _mm512_set1_ps(q[(r0 + i) * D + d]);
            for (int j = 0; j < nv; j++) c[i][j] = _mm512_fmadd_ps(qv, k[j], c[i][j]);
        }
    }
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < nv; j++) _mm512_storeu_ps(s + (r0 + i) * KB + t0 + 16 * j, c[i][j]);
#elif defined(__AVX2__)
    (void)nv;
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
    (void)nv;
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < 16; j++) {
            float dot = 0.f;
            for (int64_t d = 0; d < D; d++) dot += q[(r0 + i) * D + d] * kt[d * KB + t0 + j];
            s[(r0 + i) * KB + t0 + j] = dot;
        }
#endif
}

/* o[r][d0 .. d0 + 16 nv - 1] += sum_t p[r][t] v[t][same] for rows r0 .. r0+5, t < nk (nv = 1
 * or 4 with AVX-512, 1 otherwise) */
static inline __attribute__((always_inline)) void value_tile(
    const float *p, const float *v, int64_t D, int64_t nk, int64_t r0, int64_t d0, float *o,
    const int nv) {
#ifdef __AVX512F__
    __m512 a[RT][4];
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < nv; j++) a[i][j] = _mm512_loadu_ps(o + (r0 + i) * D + d0 + 16 * j);
    for (int64_t t = 0; t < nk; t++) {
        __m512 vv[4];
        for (int j = 0; j < nv; j++) vv[j] = _mm512_loadu_ps(v + t * D + d0 + 16 * j);
        for (int i = 0; i < RT; i++) {
            const __m512 pv = _mm512_set1_ps(p[(r0 + i) * KB + t]);
            for (int j = 0; j < nv; j++) a[i][j] = _mm512_fmadd_ps(pv, vv[j], a[i][j]);
        }
    }
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < nv; j++) _mm512_storeu_ps(o + (r0 + i) * D + d0 + 16 * j, a[i][j]);
#elif defined(__AVX2__)
    (void)nv;
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
    (void)nv;
    for (int i = 0; i < RT; i++)
        for (int64_t d = d0; d < d0 + 16; d++) {
            float acc = o[(r0 + i) * D + d];
            for (int64_t t = 0; t < nk; t++) acc += p[(r0 + i) * KB + t] * v[t * D + d];
            o[(r0 + i) * D + d] = acc;
        }
#endif
}

int cpu_prefill_supports(int64_t head_dim) { return head_dim % 16 == 0; }

/* What every work item of a call shares. */
typedef struct {
    const float *q, *k_cache, *v_cache;
    int64_t q_stride, Hq, Hkv, D, S;
    float scale;
    int causal; /* a query sees keys up to its own position (else all of key_lo .. key_end) */
    int merge;  /* start from the state that o and lse hold (another part over other keys) */
    int64_t window; /* > 0 (causal only): a query at p sees keys p - window + 1 .. p only */
    float softcap;  /* > 0: scores s -> softcap * tanh(s / softcap) after scaling */
    float *o, *lse;
} Call;

/* One work item: KV head h, the queries qi0 .. qi0 + nq - 1 of a sequence (or group) whose
 * queries sit at rows first_row.. and positions first_pos.., against keys key_lo .. key_end - 1
 * in the pages of `table`. PLAIN (a constant where it is inlined, in run()): no window and no
 * soft-capping, so the Llama path compiles to the loop without either. */
static inline __attribute__((always_inline)) void attend_block(
    const Call *c, const int32_t *table, int64_t first_row, int64_t first_pos, int64_t key_lo,
    int64_t key_end, int64_t qi0, int64_t nq, int64_t h, Buffers *w, const int PLAIN) {
    const int64_t Hq = c->Hq, Hkv = c->Hkv, D = c->D, S = c->S;
    const int64_t G = Hq / Hkv, R = nq * G, Rp = (R + RT - 1) / RT * RT;
    const int64_t window = PLAIN ? 0 : c->window;
    int64_t last_key = key_end - 1; /* the last key any query of the block sees */
    if (c->causal && first_pos + qi0 + nq - 1 < last_key) last_key = first_pos + qi0 + nq - 1;
    if (window > 0 && first_pos + qi0 - window + 1 > key_lo) /* the first query's window */
        key_lo = first_pos + qi0 - window + 1;
    for (int64_t r = 0; r < Rp; r++) {
        const int64_t qi = r / G, head = h * G + r % G, row = first_row + qi0 + qi;
        const float *qr = c->q + row * c->q_stride + head * D, scale = c->scale;
        float *wq = w->q + r * D;
        if (r < R) /* (one test per row: per value, GCC gathered the row) */
            for (int64_t d = 0; d < D; d++) wq[d] = qr[d] * scale;
        else
            for (int64_t d = 0; d < D; d++) wq[d] = 0.f;
        const float prior = r < R && c->merge ? c->lse[row * Hq + head] : -INFINITY;
        const int seen = prior > -INFINITY; /* the normalized part: m = lse, l = 1, o */
        const float *prior_o = c->o + (row * Hq + head) * D;
        for (int64_t d = 0; d < D; d++) w->o[r * D + d] = seen ? prior_o[d] : 0.f;
        w->m[r] = prior;
        w->l[r] = seen ? 1.f : 0.f;
    }
    for (int64_t k0 = key_lo; k0 <= last_key; k0 += KB) {
        const int64_t nk = last_key + 1 - k0 < KB ? last_key + 1 - k0 : KB;
        const int64_t nkp = (nk + 15) / 16 * 16;
        for (int64_t t = 0; t < nkp; t++) { /* the block's keys (transposed) and values */
            if (t < nk) {
                const int64_t pos = k0 + t;
                const int64_t slot = (int64_t)table[pos / S] * S + pos % S;
                const float *kp = c->k_cache + (slot * Hkv + h) * D;
                const float *vp = c->v_cache + (slot * Hkv + h) * D;
                for (int64_t d = 0; d < D; d++) {
                    w->kt[d * KB + t] = kp[d];
                    w->v[t * D + d] = vp[d];
                }
            } else {
                for (int64_t d = 0; d < D; d++) w->kt[d * KB + t] = w->v[t * D + d] = 0.f;
            }
        }
        for (int64_t r0 = 0; r0 < Rp; r0 += RT) {
            int64_t t0 = 0;
            if (WIDE == 2)
                for (; t0 + 32 <= nkp; t0 += 32) score_tile(w->q, w->kt, D, r0, t0, w->s, 2);
            for (; t0 < nkp; t0 += 16) score_tile(w->q, w->kt, D, r0, t0, w->s, 1);
        }
        for (int64_t r = 0; r < Rp; r++) { /* causal limit (and window), online softmax */
            float *s = w->s + r * KB;
            int64_t valid = r < R ? (c->causal ? first_pos + qi0 + r / G - k0 + 1 : nk) : 0;
            valid = valid < 0 ? 0 : (valid > nk ? nk : valid);
            int64_t from = 0; /* keys of the block before the row's window */
            if (window > 0) {
                from = first_pos + qi0 + r / G - window + 1 - k0;
                from = from < 0 ? 0 : (from > valid ? valid : from);
                for (int64_t t = 0; t < from; t++) s[t] = 0.f;
            }
            if (!PLAIN && c->softcap > 0.f) soft_cap(s + from, valid - from, c->softcap);
            if (valid > from)
                softmax_step(s + from, valid - from, &w->m[r], &w->l[r], w->o + r * D, D);
            for (int64_t t = valid; t < nkp; t++) s[t] = 0.f;
        }
        for (int64_t r0 = 0; r0 < Rp; r0 += RT) {
            int64_t d0 = 0;
            if (WIDE == 2)
                for (; d0 + 64 <= D; d0 += 64) value_tile(w->s, w->v, D, nkp, r0, d0, w->o, 4);
            for (; d0 < D; d0 += 16) value_tile(w->s, w->v, D, nkp, r0, d0, w->o, 1);
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t head = h * G + r % G, row = first_row + qi0 + r / G;
        const float l = w->l[r], inv = l > 0.f ? 1.f / l : 0.f;
        for (int64_t d = 0; d < D; d++) c->o[(row * Hq + head) * D + d] = w->o[r * D + d] * inv;
        c->lse[row * Hq + head] = l > 0.f ? w->m[r] + logf(l) : -INFINITY;
    }
}

/* How many blocks (of at most QB queries, sizes at most 1 apart) nq queries are cut into. A lone
 * sequence (a shared prefix's group: all of a step's decodes) is cut finer where that makes its
 * KV heads x blocks work items split evenly between the threads: 3 KV heads and 30 queries on 2
 * threads make 6 items of 15, not 3 of 30 (2 rounds of work on one thread, 1 on the other). */
static int64_t query_blocks(int64_t nq, int64_t Hkv, int64_t n) {
    int64_t blocks = (nq + QB - 1) / QB;
#ifdef _OPENMP
    const int64_t threads = omp_get_max_threads();
    if (n == 1)
        while ((Hkv * blocks) % threads != 0 && nq / (blocks + 1) >= QB_MIN) blocks++;
#else
    (void)Hkv;
    (void)n;
#endif
    return blocks;
}

/* Every (sequence, KV head, block of queries) of the n sequences `seqs` (NULL: 0 .. n-1), in
 * parallel. Sequence b: query rows cu_q[b] .. cu_q[b+1] - 1, keys kv_start[b] (NULL: 0) ..
 * key_end[b] - 1 in page_table row b, queries at the last positions before key_end[b]. */
static void run(const Call *c, const int32_t *page_table, int64_t max_pages, const int32_t *cu_q,
                const int32_t *key_end, const int32_t *kv_start, const int32_t *seqs, int64_t n) {
    int64_t *first_item = malloc((n + 1) * sizeof(int64_t)); /* work items of seqs[0 .. i) */
    first_item[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = seqs ? seqs[i] : i, nq = cu_q[b + 1] - cu_q[b];
        first_item[i + 1] = first_item[i] + c->Hkv * query_blocks(nq, c->Hkv, n);
    }
    const int64_t items = first_item[n], D = c->D;
    const int plain = c->window == 0 && !(c->softcap > 0.f);
    const int64_t Rp = (QB * (c->Hq / c->Hkv) + RT - 1) / RT * RT;
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
            const int64_t b = seqs ? seqs[i] : i, nq_all = cu_q[b + 1] - cu_q[b];
            const int64_t blocks = (first_item[i + 1] - first_item[i]) / c->Hkv;
            const int64_t local = item - first_item[i], h = local / blocks, k = local % blocks;
            const int64_t qi0 = k * nq_all / blocks, nq = (k + 1) * nq_all / blocks - qi0;
            const int32_t *table = page_table + b * max_pages;
            const int64_t first_pos = key_end[b] - nq_all, lo = kv_start ? kv_start[b] : 0;
            if (plain)
                attend_block(c, table, cu_q[b], first_pos, lo, key_end[b], qi0, nq, h, &w, 1);
            else
                attend_block(c, table, cu_q[b], first_pos, lo, key_end[b], qi0, nq, h, &w, 0);
        }
        free(mem);
    }
    free(first_item);
}

/* Prefill chunks: sequence seqs[i]'s queries attend causally to keys kv_start .. their own
 * position (the last `window` of them when window > 0); writes their rows of o and lse. */
void cpu_prefill_attention(const float *q, int64_t q_stride, const float *k_cache,
                           const float *v_cache, const int32_t *page_table, int64_t max_pages,
                           const int32_t *cu_q, const int32_t *context_lens,
                           const int32_t *kv_start, const int32_t *seqs, int64_t n,
                           int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t page_size, float scale, int64_t window, float softcap,
                           float *o, float *lse) {
    const Call c = {q, k_cache, v_cache, q_stride, num_q_heads, num_kv_heads, head_dim,
                    page_size, scale, 1, 0, window, softcap, o, lse};
    run(&c, page_table, max_pages, cu_q, context_lens, kv_start, seqs, n);
}

/* Shared prefixes: group g's query rows cu_q[g] .. cu_q[g+1] - 1 attend to all of its prefix
 * keys 0 .. prefix_lens[g] - 1 (pages prefix_pages[g]), merged into the state o and lse already
 * hold for those rows (their own part, by the log-sum-exp rule). */
void cpu_prefix_attention(const float *q, int64_t q_stride, const float *k_cache,
                          const float *v_cache, const int32_t *prefix_pages, int64_t max_pages,
                          const int32_t *cu_q, const int32_t *prefix_lens, int64_t groups,
                          int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t page_size, float scale, float softcap, float *o,
                          float *lse) {
    const Call c = {q, k_cache, v_cache, q_stride, num_q_heads, num_kv_heads, head_dim,
                    page_size, scale, 0, 1, 0, softcap, o, lse};
    run(&c, prefix_pages, max_pages, cu_q, prefix_lens, 0, 0, groups);
}
