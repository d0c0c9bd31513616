/* Paged-attention decode for the CPU, float32: one query token per sequence, its keys and values
 * read in place from the paged KV cache through the block table (no gather copy).
 *
 * Layout (the torch backend's): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim],
 * contiguous; q and out [num_seqs, num_heads, head_dim] with a row stride per sequence;
 * block_table [num_seqs, bt_stride] int32; seq_lens [num_seqs] int32 (>= 1); window: 0 for
 * full attention, else the sliding window W (the query sees its last W positions, itself
 * included; blocks wholly before that are not read).
 *
 * Work items are (sequence, up to 16 query heads): a block's rows are read from memory once for
 * all the heads of the item, the heads of one KV head share each row from L1 (GQA), and the next
 * block is prefetched while this one is computed. Softmax is online per block (running max and
 * sum, rescaling the accumulator), as in FlashAttention, so nothing of size seq_len is allocated.
 * With AVX2 (head_dim a multiple of 8): Q.K eight rows at a time as independent FMA chains, exp
 * by a polynomial eight lanes at a time, P.V with each head's accumulator in registers 64 columns
 * at a time; with AVX-512 (head_dim a multiple of 16) Q.K and P.V the same on 16-lane registers;
 * otherwise plain loops. On the 2-core AVX2 box, batch 64 with 192 tokens of context,
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


/* One work item's running state: its query heads (pre-scaled), their accumulators, this block's
 * scores, the online-softmax max and sum, and each head's column offset in a cache row. */
typedef struct {
    float qs[TL_GC][256] __attribute__((aligned(32)));
    float acc[TL_GC][256] __attribute__((aligned(32)));
    float s[TL_GC][TL_MAX_BLOCK_SIZE + 8] __attribute__((aligned(32)));
    float m[TL_GC], l[TL_GC];
    int64_t off[TL_GC];
} item_state;

#include "vec_math.h"

/* q0 and o0 are float32, or bfloat16 when io_bf16 (a bfloat16 model's queries and outputs; the
 * arithmetic stays float32). */
static inline void item_begin(item_state *st, const void *q0, int io_bf16, int hq0, int nh, int G,
                              int D, float scale) {
    for (int g = 0; g < nh; g++) {
        st->m[g] = -FLT_MAX; st->l[g] = 0.0f;
        st->off[g] = (int64_t)((hq0 + g) / G) * D;
        for (int i = 0; i < D; i++) {
            const float qv = io_bf16 ? tl_bf16_to_f32(((const uint16_t *)q0)[g * D + i])
                                     : ((const float *)q0)[g * D + i];
            st->qs[g][i] = qv * scale;
            st->acc[g][i] = 0.0f;
        }
    }
}

static inline void item_end(const item_state *st, int nh, int D, void *o0, int io_bf16) {
    for (int g = 0; g < nh; g++) {
        const float inv = st->l[g] > 0.0f ? 1.0f / st->l[g] : 0.0f;
        for (int i = 0; i < D; i++) {
            if (io_bf16) ((uint16_t *)o0)[g * D + i] = tl_f32_to_bf16(st->acc[g][i] * inv);
            else ((float *)o0)[g * D + i] = st->acc[g][i] * inv;
        }
    }
}

#if TL_HAVE_AVX2
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


/* The online-softmax update of head g for a block's n scores st->s[g] (padded with -FLT_MAX to
 * a multiple of 8): the scores become probabilities under the new running max, the running sum
 * follows; returns the factor that rescales the head's accumulator. */
static inline float block_softmax8(item_state *st, int g, int n) {
    float *sg = st->s[g];
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
    st->l[g] = st->l[g] * alpha + tl_hsum8(sum8);
    st->m[g] = mx;
    return alpha;
}
#endif

#define TL_CAT2(a, b) a##_##b
#define TL_CAT(a, b) TL_CAT2(a, b)

/* float32 cache. */
#define KV_T float
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#define KV_TO_F32(x) (x)
#define TL_NAME(name) TL_CAT(name, f32)
#include "paged_decode_impl.h"
#undef KV_T
#undef KV_LOAD8
#undef KV_LOAD16
#undef KV_TO_F32
#undef TL_NAME

/* bfloat16 cache. A bfloat16 is the top half of a float32, so widening is a shift. */
#define KV_T uint16_t
#define KV_LOAD8(p) _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define KV_LOAD16(p) tl_load16_bf16(p)
#define KV_TO_F32(x) tl_bf16_to_f32(x)
#define TL_NAME(name) TL_CAT(name, bf16kv)
#include "paged_decode_impl.h"

/* The exported entry points: float32 queries over a float32 cache, float32 queries over a
 * bfloat16 cache (kv_cache_dtype="bfloat16" under a float32 model), and a bfloat16 model's
 * bfloat16 queries, cache and output. */
#define TL_DECODE_ARGS const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, \
    const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens, void *out, \
    int64_t out_stride, int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, \
    int32_t head_dim, int32_t block_size, float scale, int32_t window
#define TL_DECODE_PASS q, q_stride, k_cache, v_cache, block_table, bt_stride, seq_lens, out, \
    out_stride, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window
int tl_paged_decode_f32(TL_DECODE_ARGS) { return decode_f32(TL_DECODE_PASS, 0); }
int tl_paged_decode_f32_bf16kv(TL_DECODE_ARGS) { return decode_bf16kv(TL_DECODE_PASS, 0); }
int tl_paged_decode_bf16(TL_DECODE_ARGS) { return decode_bf16kv(TL_DECODE_PASS, 1); }
