/* A candidate float32 matmul for the float path on AVX2 CPUs, measured by benchmarks/panel_gemm.py
 * (not part of the package yet): y[M, N] = x[M, K] W^T + bias, W repacked once into panels of 16
 * output columns, K-major: P[p][k][j] = W[16 p + j][k] (zeros past N).
 *
 * Why: one copy of each weight that serves every row count. Today the AVX2 runner keeps two (the
 * plain row-major weight for the C GEMV below 16 rows and MKL from 512, oneDNN's packed copy in
 * between: +540 MB for SmolLM2). A panel is one contiguous stream per thread (the GEMV reads four
 * row streams at once, which the prefetchers follow worse), and a 6 x 16 register tile does 12
 * FMAs per two weight vector loads and six broadcast activations.
 *
 * Each output is summed the same way whatever M or the thread count: k in order within chunks of
 * KC, the chunks' sums added in order, then the bias.
 *
 * The tile writes to a local 6 x 16 block and a separate epilogue copies or adds the valid part:
 * with the copy's row and column counts inside the tile function, gcc 12 compiled the whole tile
 * far slower (benchmarks/README.md, "Next: a panel-packed float32 matmul"). */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include <immintrin.h>

#define NR 16  /* output columns per panel: two AVX2 vectors */
#define MR 6   /* activation rows per tile: 12 accumulators */
#define KC 256 /* K chunk: a panel's chunk (16 KB) stays in L1 for every row tile */
#define MB 96  /* activation rows per work item (a multiple of MR) */

void tl_panel_pack(const float *w, int64_t N, int64_t K, float *out) {
    for (int64_t p = 0; p < (N + NR - 1) / NR; p++)
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < NR; j++) {
                const int64_t n = p * NR + j;
                out[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

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

/* rows [0, mr) x columns [0, ncols) of y: the chunk's sums, stored (first chunk) or added */
static void tile_any(int mr, const float *pw, int64_t kc, const float *x, int64_t ldx, float *y,
                     int64_t ldy, int first, int ncols) {
    float c[MR * NR] __attribute__((aligned(64)));
    switch (mr) {
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

/* Work items: (row block of MB, panel), panels fastest, so a thread's next item reuses the
 * activations in L2; split statically (work_steal.h would take over from a slow thread). */
void tl_panel_linear(const float *pw, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                     const float *bias) {
    const int64_t np = (N + NR - 1) / NR, items = np * ((M + MB - 1) / MB);
    #pragma omp parallel for schedule(static) if (items > 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t p = it % np, m0 = it / np * MB, m1 = m0 + MB < M ? m0 + MB : M;
        const int ncols = (int)(N - p * NR < NR ? N - p * NR : NR);
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = K - k0 < KC ? K - k0 : KC;
            for (int64_t m = m0; m < m1; m += MR)
                tile_any((int)(m1 - m < MR ? m1 - m : MR), pw + (p * K + k0) * NR, kc,
                         x + m * K + k0, K, y + m * N + p * NR, N, k0 == 0, ncols);
        }
        if (bias)
            for (int64_t m = m0; m < m1; m++)
                for (int j = 0; j < ncols; j++) y[m * N + p * NR + j] += bias[p * NR + j];
    }
}
