/* y = x W^T (+ bias) on MXFP4 weights as gpt-oss ships its experts (model/mxfp4.py): each row of
 * W [N, K] is K / 32 groups, a group 16 bytes of E2M1 nibbles (value 2j in the low nibble of byte
 * j, 2j + 1 in the high one) and one E8M0 scale byte (2^(e - 127)). For the few rows of a decode
 * step (ops/kernel_plan's mxfp4_matmul): the bytes of a weight row are read once for all rows of
 * x, each nibble made float through a 16-entry table already times its group's scale (exact: the
 * scale is a power of two), then multiplied into float32 sums. The results are those of a float32
 * matmul on the dequantized weight, up to the order of the sums.
 *
 * x is first copied group by group into the nibbles' order (the 16 even values, then the 16 odd
 * ones), so that the low nibbles of a group's 16 bytes meet 16 contiguous floats and the high
 * nibbles the next 16. Loops by the build's target (cpu_kernels' ISA level): AVX-512 F/BW/VL,
 * AVX2+FMA, or plain C.
 *
 * tl_mxfp4_unpack makes the whole matrix float32 or bfloat16 (exact in both, but for scales past
 * bfloat16's range), for the steps of many rows, whose matmul a library does better. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define MX_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define MX_AVX2 1
#include <immintrin.h>
#endif

#define MX_GROUP 32
#define MX_BYTES 16 /* nibble bytes of a group */

static const float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 2^(e - 127) (e = 0: the subnormal 2^-127; 255, E8M0's NaN, gives infinity as torch's exp2 does) */
static inline float e8m0(uint8_t e) {
    uint32_t bits = e ? (uint32_t)e << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* xp[m][32 g + i] = x[m][32 g + 2 i] and xp[m][32 g + 16 + i] = x[m][32 g + 2 i + 1], i < 16 */
static void nibble_order(const float *x, int64_t ldx, int64_t M, int64_t K, float *xp) {
    for (int64_t m = 0; m < M; m++) {
        const float *src = x + m * ldx;
        float *dst = xp + m * K;
        for (int64_t g = 0; g < K; g += MX_GROUP)
            for (int i = 0; i < MX_GROUP / 2; i++) {
                dst[g + i] = src[g + 2 * i];
                dst[g + MX_GROUP / 2 + i] = src[g + 2 * i + 1];
            }
    }
}

#if defined(MX_AVX512)
#define MX_ROWS 8 /* rows of x per pass over a weight row: two accumulators each fit the registers */
#define MX_NAME "avx512"

/* out[m] = sum over the row's groups, rows 0..MR-1 of xp (MR a constant where it is inlined) */
static inline __attribute__((always_inline)) void row_dot(const uint8_t *b, const uint8_t *s, int64_t G,
                                                          const float *xp, int64_t K, int MR, float *out) {
    const __m512 lut = _mm512_loadu_ps(kE2M1);
    const __m512i low = _mm512_set1_epi32(0x0F);
    __m512 even[MX_ROWS], odd[MX_ROWS];
    for (int m = 0; m < MR; m++) even[m] = odd[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + g * MX_BYTES)));
        __m512 table = _mm512_mul_ps(lut, _mm512_set1_ps(e8m0(s[g])));
        __m512 we = _mm512_permutexvar_ps(_mm512_and_si512(v, low), table);
        __m512 wo = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        const float *xg = xp + g * MX_GROUP;
        for (int m = 0; m < MR; m++) {
            even[m] = _mm512_fmadd_ps(we, _mm512_loadu_ps(xg + m * K), even[m]);
            odd[m] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(xg + m * K + 16), odd[m]);
        }
    }
    for (int m = 0; m < MR; m++) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
}

#elif defined(MX_AVX2)
#define MX_ROWS 4 /* 16 ymm registers: four weight vectors, four accumulators, the tables */
#define MX_NAME "avx2"

static inline __attribute__((always_inline)) void row_dot(const uint8_t *b, const uint8_t *s, int64_t G,
                                                          const float *xp, int64_t K, int MR, float *out) {
    /* the doubled E2M1 values as int8 (a byte shuffle looks them up), times half the scale */
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256 acc[MX_ROWS];
    for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(b + g * MX_BYTES));
        __m128i qe = _mm_shuffle_epi8(lut, _mm_and_si128(v, low));
        __m128i qo = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), low));
        __m256 half = _mm256_set1_ps(e8m0(s[g]) * 0.5f);
        __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qe)), half);
        __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(qe, 8))), half);
        __m256 w2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qo)), half);
        __m256 w3 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(qo, 8))), half);
        const float *xg = xp + g * MX_GROUP;
        for (int m = 0; m < MR; m++) {
            const float *xm = xg + m * K;
            __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xm));
            t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), t);
            t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), t);
            acc[m] = _mm256_add_ps(acc[m], _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), t));
        }
    }
    for (int m = 0; m < MR; m++) {
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        r = _mm_add_ss(r, _mm_movehdup_ps(r));
        out[m] = _mm_cvtss_f32(r);
    }
}

#else
#define MX_ROWS 4
#define MX_NAME "c"

static inline void row_dot(const uint8_t *b, const uint8_t *s, int64_t G, const float *xp, int64_t K,
                           int MR, float *out) {
    for (int m = 0; m < MR; m++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < G; g++) {
            const float scale = e8m0(s[g]), *xg = xp + m * K + g * MX_GROUP;
            float t = 0.0f;
            for (int j = 0; j < MX_BYTES; j++) {
                uint8_t byte = b[g * MX_BYTES + j];
                t += kE2M1[byte & 0x0F] * xg[j] + kE2M1[byte >> 4] * xg[MX_BYTES + j];
            }
            acc += t * scale;
        }
        out[m] = acc;
    }
}
#endif

/* One weight row against every row of x, MX_ROWS at a time: the row's bytes stay in L1 between
 * the passes, so memory reads them once. The switch makes MR a constant in each inlined copy. */
static void weight_row(const uint8_t *b, const uint8_t *s, int64_t G, const float *xp, int64_t K, int64_t M,
                       float *y, int64_t ldy, float bias) {
    float out[MX_ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += MX_ROWS) {
        int mr = (int)(M - m0 < MX_ROWS ? M - m0 : MX_ROWS);
        const float *xm = xp + m0 * K;
        switch (mr) {
        case 1: row_dot(b, s, G, xm, K, 1, out); break;
        case 2: row_dot(b, s, G, xm, K, 2, out); break;
        case 3: row_dot(b, s, G, xm, K, 3, out); break;
#if MX_ROWS > 4
        case 4: row_dot(b, s, G, xm, K, 4, out); break;
        case 5: row_dot(b, s, G, xm, K, 5, out); break;
        case 6: row_dot(b, s, G, xm, K, 6, out); break;
        case 7: row_dot(b, s, G, xm, K, 7, out); break;
#endif
        default: row_dot(b, s, G, xm, K, MX_ROWS, out); break;
        }
        for (int m = 0; m < mr; m++) y[(m0 + m) * ldy] = out[m] + bias;
    }
}

/* Which loops this build runs: 2 AVX-512, 1 AVX2, 0 plain C. */
int tl_mxfp4_isa(void) {
#if defined(MX_AVX512)
    return 2;
#elif defined(MX_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) W^T + bias, W as `blocks` [N, K / 32, 16]
 * and `scales` [N, K / 32] uint8, both contiguous; bias [N] or NULL. Returns 0, -1 for a K that is
 * not whole groups, -3 when the reordered copy of x cannot be allocated. */
int tl_mxfp4_linear(const uint8_t *blocks, const uint8_t *scales, int64_t N, int64_t K, const float *x,
                    int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias) {
    if (K <= 0 || K % MX_GROUP || N < 0 || M < 0) return -1;
    if (M == 0 || N == 0) return 0;
    float *xp = (float *)aligned_alloc(64, (size_t)((M * K * sizeof(float) + 63) / 64 * 64));
    if (!xp) return -3;
    nibble_order(x, ldx, M, K, xp);
    const int64_t G = K / MX_GROUP;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
    for (int64_t n = 0; n < N; n++)
        weight_row(blocks + n * G * MX_BYTES, scales + n * G, G, xp, K, M, y + n, ldy, bias ? bias[n] : 0.0f);
    free(xp);
    return 0;
}

/* out [N, K] float32 (bf16 = 0) or bfloat16 (bf16 = 1, its bits) = the weight in `blocks` [N, K /
 * 32, 16] and `scales` [N, K / 32]: model/mxfp4.dequantize's values. Returns 0, -1 for a bad K. */
int tl_mxfp4_unpack(const uint8_t *blocks, const uint8_t *scales, int64_t N, int64_t K, void *out, int bf16) {
    if (K <= 0 || K % MX_GROUP || N < 0) return -1;
    const int64_t groups = N * (K / MX_GROUP);
#pragma omp parallel for schedule(static) if (groups >= 4096)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b = blocks + g * MX_BYTES;
        const float scale = e8m0(scales[g]);
        float vals[MX_GROUP];
#if defined(MX_AVX512)
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
        const __m512 table = _mm512_mul_ps(_mm512_loadu_ps(kE2M1), _mm512_set1_ps(scale));
        const __m512 we = _mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)), table);
        const __m512 wo = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        /* even and odd values back side by side: value 2j is we[j], 2j + 1 is wo[j] */
        const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
        _mm512_storeu_ps(vals, _mm512_permutex2var_ps(we, first, wo));
        _mm512_storeu_ps(vals + 16, _mm512_permutex2var_ps(we, second, wo));
#else
        for (int j = 0; j < MX_BYTES; j++) {
            vals[2 * j] = kE2M1[b[j] & 0x0F] * scale;
            vals[2 * j + 1] = kE2M1[b[j] >> 4] * scale;
        }
#endif
        if (bf16) {
            /* every value has at most two significant bits: its bfloat16 is its float32's top half */
            uint16_t *dst = (uint16_t *)out + g * MX_GROUP;
            for (int i = 0; i < MX_GROUP; i++) {
                uint32_t bits;
                memcpy(&bits, &vals[i], sizeof bits);
                dst[i] = (uint16_t)(bits >> 16);
            }
        } else {
            memcpy((float *)out + g * MX_GROUP, vals, sizeof vals);
        }
    }
    return 0;
}
