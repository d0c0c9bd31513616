/* float32 matmul for a few rows on a plain row-major weight: y[M, N] = x[M, K] W[N, K]^T (+ bias).
 *
 * Why: a batch-1 decode step of a float32 model is a pass over every weight for one row of
 * activations, so it runs at the speed the weights stream from memory. oneDNN's packed matmul
 * (model/packed_linear.py) and MKL's GEMV read those shapes well below the memory's own rate (a
 * plain sum over the same bytes); this kernel reads each weight row once, as it lies, four rows
 * side by side (one independent stream each), and keeps the few activation rows in L1
 * (benchmarks/f32_gemv.py). From 16-32 rows the products, not the
 * memory, are the cost and oneDNN's blocked matmul catches up, then wins; the caller picks.
 *
 * Each output is summed the same way whatever M is and whichever thread computes it: VW lanes
 * (8 on AVX2, 16 on AVX-512, 1 without either) each accumulate the elements k = lane mod VW in
 * order with fused multiply-adds, then the lanes are added in a fixed tree. So a row's result does
 * not depend on the batch it came in (the fused decode step and the eager layers agree bit for
 * bit). A K that is not a multiple of VW ends with a masked load: the same order, zeros after K.
 *
 * Rows are split across the OpenMP threads in items of ITEM_N, taken over from a slower thread's
 * run at the end (work_steal.h).
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "vec_math.h"
#include "work_steal.h"

#define GROUP_N 4 /* weight rows multiplied side by side */
#define ITEM_N 16 /* weight rows per work item */

#if TL_HAVE_AVX512
#include <immintrin.h>
#define VW 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vload_tail(const float *p, int64_t n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
/* a fixed tree: halves, then quarters, ... (not _mm512_reduce_add_ps, whose order is the
 * compiler's) */
static inline float vsum(vf v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return tl_hsum8(h);
}
#elif TL_HAVE_AVX2
#include <immintrin.h>
#define VW 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vload_tail(const float *p, int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), idx));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return tl_hsum8(v); }
#else
#define VW 1
typedef float vf;
static inline vf vzero(void) { return 0.0f; }
static inline vf vload(const float *p) { return *p; }
static inline vf vload_tail(const float *p, int64_t n) { return n > 0 ? *p : 0.0f; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline float vsum(vf v) { return v; }
#endif

/* Up to GROUP_N weight rows (w, row stride K; `rows` of them) times every activation row, two
 * activation rows at a time: each weight vector loaded once feeds 2 x 4 accumulators. */
static void group(const float *w, int rows, int64_t K, const float *x, int64_t ldx, int64_t M,
                  float *y, int64_t ldy, const float *bias) {
    const float *w0 = w, *w1 = w + (rows > 1 ? K : 0), *w2 = w + (rows > 2 ? 2 * K : 0),
                *w3 = w + (rows > 3 ? 3 * K : 0);
    const int64_t kv = K - K % VW, tail = K - kv;
    float b[GROUP_N] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (bias) memcpy(b, bias, sizeof(float) * (size_t)rows);
    int64_t m = 0;
    for (; m + 1 < M; m += 2) {
        const float *p = x + m * ldx, *q = p + ldx;
        vf a0 = vzero(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
        for (int64_t k = 0; k <= K - VW; k += VW) {
            const vf v0 = vload(w0 + k), v1 = vload(w1 + k), v2 = vload(w2 + k), v3 = vload(w3 + k);
            const vf xp = vload(p + k), xq = vload(q + k);
            a0 = vfma(v0, xp, a0), a1 = vfma(v1, xp, a1), a2 = vfma(v2, xp, a2), a3 = vfma(v3, xp, a3);
            c0 = vfma(v0, xq, c0), c1 = vfma(v1, xq, c1), c2 = vfma(v2, xq, c2), c3 = vfma(v3, xq, c3);
        }
        if (tail) {
            const vf v0 = vload_tail(w0 + kv, tail), v1 = vload_tail(w1 + kv, tail),
                     v2 = vload_tail(w2 + kv, tail), v3 = vload_tail(w3 + kv, tail);
            const vf xp = vload_tail(p + kv, tail), xq = vload_tail(q + kv, tail);
            a0 = vfma(v0, xp, a0), a1 = vfma(v1, xp, a1), a2 = vfma(v2, xp, a2), a3 = vfma(v3, xp, a3);
            c0 = vfma(v0, xq, c0), c1 = vfma(v1, xq, c1), c2 = vfma(v2, xq, c2), c3 = vfma(v3, xq, c3);
        }
        const float r[2][GROUP_N] = {{vsum(a0), vsum(a1), vsum(a2), vsum(a3)},
                                     {vsum(c0), vsum(c1), vsum(c2), vsum(c3)}};
        for (int i = 0; i < rows; i++) {
            y[m * ldy + i] = r[0][i] + b[i];
            y[(m + 1) * ldy + i] = r[1][i] + b[i];
        }
    }
    if (m < M) { /* the last row of an odd M: the same sums as above, one row */
        const float *p = x + m * ldx;
        vf a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = 0; k <= K - VW; k += VW) {
            const vf xp = vload(p + k);
            a0 = vfma(vload(w0 + k), xp, a0), a1 = vfma(vload(w1 + k), xp, a1);
            a2 = vfma(vload(w2 + k), xp, a2), a3 = vfma(vload(w3 + k), xp, a3);
        }
        if (tail) {
            const vf xp = vload_tail(p + kv, tail);
            a0 = vfma(vload_tail(w0 + kv, tail), xp, a0), a1 = vfma(vload_tail(w1 + kv, tail), xp, a1);
            a2 = vfma(vload_tail(w2 + kv, tail), xp, a2), a3 = vfma(vload_tail(w3 + kv, tail), xp, a3);
        }
        const float r[GROUP_N] = {vsum(a0), vsum(a1), vsum(a2), vsum(a3)};
        for (int i = 0; i < rows; i++) y[m * ldy + i] = r[i] + b[i];
    }
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) W^T + bias, W [N, K] row-major float32,
 * bias [N] or NULL. Returns 0, or -1 for a shape it does not take. */
int32_t tl_f32_linear(const float *w, int64_t N, int64_t K, const float *x, int64_t ldx,
                      int64_t M, float *y, int64_t ldy, const float *bias) {
    if (N < 0 || K < 1 || M < 0 || ldx < K || ldy < N) return -1;
    const int64_t items = (N + ITEM_N - 1) / ITEM_N;
    tl_run runs[TL_STEAL_MAX_THREADS];
    #pragma omp parallel if (items > 1)
    {
        tl_items walk = tl_items_start(runs, items);
        for (int64_t it, nx; (it = tl_items_next(&walk, &nx)) >= 0;) {
            const int64_t n1 = (it + 1) * ITEM_N < N ? (it + 1) * ITEM_N : N;
            for (int64_t n0 = it * ITEM_N; n0 < n1; n0 += GROUP_N)
                group(w + n0 * K, (int)(n1 - n0 < GROUP_N ? n1 - n0 : GROUP_N), K, x, ldx, M,
                      y + n0, ldy, bias ? bias + n0 : NULL);
        }
    }
    return 0;
}
