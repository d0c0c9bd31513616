/* Paged-attention decode for the CPU, float32: one query token per sequence, its keys and values
 * read in place from the paged KV cache through the block table (no gather copy).
 *
 * Layout (the torch backend's): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim],
 * contiguous; q and out [num_seqs, num_heads, head_dim] with a row stride per sequence;
 * block_table [num_seqs, bt_stride] int32; seq_lens [num_seqs] int32 (>= 1).
 *
 * Work items are (sequence, up to 16 query heads): a block's rows are read from memory once for
 * all the heads of the item, the heads of one KV head share each row from L1 (GQA), and the next
 * block is prefetched while this one is computed. Softmax is online per block (running max and
 * sum, rescaling the accumulator), as in FlashAttention, so nothing of size seq_len is allocated.
 * With AVX2 (head_dim a multiple of 8): Q.K eight rows at a time as independent FMA chains, exp
 * by a polynomial eight lanes at a time, P.V with each head's accumulator in registers 64 columns
 * at a time; otherwise plain loops. On the 2-core AVX2 box, batch 64 with 192 tokens of context,
 * 30 layers take about twice the time of one plain read of that K/V from memory, 2.5x less than
 * PyTorch's SDPA on gathered blocks (benchmarks/cpu_kernels.py).
 *
 * Built by tokenloom/ops/cpu_kernels.py with -O3 -march=native -ffast-math. The code never
 * produces inf or NaN (the running max starts at -FLT_MAX, not -inf; exp of anything below -87
 * is 0), which -ffast-math's finite-math assumption requires. The library is linked without
 * -ffast-math so that loading it does not switch the process to flush-to-zero.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <omp.h>
#define TL_MAX_BLOCK_SIZE 128
/* An item's query heads (up to TL_GC, spanning any KV heads) go through each cache block
 * together: the block's rows for their KV heads are one contiguous run per token, and each row is
 * loaded from memory once for all the query heads that read it (GQA). */
#define TL_GC 16


/* The next block's rows are prefetched while this one is computed: blocks are scattered in
 * memory, and without it the kernel stalls at every block (~1.3x slower at batch 64). */
static inline void prefetch_block(const float *k_cache, const float *v_cache, int64_t base,
                                  int block_size, int64_t tok_stride, int64_t lo, int64_t hi) {
    for (int t = 0; t < block_size; t++)
        for (int64_t i = lo; i < hi; i += 16) {
            __builtin_prefetch(k_cache + base + t * tok_stride + i);
            __builtin_prefetch(v_cache + base + t * tok_stride + i);
        }
}

/* One work item's running state: its query heads (pre-scaled), their accumulators, this block's
 * scores, the online-softmax max and sum, and each head's column offset in a cache row. */
typedef struct {
    float qs[TL_GC][256] __attribute__((aligned(32)));
    float acc[TL_GC][256] __attribute__((aligned(32)));
    float s[TL_GC][TL_MAX_BLOCK_SIZE + 8] __attribute__((aligned(32)));
    float m[TL_GC], l[TL_GC];
    int64_t off[TL_GC];
} item_state;

static inline void item_begin(item_state *st, const float *q0, int hq0, int nh, int G, int D,
                              float scale) {
    for (int g = 0; g < nh; g++) {
        st->m[g] = -FLT_MAX; st->l[g] = 0.0f;
        st->off[g] = (int64_t)((hq0 + g) / G) * D;
        for (int i = 0; i < D; i++) { st->qs[g][i] = q0[g * D + i] * scale; st->acc[g][i] = 0.0f; }
    }
}

/* Block `blk` of the item's sequence: its K and V rows (*kb, *vb) and how many of its positions
 * are in the context; prefetches the next block. */
static inline int item_block(const item_state *st, int nh, int D, const int32_t *bt, int blk,
                             int L, const float *k_cache, const float *v_cache, int block_size,
                             int64_t tok_stride, int64_t blk_stride, const float **kb,
                             const float **vb) {
    *kb = k_cache + (int64_t)bt[blk] * blk_stride;
    *vb = v_cache + (int64_t)bt[blk] * blk_stride;
    if ((blk + 1) * block_size < L)
        prefetch_block(k_cache, v_cache, (int64_t)bt[blk + 1] * blk_stride, block_size,
                       tok_stride, st->off[0], st->off[nh - 1] + D);
    return L - blk * block_size < block_size ? L - blk * block_size : block_size;
}

static inline void item_end(const item_state *st, int nh, int D, float *o0) {
    for (int g = 0; g < nh; g++) {
        const float inv = st->l[g] > 0.0f ? 1.0f / st->l[g] : 0.0f;
        for (int i = 0; i < D; i++) o0[g * D + i] = st->acc[g][i] * inv;
    }
}

#include "vec_math.h"
#if TL_HAVE_AVX2
/* s[j] = q . k_j for the 8 rows k_j = k0 + j * stride (D a multiple of 8): eight independent FMA
 * chains, then one transposing reduction. A plain loop is one dependent chain per row plus a
 * horizontal sum, latency-bound at ~10x the cost. */
static inline void dot8(const float *q, const float *k0, int64_t stride, int D, float *s) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + stride + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * stride + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * stride + i), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 4 * stride + i), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 5 * stride + i), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 6 * stride + i), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 7 * stride + i), a7);
    }
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    _mm256_storeu_ps(s, _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                      _mm256_permute2f128_ps(t0, t1, 0x31)));
}

/* exp(x) for x <= 0 (scores minus their running max), eight at a time; exactly 0 below -87,
 * where expf would go subnormal (so padded lanes and a running max still at -FLT_MAX add 0). */
static inline __m256 exp8_nonpos(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm256_and_ps(tl_exp8(x), keep);
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* acc[0:64] = acc * alpha + sum_u p[u] * v[u * stride + 0:64], the 64 columns in 8 registers. */
static inline void pv64(float *acc, const float *p, int n, const float *v, int64_t stride,
                        __m256 alpha) {
    __m256 a0 = _mm256_mul_ps(_mm256_load_ps(acc), alpha);
    __m256 a1 = _mm256_mul_ps(_mm256_load_ps(acc + 8), alpha);
    __m256 a2 = _mm256_mul_ps(_mm256_load_ps(acc + 16), alpha);
    __m256 a3 = _mm256_mul_ps(_mm256_load_ps(acc + 24), alpha);
    __m256 a4 = _mm256_mul_ps(_mm256_load_ps(acc + 32), alpha);
    __m256 a5 = _mm256_mul_ps(_mm256_load_ps(acc + 40), alpha);
    __m256 a6 = _mm256_mul_ps(_mm256_load_ps(acc + 48), alpha);
    __m256 a7 = _mm256_mul_ps(_mm256_load_ps(acc + 56), alpha);
    for (int u = 0; u < n; u++) {
        const __m256 pu = _mm256_broadcast_ss(p + u);
        const float *vr = v + u * stride;
        a0 = _mm256_fmadd_ps(pu, _mm256_loadu_ps(vr), a0);
        a1 = _mm256_fmadd_ps(pu, _mm256_loadu_ps(vr + 8), a1);
        a2 = _mm256_fmadd_ps(pu, _mm256_loadu_ps(vr + 16), a2);
        a3 = _mm256_fmadd_ps(pu, _mm256_loadu_ps(vr + 24), a3);
        a4 = _mm256_fmadd_ps(pu, _mm256_loadu_ps(vr + 32), a4);
        a5 = _mm256_fmadd_ps(pu, _mm256_loadu_ps(vr + 40), a5);
        a6 = _mm256_fmadd_ps(pu, _mm256_loadu_ps(vr + 48), a6);
        a7 = _mm256_fmadd_ps(pu, _mm256_loadu_ps(vr + 56), a7);
    }
    _mm256_store_ps(acc, a0); _mm256_store_ps(acc + 8, a1);
    _mm256_store_ps(acc + 16, a2); _mm256_store_ps(acc + 24, a3);
    _mm256_store_ps(acc + 32, a4); _mm256_store_ps(acc + 40, a5);
    _mm256_store_ps(acc + 48, a6); _mm256_store_ps(acc + 56, a7);
}

/* The same for 8 columns (the remainder of a head_dim that is not a multiple of 64). */
static inline void pv8(float *acc, const float *p, int n, const float *v, int64_t stride,
                       __m256 alpha) {
    __m256 a = _mm256_mul_ps(_mm256_load_ps(acc), alpha);
    for (int u = 0; u < n; u++)
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + u), _mm256_loadu_ps(v + u * stride), a);
    _mm256_store_ps(acc, a);
}

/* One query head over one block, head_dim D a multiple of 8 (<= 256), with AVX2: the scores
 * (8-row dot products), the online-softmax update, then P.V with the head's accumulator in
 * registers, 64 columns (8 registers) at a time. kg, vg: the block's K and V rows of its KV head. */
static inline void head_block_avx2(item_state *st, int g, const float *kg, const float *vg, int n,
                                   int64_t tok_stride, int D) {
    float *sg = st->s[g], *qg = st->qs[g];
    int t = 0;
    for (; t + 8 <= n; t += 8) dot8(qg, kg + t * tok_stride, tok_stride, D, sg + t);
    for (; t < n; t++) {
        __m256 a = _mm256_setzero_ps();
        for (int i = 0; i < D; i += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(kg + t * tok_stride + i), a);
        sg[t] = hsum8(a);
    }
    for (; t % 8; t++) sg[t] = -FLT_MAX;  /* pad to 8: exp gives 0 there */
    __m256 mx8 = _mm256_set1_ps(st->m[g]);
    for (int j = 0; j < n; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_load_ps(sg + j));
    const float mx = hmax8(mx8);
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 sum8 = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) {
        const __m256 p = exp8_nonpos(_mm256_sub_ps(_mm256_load_ps(sg + j), mxv));
        _mm256_store_ps(sg + j, p);
        sum8 = _mm256_add_ps(sum8, p);
    }
    const float alpha = _mm256_cvtss_f32(exp8_nonpos(_mm256_set1_ps(st->m[g] - mx)));
    st->l[g] = st->l[g] * alpha + hsum8(sum8);
    st->m[g] = mx;
    const __m256 al = _mm256_set1_ps(alpha);
    int c = 0;
    for (; c + 64 <= D; c += 64) pv64(st->acc[g] + c, sg, n, vg + c, tok_stride, al);
    for (; c < D; c += 8) pv8(st->acc[g] + c, sg, n, vg + c, tok_stride, al);
}
#endif

/* The same for any head_dim (<= 256) with plain loops (expf vectorized by the compiler where it
 * can). */
static inline void head_block_scalar(item_state *st, int g, const float *kg, const float *vg,
                                     int n, int64_t tok_stride, int D) {
    float *sg = st->s[g], *qg = st->qs[g], *acc = st->acc[g];
    for (int t = 0; t < n; t++) {
        const float *kr = kg + t * tok_stride;
        float dot = 0.0f;
        for (int i = 0; i < D; i++) dot += qg[i] * kr[i];
        sg[t] = dot;
    }
    float mx = st->m[g];
    for (int t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
    float sum = 0.0f;
    for (int t = 0; t < n; t++) { sg[t] = expf(sg[t] - mx); sum += sg[t]; }
    const float alpha = expf(st->m[g] - mx);
    st->l[g] = st->l[g] * alpha + sum;
    st->m[g] = mx;
    for (int i = 0; i < D; i++) acc[i] *= alpha;
    for (int t = 0; t < n; t++) {
        const float p = sg[t], *vr = vg + t * tok_stride;
        for (int i = 0; i < D; i++) acc[i] += p * vr[i];
    }
}

/* One work item: query heads hq0 .. hq0 + nh - 1 of one sequence, block by block. */
static void run_item(int vec, const float *q0, int hq0, int nh, int G, const float *k_cache,
                     const float *v_cache, const int32_t *bt, int L, int64_t tok_stride,
                     int64_t blk_stride, int block_size, int D, float scale, float *o0) {
    item_state st;
    item_begin(&st, q0, hq0, nh, G, D, scale);
    for (int blk = 0; blk * block_size < L; blk++) {
        const float *kb, *vb;
        const int n = item_block(&st, nh, D, bt, blk, L, k_cache, v_cache, block_size, tok_stride,
                                 blk_stride, &kb, &vb);
        for (int g = 0; g < nh; g++) {
#if TL_HAVE_AVX2
            if (vec) {
                head_block_avx2(&st, g, kb + st.off[g], vb + st.off[g], n, tok_stride, D);
                continue;
            }
#endif
            head_block_scalar(&st, g, kb + st.off[g], vb + st.off[g], n, tok_stride, D);
        }
    }
    item_end(&st, nh, D, o0);
    (void)vec;
}

int tl_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache,
                        const float *v_cache, const int32_t *block_table, int64_t bt_stride,
                        const int32_t *seq_lens, float *out, int64_t out_stride, int32_t num_seqs,
                        int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                        int32_t block_size, float scale) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    if (head_dim > 256 || block_size > TL_MAX_BLOCK_SIZE) return -2;
    const int G = num_heads / num_kv_heads, D = head_dim;
    const int64_t tok_stride = (int64_t)num_kv_heads * D;
    const int64_t blk_stride = (int64_t)block_size * tok_stride;
    const int vec = TL_HAVE_AVX2 && D % 8 == 0;
    /* Work items are (sequence, run of up to TL_GC query heads): the fewer items per sequence,
     * the fewer passes over its cache; a small batch splits its heads until every thread has an
     * item. */
    const int nth = omp_get_max_threads();
    int hpc = num_heads < TL_GC ? num_heads : TL_GC;
    while (hpc > 1 && (int64_t)num_seqs * ((num_heads + hpc - 1) / hpc) < nth)
        hpc = (hpc + 1) / 2;
    const int nchunk = (num_heads + hpc - 1) / hpc;
    const int64_t items = (int64_t)num_seqs * nchunk;
#pragma omp parallel for schedule(static)
    for (int64_t it = 0; it < items; it++) {
        const int b = (int)(it / nchunk), c = (int)(it % nchunk);
        const int hq0 = c * hpc, nh = num_heads - hq0 < hpc ? num_heads - hq0 : hpc;
        const float *q0 = q + b * q_stride + (int64_t)hq0 * D;
        float *o0 = out + b * out_stride + (int64_t)hq0 * D;
        const int32_t *bt = block_table + b * bt_stride;
        run_item(vec, q0, hq0, nh, G, k_cache, v_cache, bt, seq_lens[b], tok_stride, blk_stride,
                 block_size, D, scale, o0);
    }
    return 0;
}
