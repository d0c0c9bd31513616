/* The chunk path (kv_chunk_fn, a bfloat16 model over its bfloat16 cache) of one vector width:
 * included by paged_decode_impl.h inside its instantiation for a bfloat16 cache, with its macros
 * and TL_NAME.
 *
 * This path reproduces, bit for bit, what transformers in bfloat16 computes for a decode query:
 * torch's SDPA, whose CPU flash kernel takes the keys in splits of up to 512 (TL_CHUNK_ROWS) and
 * per split computes
 *   s = K q                    MKL's bf16 gemm (cblas_gemm_bf16bf16f32, float32 sums), single
 *                              threaded inside torch's parallel loop;
 *   s *= scale; m = max(m, max s);
 *   p = fexp_u20(s - m), l = l e^(m_old - m) + sum p    (chunk_softmax below);
 *   acc = acc e^(m_old - m) + bf16(p) V                   MKL again;
 * and at the end out = bf16(acc * (1 / l)). The order of MKL's sums is not documented; on CPUs
 * with AVX-512-BF16 (its vdpbf16ps kernels) it was read off its results with probes (a 2^24 and
 * two ones in a row: the ones survive only if they meet each other first) and checked against
 * it on random inputs of every length 1-600 and head sizes 32-256:
 *   K q, per key: 8 lanes, lane i taking the pair (2i, 2i + 1) of each 16 elements, odd product
 *     first; the 16-element blocks alternate between two accumulators, added lane by lane at the
 *     end; then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
 *   P V, per output column: keys in groups of 8 from the split's start, each group summed from 0
 *     in the order 1, 0, 3, 2, 5, 4, 7, 6 and then added to the (rescaled) total.
 * On AVX2-only CPUs MKL's kernel sums in another order, read off there with the same probes and
 * checked against it on random inputs (d 32-256, 1-512 keys) from `benchmarks/mkl_bf16_order.py`:
 *   K q, per key: four sums, of the elements i = 0, 1, 2, 3 mod 4, each in increasing i, then
 *     (s0 + s2) + (s1 + s3). Every case checked agreed bit for bit.
 *   P V, per output column: keys in groups of 4 from the split's start, each group summed as
 *     (p0 v0 + p2 v2) + (p1 v1 + p3 v3) and then added to the total. That is MKL's order for 8
 *     columns; with 64 and more MKL groups later keys otherwise (its probe tables), and the
 *     float32 sums differ in their last bit in a fifth to two thirds of the columns at 100+
 *     keys. The bfloat16 rounding of the output hides that: against torch's SDPA, 0 of 20,160
 *     outputs differed (head sizes 32-128, 1-1,100 keys, on a Zen 3).
 * The AVX2 build (VW 8) follows these; its query and accumulators stay in column order
 * (pair_w 0). So does the AVX-512 build where MKL runs this AVX2 kernel on an AVX512-BF16 CPU
 * (an AMD Zen 4; paged_decode.c's g_mkl_avx2_order), with the 16-lane softmax of torch's AVX-512
 * build (whose exp_u20 covers the multiples of 16 and expf the rest): with AVX512-BF16 dot
 * products (kv_chunk_dp, at the end of this file), or the 8-lane loops where the build has no
 * AVX512-BF16 or the head size is not a multiple of 16. */

/* Scores of heads g0 .. g0 + gs - 1 for rows t .. t + QK_ROWS - 1 in MKL's order (above). With
 * 16 lanes a 32-element step holds block 2k in lanes 0-7 (the first accumulator) and block
 * 2k + 1 in lanes 8-15 (the second), and KV_PAIR's even/odd split is MKL's pair split. With 8
 * lanes, MKL's AVX2 order. */
TL_INLINE void TL_NAME(qk_rows_mkl)(const int gs, item_state *st, int g0, const KV_T *kb,
                                    int64_t ts, int n, int t, int D, int off) {
    const KV_T *rows[QK_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < QK_ROWS; r++) rows[r] = kb + (t + r < n ? t + r : n - 1) * ts;
#if VW == 16
    VEC acc[TL_GS][QK_ROWS];
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++)
#pragma GCC unroll 8
        for (int r = 0; r < QK_ROWS; r++) acc[g][r] = VZERO();
    int c = 0;
    for (; c + 32 <= D; c += 32) {
#pragma GCC unroll 8
        for (int r = 0; r < QK_ROWS; r++) {
            VEC lo, hi;
            KV_PAIR(rows[r] + c, lo, hi);
#pragma GCC unroll 8
            for (int g = 0; g < gs; g++) {
                acc[g][r] = VFMA(VLOAD(st->qs[g0 + g] + c + VW), hi, acc[g][r]);
                acc[g][r] = VFMA(VLOAD(st->qs[g0 + g] + c), lo, acc[g][r]);
            }
        }
    }
    if (c < D) {  /* a last block of 16 (D % 32 == 16): an even block, so lanes 0-7 */
        const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0);
        VEC qe[TL_GS], qo[TL_GS];
#pragma GCC unroll 8
        for (int g = 0; g < gs; g++) {  /* the query's tail is in column order (reorder()) */
            qe[g] = _mm512_permutexvar_ps(ev, VLOAD(st->qs[g0 + g] + c));
            qo[g] = _mm512_permutexvar_ps(od, VLOAD(st->qs[g0 + g] + c));
        }
#pragma GCC unroll 8
        for (int r = 0; r < QK_ROWS; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(rows[r] + c));
            const VEC lo = _mm512_castps256_ps512(_mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
            const VEC hi = _mm512_castps256_ps512(_mm256_castsi256_ps(
                _mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u))));
#pragma GCC unroll 8
            for (int g = 0; g < gs; g++) {
                acc[g][r] = _mm512_mask3_fmadd_ps(qo[g], hi, acc[g][r], 0x00FF);
                acc[g][r] = _mm512_mask3_fmadd_ps(qe[g], lo, acc[g][r], 0x00FF);
            }
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++) REDUCE_ROWS_MKL(acc[g], st->s[g0 + g] + off + t);
#else
    /* MKL's AVX2 order (above): two keys per vector, four elements of each a step, so lane j of
     * a key's half sums its elements j mod 4 in order; the query is in column order here. */
    VEC acc2[TL_GS][QK_ROWS / 2];
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++)
#pragma GCC unroll 8
        for (int r = 0; r < QK_ROWS / 2; r++) acc2[g][r] = VZERO();
    for (int c = 0; c < D; c += 4) {
        VEC qq[TL_GS];
#pragma GCC unroll 8
        for (int g = 0; g < gs; g++) qq[g] = _mm256_broadcast_ps((const __m128 *)(st->qs[g0 + g] + c));
#pragma GCC unroll 8
        for (int r = 0; r < QK_ROWS / 2; r++) {
            const __m128i two = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(rows[2 * r] + c)),
                                                   _mm_loadl_epi64((const __m128i *)(rows[2 * r + 1] + c)));
            const VEC x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(two), 16));
#pragma GCC unroll 8
            for (int g = 0; g < gs; g++) acc2[g][r] = VFMA(qq[g], x, acc2[g][r]);
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++)
#pragma GCC unroll 8
        for (int r = 0; r < QK_ROWS / 2; r++) {
            const VEC h = VADD(acc2[g][r], _mm256_permute_ps(acc2[g][r], 0x4E)); /* s0+s2, s1+s3 */
            const VEC sum = VADD(h, _mm256_permute_ps(h, 0xB1));
            st->s[g0 + g][off + t + 2 * r] = _mm256_cvtss_f32(sum);
            st->s[g0 + g][off + t + 2 * r + 1] = _mm_cvtss_f32(_mm256_extractf128_ps(sum, 1));
        }
#endif
}

TL_INLINE void TL_NAME(qk_chunk_gs)(const int gs, item_state *st, int g0, const KV_T *kb, int n,
                                    int64_t ts, int D, int off, pf_stream *pf) {
    for (int t = 0; t < n; t += QK_ROWS) {
        if (pf) pf_run(pf);
        TL_NAME(qk_rows_mkl)(gs, st, g0, kb, ts, n, t, D, off);
    }
}

#if VW == 16
/* acc[:, c .. c + nv * VW] = acc * alpha + P . V for heads g0 .. g0 + gs - 1 over rows
 * 0 .. n - 1 in MKL's order (above): the accumulator rescaled first, then each group of 8 rows
 * (counted from the split's start: off, a block's first row there, is a multiple of 8 when the
 * block size is) summed from 0 and added to it. */
TL_INLINE void TL_NAME(pv_cols_mkl)(const int gs, const int nv, item_state *st, int g0,
                                    const KV_T *vb, int64_t ts, int n, int c, const float *alpha,
                                    int off, pf_stream *pf) {
    VEC acc[TL_GS][4], part[TL_GS][4];
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++)
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++)
            acc[g][v] = VMUL(VLOAD(st->acc[g0 + g] + c + v * VW), VSET1(alpha[g]));
    for (int u0 = 0; u0 < n; u0 += 8) {
#pragma GCC unroll 8
        for (int g = 0; g < gs; g++)
#pragma GCC unroll 8
            for (int v = 0; v < nv; v++) part[g][v] = VZERO();
        if (u0 + 8 <= n) {  /* a whole group, unrolled */
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
                TL_NAME(pv_row)(gs, nv, st, g0, vb, ts, c, off, u0 + (k ^ 1), pf, part);
        } else {
            for (int k = 0; k < 8; k++)  /* 1, 0, 3, 2, ... of the rows there are */
                if (u0 + (k ^ 1) < n)
                    TL_NAME(pv_row)(gs, nv, st, g0, vb, ts, c, off, u0 + (k ^ 1), pf, part);
        }
#pragma GCC unroll 8
        for (int g = 0; g < gs; g++)
#pragma GCC unroll 8
            for (int v = 0; v < nv; v++) acc[g][v] = VADD(acc[g][v], part[g][v]);
    }
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++)
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++) VSTORE(st->acc[g0 + g] + c + v * VW, acc[g][v]);
}
#endif

/* a + b as written: GCC may reassociate a plain vector add under -ffast-math (_mm512_add_ps is
 * one), not a builtin with its rounding given (AVX2 has none; its loops are checked bit for bit
 * as compiled). */
#if VW == 16
#define VADD_EXACT(a, b) _mm512_add_round_ps((a), (b), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#else
#define VADD_EXACT(a, b) VADD(a, b)
#endif

/* acc[:, c .. c + VW] = acc * alpha + P . V for heads g0 .. g0 + gs - 1 over rows 0 .. n - 1, in
 * MKL's AVX2 order: groups of 4 rows from the split's start (off is a multiple of 4 when the
 * block size is), each as (row 0 + row 2) + (row 1 + row 3), added to the rescaled accumulator.
 * The columns are in their own order (pair_w 0): the 8-lane loops' P.V, and on 16 lanes the
 * last 16 columns of kv_chunk_dp's (below). */
TL_INLINE void TL_NAME(pv_cols_avx2)(const int gs, item_state *st, int g0, const KV_T *vb,
                                     int64_t ts, int n, int c, const float *alpha, int off,
                                     pf_stream *pf) {
    VEC acc[TL_GS];
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++) acc[g] = VMUL(VLOAD(st->acc[g0 + g] + c), VSET1(alpha[g]));
    for (int u0 = 0; u0 < n; u0 += 4) {
        VEC part[2][TL_GS];
#pragma GCC unroll 8
        for (int g = 0; g < gs; g++) part[0][g] = part[1][g] = VZERO();
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const int u = u0 + (k >> 1) + 2 * (k & 1);  /* 0, 2, 1, 3 */
            if (u >= n) continue;
            if (pf) pf_run(pf);
            const VEC x = KV_ONE(vb + u * ts + c);
#pragma GCC unroll 8
            for (int g = 0; g < gs; g++)
                part[k >> 1][g] = VFMA(VSET1(st->s[g0 + g][off + u]), x, part[k >> 1][g]);
        }
#pragma GCC unroll 8
        for (int g = 0; g < gs; g++) acc[g] = VADD_EXACT(acc[g], VADD_EXACT(part[0][g], part[1][g]));
    }
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++) VSTORE(st->acc[g0 + g] + c, acc[g]);
}

TL_INLINE void TL_NAME(pv_chunk_gs)(const int gs, item_state *st, int g0, const KV_T *vb, int n,
                                    int64_t ts, int D, const float *alpha, int off,
                                    pf_stream *pf) {
#if VW == 8
    for (int c = 0; c < D; c += VW, pf = NULL)
        TL_NAME(pv_cols_avx2)(gs, st, g0, vb, ts, n, c, alpha, off, pf);
#else
    int c = 0;
    for (; c + 4 * VW <= D; c += 4 * VW, pf = NULL) {
        /* the group sums double the registers P.V holds */
        if (PV_NV(gs) == 4) {
            TL_NAME(pv_cols_mkl)(gs, 4, st, g0, vb, ts, n, c, alpha, off, pf);
        } else {
            TL_NAME(pv_cols_mkl)(gs, 2, st, g0, vb, ts, n, c, alpha, off, pf);
            TL_NAME(pv_cols_mkl)(gs, 2, st, g0, vb, ts, n, c + 2 * VW, alpha, off, NULL);
        }
    }
    for (; c + 2 * VW <= D; c += 2 * VW, pf = NULL)
        TL_NAME(pv_cols_mkl)(gs, 2, st, g0, vb, ts, n, c, alpha, off, pf);
    if (c < D) TL_NAME(pv_cols_mkl)(gs, 1, st, g0, vb, ts, n, c, alpha, off, pf);
#endif
}

/* qk_chunk_gs and pv_chunk_gs for a run-time head count gn (1 .. TL_GS). */
TL_INLINE void TL_NAME(qk_chunk_any)(int gn, item_state *st, int g0, const KV_T *kb, int n,
                                     int64_t ts, int D, int off, pf_stream *pf) {
    switch (gn) {
    case 1: TL_NAME(qk_chunk_gs)(1, st, g0, kb, n, ts, D, off, pf); break;
    case 2: TL_NAME(qk_chunk_gs)(2, st, g0, kb, n, ts, D, off, pf); break;
    default: TL_NAME(qk_chunk_gs)(3, st, g0, kb, n, ts, D, off, pf); break;
    }
}

TL_INLINE void TL_NAME(pv_chunk_any)(int gn, item_state *st, int g0, const KV_T *vb, int n,
                                     int64_t ts, int D, const float *alpha, int off,
                                     pf_stream *pf) {
    switch (gn) {
    case 1: TL_NAME(pv_chunk_gs)(1, st, g0, vb, n, ts, D, alpha, off, pf); break;
    case 2: TL_NAME(pv_chunk_gs)(2, st, g0, vb, n, ts, D, alpha, off, pf); break;
    default: TL_NAME(pv_chunk_gs)(3, st, g0, vb, n, ts, D, alpha, off, pf); break;
    }
}

/* The chunk path's softmax of head g over a chunk's n raw scores q.k, step for step as torch's
 * flash kernel does it for bfloat16 (with vectors of VW lanes, as torch's build for this ISA
 * has): the scores times the scale, their max with the running one; fexp_u20 of (score - max)
 * two vectors at a time, then one, each summed per lane (the single vector's sum added to the
 * first accumulator), the two accumulators added and their lanes reduced in torch's order; expf
 * for the last n % VW scores, added one by one; the probabilities rounded to bfloat16 for P.V;
 * the running sum rescaled by expf(old max - max). Returns that factor for the accumulator. The
 * sum is kept in l[g][0] (the other lanes stay 0). */
TL_INLINE float TL_NAME(chunk_softmax)(item_state *st, int g, int n) {
    float *sg = st->s[g];
    const int n2 = n / (2 * VW) * (2 * VW), n1 = n / VW * VW;
    const VEC sc = VSET1(st->scale);
    VEC mx = VSET1(st->m[g]);
    for (int j = 0; j < n1; j += VW) {
        const VEC x = VMUL(VLOAD(sg + j), sc);
        VSTORE(sg + j, x);
        mx = VMAX(mx, x);
    }
    float m = VHMAX(mx);
    for (int j = n1; j < n; j++) {
        sg[j] *= st->scale;
        m = sg[j] > m ? sg[j] : m;
    }
    const VEC mv = VSET1(m);
    VEC sum0 = VZERO(), sum1 = VZERO(), sum_tail = VZERO();
    for (int j = 0; j < n2; j += 2 * VW) {
        const VEC p0 = VEXP_FAST(VSUB(VLOAD(sg + j), mv));
        const VEC p1 = VEXP_FAST(VSUB(VLOAD(sg + j + VW), mv));
        sum0 = VADD(sum0, p0);
        sum1 = VADD(sum1, p1);
        VSTORE(sg + j, VROUND_BF16(p0));
        VSTORE(sg + j + VW, VROUND_BF16(p1));
    }
    if (n2 < n1) {
        const VEC p = VEXP_FAST(VSUB(VLOAD(sg + n2), mv));
        sum_tail = p;
        VSTORE(sg + n2, VROUND_BF16(p));
    }
    sum0 = VADD(sum0, sum_tail);
    return tl_softmax_tail(st, g, sg + n1, n - n1, m, VHSUM_TORCH(VADD(sum0, sum1)));
}

/* The kv_chunk_fn: the scores of all the chunk's blocks first, the chunk's softmax, then P.V
 * block by block (the accumulator rescaled once, by the first). Both passes go block by block
 * and, within a block, through all the item's head groups, so that the cache is read in its
 * order, each block once per pass, while the next block's rows are prefetched, and on 16 lanes
 * the one TL_PF_FAR blocks on (pf_far_init). The 8-lane loops (a bf16 model on an AVX2 CPU, or
 * MKL's AVX2 order without AVX512-BF16) are bound by their arithmetic and ran slower with that
 * (benchmarks/README.md, "Zen 4"). */
#define TL_FAR_ON (VW == 16)
static void TL_NAME(kv_chunk)(item_state *st, const item_groups *gr, const void *const *kbs,
                              const void *const *vbs, const int *ns, int nb, int64_t ts, int D,
                              const void *nxt, int nxtn) {
    const int64_t rb = ts * (int64_t)sizeof(KV_T);
    int off = 0;
    pf_stream pf;
    for (int b = 0; b < nb; b++) {  /* block b's keys; the next block's (or V's first) fetched */
        int steps = 0;
        for (int i = 0; i < gr->n; i++) steps += (ns[b] + QK_ROWS - 1) / QK_ROWS;
        pf_init(&pf, b + 1 < nb ? kbs[b + 1] : vbs[0], (b + 1 < nb ? ns[b + 1] : ns[0]) * rb,
                steps);
        if (TL_FAR_ON && b == 0 && 2 < 2 * nb)
            pf_far(2 < nb ? kbs[2] : vbs[2 - nb], (2 < nb ? ns[2] : ns[2 - nb]) * rb);
        if (TL_FAR_ON && b + TL_PF_FAR < 2 * nb) {
            const int f = b + TL_PF_FAR;
            pf_far_init(&pf, f < nb ? kbs[f] : vbs[f - nb], (f < nb ? ns[f] : ns[f - nb]) * rb,
                        steps);
        }
        for (int i = 0; i < gr->n; i++)
            TL_NAME(qk_chunk_any)(gr->gn[i], st, gr->g0[i],
                                  (const KV_T *)((const char *)kbs[b] + gr->off[i]), ns[b], ts,
                                  D, off, &pf);
        off += ns[b];
    }
    const int nh = gr->g0[gr->n - 1] + gr->gn[gr->n - 1];
    float alpha[TL_GC], one[TL_GC];
    for (int g = 0; g < nh; g++) {
#if TL_HAVE_AVX512 && VW == 8 /* torch's 16-lane softmax beside MKL's AVX2 order (a Zen 4) */
        alpha[g] = g_mkl_avx2_order ? chunk_softmax_avx512_bf16kv(st, g, off)
                                    : TL_NAME(chunk_softmax)(st, g, off);
#else
        alpha[g] = TL_NAME(chunk_softmax)(st, g, off);
#endif
        one[g] = 1.0f;
    }
    off = 0;
    for (int b = 0; b < nb; b++) {
        pf_init(&pf, b + 1 < nb ? vbs[b + 1] : nxt, (b + 1 < nb ? ns[b + 1] : nxtn) * rb,
                gr->n * ns[b]);
        if (TL_FAR_ON && b + TL_PF_FAR < nb)
            pf_far_init(&pf, vbs[b + TL_PF_FAR], ns[b + TL_PF_FAR] * rb, gr->n * ns[b]);
        for (int i = 0; i < gr->n; i++)
            TL_NAME(pv_chunk_any)(gr->gn[i], st, gr->g0[i],
                                  (const KV_T *)((const char *)vbs[b] + gr->off[i]), ns[b], ts,
                                  D, (b ? one : alpha) + gr->g0[i], off, &pf);
        off += ns[b];
    }
}
#undef TL_FAR_ON

#if VW == 16 && defined(__AVX512BF16__)
/* ---- MKL's AVX2 order on 16 lanes with AVX512-BF16 dot products: the chunk path of an AVX-512
 * CPU whose MKL runs its AVX2 bf16 kernel (an AMD Zen 4; paged_decode.c's g_mkl_avx2_order).
 * Its sums are the 8-lane path's, term for term (the AVX2 order above); its softmax is this
 * build's 16-lane one; the query and the accumulators stay in column order (pair_w 0).
 *
 * Why dot products: every term of those sums is a product of two bfloat16 values (a query or a
 * probability rounded to bf16, a cached K or V element), exact in float32, and VDPBF16PS adds a
 * lane's two products to it one after the other, each sum rounded to nearest (its odd pair's
 * product first; tests/ops/test_amx.py checks that order on this CPU), so one instruction does
 * the work of two FMAs in a row when a lane's pair holds two consecutive terms of one sum, the
 * earlier in its upper half. The 8-lane loops spent a third of their instructions widening bf16
 * to float32 and building vectors of two keys from 8-byte loads. The instruction treats
 * subnormal inputs as zero: a term below 2^-126 that the FMAs would add is dropped, which no
 * score or output of a real model notices. */

/* Head g's query as Q.K's pairs: for each 8 columns 8s .. 8s + 7, four 32-bit words, word j =
 * (bf16 q[8s + 4 + j] in the lower half, q[8s + j] in the upper): the two terms of class j (the
 * elements i = j mod 4) that step s adds, the earlier upper. The query holds bfloat16 values
 * (a bfloat16 model's; not scaled on the chunk path), so taking the upper halves is exact. */
TL_INLINE void TL_NAME(q_pairs)(uint32_t *dst, const float *q, int D) {
    for (int c = 0; c < D; c += 8)
        for (int j = 0; j < 4; j++) {
            uint32_t hi, lo;
            memcpy(&hi, q + c + j, 4);
            memcpy(&lo, q + c + 4 + j, 4);
            dst[c / 2 + j] = (hi & 0xFFFF0000u) | (lo >> 16);
        }
}

/* Scores of heads g0 .. g0 + gs - 1 for rows t .. t + 7 in MKL's AVX2 order: each lane one
 * key's sum of one class j (the elements j mod 4, in increasing order), four lanes a key. A
 * step takes 16 elements of the eight keys (a 32-byte load each), transposed in 64-bit units
 * so that vector u holds every key's elements 4u .. 4u + 3 (keys in the order 0, 1, 4, 5, 2, 3,
 * 6, 7); interleaving the 16-bit elements of units 2s + 1 and 2s gives each lane the pair
 * (element 8s + 4 + j, element 8s + j), which one dot product adds in order: keys 0, 4, 2, 6
 * from the lower halves of the 128-bit lanes, 1, 5, 3, 7 from the upper. Then per key
 * (s0 + s2) + (s1 + s3). qp: q_pairs' words of each head. */
TL_INLINE void TL_NAME(qk_rows_dp)(const int gs, const uint32_t (*qp)[128], item_state *st,
                                   int g0, const KV_T *kb, int64_t ts, int n, int t, int D,
                                   int off) {
    const KV_T *rows[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) rows[r] = kb + (t + r < n ? t + r : n - 1) * ts;
    VEC acc_l[TL_GS], acc_h[TL_GS];
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++) acc_l[g] = acc_h[g] = VZERO();
    for (int c = 0; c < D; c += 16) {
        __m512i z[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++)  /* [key r's 16 | key r + 4's 16] */
            z[r] = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(rows[r] + c))),
                _mm256_loadu_si256((const __m256i *)(rows[r + 4] + c)), 1);
        const __m512i a0 = _mm512_unpacklo_epi64(z[0], z[1]);
        const __m512i a1 = _mm512_unpackhi_epi64(z[0], z[1]);
        const __m512i a2 = _mm512_unpacklo_epi64(z[2], z[3]);
        const __m512i a3 = _mm512_unpackhi_epi64(z[2], z[3]);
        __m512i x[4];  /* x[u]: units u of keys 0, 1, 4, 5, 2, 3, 6, 7 */
        x[0] = _mm512_shuffle_i64x2(a0, a2, 0x88);
        x[1] = _mm512_shuffle_i64x2(a1, a3, 0x88);
        x[2] = _mm512_shuffle_i64x2(a0, a2, 0xDD);
        x[3] = _mm512_shuffle_i64x2(a1, a3, 0xDD);
#pragma GCC unroll 2
        for (int s2 = 0; s2 < 2; s2++) {
            const __m512bh kl = (__m512bh)_mm512_unpacklo_epi16(x[2 * s2 + 1], x[2 * s2]);
            const __m512bh kh = (__m512bh)_mm512_unpackhi_epi16(x[2 * s2 + 1], x[2 * s2]);
#pragma GCC unroll 8
            for (int g = 0; g < gs; g++) {
                const __m512bh q = (__m512bh)_mm512_broadcast_i32x4(
                    _mm_loadu_si128((const __m128i *)(qp[g0 + g] + c / 2 + 4 * s2)));
                acc_l[g] = _mm512_dpbf16_ps(acc_l[g], kl, q);
                acc_h[g] = _mm512_dpbf16_ps(acc_h[g], kh, q);
            }
        }
    }
    /* lane 0 of each 128-bit lane: (s0 + s2) + (s1 + s3); keys 0 .. 7 from acc_l's lanes 0, 8,
     * 4, 12 (keys 0, 2, 4, 6) and acc_h's (1, 3, 5, 7) */
    const __m512i keys = _mm512_setr_epi32(0, 16, 8, 24, 4, 20, 12, 28, 0, 0, 0, 0, 0, 0, 0, 0);
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++) {
        const VEC l2 = VADD_EXACT(acc_l[g], _mm512_permute_ps(acc_l[g], 0x4E));
        const VEC h2 = VADD_EXACT(acc_h[g], _mm512_permute_ps(acc_h[g], 0x4E));
        const VEC l4 = VADD_EXACT(l2, _mm512_permute_ps(l2, 0xB1));
        const VEC h4 = VADD_EXACT(h2, _mm512_permute_ps(h2, 0xB1));
        _mm256_storeu_ps(st->s[g0 + g] + off + t,
                         _mm512_castps512_ps256(_mm512_permutex2var_ps(l4, keys, h4)));
    }
}

/* The column order of P.V's accumulators below, per 32 columns: the lower vector holds columns
 * 0-3, 8-11, 16-19, 24-27, the upper one the others (VPUNPCK{L,H}WD's halves). */
static inline __attribute__((always_inline)) void pv_dp_split(__m512 a, __m512 b, __m512 *lo,
                                                              __m512 *hi) {
    const __m512i il = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i ih =
        _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    *lo = _mm512_permutex2var_ps(a, il, b);
    *hi = _mm512_permutex2var_ps(a, ih, b);
}
static inline __attribute__((always_inline)) void pv_dp_join(__m512 lo, __m512 hi, __m512 *a,
                                                             __m512 *b) {
    const __m512i ia = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i ib =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    *a = _mm512_permutex2var_ps(lo, ia, hi);
    *b = _mm512_permutex2var_ps(lo, ib, hi);
}

/* acc[:, c .. c + 32] = acc * alpha + P . V for heads g0 .. g0 + gs - 1 over rows 0 .. n - 1 in
 * MKL's AVX2 order: groups of 4 rows from the split's start, each (row 0 + row 2) + (row 1 + row
 * 3) added to the total; (row 0 + row 2) is one dot product per lane of the pairs (v2, v0) and
 * (p2, p0), from zero. Rows past n (a last partial group) count as zero rows. pp: per head, the
 * probabilities' pairs from the block's first row, word 2k = (p[4k + 2] in the lower half, p[4k]
 * in the upper) and 2k + 1 = (p[4k + 3], p[4k + 1]), zero past n (kv_chunk_dp). */
TL_INLINE void TL_NAME(pv_cols_dp)(const int gs, item_state *st, int g0, const uint32_t *const *pp,
                                   const KV_T *vb, int64_t ts, int n, int c, const float *alpha,
                                   pf_stream *pf) {
    VEC lo[TL_GS], hi[TL_GS];
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++) {
        const VEC al = VSET1(alpha[g]);
        pv_dp_split(VMUL(VLOAD(st->acc[g0 + g] + c), al), VMUL(VLOAD(st->acc[g0 + g] + c + 16), al),
                    &lo[g], &hi[g]);
    }
    const __m512i zero = _mm512_setzero_si512();
    for (int u0 = 0; u0 < n; u0 += 4) {
        __m512i v[4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            if (pf) pf_run(pf);
            v[k] = u0 + k < n ? _mm512_loadu_si512((const void *)(vb + (u0 + k) * ts + c)) : zero;
        }
        const __m512bh e02l = (__m512bh)_mm512_unpacklo_epi16(v[2], v[0]);
        const __m512bh e02h = (__m512bh)_mm512_unpackhi_epi16(v[2], v[0]);
        const __m512bh e13l = (__m512bh)_mm512_unpacklo_epi16(v[3], v[1]);
        const __m512bh e13h = (__m512bh)_mm512_unpackhi_epi16(v[3], v[1]);
        const int w = u0 / 2;  /* the group's two words */
#pragma GCC unroll 8
        for (int g = 0; g < gs; g++) {
            const __m512bh p02 = (__m512bh)_mm512_set1_epi32((int)pp[g][w]);
            const __m512bh p13 = (__m512bh)_mm512_set1_epi32((int)pp[g][w + 1]);
            const VEC zl = _mm512_dpbf16_ps(VZERO(), e02l, p02);
            const VEC zh = _mm512_dpbf16_ps(VZERO(), e02h, p02);
            lo[g] = VADD_EXACT(lo[g], VADD_EXACT(zl, _mm512_dpbf16_ps(VZERO(), e13l, p13)));
            hi[g] = VADD_EXACT(hi[g], VADD_EXACT(zh, _mm512_dpbf16_ps(VZERO(), e13h, p13)));
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++) {
        VEC a, b;
        pv_dp_join(lo[g], hi[g], &a, &b);
        VSTORE(st->acc[g0 + g] + c, a);
        VSTORE(st->acc[g0 + g] + c + 16, b);
    }
}

TL_INLINE void TL_NAME(qk_dp_gs)(const int gs, const uint32_t (*qp)[128], item_state *st, int g0,
                                 const KV_T *kb, int n, int64_t ts, int D, int off,
                                 pf_stream *pf) {
    for (int t = 0; t < n; t += 8) {
        pf_run(pf);
        TL_NAME(qk_rows_dp)(gs, qp, st, g0, kb, ts, n, t, D, off);
    }
}

TL_INLINE void TL_NAME(pv_dp_gs)(const int gs, item_state *st, int g0, const uint32_t *const *pp,
                                 const KV_T *vb, int n, int64_t ts, int D, const float *alpha,
                                 int off, pf_stream *pf) {
    int c = 0;
    for (; c + 32 <= D; c += 32, pf = NULL)
        TL_NAME(pv_cols_dp)(gs, st, g0, pp, vb, ts, n, c, alpha, pf);
    if (c < D) TL_NAME(pv_cols_avx2)(gs, st, g0, vb, ts, n, c, alpha, off, pf);  /* last 16 */
}

/* The kv_chunk_fn in MKL's AVX2 order with dot products: kv_chunk's passes (below) over the
 * loops above; between them, the softmax and the probabilities' pairs. */
static void TL_NAME(kv_chunk_dp)(item_state *st, const item_groups *gr, const void *const *kbs,
                                 const void *const *vbs, const int *ns, int nb, int64_t ts,
                                 int D, const void *nxt, int nxtn) {
    const int64_t rb = ts * (int64_t)sizeof(KV_T);
    const int nh = gr->g0[gr->n - 1] + gr->gn[gr->n - 1];
    uint32_t qp[TL_GC][128] __attribute__((aligned(64)));
    for (int g = 0; g < nh; g++) TL_NAME(q_pairs)(qp[g], st->qs[g], D);
    int off = 0;
    pf_stream pf;
    for (int b = 0; b < nb; b++) {
        int steps = 0;
        for (int i = 0; i < gr->n; i++) steps += (ns[b] + 7) / 8;
        pf_init(&pf, b + 1 < nb ? kbs[b + 1] : vbs[0], (b + 1 < nb ? ns[b + 1] : ns[0]) * rb,
                steps);
        if (b == 0 && 2 < 2 * nb)
            pf_far(2 < nb ? kbs[2] : vbs[2 - nb], (2 < nb ? ns[2] : ns[2 - nb]) * rb);
        if (b + TL_PF_FAR < 2 * nb) {
            const int f = b + TL_PF_FAR;
            pf_far_init(&pf, f < nb ? kbs[f] : vbs[f - nb], (f < nb ? ns[f] : ns[f - nb]) * rb,
                        steps);
        }
        for (int i = 0; i < gr->n; i++) {
            const KV_T *kb = (const KV_T *)((const char *)kbs[b] + gr->off[i]);
            switch (gr->gn[i]) {
            case 1: TL_NAME(qk_dp_gs)(1, qp, st, gr->g0[i], kb, ns[b], ts, D, off, &pf); break;
            case 2: TL_NAME(qk_dp_gs)(2, qp, st, gr->g0[i], kb, ns[b], ts, D, off, &pf); break;
            default: TL_NAME(qk_dp_gs)(3, qp, st, gr->g0[i], kb, ns[b], ts, D, off, &pf); break;
            }
        }
        off += ns[b];
    }
    /* the probabilities (bf16 values after the softmax) as pv_cols_dp's pairs, each block's
     * groups of 4 rows from its start (as the 8-lane loops group them), zero past its rows */
    uint32_t pw[TL_GC][TL_CHUNK_ROWS / 2 + 2 * TL_CHUNK_ROWS / 4] __attribute__((aligned(64)));
    float alpha[TL_GC], one[TL_GC];
    for (int g = 0; g < nh; g++) {
        alpha[g] = TL_NAME(chunk_softmax)(st, g, off);
        one[g] = 1.0f;
        uint32_t *w = pw[g];
        const float *sg = st->s[g];
        for (int b = 0, o = 0; b < nb; o += ns[b++])
            for (int r = 0; r < ns[b]; r += 4) {
                uint32_t x[4];
                for (int i = 0; i < 4; i++) {
                    const float p = r + i < ns[b] ? sg[o + r + i] : 0.0f;
                    memcpy(&x[i], &p, 4);
                }
                *w++ = (x[0] & 0xFFFF0000u) | (x[2] >> 16);
                *w++ = (x[1] & 0xFFFF0000u) | (x[3] >> 16);
            }
    }
    off = 0;
    for (int b = 0, wb = 0; b < nb; wb += (ns[b] + 3) / 4 * 2, off += ns[b++]) {
        pf_init(&pf, b + 1 < nb ? vbs[b + 1] : nxt, (b + 1 < nb ? ns[b + 1] : nxtn) * rb,
                gr->n * ns[b]);
        if (b + TL_PF_FAR < nb)
            pf_far_init(&pf, vbs[b + TL_PF_FAR], ns[b + TL_PF_FAR] * rb, gr->n * ns[b]);
        for (int i = 0; i < gr->n; i++) {
            const KV_T *vb = (const KV_T *)((const char *)vbs[b] + gr->off[i]);
            const float *al = (b ? one : alpha) + gr->g0[i];
            const uint32_t *pg[TL_GS];
            for (int g = 0; g < gr->gn[i]; g++) pg[g] = pw[gr->g0[i] + g] + wb;
            switch (gr->gn[i]) {
            case 1: TL_NAME(pv_dp_gs)(1, st, gr->g0[i], pg, vb, ns[b], ts, D, al, off, &pf); break;
            case 2: TL_NAME(pv_dp_gs)(2, st, gr->g0[i], pg, vb, ns[b], ts, D, al, off, &pf); break;
            default: TL_NAME(pv_dp_gs)(3, st, gr->g0[i], pg, vb, ns[b], ts, D, al, off, &pf); break;
            }
        }
    }
}
#endif
#undef VADD_EXACT
