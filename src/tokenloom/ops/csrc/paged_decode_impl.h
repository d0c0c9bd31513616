/* The decode kernel's code that depends on the KV cache's element type KV_T: included by
 * paged_decode.c once per type, with KV_T, KV_LOAD8 / KV_LOAD16 (eight / sixteen elements as
 * float32 lanes), KV_TO_F32 (one element as a float) and TL_NAME (the type's suffix on every
 * name) defined. */
/* The next block's rows are prefetched while this one is computed: blocks are scattered in
 * memory, and without it the kernel stalls at every block (~1.3x slower at batch 64). */
static inline void TL_NAME(prefetch_block)(const KV_T *k_cache, const KV_T *v_cache, int64_t base,
                                  int block_size, int64_t tok_stride, int64_t lo, int64_t hi) {
    for (int t = 0; t < block_size; t++)
        for (int64_t i = lo; i < hi; i += 64 / (int64_t)sizeof(KV_T)) {
            __builtin_prefetch(k_cache + base + t * tok_stride + i);
            __builtin_prefetch(v_cache + base + t * tok_stride + i);
        }
}

/* Block `blk` of the item's sequence: its K and V rows (*kb, *vb) and how many of its positions
 * are in the context; prefetches the next block. */
static inline int TL_NAME(item_block)(const item_state *st, int nh, int D, const int32_t *bt,
                             int blk, int L, const KV_T *k_cache, const KV_T *v_cache, int block_size,
                             int64_t tok_stride, int64_t blk_stride, const KV_T **kb,
                             const KV_T **vb) {
    *kb = k_cache + (int64_t)bt[blk] * blk_stride;
    *vb = v_cache + (int64_t)bt[blk] * blk_stride;
    if ((blk + 1) * block_size < L)
        TL_NAME(prefetch_block)(k_cache, v_cache, (int64_t)bt[blk + 1] * blk_stride, block_size,
                       tok_stride, st->off[0], st->off[nh - 1] + D);
    return L - blk * block_size < block_size ? L - blk * block_size : block_size;
}

#if TL_HAVE_AVX2
/* s[j] = q . k_j for the 8 rows k_j = k0 + j * stride (D a multiple of 8): eight independent FMA
 * chains, then one transposing reduction. A plain loop is one dependent chain per row plus a
 * horizontal sum, latency-bound at ~10x the cost. */
static inline void TL_NAME(dot8)(const float *q, const KV_T *k0, int64_t stride, int D, float *s) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, KV_LOAD8(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, KV_LOAD8(k0 + stride + i), a1);
        a2 = _mm256_fmadd_ps(qv, KV_LOAD8(k0 + 2 * stride + i), a2);
        a3 = _mm256_fmadd_ps(qv, KV_LOAD8(k0 + 3 * stride + i), a3);
        a4 = _mm256_fmadd_ps(qv, KV_LOAD8(k0 + 4 * stride + i), a4);
        a5 = _mm256_fmadd_ps(qv, KV_LOAD8(k0 + 5 * stride + i), a5);
        a6 = _mm256_fmadd_ps(qv, KV_LOAD8(k0 + 6 * stride + i), a6);
        a7 = _mm256_fmadd_ps(qv, KV_LOAD8(k0 + 7 * stride + i), a7);
    }
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    _mm256_storeu_ps(s, _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                      _mm256_permute2f128_ps(t0, t1, 0x31)));
}

/* acc[0:64] = acc * alpha + sum_u p[u] * v[u * stride + 0:64], the 64 columns in 8 registers. */
static inline void TL_NAME(pv64)(float *acc, const float *p, int n, const KV_T *v, int64_t stride,
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
        const KV_T *vr = v + u * stride;
        a0 = _mm256_fmadd_ps(pu, KV_LOAD8(vr), a0);
        a1 = _mm256_fmadd_ps(pu, KV_LOAD8(vr + 8), a1);
        a2 = _mm256_fmadd_ps(pu, KV_LOAD8(vr + 16), a2);
        a3 = _mm256_fmadd_ps(pu, KV_LOAD8(vr + 24), a3);
        a4 = _mm256_fmadd_ps(pu, KV_LOAD8(vr + 32), a4);
        a5 = _mm256_fmadd_ps(pu, KV_LOAD8(vr + 40), a5);
        a6 = _mm256_fmadd_ps(pu, KV_LOAD8(vr + 48), a6);
        a7 = _mm256_fmadd_ps(pu, KV_LOAD8(vr + 56), a7);
    }
    _mm256_store_ps(acc, a0); _mm256_store_ps(acc + 8, a1);
    _mm256_store_ps(acc + 16, a2); _mm256_store_ps(acc + 24, a3);
    _mm256_store_ps(acc + 32, a4); _mm256_store_ps(acc + 40, a5);
    _mm256_store_ps(acc + 48, a6); _mm256_store_ps(acc + 56, a7);
}

/* The same for 8 columns (the remainder of a head_dim that is not a multiple of 64). */
static inline void TL_NAME(pv8)(float *acc, const float *p, int n, const KV_T *v, int64_t stride,
                       __m256 alpha) {
    __m256 a = _mm256_mul_ps(_mm256_load_ps(acc), alpha);
    for (int u = 0; u < n; u++)
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + u), KV_LOAD8(v + u * stride), a);
    _mm256_store_ps(acc, a);
}

/* One query head over one block, head_dim D a multiple of 8 (<= 256), with AVX2: the scores
 * (8-row dot products), the online-softmax update, then P.V with the head's accumulator in
 * registers, 64 columns (8 registers) at a time. kg, vg: the block's K and V rows of its KV
 * head. */
static inline void TL_NAME(head_block_avx2)(item_state *st, int g, const KV_T *kg,
                                            const KV_T *vg, int n, int64_t tok_stride, int D) {
    float *sg = st->s[g], *qg = st->qs[g];
    int t = 0;
    for (; t + 8 <= n; t += 8) TL_NAME(dot8)(qg, kg + t * tok_stride, tok_stride, D, sg + t);
    for (; t < n; t++) {
        __m256 a = _mm256_setzero_ps();
        for (int i = 0; i < D; i += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), KV_LOAD8(kg + t * tok_stride + i), a);
        sg[t] = tl_hsum8(a);
    }
    for (; t % 8; t++) sg[t] = -FLT_MAX;  /* pad to 8: exp gives 0 there */
    const __m256 al = _mm256_set1_ps(block_softmax8(st, g, n));
    int c = 0;
    for (; c + 64 <= D; c += 64) TL_NAME(pv64)(st->acc[g] + c, sg, n, vg + c, tok_stride, al);
    for (; c < D; c += 8) TL_NAME(pv8)(st->acc[g] + c, sg, n, vg + c, tok_stride, al);
}
#endif

#if TL_HAVE_AVX512
/* 512-bit register halves added: eight float32 lanes. */
static inline __m256 TL_NAME(fold512)(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* dot8 on 16-lane registers (D a multiple of 16): half the loads and FMAs per row. */
static inline void TL_NAME(dot8_512)(const float *q, const KV_T *k0, int64_t stride, int D,
                                     float *s) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int i = 0; i < D; i += 16) {
        const __m512 qv = _mm512_loadu_ps(q + i);
        a0 = _mm512_fmadd_ps(qv, KV_LOAD16(k0 + i), a0);
        a1 = _mm512_fmadd_ps(qv, KV_LOAD16(k0 + stride + i), a1);
        a2 = _mm512_fmadd_ps(qv, KV_LOAD16(k0 + 2 * stride + i), a2);
        a3 = _mm512_fmadd_ps(qv, KV_LOAD16(k0 + 3 * stride + i), a3);
        a4 = _mm512_fmadd_ps(qv, KV_LOAD16(k0 + 4 * stride + i), a4);
        a5 = _mm512_fmadd_ps(qv, KV_LOAD16(k0 + 5 * stride + i), a5);
        a6 = _mm512_fmadd_ps(qv, KV_LOAD16(k0 + 6 * stride + i), a6);
        a7 = _mm512_fmadd_ps(qv, KV_LOAD16(k0 + 7 * stride + i), a7);
    }
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(TL_NAME(fold512)(a0), TL_NAME(fold512)(a1)),
                                     _mm256_hadd_ps(TL_NAME(fold512)(a2), TL_NAME(fold512)(a3)));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(TL_NAME(fold512)(a4), TL_NAME(fold512)(a5)),
                                     _mm256_hadd_ps(TL_NAME(fold512)(a6), TL_NAME(fold512)(a7)));
    _mm256_storeu_ps(s, _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                      _mm256_permute2f128_ps(t0, t1, 0x31)));
}

/* pv64 with the 64 columns in 4 registers. */
static inline void TL_NAME(pv64_512)(float *acc, const float *p, int n, const KV_T *v,
                                     int64_t stride, __m512 alpha) {
    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc), alpha);
    __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + 16), alpha);
    __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(acc + 32), alpha);
    __m512 a3 = _mm512_mul_ps(_mm512_loadu_ps(acc + 48), alpha);
    for (int u = 0; u < n; u++) {
        const __m512 pu = _mm512_set1_ps(p[u]);
        const KV_T *vr = v + u * stride;
        a0 = _mm512_fmadd_ps(pu, KV_LOAD16(vr), a0);
        a1 = _mm512_fmadd_ps(pu, KV_LOAD16(vr + 16), a1);
        a2 = _mm512_fmadd_ps(pu, KV_LOAD16(vr + 32), a2);
        a3 = _mm512_fmadd_ps(pu, KV_LOAD16(vr + 48), a3);
    }
    _mm512_storeu_ps(acc, a0); _mm512_storeu_ps(acc + 16, a1);
    _mm512_storeu_ps(acc + 32, a2); _mm512_storeu_ps(acc + 48, a3);
}

static inline void TL_NAME(pv16_512)(float *acc, const float *p, int n, const KV_T *v,
                                     int64_t stride, __m512 alpha) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc), alpha);
    for (int u = 0; u < n; u++)
        a = _mm512_fmadd_ps(_mm512_set1_ps(p[u]), KV_LOAD16(v + u * stride), a);
    _mm512_storeu_ps(acc, a);
}

/* head_block_avx2 with the dot products and P.V on 16-lane registers (D a multiple of 16); the
 * softmax of the block's few scores stays on 8 lanes. */
static inline void TL_NAME(head_block_avx512)(item_state *st, int g, const KV_T *kg,
                                              const KV_T *vg, int n, int64_t tok_stride, int D) {
    float *sg = st->s[g], *qg = st->qs[g];
    int t = 0;
    for (; t + 8 <= n; t += 8) TL_NAME(dot8_512)(qg, kg + t * tok_stride, tok_stride, D, sg + t);
    for (; t < n; t++) {
        __m512 a = _mm512_setzero_ps();
        for (int i = 0; i < D; i += 16)
            a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + i), KV_LOAD16(kg + t * tok_stride + i), a);
        sg[t] = _mm512_reduce_add_ps(a);
    }
    for (; t % 8; t++) sg[t] = -FLT_MAX;
    const __m512 al = _mm512_set1_ps(block_softmax8(st, g, n));
    int c = 0;
    for (; c + 64 <= D; c += 64) TL_NAME(pv64_512)(st->acc[g] + c, sg, n, vg + c, tok_stride, al);
    for (; c < D; c += 16) TL_NAME(pv16_512)(st->acc[g] + c, sg, n, vg + c, tok_stride, al);
}
#endif

/* The same for any head_dim (<= 256) with plain loops (expf vectorized by the compiler where it
 * can). */
static inline void TL_NAME(head_block_scalar)(item_state *st, int g, const KV_T *kg, const KV_T *vg,
                                     int n, int64_t tok_stride, int D) {
    float *sg = st->s[g], *qg = st->qs[g], *acc = st->acc[g];
    for (int t = 0; t < n; t++) {
        const KV_T *kr = kg + t * tok_stride;
        float dot = 0.0f;
        for (int i = 0; i < D; i++) dot += qg[i] * KV_TO_F32(kr[i]);
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
        const float p = sg[t];
        const KV_T *vr = vg + t * tok_stride;
        for (int i = 0; i < D; i++) acc[i] += p * KV_TO_F32(vr[i]);
    }
}

/* One work item: query heads hq0 .. hq0 + nh - 1 of one sequence, block by block. With a
 * sliding window W (> 0) the query at position L - 1 sees only positions L - W .. L - 1: the
 * loop starts at the window's first block, never reads a block before it (those may be the null
 * block once freed), and in that first block skips the rows before the window. */
static void TL_NAME(run_item)(int vec, const void *q0, int io_bf16, int hq0, int nh, int G,
                     const KV_T *k_cache, const KV_T *v_cache, const int32_t *bt, int L,
                     int window, int64_t tok_stride, int64_t blk_stride, int block_size, int D,
                     float scale, void *o0) {
    item_state st;
    item_begin(&st, q0, io_bf16, hq0, nh, G, D, scale);
    const int first = window > 0 && L > window ? L - window : 0;
    for (int blk = first / block_size; blk * block_size < L; blk++) {
        const KV_T *kb, *vb;
        int n = TL_NAME(item_block)(&st, nh, D, bt, blk, L, k_cache, v_cache, block_size,
                                    tok_stride, blk_stride, &kb, &vb);
        const int skip = first > blk * block_size ? first - blk * block_size : 0;
        if (skip) {
            kb += skip * tok_stride;
            vb += skip * tok_stride;
            n -= skip;
        }
        for (int g = 0; g < nh; g++) {
#if TL_HAVE_AVX512
            if (vec == 2) {
                TL_NAME(head_block_avx512)(&st, g, kb + st.off[g], vb + st.off[g], n, tok_stride, D);
                continue;
            }
#endif
#if TL_HAVE_AVX2
            if (vec) {
                TL_NAME(head_block_avx2)(&st, g, kb + st.off[g], vb + st.off[g], n, tok_stride, D);
                continue;
            }
#endif
            TL_NAME(head_block_scalar)(&st, g, kb + st.off[g], vb + st.off[g], n, tok_stride, D);
        }
    }
    item_end(&st, nh, D, o0, io_bf16);
    (void)vec;
}

/* q and out are float32, or bfloat16 when io_bf16; element strides. */
static int TL_NAME(decode)(const void *q, int64_t q_stride, const void *k_cache_v,
                           const void *v_cache_v, const int32_t *block_table, int64_t bt_stride,
                           const int32_t *seq_lens, void *out, int64_t out_stride,
                           int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads,
                           int32_t head_dim, int32_t block_size, float scale,
                           int32_t window, int io_bf16) {
    const KV_T *k_cache = (const KV_T *)k_cache_v, *v_cache = (const KV_T *)v_cache_v;
    const int64_t esz = io_bf16 ? 2 : 4;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    if (head_dim > 256 || block_size > TL_MAX_BLOCK_SIZE) return -2;
    const int G = num_heads / num_kv_heads, D = head_dim;
    const int64_t tok_stride = (int64_t)num_kv_heads * D;
    const int64_t blk_stride = (int64_t)block_size * tok_stride;
    /* 2: the AVX-512 loops, 1: AVX2, 0: plain; the build's ISA level decides which exist
     * (TOKENLOOM_CPU_ISA builds a narrower one, see ops/cpu_features.py). */
    int vec = TL_HAVE_AVX2 && D % 8 == 0;
    if (TL_HAVE_AVX512 && D % 16 == 0) vec = 2;
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
        const char *q0 = (const char *)q + (b * q_stride + (int64_t)hq0 * D) * esz;
        char *o0 = (char *)out + (b * out_stride + (int64_t)hq0 * D) * esz;
        const int32_t *bt = block_table + b * bt_stride;
        TL_NAME(run_item)(vec, q0, io_bf16, hq0, nh, G, k_cache, v_cache, bt, seq_lens[b], window,
                          tok_stride, blk_stride, block_size, D, scale, o0);
    }
    return 0;
}
