/* Vector math and bfloat16 conversions shared by the CPU kernels (included, not compiled on its
 * own). TL_HAVE_AVX2 / TL_HAVE_AVX512 say which intrinsics the build may use: ops/cpu_kernels.py
 * builds for the ISA level it detected (ops/cpu_features.py), so these follow the compiler's
 * target macros. */
#ifndef TOKENLOOM_VEC_MATH_H
#define TOKENLOOM_VEC_MATH_H
#include <stdint.h>

/* bfloat16 is the top half of a float32: widening is a shift; narrowing rounds to nearest even
 * (the kernels never produce NaN, see paged_decode.c, so no NaN case). */
static inline float tl_bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v = { (uint32_t)x << 16 };
    return v.f;
}
static inline uint16_t tl_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { f };
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}
/* A float32 rounded to bfloat16 and back: the value a bf16 op of the reference would keep. */
static inline float tl_round_bf16(float f) { return tl_bf16_to_f32(tl_f32_to_bf16(f)); }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* exp(x), eight at a time, for x in [-87, 88] (clamped outside): x = n ln2 + r, |r| <= ln2/2,
 * exp(r) by its degree-6 Taylor polynomial (relative error < 2e-7), 2^n built in the exponent
 * bits. */
static inline __m256 tl_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
/* The sum of the eight lanes. */
static inline float tl_hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
/* torch's flash-attention CPU kernel (the SDPA that transformers calls) exponentiates a
 * bfloat16 model's scores with a fast approximation, "fexp_u20" (Malossi et al., "Fast
 * Exponential Computation on SIMD Architectures"), whose results the decode kernel's bfloat16
 * path reproduces bit for bit (paged_decode.c, kv_chunk_fn): t = x log2(e); f = t - floor(t);
 * 2^f ~ 1 + f - c(f) with a cubic c; the bits of the float32 result are then
 * trunc(2^23 (t - c(f)) + 127 * 2^23) read as an integer -- the exponent field gets
 * floor(t) + 127 and the mantissa the fraction. Good to about bfloat16's precision: its float32
 * bits differ from expf's, and so, now and then, does their bfloat16 rounding. 0 below
 * ln(FLT_MIN); +inf above ln(FLT_MAX) (never reached here: the arguments are <= 0). Here for the
 * 8-lane build, below for the 16-lane one, the same steps in the same order. */
#define TL_FEXP_LO 0xc2aeac50u  /* ln(FLT_MIN) ~ -87.34 */
#define TL_FEXP_HI 0x42b17218u  /* ln(FLT_MAX) ~ 88.72 */
#define TL_FEXP_LOG2E 0x3fb8aa3bu
#define TL_FEXP_C0 ((float)0.00010703434948458272)
#define TL_FEXP_C1 ((float)0.30354260500649682)
#define TL_FEXP_C2 ((float)-0.22433836478672356)
#define TL_FEXP_C3 ((float)-0.079204240219773236)
#define TL_FEXP_A 8388608.0f     /* 2^23 */
#define TL_FEXP_B 1065353216.0f  /* 127 * 2^23 */
static inline __m256 tl_fexp8(__m256 x) {
    const __m256 below = _mm256_cmp_ps(
        x, _mm256_castsi256_ps(_mm256_set1_epi32((int)TL_FEXP_LO)), _CMP_LT_OS);
    const __m256 above = _mm256_cmp_ps(
        x, _mm256_castsi256_ps(_mm256_set1_epi32((int)TL_FEXP_HI)), _CMP_GT_OS);
    __m256 t = _mm256_mul_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32((int)TL_FEXP_LOG2E)));
    const __m256 f = _mm256_sub_ps(t, _mm256_floor_ps(t));
    __m256 c = _mm256_fmadd_ps(f, _mm256_set1_ps(TL_FEXP_C3), _mm256_set1_ps(TL_FEXP_C2));
    c = _mm256_fmadd_ps(f, c, _mm256_set1_ps(TL_FEXP_C1));
    c = _mm256_fmadd_ps(f, c, _mm256_set1_ps(TL_FEXP_C0));
    t = _mm256_sub_ps(t, c);
    __m256 y = _mm256_castsi256_ps(_mm256_cvttps_epi32(
        _mm256_fmadd_ps(_mm256_set1_ps(TL_FEXP_A), t, _mm256_set1_ps(TL_FEXP_B))));
    y = _mm256_andnot_ps(below, y);
    return _mm256_blendv_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(0x7F800000)), above);
}
/* The sum of the eight lanes in torch's order for a float vector (its vec_reduce_all): lanes i
 * and i ^ 4 first, then i ^ 2, then i ^ 1. */
static inline float tl_hsum8_torch(__m256 v) {
    v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 0x01));
    v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
    v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
    return _mm256_cvtss_f32(v);
}
#define TL_HAVE_AVX2 1
#else
#define TL_HAVE_AVX2 0
#endif

#if TL_HAVE_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* The same sixteen at a time. */
static inline __m512 tl_exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
/* silu(g) * u sixteen at a time, silu(g) = g / (1 + exp(-g)) in the reference's order: the one
 * routine of tl_silu_and_mul_f32 (elementwise.c) and of the quantized gate|up matmul that writes
 * it in its epilogue (quant_gemm_amx_bf16.inc), so the fused and the two-pass MLP agree bit for bit. */
static inline __m512 tl_silu_mul16(__m512 g, __m512 u) {
    const __m512 e = tl_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}
/* torch's fexp_u20, sixteen at a time (see tl_fexp8). */
static inline __m512 tl_fexp16(__m512 x) {
    const __mmask16 below = _mm512_cmp_ps_mask(
        x, _mm512_castsi512_ps(_mm512_set1_epi32((int)TL_FEXP_LO)), _CMP_LT_OS);
    const __mmask16 above = _mm512_cmp_ps_mask(
        x, _mm512_castsi512_ps(_mm512_set1_epi32((int)TL_FEXP_HI)), _CMP_GT_OS);
    __m512 t = _mm512_mul_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32((int)TL_FEXP_LOG2E)));
    const __m512 f = _mm512_sub_ps(t, _mm512_floor_ps(t));
    __m512 c = _mm512_fmadd_ps(f, _mm512_set1_ps(TL_FEXP_C3), _mm512_set1_ps(TL_FEXP_C2));
    c = _mm512_fmadd_ps(f, c, _mm512_set1_ps(TL_FEXP_C1));
    c = _mm512_fmadd_ps(f, c, _mm512_set1_ps(TL_FEXP_C0));
    t = _mm512_sub_ps(t, c);
    __m512i y = _mm512_cvttps_epi32(
        _mm512_fmadd_ps(_mm512_set1_ps(TL_FEXP_A), t, _mm512_set1_ps(TL_FEXP_B)));
    y = _mm512_mask_mov_epi32(y, below, _mm512_setzero_si512());
    y = _mm512_mask_mov_epi32(y, above, _mm512_set1_epi32(0x7F800000));
    return _mm512_castsi512_ps(y);
}
/* The sum of the sixteen lanes in torch's order (lanes i and i ^ 8, then i ^ 4, i ^ 2, i ^ 1). */
static inline float tl_hsum16_torch(__m512 v) {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
    return _mm512_cvtss_f32(v);
}
/* Sixteen bfloat16 (one 256-bit load) widened to float32. */
static inline __m512 tl_load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* Sixteen float32 rounded to bfloat16 (nearest even) and stored. */
static inline void tl_store16_bf16(uint16_t *p, __m512 v) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
#else
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
#endif
}
/* v rounded to bfloat16 and widened back (the reference's bf16 intermediate). */
static inline __m512 tl_round16_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}
#define TL_HAVE_AVX512 1
#else
#define TL_HAVE_AVX512 0
#endif
#endif
