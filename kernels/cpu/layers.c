/* A step's plain decoder layers on the CPU in one call: the same kernels, with the same
 * arguments and in the same order, as batchllm/model/decoder.py's loop over layers.py's blocks
 * calls them one ctypes call at a time (so the same values, bit for bit), built and loaded by
 * kernels/cpu/layers.py. The kernels are the other libraries' (linear.c or blocks.c, ops.c,
 * decode.c, prefill.c), reached through the function pointers of a Kernels record.
 *
 * Why: the loop in Python cost ~11 ms a decode step of SmolLM2-135M's 30 layers outside the
 * kernels (~330 ctypes calls and their torch glue, each run with the caches just emptied by a
 * kernel), against ~25 ms inside them: ~1 s of a 5 s short job.
 *
 * A plain layer (Llama's; model/cpu_layers.py says which models have only those):
 *     x = norm_in(h); qkv = x Wqkv^T (+ b); q, k rotated; k, v stored at the step's slots;
 *     o = attention(q) (decodes, prefill chunks, then the shared prefixes merged in);
 *     h += o Wo^T; x = norm_mlp(h); per block of mlp_rows rows: h += down(silu(gate) * up)
 * Shapes (float32 unless said; rows contiguous): h, x, a [T, H]; qkv [T, (Hq + 2 Hkv) D];
 * o [T, Hq D]; lse [T, Hq]; gate_up [mlp_rows, 2 I]; act [mlp_rows, I]; m [mlp_rows, H];
 * positions, slots [T] int64; the attention's tables int32 as kernels/cpu/attention.py's.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef void (*LinearFn)(const float *x, int64_t M, int64_t lda, int64_t K, const float *panels,
                         const float *bias, int64_t N, float *y);
typedef void (*BlocksFn)(const float *x, int64_t M, int64_t lda, int64_t K, const uint8_t *w,
                         int64_t type, const float *bias, int64_t N, float *y);
typedef void (*AddRmsNormFn)(float *h, const float *delta, const float *w, float eps, int64_t T,
                             int64_t H, float *out);
typedef int (*RopeFn)(float *x, int64_t T, int64_t stride, int64_t heads, int64_t D,
                      const int64_t *positions, const float *cos, const float *sin,
                      int64_t max_position);
typedef void (*SiluMulFn)(const float *gate_up, int64_t T, int64_t I, float *out);
typedef void (*StoreKvFn)(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                          int64_t T, int64_t width, const int64_t *slots, float *k_cache,
                          float *v_cache);
typedef void (*DecodeFn)(const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache, const int32_t *page_table, int64_t max_pages,
                         const int32_t *context_lens, const int32_t *kv_start,
                         const int32_t *seqs, const int32_t *rows, int64_t n, int64_t hq,
                         int64_t hkv, int64_t d, int64_t page_size, float scale, int64_t window,
                         float softcap, float *o, float *lse);
typedef void (*ChunksFn)(const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache, const int32_t *page_table, int64_t max_pages,
                         const int32_t *cu_q, const int32_t *context_lens,
                         const int32_t *kv_start, const int32_t *seqs, int64_t n, int64_t hq,
                         int64_t hkv, int64_t d, int64_t page_size, float scale, int64_t window,
                         float softcap, float *o, float *lse);
typedef void (*PrefixFn)(const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache, const int32_t *prefix_pages, int64_t max_pages,
                         const int32_t *cu_q, const int32_t *prefix_lens, int64_t groups,
                         int64_t hq, int64_t hkv, int64_t d, int64_t page_size, float scale,
                         float softcap, float *o, float *lse);

typedef struct {
    LinearFn linear;
    AddRmsNormFn add_rms_norm;
    RopeFn rope;
    SiluMulFn silu_mul;
    StoreKvFn store_kv;
    DecodeFn decode;
    ChunksFn chunks;
    PrefixFn prefix;
    BlocksFn blocks; /* NULL where blocks.c is not built (then no projection has blocks) */
} Kernels;

typedef struct { /* a projection, as cpu_linear takes it, or as GGUF blocks (blocks.c) */
    const float *panels;
    const float *bias;
    int64_t n;
    const uint8_t *blocks; /* NULL: the panels */
    int64_t type;          /* GGML's type id of the blocks */
} Projection;

typedef struct { /* one layer's weights, rotary tables and cache */
    const float *norm_in, *norm_mlp;
    Projection qkv, o, gate_up, down;
    const float *cos, *sin;
    int64_t rotary_dim, max_position;
    float *k_cache, *v_cache; /* [num_pages, page_size, Hkv, D] */
} Layer;

typedef struct {
    int64_t hidden, hq, hkv, d, intermediate, page_size, mlp_rows;
    float eps, scale;
} Shape;

typedef struct { /* one step: its tokens, its attention's tables, its buffers */
    int64_t T;
    const int64_t *positions, *slots;
    const int32_t *page_table;
    int64_t max_pages;
    const int32_t *cu_q, *context_lens, *kv_start;
    const int32_t *decode_seqs, *decode_rows;
    int64_t decodes;
    const int32_t *chunk_seqs;
    int64_t chunks;
    int64_t groups; /* cascade groups: their queries are rows 0 .. cu_prefix_q[groups] - 1 */
    const int32_t *prefix_pages;
    int64_t max_prefix_pages;
    const int32_t *prefix_lens, *cu_prefix_q;
    float *h, *x, *qkv, *o, *lse, *a, *gate_up, *act, *m;
} Step;

static void project(const Kernels *k, const Projection *p, const float *x, int64_t rows,
                    int64_t K, float *y) {
    if (!rows) return;
    if (p->blocks)
        k->blocks(x, rows, K, K, p->blocks, p->type, p->bias, p->n, y);
    else
        k->linear(x, rows, K, K, p->panels, p->bias, p->n, y);
}

/* o [T, Hq, D] (zeros) and lse [T, Hq] (-inf), then each part of the step's attention into them */
static void attend(const Kernels *k, const Shape *s, const Layer *l, const Step *st) {
    const int64_t T = st->T, hq = s->hq, hkv = s->hkv, d = s->d, S = s->page_size;
    const int64_t q_stride = (hq + 2 * hkv) * d;
    memset(st->o, 0, sizeof(float) * T * hq * d);
    for (int64_t i = 0; i < T * hq; i++) st->lse[i] = -INFINITY;
    if (st->decodes)
        k->decode(st->qkv, q_stride, l->k_cache, l->v_cache, st->page_table, st->max_pages,
                  st->context_lens, st->kv_start, st->decode_seqs, st->decode_rows, st->decodes,
                  hq, hkv, d, S, s->scale, 0, 0.f, st->o, st->lse);
    if (st->chunks)
        k->chunks(st->qkv, q_stride, l->k_cache, l->v_cache, st->page_table, st->max_pages,
                  st->cu_q, st->context_lens, st->kv_start, st->chunk_seqs, st->chunks, hq, hkv,
                  d, S, s->scale, 0, 0.f, st->o, st->lse);
    if (st->groups)
        k->prefix(st->qkv, q_stride, l->k_cache, l->v_cache, st->prefix_pages,
                  st->max_prefix_pages, st->cu_prefix_q, st->prefix_lens, st->groups, hq, hkv, d,
                  S, s->scale, 0.f, st->o, st->lse);
}

/* Runs layers [0, count) over the step; h is the residual stream, in and out. Returns the
 * first layer whose rotary tables a position lies outside of (nothing of it rotated), else
 * -1. */
int64_t cpu_layers(const Kernels *k, const Shape *s, const Layer *layers, int64_t count,
                   const Step *st) {
    const int64_t T = st->T, H = s->hidden, hq = s->hq, hkv = s->hkv, d = s->d;
    const int64_t width = (hq + 2 * hkv) * d, I = s->intermediate;
    for (int64_t i = 0; i < count; i++) {
        const Layer *l = layers + i;
        k->add_rms_norm(st->h, 0, l->norm_in, s->eps, T, H, st->x);
        project(k, &l->qkv, st->x, T, H, st->qkv);
        if (k->rope(st->qkv, T, width, hq + hkv, l->rotary_dim, st->positions, l->cos, l->sin,
                    l->max_position))
            return i;
        k->store_kv(st->qkv + hq * d, width, st->qkv + (hq + hkv) * d, width, T, hkv * d,
                    st->slots, l->k_cache, l->v_cache);
        attend(k, s, l, st);
        project(k, &l->o, st->o, T, hq * d, st->a);
        k->add_rms_norm(st->h, st->a, l->norm_mlp, s->eps, T, H, st->x); /* h += a */
        for (int64_t lo = 0; lo < T; lo += s->mlp_rows) {
            const int64_t rows = T - lo < s->mlp_rows ? T - lo : s->mlp_rows;
            project(k, &l->gate_up, st->x + lo * H, rows, H, st->gate_up);
            k->silu_mul(st->gate_up, rows, I, st->act);
            project(k, &l->down, st->act, rows, I, st->m);
            float *h = st->h + lo * H;
            for (int64_t j = 0; j < rows * H; j++) h[j] += st->m[j];
        }
    }
    return -1;
}
