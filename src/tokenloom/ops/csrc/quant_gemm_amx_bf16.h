/* Quantized matmuls on AMX-BF16 tiles (Sapphire Rapids and later), included by quant_gemm.c
 * after quant_gemm_amx.h (it uses load_codes512, params512, k_scales512 and amx_request).
 *
 * Why: the AMX int8 kernel (quant_gemm_amx.h) must scale every 32-block's int32 tile on its own
 * (the per-block scales differ), so each 16 x 16 block costs a tile store, a reload and ~6
 * vector instructions per row besides two half-used tile products: at 64 rows and more it ran
 * ~3x slower than the bf16 AMX matmul on the same shapes (benchmarks/README.md). Here the scales
 * go into the weight instead: each thread dequantizes a panel of 32 output columns x all of K,
 * w = d q + m in float32 rounded once to bfloat16, into the bf16 AMX B layout in its own buffer
 * (K x 64 bytes: 96 KiB at K = 1536, in L2; never resident: the weight stays in the GGUF's
 * bytes), and multiplies every activation row with it as amx_gemm.c does, the sums staying in
 * the tiles over all of K. The dequantization is paid once per panel per 256 rows, so it is
 * cheap from a few dozen rows on; below AMX_BF16_MIN_ROWS the integer kernels run.
 *
 * Numbers: the weights are the dequantized float32 values rounded to bfloat16 (what the float
 * path holds in bfloat16: torch rounds the same way, to nearest even), the activations are
 * rounded to bfloat16 on the way into the tiles (or are bfloat16 already), the sums are float32.
 * So the results are a bfloat16 matmul's, not the integer kernels' (benchmarks/README.md has the
 * quality figures).
 *
 * Layout of the panel: as amx_gemm.c's packed weight, per 16 columns and 32 k one 1 KiB tile,
 * row kk, lane n = (w[n][2kk], w[n][2kk + 1]). The tiled quantized layout's block is 8 groups of
 * 4 k x 16 columns, so group g gives tile rows 2g and 2g + 1.
 *
 * SiLU-and-mul in the epilogue (tl_q_linear_silu): an MLP's fused gate|up matmul wrote [M, 2I]
 * float32 (25 MB at a 2048-token prefill step of SmolLM2, beyond L2) for tl_silu_and_mul_f32 to
 * read back into [M, I]; 7 % of a batch-64 prefill went to that pass alone. Pairing gate tile j
 * with up tile j + I/16 in one panel puts silu(gate) and up of the same columns in one 32 x 32
 * block, so the epilogue writes the MLP's activation directly (the weight's layout unchanged). */
#ifdef TL_HAVE_AMX
#include <omp.h>
#include "amx_bf16_step.h" /* the K step of a 32 x 32 block, as amx_gemm.c */
#include "work_steal.h"
#define AMXB_TARGET __attribute__((target( \
    "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bf16,fma,f16c,amx-tile,amx-bf16")))
#define INLINE_AMXB static inline __attribute__((always_inline)) AMXB_TARGET

/* Rows from which the bf16 tiles run (where the CPU has them): below this the panel's
 * dequantization is spread over too few rows (figures in benchmarks/README.md). */
static int amx_bf16_min_rows = 16;
static int amx_bf16_state = 2; /* 1: usable, 0: no AMX-BF16 / AVX512-BF16 or refused, 2: not asked */

static int amx_bf16_usable(void) {
    if (amx_bf16_state == 2) {
        unsigned a, b, c, d, a1, b1, c1, d1;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        __asm__ volatile("cpuid" : "=a"(a1), "=b"(b1), "=c"(c1), "=d"(d1) : "a"(7), "c"(1));
        const int has = ((d >> 22) & 1) && ((d >> 24) & 1) && ((a1 >> 5) & 1) && /* AMX-BF16, TILE, AVX512-BF16 */
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni") &&
                        __builtin_cpu_supports("avx512vbmi");
        amx_bf16_state = has && tl_q_amx_status() == 1;
        const char *rows = getenv("TOKENLOOM_QUANT_BF16_ROWS"); /* the threshold; 0: off (A/B runs) */
        if (rows && *rows) amx_bf16_min_rows = atoi(rows);
    }
    return amx_bf16_state;
}

/* Rows from which tl_q_linear (float32 activations) uses the bf16 tiles; 0 turns them off.
 * Returns the previous value. For tests and A/B measurements (ops/quant.set_amx_bf16_rows). */
int32_t tl_q_isa(int32_t fmt);
int32_t tl_q_set_amx_bf16_rows(int32_t rows) {
    const int32_t old = tl_q_isa(TL_Q8) == 4 ? amx_bf16_min_rows : 0;
    amx_bf16_min_rows = rows;
    return old;
}

AMXB_TARGET static void amxb_configure(void) {
    struct amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

/* One 32-block of a 16-column tile (codes w8, per-column d and m for k < 16 and k >= 16) ->
 * its 1 KiB bf16 B tile at out.
 *
 * Tile row 2g + p holds k = 4g + 2p and 4g + 2p + 1 of the 16 columns as (even, odd) word pairs:
 * words 0-15 are columns 0-7, words 16-31 columns 8-15. So each half is one float32 vector whose
 * lane i is column (i >> 1) (+ 8) at k = 4g + 2p + (i & 1), and one vpermb gathers its 16 codes
 * (zeroing the dwords' upper bytes) straight from the group vector, where column n's k = 4g .. 4g
 * + 3 are bytes 4n .. 4n + 3; d and m are permuted to match once per block. Then cvtne2ps packs
 * the two halves into the row as it stands: no shift-and-mask per byte and no word permute after
 * the conversion, ~22 % fewer vector instructions per block than those took, the same values. */
INLINE_AMXB void amxb_dequant_block(const __m512i w8[8], const __m512 d[2], const __m512 m[2],
                                    uint16_t *out) {
    /* vpermb indices: lane i's byte 0 <- byte 4 (i >> 1) + (i & 1) (+ 32 for columns 8-15,
     * + 2 for the row's second pair of k) */
    const __m512i idx_lo = _mm512_set_epi32(29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
    const __m512i idx_hi = _mm512_add_epi32(idx_lo, _mm512_set1_epi32(32)), two = _mm512_set1_epi32(2);
    const __mmask64 byte0 = 0x1111111111111111ULL;
    const __m512i cols_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i cols_hi = _mm512_add_epi32(cols_lo, _mm512_set1_epi32(8));
    __m512 dl[2], dh[2], ml[2], mh[2];
    for (int h = 0; h < 2; h++) {
        dl[h] = _mm512_permutexvar_ps(cols_lo, d[h]);
        dh[h] = _mm512_permutexvar_ps(cols_hi, d[h]);
        ml[h] = _mm512_permutexvar_ps(cols_lo, m[h]);
        mh[h] = _mm512_permutexvar_ps(cols_hi, m[h]);
    }
    for (int g = 0; g < 8; g++) {
        const int h = g >= 4; /* k = 4g + b: the block's second 16 weights from group 4 */
        for (int p = 0; p < 2; p++) {
            const __m512i il = p ? _mm512_add_epi32(idx_lo, two) : idx_lo;
            const __m512i ih = p ? _mm512_add_epi32(idx_hi, two) : idx_hi;
            const __m512 lo = _mm512_fmadd_ps(
                dl[h], _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(byte0, il, w8[g])), ml[h]);
            const __m512 hi = _mm512_fmadd_ps(
                dh[h], _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(byte0, ih, w8[g])), mh[h]);
            _mm512_store_si512((void *)(out + (2 * g + p) * 32), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* All nb blocks of one 16-column tile of the tiled weight -> bf16 B tiles [nb][512] at out;
 * tile == NULL (the second tile of a pair past N) gives zeros. */
INLINE_AMXB void amxb_dequant_tile(const int FMT, const uint8_t *tile, int64_t nb, uint16_t *out) {
    if (!tile) {
        memset(out, 0, (size_t)nb * 1024);
        return;
    }
    const int ub = UB(FMT), cb = CB(FMT), unit = UNIT_BYTES(FMT);
    uint8_t kbytes[256] __attribute__((aligned(64)));
    __m512 kd = _mm512_setzero_ps(), kdmin = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        const int s = (int)(j % ub);
        const uint8_t *u = tile + (j / ub) * unit, *p = u + ub * cb;
        __m512i w8[8];
        load_codes512(u + s * cb, FMT, w8);
        __m512 d[2], m[2];
        if (FMT == TL_Q4_K || FMT == TL_Q5_K) {
            if (s == 0) {
                k_scales512(p, kbytes);
                kd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
                kdmin = _mm512_sub_ps(_mm512_setzero_ps(),
                                      _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32))));
            }
            d[0] = d[1] = _mm512_mul_ps(kd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(kbytes + 16 * s)))));
            m[0] = m[1] = _mm512_mul_ps(kdmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(kbytes + 128 + 16 * s)))));
        } else {
            params512(p, FMT, s, d, m);
        }
        amxb_dequant_block(w8, d, m, out + j * 512);
    }
}

typedef void (*amxb_dequant_fn)(const uint8_t *, int64_t, uint16_t *);
#define DEFINE_AMXB(FMT) \
AMXB_TARGET static void amxb_dq_##FMT(const uint8_t *tile, int64_t nb, uint16_t *out) { \
    amxb_dequant_tile(FMT, tile, nb, out);                                                \
}
TL_EACH_FORMAT(DEFINE_AMXB)
#define AMXB_NAME(FMT) amxb_dq_##FMT,
static const amxb_dequant_fn AMXB_DEQUANT[TL_NFMT] = {TL_EACH_FORMAT(AMXB_NAME)};

/* A thread's panel: two column tiles' bf16 B tiles for all of K (K x 64 bytes). */
static uint16_t *amxb_panel(int64_t K) { return (uint16_t *)thread_panel(K * 64); }

/* A 32 x 32 float32 block (+ bias; c2: the earlier K chunks' sum, added first) -> rows x cols
 * of y, float32 or rounded to bfloat16 (nearest even). */
INLINE_AMXB void amxb_store(const float *c, const float *c2, int rows, int cols, const float *bias,
                            void *y, int64_t ldy, int y_bf16, int stream) {
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias && m1 ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    const int64_t es = y_bf16 ? 2 : 4;
    /* whole 64-byte lines per row: written around the caches (see the caller) */
    const int lines = stream && cols == 32 && !((uintptr_t)y & 63) && !((ldy * es) & 63);
    for (int r = 0; r < rows; r++) {
        __m512 s0 = _mm512_load_ps(c + r * 32), s1 = _mm512_load_ps(c + r * 32 + 16);
        if (c2) {
            s0 = _mm512_add_ps(_mm512_load_ps(c2 + r * 32), s0);
            s1 = _mm512_add_ps(_mm512_load_ps(c2 + r * 32 + 16), s1);
        }
        s0 = _mm512_add_ps(s0, b0);
        s1 = _mm512_add_ps(s1, b1);
        if (lines && y_bf16) {
            _mm512_stream_si512((void *)((uint16_t *)y + r * ldy), (__m512i)_mm512_cvtne2ps_pbh(s1, s0));
        } else if (lines) {
            _mm512_stream_ps((float *)y + r * ldy, s0);
            _mm512_stream_ps((float *)y + r * ldy + 16, s1);
        } else if (y_bf16) {
            uint16_t *out = (uint16_t *)y + r * ldy;
            _mm256_mask_storeu_epi16(out, m0, (__m256i)_mm512_cvtneps_pbh(s0));
            if (m1) _mm256_mask_storeu_epi16(out + 16, m1, (__m256i)_mm512_cvtneps_pbh(s1));
        } else {
            float *out = (float *)y + r * ldy;
            _mm512_mask_storeu_ps(out, m0, s0);
            if (m1) _mm512_mask_storeu_ps(out + 16, m1, s1);
        }
    }
}

#if TL_HAVE_AVX512
/* The glu epilogue: a 32 x 32 block whose columns 0-15 are gate columns and 16-31 the up columns
 * of the same index (+ their bias) -> rows x 16 float32 of silu(gate) * up. The sums are formed
 * as amxb_store forms them (c2 first, then the bias, a zero vector for none) and the product is
 * tl_silu_and_mul_f32's own routine, so the output is the two-pass path's bit for bit. */
INLINE_AMXB void amxb_store_glu(const float *c, const float *c2, int rows, const float *bias_g,
                                const float *bias_u, float *y, int64_t ldy, int stream) {
    const __m512 bg = bias_g ? _mm512_loadu_ps(bias_g) : _mm512_setzero_ps();
    const __m512 bu = bias_u ? _mm512_loadu_ps(bias_u) : _mm512_setzero_ps();
    const int lines = stream && !((uintptr_t)y & 63) && !((ldy * 4) & 63);
    for (int r = 0; r < rows; r++) {
        __m512 g = _mm512_load_ps(c + r * 32), u = _mm512_load_ps(c + r * 32 + 16);
        if (c2) {
            g = _mm512_add_ps(_mm512_load_ps(c2 + r * 32), g);
            u = _mm512_add_ps(_mm512_load_ps(c2 + r * 32 + 16), u);
        }
        const __m512 v = tl_silu_mul16(_mm512_add_ps(g, bg), _mm512_add_ps(u, bu));
        if (lines) _mm512_stream_ps(y + r * ldy, v);
        else _mm512_storeu_ps(y + r * ldy, v);
    }
}
#endif

/* Bytes of scratch for M rows of K (the activations in tile order, bfloat16). */
int64_t tl_q_amx_bf16_scratch_bytes(int64_t M, int64_t K) {
    return ((M + 31) & ~(int64_t)31) * K * 2 + 64;
}

/* The matmul on bf16 tiles below both entries. glu = 0: y[M, N] = x W^T (+ bias), panel np
 * the column tiles 2np and 2np + 1. glu = 1 (N = 2I, I a multiple of 16: a fused gate|up weight,
 * the gate's rows then the up's): panel j pairs gate tile j with up tile j + I/16, and the
 * epilogue writes y[M, I] = silu(gate) * up (float32), so the [M, 2I] product never reaches
 * memory and no second pass reads it back. */
AMXB_TARGET static int32_t amxb_linear(int32_t fmt, const uint8_t *w, int64_t N, int64_t K,
                                       const void *x, int32_t x_bf16, int64_t ldx, int64_t M,
                                       void *y, int32_t y_bf16, int64_t ldy, const float *bias,
                                       void *scratch, int64_t kchunk, int glu) {
    if (!amx_bf16_usable() || fmt < 0 || fmt >= TL_NFMT || K % (QK * UB(fmt)) != 0 || N <= 0)
        return -1;
    if (M <= 0) return 0;
    const int64_t nkb = K / QK, Mp = (M + 31) & ~(int64_t)31, ntiles = (N + TILE_N - 1) / TILE_N;
    const int64_t half = glu ? ntiles / 2 : 0; /* glu: the up tiles' offset */
    const int64_t npairs = glu ? half : (ntiles + 1) / 2, tile_bytes = nkb / UB(fmt) * UNIT_BYTES(fmt);
    const amxb_dequant_fn dequant = AMXB_DEQUANT[fmt];
    uint16_t *a = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    /* The activations in tile order, bfloat16, zero-padded: [Mp/16][K/32] tiles of 16 rows x 32 k. */
    #pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < Mp; m++) {
        uint16_t *dst = a + (m / 16) * nkb * 512 + (m % 16) * 32;
        for (int64_t kb = 0; kb < nkb; kb++, dst += 512) {
            if (m >= M) {
                memset(dst, 0, 64);
            } else if (x_bf16) {
                memcpy(dst, (const uint16_t *)x + m * ldx + kb * 32, 64);
            } else {
                const float *xr = (const float *)x + m * ldx + kb * 32;
                _mm512_store_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(
                    _mm512_loadu_ps(xr + 16), _mm512_loadu_ps(xr)));
            }
        }
    }
    /* Rows per pass over the weight: as many as keep their activations within ~1 MiB of L2
     * (at least 256), since each pass dequantizes every panel again (~20 ms for SmolLM2's 30
     * layers on one thread): 896 rows at K = 576, 320 at K = 1536. */
    const int64_t mpairs = Mp / 32, fit = ((int64_t)1 << 20) / (K * 2 * 32);
    const int64_t block = fit > 8 ? fit : 8;
    const int64_t kbchunk = kchunk > 0 && kchunk < K && kchunk % 32 == 0 ? kchunk / 32 : nkb;
    const int64_t es = y_bf16 ? 2 : 4;
    /* Outputs larger than L2 (prefills) leave it before their reader gets to them: streaming
     * stores write their lines without fetching them first (as amx_gemm.c, 1.2-1.3x there). */
    const int stream = M * (glu ? N / 2 : N) * es >= ((int64_t)4 << 20);
    int failed = 0;
    tl_run runs[TL_STEAL_MAX_THREADS];
    #pragma omp parallel
    {
        uint16_t *panel = amxb_panel(K);
        if (!panel) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        if (!failed) {
            amxb_configure();
            float c[32 * 32] __attribute__((aligned(64)));
            float c2[32 * 32] __attribute__((aligned(64)));
            /* Items (row block, panel pair), row block major: a contiguous run per thread, the
             * rest taken over from the back of a slower thread's run (work_steal.h). */
            const int64_t items = (mpairs + block - 1) / block * npairs;
            tl_items walk = tl_items_start(runs, items);
            for (int64_t it, nx; (it = tl_items_next(&walk, &nx)) >= 0;) {
                const int64_t np = it % npairs, mstart = it / npairs * block;
                const int64_t mcount = mpairs - mstart < block ? mpairs - mstart : block;
                const uint16_t *b0 = panel, *b1 = panel + nkb * 512;
                const int64_t t0 = glu ? np : 2 * np, t1 = glu ? np + half : 2 * np + 1;
                dequant(w + t0 * tile_bytes, nkb, panel);
                dequant(t1 < ntiles ? w + t1 * tile_bytes : NULL, nkb, panel + nkb * 512);
                /* The quantized bytes of the panel this thread most likely takes next are
                 * prefetched a few lines per K step of this panel's products: without it
                 * the dequantization waited on memory (~30 % of its samples on its loads at
                 * 64 rows). */
                const int64_t nnp = nx >= 0 ? nx % npairs : -1;
                const int64_t u0 = glu ? nnp : 2 * nnp, u1 = glu ? nnp + half : 2 * nnp + 1;
                const char *pf = nnp >= 0 && nnp != np ? (const char *)(w + u0 * tile_bytes) : NULL;
                const char *pf_end = pf ? pf + tile_bytes : NULL;
                const char *pf2 = pf && u1 < ntiles ? (const char *)(w + u1 * tile_bytes) : NULL;
                const int64_t pf_bytes = (pf2 ? 2 : 1) * tile_bytes;
                const int64_t pf_per = pf ? ((pf_bytes + 63) / 64 + mcount * nkb - 1) / (mcount * nkb) * 64 : 0;
                for (int64_t mi = 0; mi < mcount; mi++) {
                    const int64_t mp = mstart + mi;
                    const uint16_t *a0 = a + 2 * mp * nkb * 512, *a1 = a0 + nkb * 512;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t kb = 0, kflush = kbchunk; kb < nkb; kb++) {
                        for (int64_t i = 0; i < pf_per && pf < pf_end; i += 64) {
                            _mm_prefetch(pf, _MM_HINT_T0);
                            if ((pf += 64) >= pf_end && pf2) { /* on to the second tile */
                                pf = pf2;
                                pf_end = pf2 + tile_bytes;
                                pf2 = NULL;
                            }
                        }
                        amx_bf16_k_step(kb, &kflush, kbchunk, a0, a1, b0, b1, c, c2);
                    }
                    amx_bf16_store_sums(c);
                    const int64_t m0 = mp * 32, n0 = np * 32;
                    const int rows = (int)(M - m0 < 32 ? M - m0 : 32);
#if TL_HAVE_AVX512
                    if (glu) {
                        amxb_store_glu(c, kbchunk < nkb ? c2 : NULL, rows,
                                       bias ? bias + 16 * np : NULL,
                                       bias ? bias + 16 * (np + half) : NULL,
                                       (float *)y + m0 * ldy + 16 * np, ldy, stream);
                        continue;
                    }
#endif
                    const int cols = (int)(N - n0 < 32 ? N - n0 : 32);
                    amxb_store(c, kbchunk < nkb ? c2 : NULL, rows, cols, bias ? bias + n0 : NULL,
                               (char *)y + (m0 * ldy + n0) * es, ldy, y_bf16, stream);
                }
            }
            if (stream) _mm_sfence(); /* streamed lines visible before the region's barrier */
            _tile_release();
        }
    }
    return failed ? -1 : 0;
}

/* y[M, N] = x[M, K] W^T (+ bias) with W tiled quantized (fmt), on bf16 tiles: x float32 (x_bf16
 * = 0) or bfloat16, y float32 (y_bf16 = 0) or bfloat16. kchunk: 0, or sum K in chunks of this
 * many (a multiple of 32 below K), each from zero, added in order (as amx_gemm.c, so that a
 * bf16 model's matmuls can round as oneDNN's). Returns 0, or -1 where this CPU or process has
 * no AMX-BF16 or the arguments are bad. */
AMXB_TARGET int32_t tl_q_linear_amx_bf16(int32_t fmt, const uint8_t *w, int64_t N, int64_t K,
                                         const void *x, int32_t x_bf16, int64_t ldx, int64_t M,
                                         void *y, int32_t y_bf16, int64_t ldy, const float *bias,
                                         void *scratch, int64_t kchunk) {
    return amxb_linear(fmt, w, N, K, x, x_bf16, ldx, M, y, y_bf16, ldy, bias, scratch, kchunk, 0);
}
#endif

/* 0: tl_q_linear_silu declines every call (the two-pass MLP, for A/B runs and tests). */
static int silu_epilogue = 1;

/* Rows from which tl_q_linear_silu computes for format fmt here; 0 where it never does (no
 * AMX-BF16 or no AVX-512 build, the tiles or the epilogue turned off). */
int32_t tl_q_silu_rows(int32_t fmt) {
#if defined(TL_HAVE_AMX) && TL_HAVE_AVX512
    return silu_epilogue && fmt >= 0 && fmt < TL_NFMT && tl_q_isa(fmt) == 4 ? amx_bf16_min_rows : 0;
#else
    (void)fmt;
    return 0;
#endif
}

/* Turns the SiLU epilogue on (1) or off (0); returns the previous setting. */
int32_t tl_q_set_silu_epilogue(int32_t on) {
    const int32_t old = silu_epilogue;
    silu_epilogue = on != 0;
    return old;
}

/* y[M, N/2] = silu(g) * u with [g | u] = x[M, K] W^T (+ bias), W a fused gate|up weight (N/2 gate
 * rows, then N/2 up rows; tiled quantized, fmt), x and y float32 (row strides ldx, ldy), scratch
 * as tl_q_linear's: the MLP's first half in one pass on the bf16 tiles, bit for bit
 * tl_silu_and_mul_f32 of tl_q_linear's output. Returns 0; 1 where it does not apply and nothing
 * was written (M below tl_q_silu_rows(fmt), or that is 0; N/2 not a multiple of 16): the caller
 * runs the two passes; -1 for bad arguments, -2 where the panel buffer could not be allocated. */
int32_t tl_q_linear_silu(int32_t fmt, const uint8_t *w, int64_t N, int64_t K, const float *x,
                         int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias,
                         void *scratch) {
    if (fmt < 0 || fmt >= TL_NFMT || K % (QK * UB(fmt)) != 0 || N <= 0 || M < 0) return -1;
    const int32_t rows = tl_q_silu_rows(fmt);
    if (N % 32 || rows <= 0 || M < rows) return 1;
#if defined(TL_HAVE_AMX) && TL_HAVE_AVX512
    return amxb_linear(fmt, w, N, K, x, 0, ldx, M, y, 0, ldy, bias, scratch, 0, 1) ? -2 : 0;
#else
    (void)w; (void)x; (void)ldx; (void)y; (void)ldy; (void)bias; (void)scratch;
    return 1;
#endif
}
