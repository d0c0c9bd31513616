/* Quantized matmuls of many rows on AVX2 CPUs (no AVX-512) on float32 panels dequantized per
 * thread, included by quant_gemm.c after quant_gemm_avx2.h (it uses load_codes256 and params256).
 *
 * Why: the integer kernel (quant_gemm_avx2.h) multiplies two int8 activation planes with
 * VPMADDUBSW and scales every 32-block's sums on its own: from a dozen rows on it ran slower than
 * the float path's panel matmul (csrc/f32_panel.c) on the dequantized weight (benchmarks/
 * README.md, "Float32 panels from 16 rows on AVX2"). So from
 * f32p_min_rows rows each thread dequantizes a 16-column tile of the weight, w = d q + m in
 * float32, into f32_panel.c's panel layout in its own buffer (K x 64 bytes: 96 KiB at K = 1536,
 * in L2; never resident: the weight stays in the GGUF's bytes) and multiplies a block of
 * activation rows with it by f32_panel.c's products. The dequantization is paid once per tile
 * per row block, a few percent of the products from a few dozen rows on.
 *
 * Numbers: the weights are the dequantized values (one rounding of d q + m, as the float path's
 * dequantization up to that rounding), the activations are not quantized, the sums are float32:
 * a float32 matmul's results, closer to the float path than the integer kernels' (which stay
 * below the threshold, so a row's result depends on how many rows its step has, as on the
 * AMX-BF16 tiles). */
#include "work_steal.h"

int32_t tl_q_isa(int32_t fmt);

/* Rows from which tl_q_linear runs this path where the kernel level is AVX2 (0: never). */
static int f32p_min_rows = 16;
static int f32p_env_read = 0;

static int f32p_rows(void) {
    if (!f32p_env_read) {
        f32p_env_read = 1;
        const char *rows = getenv("TOKENLOOM_QUANT_F32_ROWS"); /* the threshold; 0: off (A/B runs) */
        if (rows && *rows) f32p_min_rows = atoi(rows);
    }
    return f32p_min_rows;
}

/* Sets the threshold (0: off; it applies where the level is AVX2) and returns the previous one.
 * For tests and A/B measurements (ops/quant.set_f32_panel_rows). */
int32_t tl_q_set_f32_panel_rows(int32_t rows) {
    const int32_t old = f32p_rows();
    f32p_min_rows = rows;
    return old;
}

/* Rows from which tl_q_linear takes `fmt` through this path here (0: never). */
int32_t tl_q_f32_panel_rows(int32_t fmt) { return tl_q_isa(fmt) == 1 ? f32p_rows() : 0; }

void tl_f32_panel_block(const float *panel, int64_t K, const float *x, int64_t ldx, int64_t rows,
                        float *y, int64_t ldy, int ncols);

/* All nb blocks of one 16-column tile of the tiled weight -> panel[k][16], float32. */
INLINE2 void f32p_dequant_tile(const int FMT, const uint8_t *tile, int64_t nb, float *panel) {
    const int ub = UB(FMT), cb = CB(FMT), unit = UNIT_BYTES(FMT);
    const __m256i byte = _mm256_set1_epi32(0xff);
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *u = tile + (j / ub) * unit;
        for (int h = 0; h < 2; h++) { /* columns 8h .. 8h + 7 */
            __m256i w[8];
            load_codes256(u + (j % ub) * cb, FMT, h, w);
            __m256 d[2], m[2];
            params256(u + ub * cb, FMT, (int)(j % ub), h, d, m);
            for (int g = 0; g < 8; g++) { /* lane n's byte b: column 8h + n, k = 4g + b */
                const int half = g >= 4;
                for (int b = 0; b < 4; b++) {
                    const __m256i q = FMT == TL_Q8 /* signed codes */
                        ? _mm256_srai_epi32(_mm256_slli_epi32(w[g], 24 - 8 * b), 24)
                        : _mm256_and_si256(_mm256_srli_epi32(w[g], 8 * b), byte);
                    _mm256_store_ps(panel + (j * QK + 4 * g + b) * TILE_N + 8 * h,
                                    _mm256_fmadd_ps(d[half], _mm256_cvtepi32_ps(q), m[half]));
                }
            }
        }
    }
}

typedef void (*f32p_dequant_fn)(const uint8_t *, int64_t, float *);
#define DEFINE_F32P(FMT) \
AVX2_TARGET static void f32p_dq_##FMT(const uint8_t *tile, int64_t nb, float *panel) { \
    f32p_dequant_tile(FMT, tile, nb, panel);                                          \
}
TL_EACH_FORMAT(DEFINE_F32P)
#define F32P_NAME(FMT) f32p_dq_##FMT,
static const f32p_dequant_fn F32P_DEQUANT[TL_NFMT] = {TL_EACH_FORMAT(F32P_NAME)};


/* tl_q_linear's arguments; returns -1 (nothing written) where a thread has no panel buffer. */
static int32_t f32p_linear(int32_t fmt, const uint8_t *w, int64_t N, int64_t K, const float *x,
                           int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias) {
    const int64_t nb = K / QK, ntiles = (N + TILE_N - 1) / TILE_N;
    const int64_t tile_bytes = nb / UB(fmt) * UNIT_BYTES(fmt);
    /* Rows per pass over the weight: a block's activations within ~512 KiB (L2) while the
     * thread's tiles stream past, at least 96 rows (each pass dequantizes every tile again). */
    const int64_t fit = ((int64_t)512 << 10) / (K * (int64_t)sizeof(float));
    const int64_t mb = fit > 96 ? fit : 96, mblocks = (M + mb - 1) / mb, items = mblocks * ntiles;
    const f32p_dequant_fn dequant = F32P_DEQUANT[fmt];
    int failed = 0;
    tl_run runs[TL_STEAL_MAX_THREADS];
    #pragma omp parallel
    {
        float *panel = (float *)thread_panel(K * TILE_N * (int64_t)sizeof(float));
        if (!panel) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        if (!failed) {
            /* Items (row block, tile), tiles fastest: a thread's run is consecutive tiles of a
             * row block, each dequantized once for it. */
            tl_items walk = tl_items_start(runs, items);
            for (int64_t it, nx; (it = tl_items_next(&walk, &nx)) >= 0;) {
                const int64_t t = it % ntiles, m0 = it / ntiles * mb;
                const int64_t rows = M - m0 < mb ? M - m0 : mb;
                const int ncols = (int)(N - t * TILE_N < TILE_N ? N - t * TILE_N : TILE_N);
                float *yt = y + m0 * ldy + t * TILE_N;
                dequant(w + t * tile_bytes, nb, panel);
                tl_f32_panel_block(panel, K, x + m0 * ldx, ldx, rows, yt, ldy, ncols);
                if (bias) add_bias(yt, ldy, rows, ncols, bias + t * TILE_N);
            }
        }
    }
    return failed ? -1 : 0;
}
