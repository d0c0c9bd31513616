/* Matmuls on block-quantized weights (GGUF Q4_0, Q4_1, Q8_0 and the int8 path), in llama.cpp's
 * manner: activations are quantized per 32-element block to int8 and multiplied with the weights'
 * integer codes, so a weight is read as 4 or 8 bits and never widened to float in memory.
 *
 * Weight layout ("tiled", written by ops/quant.py's repack, the same bytes per weight as the GGUF):
 * rows are grouped in tiles of 16 output columns (n); per tile and per 32-wide block j of K one
 * record:
 *   codes  8 groups g of 4 consecutive k (k = 4g + b) x 16 columns x 4 bytes, i.e. one 64-byte
 *          vector per g whose 32-bit lane n holds column n's 4 codes. Q8 codes are the int8 values
 *          XOR 0x80 (unsigned, offset 128); Q4 codes are nibbles, the vector of g in 0..3 holding
 *          group g in the low and group g+4 in the high nibbles (256 bytes; this is exactly the
 *          GGUF byte order per column, where byte i holds elements i and i + 16).
 *   scale  16 x fp16 d (one per column)
 *   min    16 x fp16 m (Q4_1 only)
 * so a weight is w = d * (q - offset) (offset 8 for Q4_0, 128 for Q8) or d * q + m (Q4_1).
 *
 * With x quantized per block as x = dx * xq, a block's contribution to y[m][n] is
 *   d * dx * sum(q * xq)  +  (m or -offset * d) * dx * sum(xq),
 * and sum(q * xq) is an unsigned-by-signed byte dot product: one VPDPBUSD per group of 4 k for all
 * 16 columns at once, with the activation's 4 bytes broadcast. The per-column scaling of a block
 * is then one vector multiply-add, with no horizontal sums (the reason for the column tiles).
 *
 * Kernels: AVX-512 VNNI, AVX2 (VPMADDUBSW; used only for Q4 codes, whose products cannot saturate
 * int16) and portable C, chosen once at run time from what the CPU reports.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

enum { TL_Q4_0 = 0, TL_Q4_1 = 1, TL_Q8 = 2 };
#define TILE_N 16
#define QK 32
#define M_BLOCK 64 /* activation rows per pass over a weight tile (kept in L2) */

static int code_bytes(int fmt) { return fmt == TL_Q8 ? 8 * 64 : 4 * 64; }
static int record_bytes(int fmt) { return code_bytes(fmt) + (fmt == TL_Q4_1 ? 64 : 32); }
static float code_offset(int fmt) { return fmt == TL_Q8 ? 128.0f : fmt == TL_Q4_0 ? 8.0f : 0.0f; }

int64_t tl_q_record_bytes(int32_t fmt) { return record_bytes(fmt); }

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

/* The code of column n, element k of a block record. */
static inline int code_at(const uint8_t *rec, int fmt, int n, int k) {
    int g = k / 4, b = k % 4;
    if (fmt == TL_Q8) return rec[64 * g + 4 * n + b];
    uint8_t byte = rec[64 * (g & 3) + 4 * n + b];
    return g < 4 ? (byte & 0x0f) : (byte >> 4);
}

/* ---------------------------------------------------------------- activation quantization */
/* Row m of x [M, K] (row stride ldx floats) -> per 32-element block int8 codes and a float scale,
 * rounding to nearest as llama.cpp's Q8_0. With levels == 2 the block's rounding error (at most
 * d / 2) is quantized again, in steps of d / 256, into a second plane: x ~ d * (q1 + q2 / 256),
 * error <= amax / 65024, and since the ratio is a power of two the kernels combine the two integer
 * dot products exactly as 256 * S1 + S2 (< 2^28) before one conversion to float. Twice the
 * integer work, for activations about as exact as float32 matmuls need (see ops/quant.py).
 * Planes: xq [levels][M][K]; xd [M][K/32] (d, or d / 256 with two levels); xs [M][K/32] = the
 * block's sum of x as represented. */
static void quantize_block(const float *xb, int8_t *qb, float *d_out, int *sum_out) {
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int i = 0; i < QK; i++) {
        int q = (int)nearbyintf(xb[i] * id);
        qb[i] = (int8_t)q;
        sum += q;
    }
    *d_out = d;
    *sum_out = sum;
}

static void quantize_rows(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t M, int64_t K,
                          int levels, int8_t *xq, float *xd, float *xs) {
    const int64_t nb = K / QK;
    for (int64_t m = m0; m < m1; m++) {
        const float *xr = x + m * ldx;
        for (int64_t j = 0; j < nb; j++) {
            int8_t *qb = xq + m * K + j * QK;
            float d;
            int sum;
            quantize_block(xr + j * QK, qb, &d, &sum);
            xd[m * nb + j] = d;
            xs[m * nb + j] = d * (float)sum;
            if (levels == 2) {
                int8_t *q2 = xq + M * K + m * K + j * QK;
                const float id = d > 0.0f ? 256.0f / d : 0.0f;
                int sum2 = 0;
                for (int i = 0; i < QK; i++) {
                    int q = (int)nearbyintf((xr[j * QK + i] - d * (float)qb[i]) * id);
                    q = q > 127 ? 127 : q < -127 ? -127 : q;
                    q2[i] = (int8_t)q;
                    sum2 += q;
                }
                xd[m * nb + j] = d / 256.0f;
                xs[m * nb + j] = (d / 256.0f) * (float)(256 * sum + sum2);
            }
        }
    }
}

/* ----------------------------------------------------------------------- portable kernel */
/* Every kernel: `rows` activation rows (codes xq, scales xd, block sums xs; the second level's
 * codes and scales `xplane` / `dplane` elements further on) against one tile of 16 columns. */
#define KERNEL_ARGS const uint8_t *tile, int fmt, int64_t nb, const int8_t *xq, const float *xd, \
    const float *xs, int64_t K, int64_t rows, float *y, int64_t ldy, int ncols, int levels,     \
    int64_t xplane

static void tile_portable(KERNEL_ARGS) {
    const int rb = record_bytes(fmt), cb = code_bytes(fmt);
    const float off = code_offset(fmt);
    for (int64_t m = 0; m < rows; m++) {
        float acc[TILE_N] = {0};
        for (int64_t j = 0; j < nb; j++) {
            const uint8_t *rec = tile + j * rb;
            const float sx = xs[m * nb + j];
            for (int n = 0; n < TILE_N; n++) {
                uint16_t h;
                memcpy(&h, rec + cb + 2 * n, 2);
                const float d = half_to_float(h);
                float mn = -off * d;
                if (fmt == TL_Q4_1) {
                    memcpy(&h, rec + cb + 32 + 2 * n, 2);
                    mn = half_to_float(h);
                }
                int32_t s = 0;
                for (int l = 0; l < levels; l++) {
                    const int8_t *xb = xq + l * xplane + m * K + j * QK;
                    int32_t sl = 0;
                    for (int k = 0; k < QK; k++) sl += code_at(rec, fmt, n, k) * (int32_t)xb[k];
                    s = s * 256 + sl;
                }
                acc[n] += d * xd[m * nb + j] * (float)s + mn * sx;
            }
        }
        for (int n = 0; n < ncols; n++) y[m * ldy + n] = acc[n];
    }
}

/* ------------------------------------------------------------------ AVX-512 VNNI kernel */
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

AVX512_TARGET static inline void load_codes512(const uint8_t *rec, int fmt, __m512i w[8]) {
    if (fmt == TL_Q8) {
        for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512((const void *)(rec + 64 * g));
    } else {
        const __m512i low = _mm512_set1_epi8(0x0f);
        for (int v = 0; v < 4; v++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(rec + 64 * v));
            w[v] = _mm512_and_si512(raw, low);
            w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
    }
}

/* sum over the block of codes (16 columns) times the 32 activation codes at xb. */
AVX512_TARGET static inline __m512i block_dot512(const __m512i w[8], const int8_t *xb) {
    __m512i s = _mm512_setzero_si512();
    for (int g = 0; g < 8; g++) {
        int32_t x4;
        memcpy(&x4, xb + 4 * g, 4);
        s = _mm512_dpbusd_epi32(s, w[g], _mm512_set1_epi32(x4));
    }
    return s;
}

/* MR activation rows against one tile; MR and LEVELS are constants in every caller, so the
 * loops over them unroll into independent accumulator chains. */
#define DEFINE_TILE512(MR, LEVELS)                                                               \
AVX512_TARGET static void tile512_##MR##_##LEVELS(const uint8_t *tile, int fmt, int64_t nb,     \
        const int8_t *xq, const float *xd, const float *xs, int64_t K, float *y, int64_t ldy,    \
        int ncols, int64_t xplane) {                                                             \
    const int rb = record_bytes(fmt), cb = code_bytes(fmt);                                      \
    const __m512 neg_off = _mm512_set1_ps(-code_offset(fmt));                                    \
    __m512 acc[MR];                                                                              \
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();                                   \
    for (int64_t j = 0; j < nb; j++) {                                                           \
        const uint8_t *rec = tile + j * rb;                                                      \
        __m512i w[8];                                                                            \
        load_codes512(rec, fmt, w);                                                              \
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb)));        \
        const __m512 mn = fmt == TL_Q4_1                                                         \
            ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb + 32)))              \
            : _mm512_mul_ps(d, neg_off);                                                         \
        for (int r = 0; r < MR; r++) {                                                           \
            __m512i s = block_dot512(w, xq + r * K + j * QK);                                    \
            if (LEVELS == 2)                                                                     \
                s = _mm512_add_epi32(_mm512_slli_epi32(s, 8),                                    \
                                     block_dot512(w, xq + xplane + r * K + j * QK));             \
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xd[r * nb + j]));               \
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);                      \
            acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[r * nb + j]), acc[r]);                \
        }                                                                                        \
    }                                                                                            \
    const __mmask16 keep = (__mmask16)((1u << ncols) - 1u);                                      \
    for (int r = 0; r < MR; r++) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);              \
}
DEFINE_TILE512(1, 1)
DEFINE_TILE512(2, 1)
DEFINE_TILE512(3, 1)
DEFINE_TILE512(4, 1)
DEFINE_TILE512(1, 2)
DEFINE_TILE512(2, 2)
DEFINE_TILE512(3, 2)
DEFINE_TILE512(4, 2)

#define TILE512_CALL(MR, LEVELS) tile512_##MR##_##LEVELS(tile, fmt, nb, xq + r * K, xd + r * nb,  \
    xs + r * nb, K, y + r * ldy, ldy, ncols, xplane)

AVX512_TARGET static void tile_avx512(KERNEL_ARGS) {
    int64_t r = 0;
    if (levels == 2) {
        for (; r + 4 <= rows; r += 4) TILE512_CALL(4, 2);
        switch (rows - r) {
        case 3: TILE512_CALL(3, 2); break;
        case 2: TILE512_CALL(2, 2); break;
        case 1: TILE512_CALL(1, 2); break;
        default: break;
        }
        return;
    }
    for (; r + 4 <= rows; r += 4) TILE512_CALL(4, 1);
    switch (rows - r) {
    case 3: TILE512_CALL(3, 1); break;
    case 2: TILE512_CALL(2, 1); break;
    case 1: TILE512_CALL(1, 1); break;
    default: break;
    }
}

/* ----------------------------------------------------------------------- AVX2 kernel */
/* VPMADDUBSW multiplies unsigned by signed bytes into saturating int16 pairs: safe for 4-bit
 * codes (2 * 15 * 128 < 32767), not for Q8's 8-bit ones, which take the portable kernel. */
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET static void tile_avx2(KERNEL_ARGS) {
    const int rb = record_bytes(fmt), cb = code_bytes(fmt);
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256 neg_off = _mm256_set1_ps(-code_offset(fmt));
    for (int64_t r = 0; r < rows; r++) {
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t j = 0; j < nb; j++) {
            const uint8_t *rec = tile + j * rb;
            for (int h = 0; h < 2; h++) { /* columns 8h .. 8h + 7 */
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + cb + 16 * h)));
                __m256i total = _mm256_setzero_si256();
                for (int l = 0; l < levels; l++) {
                    const int8_t *xb = xq + l * xplane + r * K + j * QK;
                    __m256i s = _mm256_setzero_si256();
                    for (int v = 0; v < 4; v++) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(rec + 64 * v + 32 * h));
                        const __m256i lo = _mm256_and_si256(raw, low);
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                        int32_t a4, b4;
                        memcpy(&a4, xb + 4 * v, 4);
                        memcpy(&b4, xb + 4 * (v + 4), 4);
                        const __m256i p = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a4)),
                            _mm256_maddubs_epi16(hi, _mm256_set1_epi32(b4)));
                        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
                    }
                    total = _mm256_add_epi32(_mm256_slli_epi32(total, 8), s);
                }
                acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total),
                                         _mm256_mul_ps(d, _mm256_set1_ps(xd[r * nb + j])), acc[h]);
                const __m256 mn = fmt == TL_Q4_1
                    ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + cb + 32 + 16 * h)))
                    : _mm256_mul_ps(d, neg_off);
                acc[h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[r * nb + j]), acc[h]);
            }
        }
        float out[TILE_N];
        _mm256_storeu_ps(out, acc[0]);
        _mm256_storeu_ps(out + 8, acc[1]);
        memcpy(y + r * ldy, out, sizeof(float) * (size_t)ncols);
    }
}

/* ------------------------------------------------------------------------- dispatch */
typedef void (*tile_fn)(KERNEL_ARGS);

static int isa_level = -1; /* 2: AVX-512 VNNI, 1: AVX2, 0: portable */

static int detect_isa(void) {
    const char *force = getenv("TOKENLOOM_QUANT_ISA"); /* pin a kernel: avx512|avx2|c */
    __builtin_cpu_init();
    int best = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = 1;
    if (best && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        best = 2;
    if (force) {
        int want = !strcmp(force, "avx512") ? 2 : !strcmp(force, "avx2") ? 1 : 0;
        if (want < best) best = want;
    }
    return best;
}

/* The kernel that runs `fmt` here (2 AVX-512 VNNI, 1 AVX2, 0 portable C). */
int32_t tl_q_isa(int32_t fmt) {
    if (isa_level < 0) isa_level = detect_isa();
    if (isa_level == 1 && fmt == TL_Q8) return 0;
    return isa_level;
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
    case 2: return tile_avx512;
    case 1: return tile_avx2;
    default: return tile_portable;
    }
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T (+ bias), W the tiled weight of N
 * rows (padded to a multiple of 16), activations quantized in `levels` (1 or 2) int8 planes into
 * `scratch` (tl_q_scratch_bytes). Returns 0, or -1 for a K that is not a multiple of 32. */
int64_t tl_q_scratch_bytes(int64_t M, int64_t K) {
    return 2 * M * K + 2 * M * (K / QK) * (int64_t)sizeof(float) + 64;
}

int32_t tl_q_linear(int32_t fmt, const uint8_t *w, int64_t N, int64_t K, const float *x,
                    int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias,
                    void *scratch, int32_t levels) {
    if (K % QK != 0 || N <= 0 || M < 0 || levels < 1 || levels > 2) return -1;
    const int64_t nb = K / QK, ntiles = (N + TILE_N - 1) / TILE_N;
    const int64_t tile_bytes = nb * record_bytes(fmt);
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(((uintptr_t)(xq + levels * M * K) + 63) & ~(uintptr_t)63);
    float *xs = xd + M * nb;
    const tile_fn kern = pick(fmt);
    const int64_t mblocks = (M + M_BLOCK - 1) / M_BLOCK;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_rows(x, ldx, m, m + 1, M, K, levels, xq, xd, xs);
        /* Row blocks outermost: a block's activations stay in L2 while each thread streams its
         * share of the weight tiles past them. */
        #pragma omp for collapse(2) schedule(static)
        for (int64_t mb = 0; mb < mblocks; mb++) {
            for (int64_t t = 0; t < ntiles; t++) {
                const int64_t m0 = mb * M_BLOCK, rows = M - m0 < M_BLOCK ? M - m0 : M_BLOCK;
                const int ncols = (int)(N - t * TILE_N < TILE_N ? N - t * TILE_N : TILE_N);
                float *yt = y + m0 * ldy + t * TILE_N;
                kern(w + t * tile_bytes, fmt, nb, xq + m0 * K, xd + m0 * nb, xs + m0 * nb, K, rows,
                     yt, ldy, ncols, levels, M * K);
                if (bias)
                    for (int64_t r = 0; r < rows; r++)
                        for (int n = 0; n < ncols; n++) yt[r * ldy + n] += bias[t * TILE_N + n];
            }
        }
    }
    return 0;
}

/* Rows `ids` of the tiled weight, dequantized into out [n_ids, K] (the embedding lookup). */
void tl_q_dequant_rows(int32_t fmt, const uint8_t *w, int64_t K, const int64_t *ids,
                       int64_t n_ids, float *out) {
    const int64_t nb = K / QK, rb = record_bytes(fmt), cb = code_bytes(fmt);
    const float off = code_offset(fmt);
    #pragma omp parallel for schedule(static) if (n_ids > 16)
    for (int64_t i = 0; i < n_ids; i++) {
        const int64_t row = ids[i], t = row / TILE_N;
        const int n = (int)(row % TILE_N);
        for (int64_t j = 0; j < nb; j++) {
            const uint8_t *rec = w + (t * nb + j) * rb;
            uint16_t h;
            memcpy(&h, rec + cb + 2 * n, 2);
            const float d = half_to_float(h);
            float mn = -off * d;
            if (fmt == TL_Q4_1) {
                memcpy(&h, rec + cb + 32 + 2 * n, 2);
                mn = half_to_float(h);
            }
            float *o = out + i * K + j * QK;
            for (int k = 0; k < QK; k++) o[k] = d * (float)code_at(rec, fmt, n, k) + mn;
        }
    }
}
