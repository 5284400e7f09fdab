/* float32 values as sums of three bfloat16 values, v = h + m + l exactly, in the layouts of the
 * tile unit (amx.h, which says why): x's rows as they are, W's panels pair-interleaved. */
#ifndef BATCHLLM_CPU_BF16_SPLIT_H
#define BATCHLLM_CPU_BF16_SPLIT_H

#include <immintrin.h>
#include <stdint.h>

/* float32 -> bf16 and back (the bf16 as the top half of a float32) */
static inline __m512 bf16_float(__m256bh h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

/* v = h + m + l, each bf16 (16 lanes) */
static inline void split3(__m512 v, __m256bh *h, __m256bh *m, __m256bh *l) {
    *h = _mm512_cvtneps_pbh(v);
    v = _mm512_sub_ps(v, bf16_float(*h));
    *m = _mm512_cvtneps_pbh(v);
    v = _mm512_sub_ps(v, bf16_float(*m));
    *l = _mm512_cvtneps_pbh(v);
}

/* split3's h and m alone: for values whose l is zero */
static inline void split2(__m512 v, __m256bh *h, __m256bh *m) {
    *h = _mm512_cvtneps_pbh(v);
    *m = _mm512_cvtneps_pbh(_mm512_sub_ps(v, bf16_float(*h)));
}

/* 16 bf16 of k and 16 of k + 1 -> 32 as the tile unit takes W: column j's pair at 2j, 2j + 1 */
static inline __m512i pair_interleave(__m256bh a, __m256bh b) {
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    return _mm512_permutexvar_epi16(
        pairs, _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)a), (__m256i)b, 1));
}

/* x [M, K] (stride lda) -> parts [3][Mp][Kp] bf16, zero past M and K */
static void split_rows(const float *x, int64_t M, int64_t lda, int64_t K, int64_t Mp, int64_t Kp,
                       uint16_t *parts) {
    const int64_t plane = Mp * Kp;
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t r = 0; r < Mp; r++) {
        for (int64_t k = 0; k < Kp; k += 16) {
            const int64_t left = r < M ? K - k : 0;
            const __mmask16 mask = left >= 16 ? 0xFFFF : left > 0 ? (1u << left) - 1 : 0;
            __m256bh h, m, l;
            split3(_mm512_maskz_loadu_ps(mask, x + r * lda + k), &h, &m, &l);
            _mm256_storeu_si256((__m256i *)(parts + r * Kp + k), (__m256i)h);
            _mm256_storeu_si256((__m256i *)(parts + plane + r * Kp + k), (__m256i)m);
            _mm256_storeu_si256((__m256i *)(parts + 2 * plane + r * Kp + k), (__m256i)l);
        }
    }
}

/* panel [K, 16] float32 -> parts [planes][Kp / 2][32] bf16, pair-interleaved, zero past K: h,
 * m (planes >= 2) and l (planes = 3). Returns which parts are nonzero somewhere (+-0 are zero):
 * 1 for m, 2 for l, so that a caller asking for two planes learns whether the panel needed the
 * third, or only the first. */
static int split_panel(const float *panel, int64_t K, int64_t Kp, uint16_t *parts, int planes) {
    const int64_t plane = Kp * 16;
    __m512i mid = _mm512_setzero_si512(), low = _mm512_setzero_si512();
    const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
    for (int64_t k = 0; k < Kp; k += 2) {
        const __m512 a = k < K ? _mm512_loadu_ps(panel + k * 16) : _mm512_setzero_ps();
        const __m512 b = k + 1 < K ? _mm512_loadu_ps(panel + (k + 1) * 16) : _mm512_setzero_ps();
        __m256bh ah, am, al, bh, bm, bl;
        split3(a, &ah, &am, &al);
        split3(b, &bh, &bm, &bl);
#define JOINED(x, y) _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)x), (__m256i)y, 1)
        _mm512_store_si512(parts + k * 16, pair_interleave(ah, bh));
        if (planes > 1) _mm512_store_si512(parts + plane + k * 16, pair_interleave(am, bm));
        if (planes > 2) _mm512_store_si512(parts + 2 * plane + k * 16, pair_interleave(al, bl));
        mid = _mm512_or_si512(mid, _mm512_and_si512(JOINED(am, bm), magnitude));
        low = _mm512_or_si512(low, _mm512_and_si512(JOINED(al, bl), magnitude));
#undef JOINED
    }
    return (_mm512_test_epi16_mask(mid, mid) != 0) | (_mm512_test_epi16_mask(low, low) != 0) << 1;
}

#endif
