/* The decode kernel's vector loops for one vector width and one KV cache element type: included
 * by paged_decode.c once per (ISA, type), with the vector macros (VEC, VW lanes, VLOAD, VFMA, ...,
 * QK_ROWS, PV_NV, REDUCE_ROWS), the cache's KV_T, KV_ONE(p) (VW elements widened to float32, in
 * order), KV_PAIR(p, lo, hi) (2 VW elements: a float32 cache's in order, a bfloat16 cache's
 * even and odd ones, see paged_decode.c), KV_BF16 (1 for a bfloat16 cache), ISA and KV_SFX (the
 * names' suffixes) defined.
 *
 * The head count gs (1 .. TL_GS) is a constant in every call of the always-inline helpers, so
 * their (heads x rows) and (heads x columns) arrays live in registers. */
#define TL_NAME(name) TL_CAT3(name, ISA, KV_SFX)
#define TL_INLINE static inline __attribute__((always_inline))

/* Scores of heads g0 .. g0 + gs - 1 for rows t .. t + QK_ROWS - 1 (rows past n repeat row n - 1;
 * the caller pads their scores away): each K row is widened once for all gs heads. */
TL_INLINE void TL_NAME(qk_rows)(const int gs, item_state *st, int g0, const KV_T *kb,
                                int64_t ts, int n, int t, int D, int off) {
    VEC acc[TL_GS][QK_ROWS];
    const KV_T *rows[QK_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < QK_ROWS; r++) rows[r] = kb + (t + r < n ? t + r : n - 1) * ts;
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++)
#pragma GCC unroll 8
        for (int r = 0; r < QK_ROWS; r++) acc[g][r] = VZERO();
    int c = 0;
    for (; c + 2 * VW <= D; c += 2 * VW) {
#pragma GCC unroll 8
        for (int r = 0; r < QK_ROWS; r++) {
            VEC lo, hi;
            KV_PAIR(rows[r] + c, lo, hi);
#pragma GCC unroll 8
            for (int g = 0; g < gs; g++) {
                acc[g][r] = VFMA(VLOAD(st->qs[g0 + g] + c), lo, acc[g][r]);
                acc[g][r] = VFMA(VLOAD(st->qs[g0 + g] + c + VW), hi, acc[g][r]);
            }
        }
    }
    if (c < D) {
#pragma GCC unroll 8
        for (int r = 0; r < QK_ROWS; r++) {
            const VEC x = KV_ONE(rows[r] + c);
#pragma GCC unroll 8
            for (int g = 0; g < gs; g++) acc[g][r] = VFMA(VLOAD(st->qs[g0 + g] + c), x, acc[g][r]);
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++) REDUCE_ROWS(acc[g], st->s[g0 + g] + off + t);
}

/* part += p[u] * V[u] (row u of the block) for heads g0 .. g0 + gs - 1 and nv vectors of
 * columns from c (pv_cols, and pv_cols_mkl in paged_decode_chunk.h). */
TL_INLINE void TL_NAME(pv_row)(const int gs, const int nv, item_state *st, int g0,
                                   const KV_T *vb, int64_t ts, int c, int off, int u,
                                   pf_stream *pf, VEC part[TL_GS][4]) {
    const KV_T *vr = vb + u * ts + c;
    VEC x[4];
    if (pf) pf_run(pf);
    if (nv == 1) {
        x[0] = KV_ONE(vr);
    } else {
#pragma GCC unroll 8
        for (int v = 0; v < nv; v += 2) KV_PAIR(vr + v * VW, x[v], x[v + 1]);
    }
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++) {
        const VEC p = VSET1(st->s[g0 + g][off + u]);
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++) part[g][v] = VFMA(p, x[v], part[g][v]);
    }
}


/* acc[:, c .. c + nv * VW] = acc * alpha + P . V for heads g0 .. g0 + gs - 1 over rows 0 .. n - 1
 * (nv = 1: one in-order chunk, the tail of a head; otherwise even, of KV_PAIR chunks). */
TL_INLINE void TL_NAME(pv_cols)(const int gs, const int nv, item_state *st, int g0,
                                const KV_T *vb, int64_t ts, int n, int c, const float *alpha,
                                int off, pf_stream *pf) {
    VEC acc[TL_GS][4];
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++)
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++)
            acc[g][v] = VMUL(VLOAD(st->acc[g0 + g] + c + v * VW), VSET1(alpha[g]));
    for (int u = 0; u < n; u++) TL_NAME(pv_row)(gs, nv, st, g0, vb, ts, c, off, u, pf, acc);
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++)
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++) VSTORE(st->acc[g0 + g] + c + v * VW, acc[g][v]);
}

/* The online-softmax update of head g for a block's n scores (padded with -FLT_MAX to a
 * multiple of VW): the scores become probabilities under the new running max, the running sum
 * follows; returns the factor that rescales the head's accumulator. */
TL_INLINE float TL_NAME(block_softmax)(item_state *st, int g, int n) {
    float *sg = st->s[g];
    VEC mx = VSET1(st->m[g]);
    for (int j = 0; j < n; j += VW) mx = VMAX(mx, VLOAD(sg + j));
    const float m = VHMAX(mx);
    const VEC mv = VSET1(m);
    VEC sum = VZERO();
    for (int j = 0; j < n; j += VW) {
        const VEC p = VEXP_NONPOS(VSUB(VLOAD(sg + j), mv));
        VSTORE(sg + j, p);
        sum = VADD(sum, p);
    }
    const VEC alpha = VEXP_NONPOS(VSET1(st->m[g] - m));
    /* The running sum stays per lane (summed at the item's end): no reduction here. */
    VSTORE(st->l[g], VFMA(VLOAD(st->l[g]), alpha, sum));
    st->m[g] = m;
    return VFIRST(alpha);
}

/* P.V of heads g0 .. g0 + gs - 1 over n rows whose probabilities start at s[off]; the first
 * pass over the rows advances the prefetch stream pf a step per row. */
TL_INLINE void TL_NAME(pv_gs)(const int gs, item_state *st, int g0, const KV_T *vb, int n,
                              int64_t ts, int D, const float *alpha, int off, pf_stream *pf) {
    int c = 0;
    for (; c + 4 * VW <= D; c += 4 * VW, pf = NULL) {
        if (PV_NV(gs) == 4) {
            TL_NAME(pv_cols)(gs, 4, st, g0, vb, ts, n, c, alpha, off, pf);
        } else {
            TL_NAME(pv_cols)(gs, 2, st, g0, vb, ts, n, c, alpha, off, pf);
            TL_NAME(pv_cols)(gs, 2, st, g0, vb, ts, n, c + 2 * VW, alpha, off, NULL);
        }
    }
    for (; c + 2 * VW <= D; c += 2 * VW, pf = NULL)
        TL_NAME(pv_cols)(gs, 2, st, g0, vb, ts, n, c, alpha, off, pf);
    if (c < D) TL_NAME(pv_cols)(gs, 1, st, g0, vb, ts, n, c, alpha, off, pf);
}

/* Q.K of heads g0 .. g0 + gs - 1 over n rows into s[off ..], the prefetch stream pf advanced
 * a step per QK_ROWS rows. */
TL_INLINE void TL_NAME(qk_gs)(const int gs, item_state *st, int g0, const KV_T *kb, int n,
                              int64_t ts, int D, int off, pf_stream *pf) {
    for (int t = 0; t < n; t += QK_ROWS) {
        if (pf) pf_run(pf);
        TL_NAME(qk_rows)(gs, st, g0, kb, ts, n, t, D, off);
    }
}

TL_INLINE void TL_NAME(kv_block_gs)(const int gs, item_state *st, int g0, const KV_T *kb,
                                    const KV_T *vb, int n, int64_t ts, int D, pf_stream *pk,
                                    pf_stream *pv) {
    TL_NAME(qk_gs)(gs, st, g0, kb, n, ts, D, 0, pk);
    const int npad = (n + VW - 1) / VW * VW;
    float alpha[TL_GS];
#pragma GCC unroll 8
    for (int g = 0; g < gs; g++) {
        for (int j = n; j < npad; j++) st->s[g0 + g][j] = -FLT_MAX;  /* exp gives 0 there */
        alpha[g] = TL_NAME(block_softmax)(st, g0 + g, npad);
    }
    TL_NAME(pv_gs)(gs, st, g0, vb, n, ts, D, alpha, 0, pv);
}

/* qk_gs and pv_gs for a run-time head count gn (1 .. TL_GS). */
TL_INLINE void TL_NAME(qk_any)(int gn, item_state *st, int g0, const KV_T *kb, int n, int64_t ts,
                               int D, int off, pf_stream *pf) {
    switch (gn) {
    case 1: TL_NAME(qk_gs)(1, st, g0, kb, n, ts, D, off, pf); break;
    case 2: TL_NAME(qk_gs)(2, st, g0, kb, n, ts, D, off, pf); break;
    default: TL_NAME(qk_gs)(3, st, g0, kb, n, ts, D, off, pf); break;
    }
}

TL_INLINE void TL_NAME(pv_any)(int gn, item_state *st, int g0, const KV_T *vb, int n, int64_t ts,
                               int D, const float *alpha, int off, pf_stream *pf) {
    switch (gn) {
    case 1: TL_NAME(pv_gs)(1, st, g0, vb, n, ts, D, alpha, off, pf); break;
    case 2: TL_NAME(pv_gs)(2, st, g0, vb, n, ts, D, alpha, off, pf); break;
    default: TL_NAME(pv_gs)(3, st, g0, vb, n, ts, D, alpha, off, pf); break;
    }
}

/* The kv_block_fn: gn (1 .. TL_GS) heads of one KV head over n rows of a block. */
static void TL_NAME(kv_block)(item_state *st, int g0, int gn, const void *kb, const void *vb,
                              int n, int64_t ts, int D, pf_stream *pk, pf_stream *pv) {
    const KV_T *k = (const KV_T *)kb, *v = (const KV_T *)vb;
    switch (gn) {
    case 1: TL_NAME(kv_block_gs)(1, st, g0, k, v, n, ts, D, pk, pv); break;
    case 2: TL_NAME(kv_block_gs)(2, st, g0, k, v, n, ts, D, pk, pv); break;
    default: TL_NAME(kv_block_gs)(3, st, g0, k, v, n, ts, D, pk, pv); break;
    }
}

/* The chunk path (kv_chunk_fn), for a bfloat16 cache only. */
#if KV_BF16
#include "paged_decode_chunk.h"
#endif

#undef TL_NAME
#undef TL_INLINE
