/* float32 matmul on a panel-packed weight: y[M, N] (row stride ldy) = x[M, K] (row stride ldx)
 * W^T + bias, for every row count, W packed once into panels of NR = 16 output columns, K-major:
 * P[p][k][j] = W[16 p + j][k], zeros past N (ops/cpu_kernels.f32_panel_pack).
 *
 * Why: on AVX2 CPUs the float path kept two copies of every weight, the plain row-major one (the
 * C GEMV of f32_gemv.c below 16 rows, MKL for prefill) and oneDNN's packed one (16-511 rows).
 * This layout serves every row count from one copy, faster than either at decode sizes: a
 * thread reads its panels as one contiguous stream (the GEMV's four row streams are harder on
 * the prefetchers), and a 6 x 16 register tile does 12 FMAs per two weight vector loads and six
 * broadcast activations (benchmarks/panel_gemm.py).
 *
 * Each output is summed the same way whatever M, the tile a row falls in or the thread that
 * computes it: k in order within chunks of KC (one FMA chain per output), the chunks' sums added
 * in order, then the bias. So a row's result does not depend on its batch, and the fused decode
 * step (decode_step.c) and the eager layers agree bit for bit.
 *
 * The tile writes a full local block and a separate epilogue stores or adds its valid rows and
 * columns: with those counts inside the tile function gcc 12 compiled the tile far slower.
 *
 * Work items are (row block of MB, panel), panels fastest so that a thread's next item reuses the
 * activations in L2; taken over from a slower thread's run at the end (work_steal.h). */
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "vec_math.h"
#include "work_steal.h"

#define NR 16  /* output columns per panel */
#define MR 6   /* activation rows per tile */
#define KC 256 /* K chunk: a panel's chunk (16 KB) stays in L1 across the row tiles */
#define MB 96  /* activation rows per work item (a multiple of MR) */

#if TL_HAVE_AVX2
#include <immintrin.h>
static inline __attribute__((always_inline)) void tile(int mr, const float *pw, int64_t kc,
                                                       const float *x, int64_t ldx, float *c) {
    __m256 a[MR][2];
    for (int i = 0; i < mr; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_loadu_ps(pw + k * NR), w1 = _mm256_loadu_ps(pw + k * NR + 8);
        for (int i = 0; i < mr; i++) {
            const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
            a[i][0] = _mm256_fmadd_ps(xv, w0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(xv, w1, a[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(c + i * NR, a[i][0]);
        _mm256_storeu_ps(c + i * NR + 8, a[i][1]);
    }
}
#else
/* The same sums one lane at a time: each output one FMA chain over k. */
static inline void tile(int mr, const float *pw, int64_t kc, const float *x, int64_t ldx, float *c) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) {
            float s = 0.0f;
            for (int64_t k = 0; k < kc; k++) s = __builtin_fmaf(x[i * ldx + k], pw[k * NR + j], s);
            c[i * NR + j] = s;
        }
}
#endif

/* rows [0, mr) x columns [0, ncols) of y: the chunk's sums, stored (first chunk) or added */
static void tile_rows(int mr, const float *pw, int64_t kc, const float *x, int64_t ldx, float *y,
                      int64_t ldy, int first, int ncols) {
    float c[MR * NR] __attribute__((aligned(64)));
    switch (mr) { /* constant row counts: the accumulators stay in registers */
    case 6: tile(6, pw, kc, x, ldx, c); break;
    case 5: tile(5, pw, kc, x, ldx, c); break;
    case 4: tile(4, pw, kc, x, ldx, c); break;
    case 3: tile(3, pw, kc, x, ldx, c); break;
    case 2: tile(2, pw, kc, x, ldx, c); break;
    default: tile(1, pw, kc, x, ldx, c); break;
    }
    for (int i = 0; i < mr; i++) {
        float *yr = y + i * ldy;
        if (first) memcpy(yr, c + i * NR, sizeof(float) * (size_t)ncols);
        else for (int j = 0; j < ncols; j++) yr[j] += c[i * NR + j];
    }
}

/* rows x ncols of y (row stride ldy) = x[rows, K] (row stride ldx) times one panel (K x NR, the
 * layout above), all of K: a work item's products, for the matmul below and for
 * quant_gemm_f32panel.inc, which multiplies panels it dequantized from a GGUF's blocks. */
void tl_f32_panel_block(const float *panel, int64_t K, const float *x, int64_t ldx, int64_t rows,
                        float *y, int64_t ldy, int ncols) {
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        for (int64_t m = 0; m < rows; m += MR)
            tile_rows((int)(rows - m < MR ? rows - m : MR), panel + k0 * NR, kc, x + m * ldx + k0,
                      ldx, y + m * ldy, ldy, k0 == 0, ncols);
    }
}

/* Returns 0, or -1 for a shape it does not take. */
int32_t tl_f32_panel_linear(const float *pw, int64_t N, int64_t K, const float *x, int64_t ldx,
                            int64_t M, float *y, int64_t ldy, const float *bias) {
    if (N < 1 || K < 1 || M < 0 || ldx < K || ldy < N) return -1;
    const int64_t np = (N + NR - 1) / NR, items = np * ((M + MB - 1) / MB);
    tl_run runs[TL_STEAL_MAX_THREADS];
    #pragma omp parallel if (items > 1)
    {
        tl_items walk = tl_items_start(runs, items);
        for (int64_t it, nx; (it = tl_items_next(&walk, &nx)) >= 0;) {
            const int64_t p = it % np, m0 = it / np * MB, m1 = m0 + MB < M ? m0 + MB : M;
            const int ncols = (int)(N - p * NR < NR ? N - p * NR : NR);
            tl_f32_panel_block(pw + p * K * NR, K, x + m0 * ldx, ldx, m1 - m0, y + m0 * ldy + p * NR,
                               ldy, ncols);
            if (bias)
                for (int64_t m = m0; m < m1; m++)
                    for (int j = 0; j < ncols; j++) y[m * ldy + p * NR + j] += bias[p * NR + j];
        }
    }
    return 0;
}
