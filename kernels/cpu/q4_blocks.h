/* A weight of 4-bit blocks, for the tile unit (amx_q4.h): each value w = d q + m, q in 0..15,
 * d and m float16, one (d, m) a column and block of 32 along K. It is the form of a checkpoint
 * quantized to Q4_1 (SmolLM2's layers), found again in the float32 values it was
 * dequantized to: 0.625 bytes a weight where its parts take 4.
 *
 * q4_pack_block takes a block only where every value is found again exactly (fma(q, d, m) == w,
 * the kernel's own formula) and is h + m exactly (no third part: amx.h). A checkpoint quantized
 * as llama.cpp's Q4_1 (m the block's minimum, d its range / 15) has q = 0 at the minimum and
 * q = 15 at the maximum, which is how the block is found. A quantizer that does not reach both
 * ends of a block (llama.cpp's imatrix search may not) leaves that weight on its parts: slower,
 * not wrong.
 *
 * q4_rows makes a block's two parts back, h = bf16(w) and m = bf16(w - h) as split_panel makes
 * them, so that every product is the same sum, bit for bit, as from the parts. A column's 32
 * values share their (d, m), so they take only 16 values: its h and m are looked up (one
 * vpermw each) in a table of 16 made from d and m, a row of the tile unit's A operand each:
 * half the instructions of making each value and splitting it. */
#ifndef BATCHLLM_CPU_Q4_BLOCKS_H
#define BATCHLLM_CPU_Q4_BLOCKS_H

#include <immintrin.h>
#include <stdint.h>

#include "bf16_split.h"

#define Q4_K 32 /* k of a block: a tile step's */
/* Bytes of a panel's block: 8 x 32 bytes of q (byte i of the c-th 32: column 2c's q at k = i,
 * low nibble, and column 2c + 1's), then the 16 columns' d and m as float16. */
#define Q4_BYTES (16 * 16 + 2 * 16 * 2)
#define Q4_D 256
#define Q4_M 288

/* The block of 32 k of a panel [K, 16] float32 at rows into out: 1 where every value is
 * d q + m (as above, the same bits: a -0 that would come back +0 is refused) and h + m exactly,
 * 2 if so and some m part is nonzero; 0 where a value is not (out then undefined). */
static int q4_pack_block(const float *rows, uint8_t *out) {
    __m512 lo = _mm512_loadu_ps(rows), hi = lo;
    for (int k = 1; k < Q4_K; k++) {
        const __m512 v = _mm512_loadu_ps(rows + k * 16);
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
    }
    const __m256i m16 = _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT);
    const __m256i d16 = _mm512_cvtps_ph(_mm512_div_ps(_mm512_sub_ps(hi, lo), _mm512_set1_ps(15)),
                                        _MM_FROUND_TO_NEAREST_INT);
    const __m512 m = _mm512_cvtph_ps(m16), d = _mm512_cvtph_ps(d16);
    const __mmask16 live = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    /* q = (v - m) / d, as the reciprocal's product: a value off by an ulp rounds to the same
     * q, and any q that does not give v back fails the check below */
    const __m512 inverse = _mm512_maskz_div_ps(live, _mm512_set1_ps(1), d);
    const __m256i magnitude = _mm256_set1_epi16(0x7FFF);
    __mmask16 found = 0xFFFF, mid = 0;
    uint8_t q[Q4_K][16];
    for (int k = 0; k < Q4_K; k++) {
        const __m512 v = _mm512_loadu_ps(rows + k * 16);
        __m512i qk = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(v, m), inverse));
        qk = _mm512_min_epi32(_mm512_max_epi32(qk, _mm512_setzero_si512()),
                              _mm512_set1_epi32(15));
        const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qk), d, m);
        found &= _mm512_cmpeq_epi32_mask(_mm512_castps_si512(w), _mm512_castps_si512(v));
        __m256bh h, mp, l;
        split3(v, &h, &mp, &l);
        const __m256i lz = _mm256_and_si256((__m256i)l, magnitude);
        const __m256i mz = _mm256_and_si256((__m256i)mp, magnitude);
        found &= ~_mm256_test_epi16_mask(lz, lz);
        mid |= _mm256_test_epi16_mask(mz, mz);
        _mm_storeu_si128((__m128i *)q[k], _mm512_cvtepi32_epi8(qk));
    }
    for (int c = 0; c < 8; c++)
        for (int k = 0; k < Q4_K; k++)
            out[32 * c + k] = (uint8_t)(q[k][2 * c] | q[k][2 * c + 1] << 4);
    _mm256_storeu_si256((__m256i *)(out + Q4_D), d16);
    _mm256_storeu_si256((__m256i *)(out + Q4_M), m16);
    if (found != 0xFFFF) return 0;
    return mid ? 2 : 1;
}

/* A panel's block back to its two parts as the tile unit's A operand, [16 columns][32 k] bf16
 * each (h at h_out, m at m_out; 64-byte aligned) */
static inline void q4_rows(const uint8_t *block, uint16_t *h_out, uint16_t *m_out) {
    float d[16], m[16];
    _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + Q4_D))));
    _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + Q4_M))));
    const __m512 q = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i nibble = _mm512_set1_epi16(15);
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        const __m512i bytes = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256((const __m256i *)(block + 32 * c)));
        const __m512i index[2] = {_mm512_and_si512(bytes, nibble),
                                  _mm512_srli_epi16(bytes, 4)};
        for (int i = 0; i < 2; i++) {
            const int j = 2 * c + i;
            __m256bh h, mp;
            split2(_mm512_fmadd_ps(q, _mm512_set1_ps(d[j]), _mm512_set1_ps(m[j])), &h, &mp);
            _mm512_store_si512(h_out + j * 32,
                               _mm512_permutexvar_epi16(index[i],
                                                        _mm512_castsi256_si512((__m256i)h)));
            _mm512_store_si512(m_out + j * 32,
                               _mm512_permutexvar_epi16(index[i],
                                                        _mm512_castsi256_si512((__m256i)mp)));
        }
    }
}

#endif
