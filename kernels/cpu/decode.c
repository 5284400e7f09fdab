/* Decode attention on the CPU over the paged KV cache: the C twin of the decode half of
 * paged_attention_ref (kernels/reference/paged_attention.py), built and loaded by
 * kernels/cpu/decode.py.
 *
 * For each one-query sequence i (seqs[i] indexes page_table/context_lens/kv_start, rows[i] is its
 * query row), every query head attends to the keys at positions kv_start .. context_len - 1,
 * read straight out of the pages, with the online softmax of flash attention over blocks of
 * BLOCK keys: the block's scores (a page run at a time; all KV heads of a page are contiguous),
 * then its exponentials (8 at a time), then its values. The next page's keys and the current
 * page's values are prefetched while the scores are computed (the pages are scattered).
 * Writes o[row] and lse[row] (natural-log sum-exp of the scaled scores; o = 0 and lse = -inf
 * for a sequence with no key). A sliding window moves a sequence's first key; soft-capping
 * (Gemma 2) runs in its own inlined copy of the per-sequence loop, so neither costs the Llama
 * path anything.
 *
 * Shapes (float32, int32 indices, contiguous but q's rows):
 *   q [T, Hq, D] with rows q_stride floats apart; o [T, Hq, D]; lse [T, Hq];
 *   k_cache, v_cache [num_pages, page_size, Hkv, D];
 *   page_table [B, max_pages]; context_lens, kv_start [B]; seqs, rows [n].
 * Query head hq reads KV head hq / (Hq / Hkv). Parallel over sequences with OpenMP (torch's own
 * runtime, so torch's thread count). AVX2 + FMA where the compiler targets them, else plain C.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define BLOCK 128 /* tokens per softmax block, a multiple of 8 */

#ifdef __AVX2__
/* the sums of 8 vectors, as one vector */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                           __m256 a6, __m256 a7) {
    __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    __m256 b2 = _mm256_hadd_ps(a4, a5), b3 = _mm256_hadd_ps(a6, a7);
    __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);
    /* c0 = [t0l t1l t2l t3l | t0h t1h t2h t3h], c1 likewise for t4..t7 */
    __m256 lo = _mm256_permute2f128_ps(c0, c1, 0x20), hi = _mm256_permute2f128_ps(c0, c1, 0x31);
    return _mm256_add_ps(lo, hi);
}
#endif

/* s[t] = q . k_t for t < len, k_t = k + t * stride, D floats each */
static inline void page_scores(const float *q, const float *k, int64_t stride, int64_t len,
                               int64_t D, float *s) {
    int64_t t = 0;
#ifdef __AVX2__
    if (D % 8 == 0) {
        for (; t + 8 <= len; t += 8) {
            __m256 a[8];
            for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                for (int j = 0; j < 8; j++)
                    a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (t + j) * stride + d), a[j]);
            }
            _mm256_storeu_ps(s + t, hsum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
        }
    }
#endif
    for (; t < len; t++) {
        const float *kt = k + t * stride;
        float dot = 0.f;
        for (int64_t d = 0; d < D; d++) dot += q[d] * kt[d];
        s[t] = dot;
    }
}

/* acc[d] += sum_t p[t] * v_t[d], v_t = v + t * stride */
static inline void page_values(const float *p, const float *v, int64_t stride, int64_t len,
                               int64_t D, float *acc) {
    int64_t d0 = 0;
#ifdef __AVX2__
    for (; d0 + 64 <= D; d0 += 64) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_loadu_ps(acc + d0 + 8 * j);
        for (int64_t t = 0; t < len; t++) {
            const __m256 pt = _mm256_set1_ps(p[t]);
            const float *vt = v + t * stride + d0;
            for (int j = 0; j < 8; j++)
                a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * j), a[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + d0 + 8 * j, a[j]);
    }
#endif
    for (; d0 < D; d0++) {
        float a = acc[d0];
        for (int64_t t = 0; t < len; t++) a += p[t] * v[t * stride + d0];
        acc[d0] = a;
    }
}

/* ask for n floats from p into the cache, a 64-byte line at a time */
static inline void prefetch_run(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 3);
}

/* The keys pos .. at most hi - 1 that lie in one page (table: the sequence's row of the page
 * table): returns how many; *slot = the first one's slot in the cache. */
static inline int64_t page_run(const int32_t *table, int64_t S, int64_t pos, int64_t hi,
                               int64_t *slot) {
    const int64_t first = pos % S;
    *slot = (int64_t)table[pos / S] * S + first;
    return S - first < hi - pos ? S - first : hi - pos;
}

int cpu_decode_limits(int64_t num_q_heads, int64_t head_dim) {
    return num_q_heads <= MAX_HEADS && head_dim <= MAX_HEAD_DIM;
}

/* One sequence: every query head against the keys lo .. end - 1 of its page table row, its
 * scores soft-capped when CAPPED. Inlined into the two entry loops below with CAPPED a constant,
 * so the Llama path (CAPPED 0) compiles to the loop without the cap. */
static inline __attribute__((always_inline)) void decode_seq(
    const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
    const int32_t *table, int64_t lo0, int64_t end, int64_t row, int64_t num_q_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t page_size, float scale, const int CAPPED,
    float softcap, float *o, float *lse) {
    const int64_t G = num_q_heads / num_kv_heads, D = head_dim, S = page_size, H = num_q_heads;
    const int64_t token_stride = num_kv_heads * D;
    float qs[MAX_HEADS][MAX_HEAD_DIM], acc[MAX_HEADS][MAX_HEAD_DIM];
    float s[MAX_HEADS][BLOCK], m[MAX_HEADS], l[MAX_HEADS];
    for (int64_t hq = 0; hq < H; hq++) {
        const float *qh = q + row * q_stride + hq * D;
        m[hq] = -INFINITY;
        l[hq] = 0.f;
        for (int64_t d = 0; d < D; d++) { qs[hq][d] = qh[d] * scale; acc[hq][d] = 0.f; }
    }
    for (int64_t lo = lo0; lo < end; lo += BLOCK) {
        const int64_t hi = end - lo < BLOCK ? end : lo + BLOCK;
        for (int64_t pos = lo; pos < hi;) {  /* scores of the block, a page run at a time */
            int64_t slot, next_slot;
            const int64_t len = page_run(table, S, pos, hi, &slot);
            /* fetch the next run's keys, and this run's values for after the softmax */
            if (pos + len < end) {
                const int64_t next_len = page_run(table, S, pos + len, end, &next_slot);
                prefetch_run(k_cache + next_slot * token_stride, next_len * token_stride);
            }
            prefetch_run(v_cache + slot * token_stride, len * token_stride);
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const float *k = k_cache + slot * token_stride + h * D;
                for (int64_t hq = h * G; hq < (h + 1) * G; hq++)
                    page_scores(qs[hq], k, token_stride, len, D, s[hq] + (pos - lo));
            }
            pos += len;
        }
        for (int64_t hq = 0; hq < H; hq++) {  /* online softmax over the block */
            if (CAPPED) soft_cap(s[hq], hi - lo, softcap);
            softmax_step(s[hq], hi - lo, &m[hq], &l[hq], acc[hq], D);
        }
        for (int64_t pos = lo; pos < hi;) {  /* values, a page run at a time */
            int64_t slot;
            const int64_t len = page_run(table, S, pos, hi, &slot);
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const float *v = v_cache + slot * token_stride + h * D;
                for (int64_t hq = h * G; hq < (h + 1) * G; hq++)
                    page_values(s[hq] + (pos - lo), v, token_stride, len, D, acc[hq]);
            }
            pos += len;
        }
    }
    for (int64_t hq = 0; hq < H; hq++) {
        const float inv = l[hq] > 0.f ? 1.f / l[hq] : 0.f;
        for (int64_t d = 0; d < D; d++) o[(row * H + hq) * D + d] = acc[hq][d] * inv;
        lse[row * H + hq] = l[hq] > 0.f ? m[hq] + logf(l[hq]) : -INFINITY;
    }
}

/* window > 0: the query (at position context_len - 1) sees only the last `window` keys, so a
 * sequence starts at max(kv_start, context_len - window), once, outside the loops. softcap > 0:
 * scores s -> softcap * tanh(s / softcap) after scaling. */
void cpu_decode_attention(const float *q, int64_t q_stride, const float *k_cache,
                          const float *v_cache,
                          const int32_t *page_table, int64_t max_pages,
                          const int32_t *context_lens, const int32_t *kv_start,
                          const int32_t *seqs, const int32_t *rows, int64_t n,
                          int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t page_size, float scale, int64_t window, float softcap,
                          float *o, float *lse) {
    /* one sequence: no team to fork (the other thread would only wait) */
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = seqs[i], end = context_lens[b];
        int64_t lo = kv_start[b];
        if (window > 0 && end - window > lo) lo = end - window;
        const int32_t *table = page_table + b * max_pages;
        if (softcap > 0.f)
            decode_seq(q, q_stride, k_cache, v_cache, table, lo, end, rows[i], num_q_heads,
                       num_kv_heads, head_dim, page_size, scale, 1, softcap, o, lse);
        else
            decode_seq(q, q_stride, k_cache, v_cache, table, lo, end, rows[i], num_q_heads,
                       num_kv_heads, head_dim, page_size, scale, 0, 0.f, o, lse);
    }
}
