/* Paged-attention decode for the CPU, float32: one query token per sequence, its keys and values
 * read in place from the paged KV cache through the block table (no gather copy).
 *
 * Layout (the torch backend's): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim],
 * contiguous; q and out [num_seqs, num_heads, head_dim] with a row stride per sequence;
 * block_table [num_seqs, bt_stride] int32; seq_lens [num_seqs] int32 (>= 1).
 *
 * One work item per (sequence, query head); the heads that share a KV head are neighbouring items,
 * so the K/V rows one reads are still in L2 for the next. Softmax is online per block (running
 * max and sum, rescaling the accumulator), as in FlashAttention, so nothing of size seq_len is
 * allocated. Specialized for head_dim 64 and 128 (the accumulator then lives in registers), with a
 * generic fallback; the Q.K products go eight positions at a time through AVX2 FMA chains when
 * the build machine has them. On the 2-core AVX2 box the kernel runs at about the speed of
 * reading the context's K/V once from memory (float32 KV: that read is the floor).
 *
 * Built by tokenloom/attention/cpu_kernels.py with -O3 -march=native -ffast-math: the dot
 * products and the V accumulation vectorize over head_dim and expf over the block's positions
 * (glibc's libmvec). The code never produces inf or NaN (the running max starts at -FLT_MAX, not
 * -inf), which -ffast-math's finite-math assumption requires. The library is linked without
 * -ffast-math so that loading it does not switch the process to flush-to-zero.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#define TL_MAX_BLOCK_SIZE 128
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
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
#define TL_HAVE_DOT8 1
#else
#define TL_HAVE_DOT8 0
static inline void dot8(const float *q, const float *k0, int64_t stride, int D, float *s) {
    (void)q; (void)k0; (void)stride; (void)D; (void)s;
}
#endif

#define TL_DEFINE_HEAD(NAME, DCONST)                                                              \
static inline void NAME(const float *qg, const float *k_cache, const float *v_cache,          \
                        const int32_t *bt, int L, int64_t tok_stride, int64_t blk_stride,    \
                        int64_t head_off, int block_size, int d_rt, float scale, float *og) { \
    const int D = DCONST ? DCONST : d_rt;                                                       \
    float acc[DCONST ? DCONST : 256];                                                           \
    float s[TL_MAX_BLOCK_SIZE];                                                                 \
    float m = -FLT_MAX, l = 0.0f;                                                               \
    for (int i = 0; i < D; i++) acc[i] = 0.0f;                                                  \
    for (int start = 0, blk = 0; start < L; start += block_size, blk++) {                     \
        const int n = L - start < block_size ? L - start : block_size;                          \
        const int64_t base = (int64_t)bt[blk] * blk_stride + head_off;                          \
        const float *kb = k_cache + base, *vb = v_cache + base;                                  \
        float mx = m;                                                                           \
        int t0 = 0;                                                                             \
        if (TL_HAVE_DOT8 && D % 8 == 0)                                                         \
            for (; t0 + 8 <= n; t0 += 8) dot8(qg, kb + t0 * tok_stride, tok_stride, D, s + t0); \
        for (int t = t0; t < n; t++) {                                                          \
            const float *kr = kb + t * tok_stride;                                              \
            float dot = 0.0f;                                                                   \
            for (int i = 0; i < D; i++) dot += qg[i] * kr[i];                                   \
            s[t] = dot;                                                                         \
        }                                                                                       \
        for (int t = 0; t < n; t++) {                                                           \
            s[t] *= scale;                                                                      \
            mx = s[t] > mx ? s[t] : mx;                                                         \
        }                                                                                       \
        float sum = 0.0f;                                                                       \
        for (int t = 0; t < n; t++) { s[t] = expf(s[t] - mx); sum += s[t]; }                    \
        const float alpha = expf(m - mx);                                                       \
        l = l * alpha + sum;                                                                    \
        m = mx;                                                                                 \
        for (int i = 0; i < D; i++) acc[i] *= alpha;                                            \
        for (int t = 0; t < n; t++) {                                                           \
            const float p = s[t];                                                               \
            const float *vr = vb + t * tok_stride;                                              \
            for (int i = 0; i < D; i++) acc[i] += p * vr[i];                                    \
        }                                                                                       \
    }                                                                                           \
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;                                               \
    for (int i = 0; i < D; i++) og[i] = acc[i] * inv;                                           \
}

TL_DEFINE_HEAD(head_d64, 64)
TL_DEFINE_HEAD(head_d128, 128)
TL_DEFINE_HEAD(head_any, 0)

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
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < num_seqs; b++) {
        for (int hq = 0; hq < num_heads; hq++) {
            const int h = hq / G;
            const float *qg = q + b * q_stride + (int64_t)hq * D;
            float *og = out + b * out_stride + (int64_t)hq * D;
            const int32_t *bt = block_table + b * bt_stride;
            const int L = seq_lens[b];
            if (D == 64)
                head_d64(qg, k_cache, v_cache, bt, L, tok_stride, blk_stride, (int64_t)h * D, block_size, D, scale, og);
            else if (D == 128)
                head_d128(qg, k_cache, v_cache, bt, L, tok_stride, blk_stride, (int64_t)h * D, block_size, D, scale, og);
            else
                head_any(qg, k_cache, v_cache, bt, L, tok_stride, blk_stride, (int64_t)h * D, block_size, D, scale, og);
        }
    }
    return 0;
}
