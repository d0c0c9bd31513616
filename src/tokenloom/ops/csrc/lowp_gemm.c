/* Matmuls on 1- and 2-byte float weights (FP8 e4m3 with float32 scales, bfloat16) with float32
 * activations and outputs, the weight read in its stored width and widened in registers.
 *
 * Why: an FP8 checkpoint dequantized at load holds 2 (bf16) or 4 (float32) bytes per weight,
 * and a decode step streams every weight once, so it reads two to four times the file's bytes;
 * a bfloat16 LM head left in float by a quantizer (int4/int8 checkpoints) held as float32 reads
 * twice its bytes. Here the weight stays as stored, and each element is widened to float32 in a
 * register and multiplied there: at decode sizes the matmul moves the stored bytes once.
 *
 * Layout (written by ops/lowp.py): amx_gemm.c's packed bf16 layout, in either width: output
 * columns in tiles of 16 (N padded with zero columns to a multiple of 32: whole tile pairs), K
 * padded with zeros to Kp, a multiple of 32; tile t holds Kp/2 rows of 16 column pairs, element
 * (k, n) at t * Kp * 16 + (k / 2) * 32 + n * 2 + (k & 1). So a bf16 weight is its own AMX B
 * operand (tiles of 32 k x 16 columns, 1 KiB each, in a row), and an e4m3 one becomes one by
 * widening each 32-byte row to a 64-byte one. FP8 scales are float32 [tiles][G][32], the scale
 * of column n twice (at 2n and 2n + 1, as the elements), for k in group g = k / gk (gk a
 * multiple of 32, or G = 1; per tensor or per channel: G = 1; 128 x 128 blocks: gk = 128, each
 * row of a block given the block's scale), times 2^8 (see e4m3 below).
 *
 * Numbers: the widening is exact (e4m3 and bf16 are subsets of float32), and an FP8 weight is
 * widened times its scale in float32, rounded once: the weight the float32 dequantization at
 * load holds (model/fp8_checkpoint.dequantize_fp8), bit for bit. The sums are float32 FMAs, so
 * results differ from a float32 F.linear only in summation order. From `amx_rows` activation rows
 * on a CPU with AMX-BF16 the activations are rounded to bfloat16 on the way into the tiles, and
 * an FP8 weight is widened to bfloat16 panels (32 columns x K) per call, as the quantized
 * kernels' bf16 tiles do (quant_gemm_amx_bf16.inc): a bfloat16 matmul's results, with float32
 * sums and outputs.
 *
 * e4m3 -> float: the byte's 7 magnitude bits shifted left by 7 and its sign to bit 15 are a
 * float16 of the same mantissa with the exponent biased by 15 instead of 7, i.e. the value
 * times 2^-8, denormals included (F16C widens float16 denormals exactly); the scales carry the
 * 2^8 back. No lookup table: a few integer ops and one conversion per 16 (8 on AVX2) weights.
 * e4m3's NaN (0x7f, 0xff) reads as 480: checkpoints do not store NaN weights.
 *
 * Kernels, chosen at run time from the CPU (tl_lp_level): portable C (0), AVX2+F16C (1),
 * AVX-512 F/BW/VL (2), and AVX-512 with AMX-BF16 tiles from amx_rows rows (3). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>

enum { TL_LP_BF16 = 0, TL_LP_E4M3 = 1 };
#define LP_TILE 16
#define LP_CT 4 /* column tiles per pass of the vector kernels (64 columns) */
#define LP_RM 4 /* activation rows per pass of the vector kernels */

static int lp_forced = -1;     /* tests: at most this level (-1: the best the CPU has) */
static int lp_level_now = -1;  /* the level in use, detected once */
static int lp_amx_rows = 16;   /* rows from which the AMX tiles run (0: never); ops/lowp.py sets it */
static int lp_last = -1;       /* the kernel level the last call ran (a probe for the plan's test) */

int32_t tl_q_amx_status(void); /* quant_gemm.c: whether Linux granted the AMX tile state (1) */

static int lp_detect(void) {
    __builtin_cpu_init();
    int best = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) best = 1;
    if (best && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        best = 2;
#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__)) && defined(__linux__)
    if (best == 2 && (lp_forced < 0 || lp_forced >= 3)) { /* the tile state asked for only where allowed */
        unsigned a, b, c, d, a1, b1, c1, d1;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        __asm__ volatile("cpuid" : "=a"(a1), "=b"(b1), "=c"(c1), "=d"(d1) : "a"(7), "c"(1));
        if (((d >> 22) & 1) && ((d >> 24) & 1) && ((a1 >> 5) & 1) && tl_q_amx_status() == 1) best = 3;
    }
#endif
    return lp_forced >= 0 && lp_forced < best ? lp_forced : best;
}

/* The kernel level in use: 3 AMX-BF16 tiles from amx_rows rows (AVX-512 below), 2 AVX-512,
 * 1 AVX2, 0 portable. */
int32_t tl_lp_level(void) {
    if (lp_level_now < 0) lp_level_now = lp_detect();
    return lp_level_now;
}

/* Caps the level (-1: none; tests run every kernel the CPU has); returns the level now in use. */
int32_t tl_lp_limit_level(int32_t level) {
    lp_forced = level;
    lp_level_now = lp_detect();
    return lp_level_now;
}

/* Rows from which the AMX tiles run (0: never); returns the previous value. */
int32_t tl_lp_set_amx_rows(int32_t rows) {
    const int32_t old = lp_amx_rows;
    lp_amx_rows = rows;
    return old;
}

/* The level of the kernel the last tl_lp_linear ran (-1: none yet). */
int32_t tl_lp_last_kernel(void) { return lp_last; }

static int64_t lp_up32(int64_t n) { return (n + 31) & ~(int64_t)31; }

/* Elements of the stored weight of an [N, K] matrix (either width). */
int64_t tl_lp_packed_elems(int64_t N, int64_t K) { return lp_up32(N) * lp_up32(K); }

/* ------------------------------------------------------------------------- portable C */
static float lp_e4m3(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
    return (b & 0x80) ? -v : v;
}

static float lp_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Columns [t * 16, t * 16 + 16) of y for all M rows (K even). */
static void lp_tile_portable(int kind, const void *w, const float *scales, int64_t G, int64_t gk,
                             int64_t K, const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy,
                             int64_t N, const float *bias, int64_t t) {
    const int64_t Kp = lp_up32(K), n0 = t * LP_TILE, cols = N - n0 < LP_TILE ? N - n0 : LP_TILE;
    for (int64_t m = 0; m < M; m++) {
        float acc[2 * LP_TILE] = {0}; /* column n's sums over even and odd k, as the vector kernels */
        for (int64_t k = 0; k < K; k++) {
            const float xv = x[m * ldx + k];
            for (int n = 0; n < LP_TILE; n++) {
                const int64_t at = t * Kp * LP_TILE + (k / 2) * 32 + n * 2 + (k & 1);
                float wv;
                if (kind == TL_LP_BF16) wv = lp_bf16(((const uint16_t *)w)[at]);
                else wv = lp_e4m3(((const uint8_t *)w)[at]) * (scales[(t * G + k / gk) * 32 + 2 * n] / 256.0f);
                acc[2 * n + (k & 1)] = fmaf(wv, xv, acc[2 * n + (k & 1)]);
            }
        }
        for (int n = 0; n < cols; n++)
            y[m * ldy + n0 + n] = acc[2 * n] + acc[2 * n + 1] + (bias ? bias[n0 + n] : 0.0f);
    }
}

/* ------------------------------------------------------------------------- AVX2 */
#define LP_AVX2 __attribute__((target("avx2,fma,f16c")))
#define LP_INLINE2 static inline __attribute__((always_inline)) LP_AVX2

/* Half h (columns 8h .. 8h + 7) of one k pair of a tile as float32: for bf16 the even and the
 * odd k of the 8 columns (ev, od); for e4m3 the 16 (column, k) pairs in stored order, columns
 * 8h .. 8h + 3 in ev and 8h + 4 .. 8h + 7 in od, times their scales. */
LP_INLINE2 void lp_load_avx2(const int kind, const void *w, int64_t at, int h, const float *s,
                             __m256 *ev, __m256 *od) {
    if (kind == TL_LP_BF16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + at + 16 * h));
        *ev = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *od = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
        return;
    }
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)w + at + 16 * h)));
    const __m256i f16 = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    *ev = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(f16)), _mm256_loadu_ps(s + 16 * h));
    *od = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(f16, 1)), _mm256_loadu_ps(s + 16 * h + 8));
}

/* RM rows x CT tiles: rows [m0, m0 + RM) x tiles [t0, t0 + CT); K even. */
LP_INLINE2 void lp_block_avx2(const int kind, const int RM, const int CT, const void *w, const float *scales,
                              int64_t G, int64_t gk, int64_t K, const float *x, int64_t ldx, float *y,
                              int64_t ldy, int64_t N, const float *bias, int64_t t0, int64_t m0) {
    const int64_t Kp = lp_up32(K);
    __m256 acc[LP_RM][2 * LP_CT][2];
    for (int r = 0; r < RM; r++)
        for (int c = 0; c < 2 * CT; c++) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    for (int64_t g = 0, k0 = 0; k0 < K; g++, k0 += gk) {
        const int64_t k1 = k0 + gk < K ? k0 + gk : K;
        for (int64_t k = k0; k < k1; k += 2) {
            __m256 ev[2 * LP_CT], od[2 * LP_CT];
            for (int c = 0; c < 2 * CT; c++)
                lp_load_avx2(kind, w, (t0 + c / 2) * Kp * LP_TILE + k * 16, c & 1,
                             kind == TL_LP_E4M3 ? scales + ((t0 + c / 2) * G + g) * 32 : NULL, &ev[c], &od[c]);
            for (int r = 0; r < RM; r++) {
                const float *xr = x + (m0 + r) * ldx + k;
                if (kind == TL_LP_BF16) {
                    const __m256 x0 = _mm256_broadcast_ss(xr), x1 = _mm256_broadcast_ss(xr + 1);
                    for (int c = 0; c < 2 * CT; c++) {
                        acc[r][c][0] = _mm256_fmadd_ps(ev[c], x0, acc[r][c][0]);
                        acc[r][c][1] = _mm256_fmadd_ps(od[c], x1, acc[r][c][1]);
                    }
                } else { /* (x[k], x[k + 1]) in every lane pair */
                    double pair;
                    memcpy(&pair, xr, sizeof pair);
                    const __m256 xx = _mm256_castpd_ps(_mm256_set1_pd(pair));
                    for (int c = 0; c < 2 * CT; c++) {
                        acc[r][c][0] = _mm256_fmadd_ps(ev[c], xx, acc[r][c][0]);
                        acc[r][c][1] = _mm256_fmadd_ps(od[c], xx, acc[r][c][1]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < RM; r++)
        for (int c = 0; c < 2 * CT; c++) {
            const int64_t n0 = (t0 + c / 2) * LP_TILE + (c & 1) * 8;
            float a[8], b[8], out[8];
            _mm256_storeu_ps(a, acc[r][c][0]);
            _mm256_storeu_ps(b, acc[r][c][1]);
            for (int i = 0; i < 8; i++) /* bf16: column i's even and odd sums; e4m3: lane pairs */
                out[i] = kind == TL_LP_BF16 ? a[i] + b[i] : i < 4 ? a[2 * i] + a[2 * i + 1] : b[2 * i - 8] + b[2 * i - 7];
            for (int i = 0; i < 8 && n0 + i < N; i++) y[(m0 + r) * ldy + n0 + i] = out[i] + (bias ? bias[n0 + i] : 0.0f);
        }
}

/* ------------------------------------------------------------------------- AVX-512 */
#define LP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define LP_INLINE512 static inline __attribute__((always_inline)) LP_AVX512

/* One k pair of a tile as float32: bf16, the even and the odd k of the 16 columns (ev, od);
 * e4m3, the 32 (column, k) pairs in stored order, columns 0-7 in ev and 8-15 in od, times
 * their scales (s: the tile's 32 for the group). */
LP_INLINE512 void lp_load_avx512(const int kind, const void *w, int64_t at, const float *s, __m512 *ev,
                                 __m512 *od) {
    if (kind == TL_LP_BF16) {
        const __m512i v = _mm512_loadu_si512((const void *)((const uint16_t *)w + at));
        *ev = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        *od = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
        return;
    }
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)((const uint8_t *)w + at)));
    const __m512i f16 = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x7f)), 7),
                                        _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
    *ev = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(f16)), _mm512_loadu_ps(s));
    *od = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(f16, 1)), _mm512_loadu_ps(s + 16));
}

LP_INLINE512 void lp_block_avx512(const int kind, const int RM, const int CT, const void *w, const float *scales,
                                  int64_t G, int64_t gk, int64_t K, const float *x, int64_t ldx, float *y,
                                  int64_t ldy, int64_t N, const float *bias, int64_t t0, int64_t m0) {
    const int64_t Kp = lp_up32(K);
    __m512 acc[LP_RM][LP_CT][2];
    for (int r = 0; r < RM; r++)
        for (int c = 0; c < CT; c++) acc[r][c][0] = acc[r][c][1] = _mm512_setzero_ps();
    for (int64_t g = 0, k0 = 0; k0 < K; g++, k0 += gk) {
        const int64_t k1 = k0 + gk < K ? k0 + gk : K;
        for (int64_t k = k0; k < k1; k += 2) {
            __m512 ev[LP_CT], od[LP_CT];
            for (int c = 0; c < CT; c++)
                lp_load_avx512(kind, w, (t0 + c) * Kp * LP_TILE + k * 16,
                               kind == TL_LP_E4M3 ? scales + ((t0 + c) * G + g) * 32 : NULL, &ev[c], &od[c]);
            for (int r = 0; r < RM; r++) {
                const float *xr = x + (m0 + r) * ldx + k;
                if (kind == TL_LP_BF16) {
                    const __m512 x0 = _mm512_set1_ps(xr[0]), x1 = _mm512_set1_ps(xr[1]);
                    for (int c = 0; c < CT; c++) {
                        acc[r][c][0] = _mm512_fmadd_ps(ev[c], x0, acc[r][c][0]);
                        acc[r][c][1] = _mm512_fmadd_ps(od[c], x1, acc[r][c][1]);
                    }
                } else { /* (x[k], x[k + 1]) in every lane pair */
                    double pair;
                    memcpy(&pair, xr, sizeof pair);
                    const __m512 xx = _mm512_castpd_ps(_mm512_set1_pd(pair));
                    for (int c = 0; c < CT; c++) {
                        acc[r][c][0] = _mm512_fmadd_ps(ev[c], xx, acc[r][c][0]);
                        acc[r][c][1] = _mm512_fmadd_ps(od[c], xx, acc[r][c][1]);
                    }
                }
            }
        }
    }
    /* e4m3: lanes (2n, 2n + 1) are column n's even and odd sums, columns 0-7 in [0], 8-15 in [1] */
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    for (int r = 0; r < RM; r++)
        for (int c = 0; c < CT; c++) {
            const int64_t n0 = (t0 + c) * LP_TILE;
            const int cols = N - n0 < LP_TILE ? (int)(N - n0) : LP_TILE;
            if (cols <= 0) continue;
            const __mmask16 mk = (__mmask16)((1u << cols) - 1);
            __m512 v = kind == TL_LP_BF16
                ? _mm512_add_ps(acc[r][c][0], acc[r][c][1])
                : _mm512_add_ps(_mm512_permutex2var_ps(acc[r][c][0], evens, acc[r][c][1]),
                                _mm512_permutex2var_ps(acc[r][c][0], odds, acc[r][c][1]));
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, bias + n0));
            _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0, mk, v);
        }
}

/* The vector kernels' dispatch to compile-time row and tile counts: column group j (tiles
 * [j * CT, ...)) for all M rows, RM rows per pass (the group's weight stays in L2 between passes). */
#define LP_CASES(BLOCK, KIND, CT)                                                                      \
    switch (rm) {                                                                                      \
    case 1: BLOCK(KIND, 1, CT, w, scales, G, gk, K, x, ldx, y, ldy, N, bias, tt, m0); break;           \
    case 2: BLOCK(KIND, 2, CT, w, scales, G, gk, K, x, ldx, y, ldy, N, bias, tt, m0); break;           \
    case 3: BLOCK(KIND, 3, CT, w, scales, G, gk, K, x, ldx, y, ldy, N, bias, tt, m0); break;           \
    default: BLOCK(KIND, 4, CT, w, scales, G, gk, K, x, ldx, y, ldy, N, bias, tt, m0);                 \
    }
#define LP_GROUP(NAME, TARGET, BLOCK)                                                                  \
TARGET static void NAME(int kind, const void *w, const float *scales, int64_t G, int64_t gk, int64_t K, \
                        const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy, int64_t N,       \
                        const float *bias, int64_t ntiles, int64_t j) {                                 \
    const int64_t t0 = j * LP_CT;                                                                       \
    const int ct = ntiles - t0 < LP_CT ? (int)(ntiles - t0) : LP_CT;                                    \
    for (int64_t m0 = 0; m0 < M; m0 += LP_RM) {                                                         \
        const int rm = M - m0 < LP_RM ? (int)(M - m0) : LP_RM;                                          \
        if (ct == LP_CT) {                                                                              \
            const int64_t tt = t0;                                                                      \
            if (kind == TL_LP_BF16) { LP_CASES(BLOCK, TL_LP_BF16, LP_CT) }                             \
            else { LP_CASES(BLOCK, TL_LP_E4M3, LP_CT) }                                                \
        } else {                                                                                        \
            for (int64_t tt = t0; tt < t0 + ct; tt++) {                                                 \
                if (kind == TL_LP_BF16) { LP_CASES(BLOCK, TL_LP_BF16, 1) }                             \
                else { LP_CASES(BLOCK, TL_LP_E4M3, 1) }                                                \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
}
LP_GROUP(lp_group_avx2, LP_AVX2, lp_block_avx2)
LP_GROUP(lp_group_avx512, LP_AVX512, lp_block_avx512)

/* ------------------------------------------------------------------------- AMX-BF16 tiles */
#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__)) && defined(__linux__)
#define LP_HAVE_AMX 1
#include "amx_bf16_step.h"
#define LP_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c,amx-tile,amx-bf16")))

LP_AMX static void lp_amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

/* Column tile t of an e4m3 weight -> its bf16 B tiles for all of Kp (rows of 32 bytes widened,
 * times their scales, to rows of 64). */
LP_AMX static void lp_amx_panel(const uint8_t *w, const float *scales, int64_t G, int64_t gk, int64_t Kp,
                                int64_t t, uint16_t *out) {
    for (int64_t k = 0; k < Kp; k += 2) {
        __m512 ev, od;
        lp_load_avx512(TL_LP_E4M3, w, t * Kp * LP_TILE + k * 16, scales + (t * G + (k / gk < G ? k / gk : G - 1)) * 32,
                       &ev, &od);
        _mm512_store_si512((void *)(out + k * 16), (__m512i)_mm512_cvtne2ps_pbh(od, ev));
    }
}

static __thread uint16_t *lp_panel_buf;
static __thread int64_t lp_panel_bytes;

/* y = x W^T on bf16 tiles: items (a block of up to 8 row pairs, a pair of column tiles); an e4m3
 * pair is widened once per item into the thread's panel, a bf16 one is read in place. Returns -1
 * without a panel buffer. */
LP_AMX static int lp_linear_amx(int kind, const void *w, const float *scales, int64_t G, int64_t gk,
                                int64_t N, int64_t K, const float *x, int64_t ldx, int64_t M, float *y,
                                int64_t ldy, const float *bias, void *scratch) {
    const int64_t Kp = lp_up32(K), nkb = Kp / 32, Mp = (M + 31) & ~(int64_t)31;
    const int64_t npairs = lp_up32(N) / 32, mpairs = Mp / 32, block = 8;
    uint16_t *a = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    /* the activations in tile order, bfloat16, zero-padded: [Mp/16][Kp/32] tiles of 16 rows x 32 k */
    #pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < Mp; m++) {
        uint16_t *dst = a + (m / 16) * nkb * 512 + (m % 16) * 32;
        for (int64_t kb = 0; kb < nkb; kb++, dst += 512) {
            const int64_t left = m >= M ? 0 : K - kb * 32;
            const __mmask16 m0 = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            const __mmask16 m1 = left >= 32 ? 0xFFFF : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            const float *xr = x + (m < M ? m : 0) * ldx + kb * 32;
            _mm512_store_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, xr + 16),
                                                                        _mm512_maskz_loadu_ps(m0, xr)));
        }
    }
    const int64_t items = (mpairs + block - 1) / block * npairs;
    int failed = 0;
    #pragma omp parallel
    {
        uint16_t *panel = NULL;
        if (kind == TL_LP_E4M3) {
            if (lp_panel_bytes < Kp * 64) {
                free(lp_panel_buf);
                lp_panel_buf = aligned_alloc(64, (size_t)Kp * 64);
                lp_panel_bytes = lp_panel_buf ? Kp * 64 : 0;
            }
            panel = lp_panel_buf;
            if (!panel) {
                #pragma omp atomic write
                failed = 1;
            }
        }
        #pragma omp barrier
        if (!failed) {
            lp_amx_configure();
            float c[32 * 32] __attribute__((aligned(64)));
            float c2[32 * 32] __attribute__((aligned(64)));
            #pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++) {
                const int64_t np = it % npairs, mstart = it / npairs * block;
                const int64_t mcount = mpairs - mstart < block ? mpairs - mstart : block;
                const uint16_t *b0, *b1;
                if (kind == TL_LP_E4M3) {
                    lp_amx_panel((const uint8_t *)w, scales, G, gk, Kp, 2 * np, panel);
                    lp_amx_panel((const uint8_t *)w, scales, G, gk, Kp, 2 * np + 1, panel + nkb * 512);
                    b0 = panel;
                } else {
                    b0 = (const uint16_t *)w + 2 * np * nkb * 512;
                }
                b1 = b0 + nkb * 512;
                for (int64_t mi = 0; mi < mcount; mi++) {
                    const int64_t mp = mstart + mi;
                    const uint16_t *a0 = a + 2 * mp * nkb * 512, *a1 = a0 + nkb * 512;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t kb = 0, kflush = nkb; kb < nkb; kb++)
                        amx_bf16_k_step(kb, &kflush, nkb, a0, a1, b0, b1, c, c2);
                    amx_bf16_store_sums(c);
                    const int64_t m0 = mp * 32, n0 = np * 32;
                    const int rows = (int)(M - m0 < 32 ? M - m0 : 32), cols = (int)(N - n0 < 32 ? N - n0 : 32);
                    const __mmask16 k0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
                    const __mmask16 k1 = cols >= 32 ? 0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
                    const __m512 bb0 = bias ? _mm512_maskz_loadu_ps(k0, bias + n0) : _mm512_setzero_ps();
                    const __m512 bb1 = bias && k1 ? _mm512_maskz_loadu_ps(k1, bias + n0 + 16) : _mm512_setzero_ps();
                    for (int r = 0; r < rows; r++) {
                        float *out = y + (m0 + r) * ldy + n0;
                        _mm512_mask_storeu_ps(out, k0, _mm512_add_ps(_mm512_load_ps(c + r * 32), bb0));
                        if (k1) _mm512_mask_storeu_ps(out + 16, k1, _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), bb1));
                    }
                }
            }
            _tile_release();
        }
    }
    return failed ? -1 : 0;
}
#endif

/* Bytes of scratch a call of M rows of K needs (the AMX path's activations in tile order). */
int64_t tl_lp_scratch_bytes(int64_t M, int64_t K) {
    return M >= lp_amx_rows && lp_amx_rows > 0 && tl_lp_level() == 3 ? ((M + 31) & ~(int64_t)31) * lp_up32(K) * 2 + 64
                                                                      : 0;
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) W^T (+ bias[N]), all float32; W [N, K]
 * stored as the layout above, of `kind` (TL_LP_BF16, or TL_LP_E4M3 with scales [tiles][G][32]
 * of gk k each). K even. scratch: tl_lp_scratch_bytes(M, K) bytes. Returns 0, -1 for bad
 * arguments or no panel buffer. */
int32_t tl_lp_linear(int32_t kind, const void *w, const float *scales, int64_t G, int64_t gk, int64_t N,
                     int64_t K, const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy,
                     const float *bias, void *scratch) {
    if ((kind != TL_LP_BF16 && kind != TL_LP_E4M3) || N <= 0 || K <= 0 || K % 2 || M < 0 || gk <= 0)
        return -1;
    if (kind == TL_LP_E4M3 && (!scales || G != (K + gk - 1) / gk || (G > 1 && gk % 32)))
        return -1;
    if (kind == TL_LP_BF16 || G == 1) gk = lp_up32(K), G = 1;
    if (M == 0) return 0;
    const int level = tl_lp_level();
    const int64_t ntiles = (N + LP_TILE - 1) / LP_TILE;
#ifdef LP_HAVE_AMX
    if (level == 3 && lp_amx_rows > 0 && M >= lp_amx_rows && scratch) {
        lp_last = 3;
        return lp_linear_amx(kind, w, scales, G, gk, N, K, x, ldx, M, y, ldy, bias, scratch);
    }
#endif
    if (level >= 1) {
        lp_last = level >= 2 ? 2 : 1;
        const int64_t groups = (ntiles + LP_CT - 1) / LP_CT;
        #pragma omp parallel for schedule(static) if (groups > 1 && N * K >= 65536)
        for (int64_t j = 0; j < groups; j++) {
            if (level >= 2) lp_group_avx512(kind, w, scales, G, gk, K, x, ldx, M, y, ldy, N, bias, ntiles, j);
            else lp_group_avx2(kind, w, scales, G, gk, K, x, ldx, M, y, ldy, N, bias, ntiles, j);
        }
        return 0;
    }
    lp_last = 0;
    #pragma omp parallel for schedule(static) if (ntiles > 1 && N * K >= 65536)
    for (int64_t t = 0; t < ntiles; t++)
        lp_tile_portable(kind, w, scales, G, gk, K, x, ldx, M, y, ldy, N, bias, t);
    return 0;
}
