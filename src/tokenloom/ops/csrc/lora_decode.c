/* LoRA adapters' products inside the fused decode step (decode_step.c): y[t] += (x[t] A^T) B_t
 * for each token t that runs with an adapter, on one of a layer's four projections.
 *
 * Why: a decode step with an adapter in it used to leave the one C call for the eager layers,
 * and at batch 1 that cost most of the step rate (benchmarks/lora.py),
 * while the adapter's own products are small (rank x (in + out) multiply-adds per token and
 * projection). Here they run between the step's kernels, in float32 activations.
 *
 * An adapter's projection (model/lora.py) stacks its parts' A matrices ([rank, K]) and places
 * their scaled, transposed B matrices block-diagonally in b_t ([rank, N]): part p's xa columns
 * r_start[p]..r_start[p+1] feed only its output columns n_start[p]..n_end[p]. Only those blocks
 * are read, so the zeros of the block-diagonal layout cost no memory traffic.
 *
 * Each output is summed in one fixed order (xa over K in order; then y plus the parts' rank
 * columns in order), whatever the batch or the thread count: a token's result does not depend on
 * the step it runs in. It is not the eager path's bit for bit (two MKL products there), only
 * equal to rounding (tests/model/test_fused_decode.py).
 */
#include <stdint.h>
#include <omp.h>

typedef struct {
    const float *a;   /* [rank, K] */
    const float *b_t; /* [rank, N], row stride N */
    int32_t rank;     /* 0: the adapter leaves this projection alone */
    int32_t num_parts;
    int32_t r_start[4];
    int32_t n_start[3], n_end[3];
} tl_lora_proj;

/* The step's adapters: adapters[i] is adapter i's table of [num_layers * 4] projections (qkv, o,
 * gate_up, down per layer); token_adapter[t] the index of token t's adapter, -1 for none. xa is
 * scratch for [T, max_rank] floats. */
typedef struct tl_lora {
    const tl_lora_proj *const *adapters;
    const int32_t *token_adapter;
    float *xa;
    int32_t max_rank;
    int32_t num_layers;
} tl_lora;

#define TL_LORA_COLS 64 /* output columns per work item of the B product */

static inline const tl_lora_proj *proj_of(const tl_lora *lo, int32_t t, int32_t layer,
                                          int32_t which) {
    const int32_t i = lo->token_adapter[t];
    if (i < 0) return 0;
    const tl_lora_proj *p = lo->adapters[i] + (int64_t)layer * 4 + which;
    return p->rank > 0 ? p : 0;
}

/* Whether any token of the step has an adapter on this projection. */
int32_t tl_lora_touches(const tl_lora *lo, int32_t layer, int32_t which, int32_t T) {
    if (!lo) return 0;
    for (int32_t t = 0; t < T; t++)
        if (proj_of(lo, t, layer, which)) return 1;
    return 0;
}

/* y[T, N] (row stride N) += the step's adapters' products of x[T, K] (row stride K) on projection
 * `which` (0 qkv, 1 o, 2 gate_up, 3 down) of `layer`. */
void tl_lora_add(const tl_lora *lo, int32_t layer, int32_t which, const float *x, int64_t K,
                 int32_t T, float *y, int64_t N) {
    if (!tl_lora_touches(lo, layer, which, T)) return;
    const int64_t R = lo->max_rank, items = (N + TL_LORA_COLS - 1) / TL_LORA_COLS;
    float *xa = lo->xa;
    /* one thread for a token's few products; both cores once the adapter's bytes are many */
    #pragma omp parallel if ((int64_t)T * R * (K + N) > 65536)
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < (int64_t)T * R; i++) {
            const int32_t t = (int32_t)(i / R), r = (int32_t)(i % R);
            const tl_lora_proj *p = proj_of(lo, t, layer, which);
            if (!p || r >= p->rank) continue;
            const float *xt = x + t * K, *ar = p->a + r * K;
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += xt[k] * ar[k];
            xa[i] = s;
        }
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t c0 = it * TL_LORA_COLS, c1 = c0 + TL_LORA_COLS < N ? c0 + TL_LORA_COLS : N;
            for (int32_t t = 0; t < T; t++) {
                const tl_lora_proj *p = proj_of(lo, t, layer, which);
                if (!p) continue;
                float *yt = y + t * N;
                const float *xat = xa + t * R;
                for (int32_t q = 0; q < p->num_parts; q++) {
                    const int64_t n0 = p->n_start[q] > c0 ? p->n_start[q] : c0;
                    const int64_t n1 = p->n_end[q] < c1 ? p->n_end[q] : c1;
                    for (int32_t r = p->r_start[q]; n0 < n1 && r < p->r_start[q + 1]; r++) {
                        const float s = xat[r], *b = p->b_t + r * N;
                        for (int64_t n = n0; n < n1; n++) yt[n] += s * b[n];
                    }
                }
            }
        }
    }
}
