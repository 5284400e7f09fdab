/* The model's pointwise steps on the CPU, each one pass over its rows instead of torch's chain
 * of elementwise ops (each a pass over memory), and the KV store: built and loaded by
 * kernels/cpu/ops.py, whose torch twins (kernels/reference/pointwise.py: the formulas of Hugging
 * Face's Llama modules, and kernels/reference/store_kv.py) they are checked against.
 *
 * Shapes (float32, contiguous rows): see each function. Rows run in parallel with OpenMP (torch's
 * own runtime) where a step has enough of them: a decode step of a few rows runs on one thread.
 * AVX2 + FMA for e^x where the compiler targets them, else plain C.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* Below this many floats a pass runs on one thread (SmolLM2: RMSNorm up to 7 rows, SiLU-and-
 * multiply, an e^x a float, 1 row). Measured with the team awake (it is, between projections):
 * RMSNorm of 1 row 3.2 -> 2.9 us serial, of 8 rows 3.8 either way, of 16 rows 4.4 parallel
 * against 5.1; SiLU 4 rows 3.8 parallel, 4.3 serial. A serial pass also leaves the other core to
 * whatever else runs there. */
#define PARALLEL_FLOATS (1 << 12)

/* h [T, H] += delta [T, H] (when delta is not NULL), then
 * out [T, H] = w [H] * (h * 1 / sqrt(mean(h^2) + eps)), as LlamaRMSNorm in float32. */
void cpu_add_rms_norm(float *h, const float *delta, const float *w, float eps, int64_t T,
                      int64_t H, float *out) {
#pragma omp parallel for schedule(static) if (T * H >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < T; t++) {
        float *x = h + t * H;
        if (delta != 0) {
            const float *dx = delta + t * H;
            for (int64_t i = 0; i < H; i++) x[i] += dx[i];
        }
        float squares = 0.f;
        for (int64_t i = 0; i < H; i++) squares += x[i] * x[i];
        const float r = 1.f / sqrtf(squares / (float)H + eps);
        float *o = out + t * H;
        for (int64_t i = 0; i < H; i++) o[i] = w[i] * (x[i] * r);
    }
}

/* Rotary embedding in place on the first `heads` heads of each row of x (row t at x + t * stride,
 * head j at + j * D): x = x * cos[p] + rotate_half(x) * sin[p], p = positions[t]; cos, sin
 * [max_position, D]; rotate_half(x) = (-x[D/2:], x[:D/2]). Returns -1, x untouched, where a
 * position lies outside the tables (checked here: two torch reductions per layer cost more
 * than a one-row step's rotation), else 0. */
int cpu_rope(float *x, int64_t T, int64_t stride, int64_t heads, int64_t D,
             const int64_t *positions, const float *cos, const float *sin,
             int64_t max_position) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return -1;
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T * heads * D >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
        for (int64_t j = 0; j < heads; j++) {
            float *a = x + t * stride + j * D, *b = a + half;
            for (int64_t i = 0; i < half; i++) {
                const float lo = a[i], hi = b[i];
                a[i] = lo * c[i] - hi * s[i];
                b[i] = hi * c[half + i] + lo * s[half + i];
            }
        }
    }
    return 0;
}

/* out [T, I] = silu(gate) * up, gate_up [T, 2I] = (gate | up) per row; silu(g) = g / (1 + e^-g) */
void cpu_silu_mul(const float *gate_up, int64_t T, int64_t I, float *out) {
#pragma omp parallel for schedule(static) if (2 * T * I >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(zero, gv));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* k_cache row slots[t] = k row t, v likewise; a row is `width` floats (Hkv * D), k's rows
 * k_stride floats apart (views of the qkv projection), the caches' rows contiguous. */
void cpu_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t T,
                  int64_t width, const int64_t *slots, float *k_cache, float *v_cache) {
#pragma omp parallel for schedule(static) if (T * width >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < T; t++) {
        float *kd = k_cache + slots[t] * width, *vd = v_cache + slots[t] * width;
        const float *ks = k + t * k_stride, *vs = v + t * v_stride;
        for (int64_t i = 0; i < width; i++) {
            kd[i] = ks[i];
            vd[i] = vs[i];
        }
    }
}
