/* Shared by the CPU kernels (the .c files beside it): e^x 8 at a time, and the online softmax. */
#ifndef BATCHLLM_CPU_SIMD_H
#define BATCHLLM_CPU_SIMD_H

#include <math.h>
#include <stdint.h>

#ifdef __AVX2__
#include <immintrin.h>

/* e^x for 8 floats (Cephes' expf polynomial, about 1 ulp), x clamped to [-87.3, 88.4] */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365447f)),
                      _mm256_set1_ps(88.3762626f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

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

/* s[t] = cap * tanh(s[t] / cap) for t < len (attention-logit soft-capping, Gemma 2), with
 * tanh(x) = 1 - 2 / (e^(2x) + 1): exact at both ends (e^(2x) clamped), ~1e-7 absolute near 0. */
static inline void soft_cap(float *s, int64_t len, float cap) {
    const float inv = 1.f / cap;
    int64_t t = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f);
    const __m256 c = _mm256_set1_ps(cap), twice_inv = _mm256_set1_ps(2.f * inv);
    for (; t + 8 <= len; t += 8) {
        const __m256 e = exp8(_mm256_mul_ps(_mm256_loadu_ps(s + t), twice_inv));
        const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
        _mm256_storeu_ps(s + t, _mm256_mul_ps(c, th));
    }
#endif
    for (; t < len; t++) s[t] = cap * tanhf(s[t] * inv);
}

/* One block of the online softmax of one query row: its scores s[0 .. len) become
 * e^(s - m') with m' = max(*m, scores); the running sum *l and the D accumulated outputs in acc
 * are rescaled from *m to m', *l gains the block's sum, *m = m'. (*m = -inf: nothing yet.) */
static inline void softmax_step(float *s, int64_t len, float *m, float *l, float *acc,
                                int64_t D) {
    const float top = row_max(s, len, *m);
    const float rescale = expf(*m - top);
    if (rescale != 1.f)
        for (int64_t d = 0; d < D; d++) acc[d] *= rescale;
    *l = *l * rescale + exp_shift_sum(s, len, top);
    *m = top;
}

#endif
