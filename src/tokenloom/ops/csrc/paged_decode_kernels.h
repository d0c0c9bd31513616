/* The per-block (kv_block_fn) and per-chunk (kv_chunk_fn) work of paged_decode.c for each
 * vector width: AVX2 (8 lanes) and AVX-512 (16 lanes), each instantiated from
 * paged_decode_impl.h for a float32 and a bfloat16 cache, and the plain loops for other head
 * sizes and builds without either. Included once by paged_decode.c, after item_state,
 * item_groups, pf_stream and the two function types; kept apart so that the driver (work
 * items, threads, parts, merging) reads in one file. */
#ifndef TL_PAGED_DECODE_KERNELS_H
#define TL_PAGED_DECODE_KERNELS_H

/* Rows r0 .. r1 - 1 (len bytes each, row_bytes apart) at p, prefetched at once (the plain
 * loops). */
static inline void prefetch_rows(const void *p, int r0, int r1, int64_t row_bytes, int64_t len) {
    for (int r = r0; r < r1; r++)
        for (int64_t i = 0; i < len; i += 64) __builtin_prefetch((const char *)p + r * row_bytes + i);
}

#if TL_HAVE_AVX512
/* The 16-lane softmax, which the 8-lane chunk path takes where torch's vectors are AVX-512's
 * and MKL's order is its AVX2 one (g_mkl_avx2_order); defined with the 16-lane loops below. */
static inline __attribute__((always_inline)) float chunk_softmax_avx512_bf16kv(item_state *st,
                                                                             int g, int n);
#endif

/* ---- 8 lanes (AVX2) */
#if TL_HAVE_AVX2
#define VEC __m256
#define VW 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_load_ps(p)
#define VSTORE(p, x) _mm256_store_ps(p, x)
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VFIRST(x) _mm256_cvtss_f32(x)
/* Q.K rows per step: (3 heads x 4 rows) accumulators leave 4 of the 16 registers. */
#define QK_ROWS 4
/* P.V accumulators per head and step (x 8 columns): 3 heads x 2, or 2 x 4. */
#define PV_NV(gs) ((gs) > 2 ? 2 : 4)

static inline VEC exp_nonpos_256(VEC x) {
    return _mm256_and_ps(tl_exp8(x), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}
#define VEXP_NONPOS(x) exp_nonpos_256(x)
/* float32 -> the nearest bfloat16 (ties to even), kept as float32; finite inputs. */
static inline VEC round_bf16_256(VEC x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u)));
}
#define VROUND_BF16(x) round_bf16_256(x)
#define VEXP_FAST(x) tl_fexp8(x)
#define VHSUM_TORCH(x) tl_hsum8_torch(x)
static inline float hmax_256(VEC v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
#define VHMAX(x) hmax_256(x)
/* s[0:4] = the lane sums of a[0:4]. */
static inline void reduce_rows_256(const VEC *a, float *s) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}
#define REDUCE_ROWS(a, s) reduce_rows_256(a, s)
/* MKL's tree for one row's 8 lanes, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), is the one above
 * (see paged_decode_chunk.h). */
#define REDUCE_ROWS_MKL(a, s) reduce_rows_256(a, s)

#define ISA avx2
#define KV_T float
#define KV_ONE(p) _mm256_loadu_ps(p)
#define KV_PAIR(p, lo, hi) do { (lo) = _mm256_loadu_ps(p); (hi) = _mm256_loadu_ps((p) + 8); } while (0)
#define KV_SFX f32
#define KV_BF16 0
#include "paged_decode_impl.h"
#undef KV_T
#undef KV_ONE
#undef KV_PAIR
#undef KV_SFX
#undef KV_BF16
#define KV_T uint16_t
#define KV_ONE(p) _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define KV_PAIR(p, lo, hi) do { \
    const __m256i x_ = _mm256_loadu_si256((const __m256i *)(p)); \
    (lo) = _mm256_castsi256_ps(_mm256_slli_epi32(x_, 16)); \
    (hi) = _mm256_castsi256_ps(_mm256_and_si256(x_, _mm256_set1_epi32((int)0xFFFF0000u))); \
} while (0)
#define KV_SFX bf16kv
#define KV_BF16 1
#include "paged_decode_impl.h"
#undef KV_T
#undef KV_ONE
#undef KV_PAIR
#undef KV_SFX
#undef KV_BF16
#undef ISA
#undef VEC
#undef VW
#undef VZERO
#undef VLOAD
#undef VSTORE
#undef VSET1
#undef VFMA
#undef VMUL
#undef VADD
#undef VSUB
#undef VMAX
#undef VFIRST
#undef QK_ROWS
#undef PV_NV
#undef VEXP_NONPOS
#undef VROUND_BF16
#undef VEXP_FAST
#undef VHSUM_TORCH
#undef VHMAX
#undef REDUCE_ROWS
#undef REDUCE_ROWS_MKL
#endif

/* ---- 16 lanes (AVX-512) */
#if TL_HAVE_AVX512
#define VEC __m512
#define VW 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_load_ps(p)
#define VSTORE(p, x) _mm512_store_ps(p, x)
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VFIRST(x) _mm512_cvtss_f32(x)
/* (3 heads x 8 rows) Q.K accumulators and (3 heads x 4) P.V ones, of 32 registers. */
#define QK_ROWS 8
#define PV_NV(gs) 4

static inline VEC exp_nonpos_512(VEC x) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ),
                               tl_exp16(x));
}
#define VEXP_NONPOS(x) exp_nonpos_512(x)
#define VROUND_BF16(x) tl_round16_bf16(x)
#define VEXP_FAST(x) tl_fexp16(x)
#define VHSUM_TORCH(x) tl_hsum16_torch(x)
#define VHMAX(x) _mm512_reduce_max_ps(x)
/* s[0:8] = the lane sums of a[0:8]: pairs interleaved and added, then quadruples, then the four
 * 128-bit lanes folded (24 instructions for 8 rows). */
static inline void reduce_rows_512(const VEC *a, float *s) {
    __m512 t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++)  /* per 128-bit lane: the lane's sums of rows 4i .. 4i + 3 */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    /* [u0.L0 + u0.L2, u0.L1 + u0.L3, u1.L0 + u1.L2, u1.L1 + u1.L3] */
    const __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                                   _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(v, v, 0x88),
                                   _mm512_shuffle_f32x4(v, v, 0xDD));
    _mm256_storeu_ps(s, _mm512_castps512_ps256(w));
}
#define REDUCE_ROWS(a, s) reduce_rows_512(a, s)
/* s[0:8] = the sums of a[0:8] in the order of MKL's bf16 dot products (paged_decode_chunk.h):
 * lanes 0-7 (its first accumulator) plus lanes 8-15 (its second), then, of those eight,
 * ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)) -- transposed across the rows as reduce_rows_512. */
static inline void reduce_rows_mkl_512(const VEC *a, float *s) {
    __m512 w[4], x[2];
    for (int i = 0; i < 4; i++)  /* [row 2i's A + B | row 2i + 1's], 8 lanes each */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)  /* adjacent lanes: (0 + 1), (2 + 3), ... of two w at once */
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xDD));
    /* again: 128-bit lane 0 = rows 0, 2, 4, 6's (0+1)+(2+3), lane 1 their (4+5)+(6+7), lanes 2
     * and 3 the same of rows 1, 3, 5, 7 */
    const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88),
                                   _mm512_shuffle_ps(x[0], x[1], 0xDD));
    const __m512 z = _mm512_add_ps(y, _mm512_shuffle_f32x4(y, y, 0xB1));
    const __m512 r = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0), z);
    _mm256_storeu_ps(s, _mm512_castps512_ps256(r));
}
#define REDUCE_ROWS_MKL(a, s) reduce_rows_mkl_512(a, s)

#define ISA avx512
#define KV_T float
#define KV_ONE(p) _mm512_loadu_ps(p)
#define KV_PAIR(p, lo, hi) do { (lo) = _mm512_loadu_ps(p); (hi) = _mm512_loadu_ps((p) + 16); } while (0)
#define KV_SFX f32
#define KV_BF16 0
#include "paged_decode_impl.h"
#undef KV_T
#undef KV_ONE
#undef KV_PAIR
#undef KV_SFX
#undef KV_BF16
#define KV_T uint16_t
#define KV_ONE(p) tl_load16_bf16(p)
#define KV_PAIR(p, lo, hi) do { \
    const __m512i x_ = _mm512_loadu_si512((const void *)(p)); \
    (lo) = _mm512_castsi512_ps(_mm512_slli_epi32(x_, 16)); \
    (hi) = _mm512_castsi512_ps(_mm512_and_si512(x_, _mm512_set1_epi32((int)0xFFFF0000u))); \
} while (0)
#define KV_SFX bf16kv
#define KV_BF16 1
#include "paged_decode_impl.h"
#undef KV_T
#undef KV_ONE
#undef KV_PAIR
#undef KV_SFX
#undef KV_BF16
#undef ISA
#endif

/* ---- plain loops, one head at a time (any head_dim <= 256) */
#define TL_SCALAR_BLOCK(KV_T, KV_TO_F32, NAME)                                                  \
static void NAME(item_state *st, int g0, int gn, const void *kbv, const void *vbv, int n,     \
                 int64_t tok_stride, int D, pf_stream *pk, pf_stream *pv) {                    \
    const KV_T *kb = (const KV_T *)kbv, *vb = (const KV_T *)vbv;                               \
    if (pk) { pk->per = pk->end - pk->p; pf_run(pk); }                                         \
    if (pv) { pv->per = pv->end - pv->p; pf_run(pv); }                                         \
    for (int g = g0; g < g0 + gn; g++) {                                                       \
        float *sg = st->s[g], *qg = st->qs[g], *acc = st->acc[g];                              \
        for (int t = 0; t < n; t++) {                                                          \
            const KV_T *kr = kb + t * tok_stride;                                              \
            float dot = 0.0f;                                                                  \
            for (int i = 0; i < D; i++) dot += qg[i] * KV_TO_F32(kr[i]);                       \
            sg[t] = dot;                                                                       \
        }                                                                                      \
        float mx = st->m[g];                                                                   \
        for (int t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;                              \
        float sum = 0.0f;                                                                      \
        for (int t = 0; t < n; t++) { sg[t] = expf(sg[t] - mx); sum += sg[t]; }                \
        const float alpha = expf(st->m[g] - mx);                                               \
        st->l[g][0] = st->l[g][0] * alpha + sum;                                                  \
        st->m[g] = mx;                                                                         \
        for (int i = 0; i < D; i++) acc[i] *= alpha;                                           \
        for (int t = 0; t < n; t++) {                                                          \
            const float p = sg[t];                                                             \
            const KV_T *vr = vb + t * tok_stride;                                              \
            for (int i = 0; i < D; i++) acc[i] += p * KV_TO_F32(vr[i]);                        \
        }                                                                                      \
    }                                                                                          \
}
/* The chunk path's plain loops (bfloat16 cache; see kv_chunk_fn): expf and sums in order, so
 * transformers' outputs to rounding, not bit for bit as the vector loops (paged_decode_chunk.h). */
static void kv_chunk_scalar_bf16kv(item_state *st, const item_groups *gr, const void *const *kbs,
                                   const void *const *vbs, const int *ns, int nb,
                                   int64_t tok_stride, int D, const void *nxt, int nxtn) {
    for (int b = 0; b < nb; b++) {  /* the plain loops are slow enough to take the chunk at once */
        prefetch_rows(kbs[b], 0, ns[b], tok_stride * 2, tok_stride * 2);
        prefetch_rows(vbs[b], 0, ns[b], tok_stride * 2, tok_stride * 2);
    }
    if (nxt) prefetch_rows(nxt, 0, nxtn, tok_stride * 2, tok_stride * 2);
    for (int i = 0; i < gr->n; i++)
    for (int g = gr->g0[i]; g < gr->g0[i] + gr->gn[i]; g++) {
        float *sg = st->s[g], *qg = st->qs[g], *acc = st->acc[g];
        int n = 0;
        for (int b = 0; b < nb; b++)
            for (int t = 0; t < ns[b]; t++, n++) {
                const uint16_t *kr = (const uint16_t *)((const char *)kbs[b] + gr->off[i]) + t * tok_stride;
                float dot = 0.0f;
                for (int c = 0; c < D; c++) dot += qg[c] * tl_bf16_to_f32(kr[c]);
                sg[n] = dot * st->scale;  /* the query is not pre-scaled on the chunk path */
            }
        float mx = st->m[g];
        for (int t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.0f;
        for (int t = 0; t < n; t++) {
            const float p = expf(sg[t] - mx);
            sum += p;
            sg[t] = tl_round_bf16(p);
        }
        const float alpha = expf(st->m[g] - mx);
        st->l[g][0] = st->l[g][0] * alpha + sum;
        st->m[g] = mx;
        for (int c = 0; c < D; c++) acc[c] *= alpha;
        n = 0;
        for (int b = 0; b < nb; b++)
            for (int t = 0; t < ns[b]; t++, n++) {
                const uint16_t *vr = (const uint16_t *)((const char *)vbs[b] + gr->off[i]) + t * tok_stride;
                for (int c = 0; c < D; c++) acc[c] += sg[n] * tl_bf16_to_f32(vr[c]);
            }
    }
}

#define TL_F32_ID(x) (x)
TL_SCALAR_BLOCK(float, TL_F32_ID, kv_block_scalar_f32)
TL_SCALAR_BLOCK(uint16_t, tl_bf16_to_f32, kv_block_scalar_bf16kv)

#endif /* TL_PAGED_DECODE_KERNELS_H */
