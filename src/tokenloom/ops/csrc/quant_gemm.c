/* Matmuls on block-quantized weights (GGUF Q4_0, Q4_1, Q5_0, Q8_0, the K-quants Q4_K, Q5_K,
 * Q6_K, and the int8 path), in llama.cpp's manner: activations are quantized per 32-element
 * block to int8 and multiplied with the weights' integer codes, so a weight is read as 4 to 8
 * bits and never widened to float in memory.
 *
 * Weight layout ("tiled", written by ops/quant.py's repack, the same bytes per weight as the GGUF):
 * rows are grouped in tiles of 16 output columns (n); a tile is a run of units, a unit being one
 * 32-wide block of K (Q4_0, Q4_1, Q5_0, Q8) or one 256-wide super-block of 8 such blocks
 * (K-quants). A unit holds the codes of its blocks, then its parameters.
 *   codes of a block: 8 groups g of 4 consecutive k (k = 4g + b) x 16 columns x 4 bytes, i.e.
 *     one 64-byte vector per g whose 32-bit lane n holds column n's 4 codes:
 *     - Q8: the int8 values XOR 0x80 (unsigned, offset 128), 8 vectors (512 bytes);
 *     - 4-bit low parts: 4 vectors, vector v holding group v in the low and group v + 4 in the
 *       high nibbles (256 bytes; the GGUF Q4_0 byte order per column: byte i = elements i, i+16);
 *     - Q5_0 / Q5_K add one vector of fifth bits: lane n's byte b has bit g = bit 4 of k = 4g+b
 *       (64 bytes), so group g's bits are one shift and mask away;
 *     - Q6_K adds two vectors of the top two bits: vector (g >> 2), lane n's byte b, bits
 *       2(g & 3) .. 2(g & 3) + 1 for k = 4g + b (128 bytes).
 *   parameters of a unit, per column (16 lanes each):
 *     Q4_0 / Q8 / Q5_0: fp16 d                        w = d (q - 8 | 128 | 16)
 *     Q4_1:             fp16 d, fp16 m                w = d q + m
 *     Q4_K / Q5_K:      fp16 d, fp16 dmin, then 12 byte planes of 16 columns: plane s < 8 holds
 *                       sub-block s's 6-bit scale (low nibble) and min (high nibble) low bits,
 *                       plane 8 + i the top two bits of scale i, scale i+4, min i, min i+4
 *                                                     w = d sc_s q - dmin m_s
 *     Q6_K:             16 byte planes of int8 scales (one per 16 weights), fp16 d
 *                                                     w = d sc_h (q - 32)
 * so every unit has exactly 16 times the GGUF block's bytes (Q4_K 144, Q5_K 176, Q6_K 210 per
 * 256 weights; Q5_0 22 per 32): only the scales' bits are re-arranged, never widened.
 *
 * With x quantized per block as x = dx * xq, a block's contribution to y[m][n] is
 *   d * dx * sum(q * xq)  +  (min or -offset * d) * dx * sum(xq),
 * and sum(q * xq) is an unsigned-by-signed byte dot product: one VPDPBUSD per group of 4 k for all
 * 16 columns at once, with the activation's 4 bytes broadcast. The per-column scaling of a block
 * is then one vector multiply-add, with no horizontal sums (the reason for the column tiles).
 * Q6_K's scales change every 16 weights, so its blocks are summed as two halves (groups 0-3 and
 * 4-7) against the activations' half-block sums.
 *
 * Kernels: AVX-512 VNNI, AVX2 (VPMADDUBSW) and portable C, chosen once at run time from what the
 * CPU reports.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "vec_math.h" /* tl_bf16_to_f32, tl_f32_to_bf16 */

enum { TL_Q4_0 = 0, TL_Q4_1 = 1, TL_Q8 = 2, TL_Q5_0 = 3, TL_Q4_K = 4, TL_Q5_K = 5, TL_Q6_K = 6,
       TL_NFMT = 7 };
/* X(format) for every format in id order: the kernels' per-format specialisations and their
 * dispatch tables (indexed by format id) are spelled once each. */
#define TL_EACH_FORMAT(X) X(TL_Q4_0) X(TL_Q4_1) X(TL_Q8) X(TL_Q5_0) X(TL_Q4_K) X(TL_Q5_K) X(TL_Q6_K)
#define TILE_N 16
#define QK 32
#define M_BLOCK 64 /* activation rows per pass over a weight tile (kept in L2) */
#define MR_MAX 16  /* rows per expansion of a block's codes and scales (AVX-512 kernel) */

/* 32-blocks per unit, code bytes per block, parameter bytes per unit (16 columns). */
static const int UNIT_BLOCKS[TL_NFMT] = {1, 1, 1, 1, 8, 8, 8};
static const int CODE_BYTES[TL_NFMT] = {256, 256, 512, 320, 256, 320, 384};
static const int PARAM_BYTES[TL_NFMT] = {32, 64, 32, 32, 256, 256, 288};
#define UB(f) UNIT_BLOCKS[f]
#define CB(f) CODE_BYTES[f]
#define UNIT_BYTES(f) (UNIT_BLOCKS[f] * CODE_BYTES[f] + PARAM_BYTES[f])

static float code_offset(int fmt) {
    return fmt == TL_Q8 ? 128.0f : fmt == TL_Q4_0 ? 8.0f : fmt == TL_Q5_0 ? 16.0f : 0.0f;
}

/* Bytes of one unit of 16 columns, and the 32-blocks in a unit (K must be a multiple of 32
 * times that). */
int64_t tl_q_record_bytes(int32_t fmt) { return UNIT_BYTES(fmt); }
int32_t tl_q_unit_blocks(int32_t fmt) { return UB(fmt); }

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float half_at(const uint8_t *p, int i) {
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return half_to_float(h);
}

/* The code (unsigned) of column n, element k of a block's codes. */
static inline int code_at(const uint8_t *codes, int fmt, int n, int k) {
    const int g = k / 4, b = k % 4;
    if (fmt == TL_Q8) return codes[64 * g + 4 * n + b];
    const uint8_t byte = codes[64 * (g & 3) + 4 * n + b];
    int q = g < 4 ? (byte & 0x0f) : (byte >> 4);
    if (fmt == TL_Q5_0 || fmt == TL_Q5_K) q |= ((codes[256 + 4 * n + b] >> g) & 1) << 4;
    if (fmt == TL_Q6_K) q |= ((codes[256 + 64 * (g >> 2) + 4 * n + b] >> (2 * (g & 3))) & 3) << 4;
    return q;
}

/* Column n's scale and min of sub-block s of a unit (params at p): w = d[h] q + m[h], h the
 * 16-weight half of the block (the same for both halves except in Q6_K). */
static void params_at(const uint8_t *p, int fmt, int s, int n, float d[2], float m[2]) {
    if (fmt == TL_Q4_K || fmt == TL_Q5_K) {
        const int lo = p[64 + 16 * s + n], hi = p[64 + 16 * (8 + (s & 3)) + n], sh = 2 * (s >> 2);
        const int sc = (lo & 15) | (((hi >> sh) & 3) << 4);
        const int mn = (lo >> 4) | (((hi >> (sh + 4)) & 3) << 4);
        d[0] = d[1] = half_at(p, n) * (float)sc;
        m[0] = m[1] = -(half_at(p + 32, n) * (float)mn);
    } else if (fmt == TL_Q6_K) {
        const float dd = half_at(p + 256, n);
        for (int h = 0; h < 2; h++) {
            d[h] = dd * (float)(int8_t)p[16 * (2 * s + h) + n];
            m[h] = -32.0f * d[h];
        }
    } else {
        d[0] = d[1] = half_at(p, n);
        m[0] = m[1] = fmt == TL_Q4_1 ? half_at(p + 32, n) : -code_offset(fmt) * d[0];
    }
}

/* ---------------------------------------------------------------- activation quantization */
/* Row m of x [M, K] (row stride ldx floats) -> per 32-element block int8 codes and a float scale,
 * rounding to nearest as llama.cpp's Q8_0. With levels == 2 the block's rounding error (at most
 * d / 2) is quantized again, in steps of d / 256, into a second plane: x ~ d * (q1 + q2 / 256),
 * error <= amax / 65024, and since the ratio is a power of two the kernels combine the two integer
 * dot products exactly as 256 * S1 + S2 (< 2^28) before one conversion to float. Twice the
 * integer work, for activations about as exact as float32 matmuls need (see ops/quant.py).
 * Planes: xq [levels][M][K]; xd [M][K/32] (d, or d / 256 with two levels); xs [M][K/32] = the
 * block's sum of x as represented; xh [M][K/16] the same per 16-element half (for Q6_K). */
static void quantize_block(const float *xb, int8_t *qb, float *d_out) {
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < QK; i++) qb[i] = (int8_t)(int)nearbyintf(xb[i] * id);
    *d_out = d;
}

static void quantize_rows(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t M, int64_t K,
                          int levels, int8_t *xq, float *xd, float *xs, float *xh) {
    const int64_t nb = K / QK;
    for (int64_t m = m0; m < m1; m++) {
        const float *xr = x + m * ldx;
        for (int64_t j = 0; j < nb; j++) {
            int8_t *qb = xq + m * K + j * QK;
            float d;
            quantize_block(xr + j * QK, qb, &d);
            int half[2] = {0, 0};
            for (int i = 0; i < 16; i++) half[0] += qb[i];
            for (int i = 16; i < QK; i++) half[1] += qb[i];
            if (levels == 2) {
                int8_t *q2 = xq + M * K + m * K + j * QK;
                const float id = d > 0.0f ? 256.0f / d : 0.0f;
                int half2[2] = {0, 0};
                for (int i = 0; i < QK; i++) {
                    int q = (int)nearbyintf((xr[j * QK + i] - d * (float)qb[i]) * id);
                    q = q > 127 ? 127 : q < -127 ? -127 : q;
                    q2[i] = (int8_t)q;
                }
                for (int i = 0; i < 16; i++) half2[0] += q2[i];
                for (int i = 16; i < QK; i++) half2[1] += q2[i];
                d /= 256.0f;
                half[0] = 256 * half[0] + half2[0];
                half[1] = 256 * half[1] + half2[1];
            }
            xd[m * nb + j] = d;
            xs[m * nb + j] = d * (float)(half[0] + half[1]);
            xh[m * 2 * nb + 2 * j] = d * (float)half[0];
            xh[m * 2 * nb + 2 * j + 1] = d * (float)half[1];
        }
    }
}

/* ----------------------------------------------------------------------- portable kernel */
/* Every kernel: `rows` activation rows (codes xq, scales xd, block sums xs, half-block sums xh;
 * the second level's codes `xplane` elements further on) against one tile of 16 columns. */
#define KERNEL_ARGS const uint8_t *tile, int fmt, int64_t nb, const int8_t *xq, const float *xd, \
    const float *xs, const float *xh, int64_t K, int64_t rows, float *y, int64_t ldy, int ncols, \
    int levels, int64_t xplane

static void tile_portable(KERNEL_ARGS) {
    const int ub = UB(fmt), cb = CB(fmt), unit = UNIT_BYTES(fmt);
    float acc[M_BLOCK][TILE_N];
    memset(acc, 0, sizeof(float) * TILE_N * (size_t)rows);
    /* Each block's codes and parameters are decoded once per column, then applied to every row. */
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *u = tile + (j / ub) * unit, *codes = u + (j % ub) * cb;
        for (int n = 0; n < TILE_N; n++) {
            float d[2], mn[2];
            params_at(u + ub * cb, fmt, (int)(j % ub), n, d, mn);
            int32_t q[QK];
            for (int k = 0; k < QK; k++) q[k] = code_at(codes, fmt, n, k);
            for (int64_t m = 0; m < rows; m++) {
                const float dx = xd[m * nb + j];
                int32_t s[2] = {0, 0};
                for (int l = 0; l < levels; l++) {
                    const int8_t *xb = xq + l * xplane + m * K + j * QK;
                    int32_t lo = 0, hi = 0;
                    for (int k = 0; k < 16; k++) lo += q[k] * (int32_t)xb[k];
                    for (int k = 16; k < QK; k++) hi += q[k] * (int32_t)xb[k];
                    s[0] = s[0] * 256 + lo;
                    s[1] = s[1] * 256 + hi;
                }
                if (fmt == TL_Q6_K)
                    acc[m][n] += d[0] * dx * (float)s[0] + d[1] * dx * (float)s[1]
                                 + mn[0] * xh[m * 2 * nb + 2 * j] + mn[1] * xh[m * 2 * nb + 2 * j + 1];
                else
                    acc[m][n] += d[0] * dx * (float)(s[0] + s[1]) + mn[0] * xs[m * nb + j];
            }
        }
    }
    for (int64_t m = 0; m < rows; m++) memcpy(y + m * ldy, acc[m], sizeof(float) * (size_t)ncols);
}

/* A thread's buffer for the weight panels it dequantizes (quant_gemm_amx_bf16.inc's bf16 ones,
 * quant_gemm_f32panel.inc's float32 ones; a thread runs one matmul at a time), 64-byte aligned,
 * grown to the most bytes asked for; NULL without memory. */
static __thread void *panel_buf;
static __thread int64_t panel_buf_bytes;

static void *thread_panel(int64_t bytes) {
    if (bytes > panel_buf_bytes) {
        free(panel_buf);
        panel_buf = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
        panel_buf_bytes = panel_buf ? bytes : 0;
    }
    return panel_buf;
}

/* A decode (a few rows) reads each weight byte once, and a block's products take less time than
 * fetching the next block from memory: left to the hardware prefetchers, which stop at every
 * 4 KiB page, the memory idles while the core computes. The vector kernels therefore request the
 * bytes PREFETCH_DIST ahead of the block they are on, a block's worth per block, so that the
 * stream runs while they compute; it carries on into the next tile, which a thread's static
 * share of the tiles places right after (benchmarks/quant_decode_ab.py). */
#define PREFETCH_DIST 2048
static inline __attribute__((always_inline)) const char *prefetch_until(const char *pf,
                                                                         const char *end) {
    for (; pf < end; pf += 64) _mm_prefetch(pf, _MM_HINT_T0);
    return pf;
}

#include "quant_gemm_avx512.inc" /* tile_avx512 and its helpers */

#include "quant_gemm_avx2.inc" /* tile2_* and TILE2[] */

#include "quant_gemm_amx.inc" /* amx_* and AMX_KERNELS[] */

int32_t tl_q_amx_status(void);
#include "quant_gemm_amx_bf16.inc" /* tl_q_linear_amx_bf16: dequantized panels on bf16 tiles */

/* ------------------------------------------------------------------------- dispatch */
/* 4: as 3, and from amx_bf16_min_rows rows the weight dequantized to bf16 panels on AMX-BF16
 * tiles (quant_gemm_amx_bf16.inc), 3: AVX-512 VNNI with AMX int8 from AMX_MIN_ROWS rows (8 or 16),
 * 2: AVX-512 VNNI, 1: AVX2, 0: portable */
static int isa_level = -1;
static int amx_state = 2; /* amx_request()'s answer, asked once per process (2: not yet) */

int32_t tl_q_amx_status(void) {
#ifdef TL_HAVE_AMX
    if (amx_state == 2) amx_state = amx_request();
    return amx_state;
#else
    return 0;
#endif
}

/* The level ops/kernel_plan.py caps this process at (TOKENLOOM_QUANT_ISA, read in envs.py and
 * passed by tl_q_force_isa): 4 amx_bf16, 3 amx, 2 avx512, 1 avx2, 0 c; -1: no cap. */
static int forced_level = -1;

/* What the CPU can run, capped at forced_level. The plan states the same decision from the CPU's
 * flags (kernel_plan.quant_level); tests/ops/test_kernel_plan.py checks that they agree. The AMX
 * tile state is only asked for where the cap allows AMX. */
static int detect_isa(void) {
    __builtin_cpu_init();
    int best = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = 1;
    if (best && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        best = 2;
    if (forced_level >= 0) {
        const int want = forced_level;
        if (want < 3) return want < best ? want : best; /* below AMX: never ask for the tile state */
        if (best == 2 && tl_q_amx_status() == 1) best = 3;
#ifdef TL_HAVE_AMX
        if (best == 3 && want == 4 && amx_bf16_usable()) best = 4;
#endif
        return best;
    }
    if (best == 2 && tl_q_amx_status() == 1) best = 3;
#ifdef TL_HAVE_AMX
    if (best == 3 && amx_bf16_usable()) best = 4;
#endif
    return best;
}

/* Caps the kernel level (-1: none) and returns the level now in use: how the kernel plan's
 * TOKENLOOM_QUANT_ISA reaches the library (ops/quant.py calls it once when it binds). */
int32_t tl_q_force_isa(int32_t want) {
    forced_level = want;
    isa_level = detect_isa();
    return isa_level;
}

/* Which kernel the last tl_q_linear / tl_q_linear_bf16 call ran (0 tile_portable, 1 tile2_*,
 * 2 tile_avx512, 3 amx_* int8, 4 the bf16 tiles, 5 f32p_linear; -1 none yet): a probe for the
 * test that checks the kernel plan against the functions actually called. */
static int last_kernel = -1;
int32_t tl_q_last_kernel(void) { return last_kernel; }

static int has_amx_kernel(int fmt) {
#ifdef TL_HAVE_AMX
    return AMX_KERNELS[fmt][0] != NULL;
#else
    (void)fmt;
    return 0;
#endif
}

/* The kernel that runs `fmt` here (4: as 3, and bf16 tiles from amx_bf16_min_rows rows; 3
 * AVX-512 VNNI + AMX int8 for larger batches, 2 AVX-512 VNNI, 1 AVX2, 0 portable C). Every
 * format has a bf16-tile path; Q6_K has no AMX int8 one. */
int32_t tl_q_isa(int32_t fmt) {
    if (isa_level < 0) isa_level = detect_isa();
    return isa_level == 3 && !has_amx_kernel(fmt) ? 2 : isa_level;
}

/* Use at most kernel `level` (tests run every kernel the CPU has); -1 restores the best.
 * Returns the level now in use. */
int32_t tl_q_limit_isa(int32_t level) {
    isa_level = detect_isa();
    if (level >= 0 && level < isa_level) isa_level = level;
    return isa_level;
}

static tile_fn pick(int fmt) {
    switch (tl_q_isa(fmt)) {
    case 4:
    case 3:
    case 2: return tile_avx512;
    case 1: return TILE2[fmt];
    default: return tile_portable;
    }
}

/* Activation rows as the scratch holds them: a multiple of 16, so the AMX kernel reads whole
 * 16-row tiles (the padding rows' codes are zero). */
static int64_t padded_rows(int64_t M) { return (M + 15) / 16 * 16; }

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T (+ bias), W the tiled weight of N
 * rows (padded to a multiple of 16), activations quantized in `levels` (1 or 2) int8 planes into
 * `scratch` (tl_q_scratch_bytes). Returns 0, or -1 for a K that is not a multiple of the
 * format's unit (32, or 256 for the K-quants) or another bad argument. */
int64_t tl_q_scratch_bytes(int64_t M, int64_t K) {
    const int64_t Mp = padded_rows(M);
    const int64_t ints = 2 * Mp * K + 4 * Mp * (K / QK) * (int64_t)sizeof(float) + 64;
#ifdef TL_HAVE_AMX
    const int64_t tiles = tl_q_amx_bf16_scratch_bytes(M, K); /* the bf16 tiles' activations */
    return ints > tiles ? ints : tiles;
#else
    return ints;
#endif
}

static void add_bias(float *yt, int64_t ldy, int64_t rows, int ncols, const float *b) {
    for (int64_t r = 0; r < rows; r++)
        for (int n = 0; n < ncols; n++) yt[r * ldy + n] += b[n];
}

#include "quant_gemm_f32panel.inc" /* f32p_linear: dequantized float32 panels on AVX2 */

int32_t tl_q_linear(int32_t fmt, const uint8_t *w, int64_t N, int64_t K, const float *x,
                    int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias,
                    void *scratch, int32_t levels) {
    if (fmt < 0 || fmt >= TL_NFMT || K % (QK * UB(fmt)) != 0 || N <= 0 || M < 0 || levels < 1 ||
        levels > 2)
        return -1;
    if (tl_q_isa(fmt) == 1 && f32p_rows() > 0 && M >= f32p_rows() &&
        f32p_linear(fmt, w, N, K, x, ldx, M, y, ldy, bias) == 0) {
        last_kernel = 5;
        return 0;
    }
#ifdef TL_HAVE_AMX
    if (amx_bf16_min_rows > 0 && M >= amx_bf16_min_rows && tl_q_isa(fmt) == 4 &&
        tl_q_linear_amx_bf16(fmt, w, N, K, x, 0, ldx, M, y, 0, ldy, bias, scratch, 0) == 0) {
        last_kernel = 4;
        return 0;
    }
#endif
    const int64_t nb = K / QK, ntiles = (N + TILE_N - 1) / TILE_N, Mp = padded_rows(M);
    const int64_t tile_bytes = nb / UB(fmt) * UNIT_BYTES(fmt), xplane = Mp * K;
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(((uintptr_t)(xq + levels * Mp * K) + 63) & ~(uintptr_t)63);
    float *xs = xd + Mp * nb, *xh = xs + Mp * nb;
    const tile_fn kern = pick(fmt);
    const int64_t mblocks = (M + M_BLOCK - 1) / M_BLOCK;
#ifdef TL_HAVE_AMX
    const int use_amx = tl_q_isa(fmt) >= 3 && has_amx_kernel(fmt) && M >= AMX_MIN_ROWS(levels);
#else
    const int use_amx = 0;
#endif
    const int vec_quant = tl_q_isa(fmt) >= 2;
    last_kernel = use_amx ? 3 : tl_q_isa(fmt) >= 2 ? 2 : tl_q_isa(fmt);
    for (int l = 0; l < levels; l++) memset(xq + l * xplane + M * K, 0, (size_t)((Mp - M) * K));
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            if (vec_quant) quantize_rows512(x, ldx, m, m + 1, Mp, K, levels, xq, xd, xs, xh);
            else quantize_rows(x, ldx, m, m + 1, Mp, K, levels, xq, xd, xs, xh);
        }
        /* Row blocks outermost: a block's activations stay in L2 while each thread streams its
         * share of the weight tiles past them (work items of up to 64 rows x 16 columns). On
         * AMX each thread configures its own tiles; without memory for the expanded codes it
         * keeps the VNNI kernel. */
        uint8_t *buf = NULL;
#ifdef TL_HAVE_AMX
        if (use_amx && (buf = amx_scratch(K))) amx_configure();
#endif
        #pragma omp for collapse(2) schedule(static)
        for (int64_t mb = 0; mb < mblocks; mb++) {
            for (int64_t t = 0; t < ntiles; t++) {
                const int64_t m0 = mb * M_BLOCK, rows = M - m0 < M_BLOCK ? M - m0 : M_BLOCK;
                const int ncols = (int)(N - t * TILE_N < TILE_N ? N - t * TILE_N : TILE_N);
                float *yt = y + m0 * ldy + t * TILE_N;
#ifdef TL_HAVE_AMX
                if (buf)
                    AMX_KERNELS[fmt][levels - 1](w + t * tile_bytes, nb, xq + m0 * K, xd + m0 * nb,
                                                 xs + m0 * nb, K, (int)rows, yt, ldy, ncols, xplane, buf);
                else
#endif
                    kern(w + t * tile_bytes, fmt, nb, xq + m0 * K, xd + m0 * nb, xs + m0 * nb,
                         xh + m0 * 2 * nb, K, rows, yt, ldy, ncols, levels, xplane);
                if (bias) add_bias(yt, ldy, rows, ncols, bias + t * TILE_N);
            }
        }
#ifdef TL_HAVE_AMX
        if (buf) amx_release();
#endif
    }
    return 0;
}

/* Scratch bytes of tl_q_linear_bf16 for M rows of K into N columns (on the tiles only their
 * activation copy; else float32 copies of x and y besides the integer kernels' scratch). */
int64_t tl_q_bf16_scratch_bytes(int64_t M, int64_t N, int64_t K) {
#ifdef TL_HAVE_AMX
    if (amx_bf16_min_rows > 0 && M >= amx_bf16_min_rows && tl_q_isa(TL_Q8) == 4)
        return tl_q_amx_bf16_scratch_bytes(M, K);
#endif
    return tl_q_scratch_bytes(M, K) + 4 * M * (K + N) + 128;
}

/* tl_q_linear for a bfloat16 model: x and y bfloat16 (row strides ldx, ldy), y rounded once to
 * nearest even. Where the bf16 tiles run (level 4, from amx_bf16_min_rows rows) the activations
 * go into the tiles as they are and the sums are rounded as a bf16 matmul's (kchunk: as
 * tl_q_linear_amx_bf16), so there a GGUF computed in bfloat16 gives the bf16 float path's
 * results bit for bit (its weights are the same dequantized values rounded to bf16). Below it
 * (and without the tiles) the rows are widened to float32 for the integer kernels: at one row
 * the VNNI kernel beats the tiles, whose 16-row tiles would be mostly padding
 * (benchmarks/cpu_time_ab.py). */
int32_t tl_q_linear_bf16(int32_t fmt, const uint8_t *w, int64_t N, int64_t K, const uint16_t *x,
                         int64_t ldx, int64_t M, uint16_t *y, int64_t ldy, const float *bias,
                         void *scratch, int32_t levels, int64_t kchunk) {
    if (fmt < 0 || fmt >= TL_NFMT || K % (QK * UB(fmt)) != 0 || N <= 0 || M < 0)
        return -1;
    if (M == 0) return 0;
#ifdef TL_HAVE_AMX
    if (amx_bf16_min_rows > 0 && M >= amx_bf16_min_rows && tl_q_isa(fmt) == 4) { /* scratch sized for this alone */
        last_kernel = 4;
        return tl_q_linear_amx_bf16(fmt, w, N, K, x, 1, ldx, M, y, 1, ldy, bias, scratch, kchunk) ? -2 : 0;
    }
#endif
    char *base = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *xf = (float *)base, *yf = xf + M * K;
    void *inner = (void *)(((uintptr_t)(yf + M * N) + 63) & ~(uintptr_t)63);
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = tl_bf16_to_f32(x[m * ldx + k]);
    const int32_t rc = tl_q_linear(fmt, w, N, K, xf, K, M, yf, N, bias, inner, levels);
    if (rc) return rc;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) y[m * ldy + n] = tl_f32_to_bf16(yf[m * N + n]);
    return 0;
}

/* Rows `ids` of the tiled weight, dequantized into out [n_ids, K] (the embedding lookup). */
void tl_q_dequant_rows(int32_t fmt, const uint8_t *w, int64_t K, const int64_t *ids,
                       int64_t n_ids, float *out) {
    const int64_t nb = K / QK, ub = UB(fmt), cb = CB(fmt), unit = UNIT_BYTES(fmt);
    const int64_t tile_bytes = nb / ub * unit;
    #pragma omp parallel for schedule(static) if (n_ids > 16)
    for (int64_t i = 0; i < n_ids; i++) {
        const int64_t row = ids[i], t = row / TILE_N;
        const int n = (int)(row % TILE_N);
        for (int64_t j = 0; j < nb; j++) {
            const uint8_t *u = w + t * tile_bytes + (j / ub) * unit, *codes = u + (j % ub) * cb;
            float d[2], mn[2];
            params_at(u + ub * cb, fmt, (int)(j % ub), n, d, mn);
            float *o = out + i * K + j * QK;
            for (int k = 0; k < QK; k++) o[k] = d[k >= 16] * (float)code_at(codes, fmt, n, k) + mn[k >= 16];
        }
    }
}

#include "quant_moe.inc" /* tl_q_moe: a layer's chosen quantized experts in one call */
