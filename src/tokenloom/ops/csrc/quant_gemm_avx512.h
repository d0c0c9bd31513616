/* The AVX-512 VNNI kernels of quant_gemm.c, included by it after the shared layout helpers (UB,
 * CB, UNIT_BYTES, code_offset, KERNEL_ARGS, quantize_rows, tile_portable); their helpers
 * (load_codes512, params512, k_scales512) are used by the AMX kernels included after them. Kept
 * apart only to keep each file readable. */
/* ------------------------------------------------------------------ AVX-512 VNNI kernel */
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define INLINE512 static inline __attribute__((always_inline)) AVX512_TARGET

/* The 8 group vectors of a block's codes (16 columns x 4 k each). */
INLINE512 void load_codes512(const uint8_t *c, const int fmt, __m512i w[8]) {
    if (fmt == TL_Q8) {
        for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512((const void *)(c + 64 * g));
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int v = 0; v < 4; v++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(c + 64 * v));
        w[v] = _mm512_and_si512(raw, low);
        w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    if (fmt == TL_Q5_0 || fmt == TL_Q5_K) { /* bit g of each byte -> bit 4 */
        const __m512i hb = _mm512_loadu_si512((const void *)(c + 256)), bit4 = _mm512_set1_epi8(0x10);
        for (int g = 0; g < 8; g++) {
            const __m512i t = g <= 4 ? _mm512_slli_epi32(hb, 4 - g) : _mm512_srli_epi32(hb, g - 4);
            w[g] = _mm512_ternarylogic_epi32(w[g], t, bit4, 0xF8); /* w | (t & bit4) */
        }
    } else if (fmt == TL_Q6_K) { /* bits 2r, 2r+1 of each byte -> bits 4, 5 */
        const __m512i bits45 = _mm512_set1_epi8(0x30);
        for (int half = 0; half < 2; half++) {
            const __m512i hb = _mm512_loadu_si512((const void *)(c + 256 + 64 * half));
            const __m512i t[4] = {_mm512_slli_epi32(hb, 4), _mm512_slli_epi32(hb, 2), hb,
                                  _mm512_srli_epi32(hb, 2)};
            for (int r = 0; r < 4; r++)
                w[4 * half + r] = _mm512_ternarylogic_epi32(w[4 * half + r], t[r], bits45, 0xF8);
        }
    }
}

/* Per-column scale d and min m (16 lanes) of sub-block s of a unit; [1] is the second half's
 * (Q6_K only). */
INLINE512 void params512(const uint8_t *p, const int fmt, int s, __m512 d[2], __m512 m[2]) {
    if (fmt == TL_Q4_K || fmt == TL_Q5_K) {
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 64 + 16 * s)));
        const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 64 + 16 * (8 + (s & 3)))));
        const __m512i three = _mm512_set1_epi32(3);
        const int sh = 2 * (s >> 2);
        const __m512i sc = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(15)),
            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hi, sh), three), 4));
        const __m512i mn = _mm512_or_si512(_mm512_srli_epi32(lo, 4),
            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hi, sh + 4), three), 4));
        const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        d[0] = d[1] = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(sc));
        m[0] = m[1] = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dm), _mm512_cvtepi32_ps(mn));
    } else if (fmt == TL_Q6_K) {
        const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
        const __m512 neg32 = _mm512_set1_ps(-32.0f);
        for (int h = 0; h < 2; h++) {
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * (2 * s + h))));
            d[h] = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(sc));
            m[h] = _mm512_mul_ps(d[h], neg32);
        }
    } else {
        d[0] = d[1] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        m[0] = m[1] = fmt == TL_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)))
                                     : _mm512_mul_ps(d[0], _mm512_set1_ps(-code_offset(fmt)));
    }
}

/* Q4_K / Q5_K: a super-block's 6-bit scales and mins for all 8 sub-blocks and 16 columns at once,
 * as bytes: out[16 s + n] = scale of sub-block s, out[128 + 16 s + n] = its min (the planes of
 * the layout comment: per-sub-block decoding cost about as much as the block's dot products at
 * one row). Byte-wise shifts are 16-bit shifts whose spill into the neighbour byte is masked off. */
INLINE512 void k_scales512(const uint8_t *p, uint8_t out[256]) {
    const __m512i l0 = _mm512_loadu_si512((const void *)(p + 64));  /* planes 0-3 */
    const __m512i l1 = _mm512_loadu_si512((const void *)(p + 128)); /* planes 4-7 */
    const __m512i h = _mm512_loadu_si512((const void *)(p + 192));  /* planes 8-11 */
    const __m512i low = _mm512_set1_epi8(0x0f), b45 = _mm512_set1_epi8(0x30);
    const __m512i lo0 = _mm512_and_si512(l0, low), lo1 = _mm512_and_si512(l1, low);
    const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(l0, 4), low);
    const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(l1, 4), low);
    _mm512_storeu_si512((void *)out, _mm512_ternarylogic_epi32(lo0, _mm512_slli_epi16(h, 4), b45, 0xF8));
    _mm512_storeu_si512((void *)(out + 64), _mm512_ternarylogic_epi32(lo1, _mm512_slli_epi16(h, 2), b45, 0xF8));
    _mm512_storeu_si512((void *)(out + 128), _mm512_ternarylogic_epi32(hi0, h, b45, 0xF8));
    _mm512_storeu_si512((void *)(out + 192), _mm512_ternarylogic_epi32(hi1, _mm512_srli_epi16(h, 2), b45, 0xF8));
}

/* sum over groups g0..g1-1 of codes (16 columns) times the activation codes at xb. */
INLINE512 __m512i block_dot512(const __m512i w[8], const int8_t *xb, int g0, int g1) {
    __m512i s = _mm512_setzero_si512();
    for (int g = g0; g < g1; g++) {
        int32_t x4;
        memcpy(&x4, xb + 4 * g, 4);
        s = _mm512_dpbusd_epi32(s, w[g], _mm512_set1_epi32(x4));
    }
    return s;
}

INLINE512 __m512i dot_levels512(const __m512i w[8], const int8_t *xb, int64_t xplane, int levels,
                                int g0, int g1) {
    __m512i s = block_dot512(w, xb, g0, g1);
    if (levels == 2)
        s = _mm512_add_epi32(_mm512_slli_epi32(s, 8), block_dot512(w, xb + xplane, g0, g1));
    return s;
}

/* MR (1..MR_MAX) activation rows against one tile; FMT and LEVELS are constants in every
 * instance, so the format's branches fold away. A block's codes and scales are expanded once per
 * MR rows: 16 rather than 4 took 9 % (Q4_1) to 19 % (Q6_K, whose 6-bit codes cost the most to
 * expand) off 64-row matmuls. The loop over the rows stays rolled (the accumulators live in L1):
 * unrolled for a constant MR of 4 it measured a few % slower. */
INLINE512 void tile512_body(const int FMT, const int MR, const int LEVELS, const uint8_t *tile,
                            int64_t nb, const int8_t *xq, const float *xd, const float *xs,
                            const float *xh, int64_t K, float *y, int64_t ldy, int ncols,
                            int64_t xplane) {
    const int ub = UB(FMT), cb = CB(FMT), unit = UNIT_BYTES(FMT);
    __m512 acc[MR_MAX];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    uint8_t kbytes[256] __attribute__((aligned(64)));
    __m512 kd = _mm512_setzero_ps(), kdmin = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *u = tile + (j / ub) * unit;
        const int s = (int)(j % ub);
        __m512i w[8];
        load_codes512(u + s * cb, FMT, w);
        __m512 d[2], mn[2];
        if (FMT == TL_Q4_K || FMT == TL_Q5_K) {
            const uint8_t *p = u + ub * cb;
            if (s == 0) {
                k_scales512(p, kbytes);
                kd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
                kdmin = _mm512_sub_ps(_mm512_setzero_ps(),
                                      _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32))));
            }
            const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(kbytes + 16 * s))));
            const __m512 mm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(kbytes + 128 + 16 * s))));
            d[0] = d[1] = _mm512_mul_ps(kd, sc);
            mn[0] = mn[1] = _mm512_mul_ps(kdmin, mm);
        } else {
            params512(u + ub * cb, FMT, s, d, mn);
        }
        #pragma GCC unroll 1
        for (int r = 0; r < MR; r++) {
            const int8_t *xb = xq + r * K + j * QK;
            const __m512 dx = _mm512_set1_ps(xd[r * nb + j]);
            if (FMT == TL_Q6_K) {
                const __m512i s0 = dot_levels512(w, xb, xplane, LEVELS, 0, 4);
                const __m512i s1 = dot_levels512(w, xb, xplane, LEVELS, 4, 8);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d[0], dx), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d[1], dx), acc[r]);
                acc[r] = _mm512_fmadd_ps(mn[0], _mm512_set1_ps(xh[r * 2 * nb + 2 * j]), acc[r]);
                acc[r] = _mm512_fmadd_ps(mn[1], _mm512_set1_ps(xh[r * 2 * nb + 2 * j + 1]), acc[r]);
            } else {
                const __m512i s = dot_levels512(w, xb, xplane, LEVELS, 0, 8);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d[0], dx), acc[r]);
                acc[r] = _mm512_fmadd_ps(mn[0], _mm512_set1_ps(xs[r * nb + j]), acc[r]);
            }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << ncols) - 1u);
    for (int r = 0; r < MR; r++) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

typedef void (*tile512_fn)(int, const uint8_t *, int64_t, const int8_t *, const float *,
                           const float *, const float *, int64_t, float *, int64_t, int, int64_t);

#define DEFINE_TILE512(FMT, LEVELS)                                                              \
AVX512_TARGET static void tile512_##FMT##_##LEVELS(int mr, const uint8_t *tile, int64_t nb,     \
        const int8_t *xq, const float *xd, const float *xs, const float *xh, int64_t K, float *y, \
        int64_t ldy, int ncols, int64_t xplane) {                                                \
    tile512_body(FMT, mr, LEVELS, tile, nb, xq, xd, xs, xh, K, y, ldy, ncols, xplane);           \
}
#define DEFINE_TILE512_FMT(FMT) DEFINE_TILE512(FMT, 1) DEFINE_TILE512(FMT, 2)
DEFINE_TILE512_FMT(TL_Q4_0)
DEFINE_TILE512_FMT(TL_Q4_1)
DEFINE_TILE512_FMT(TL_Q8)
DEFINE_TILE512_FMT(TL_Q5_0)
DEFINE_TILE512_FMT(TL_Q4_K)
DEFINE_TILE512_FMT(TL_Q5_K)
DEFINE_TILE512_FMT(TL_Q6_K)

#define TILE512_ROW(FMT) {tile512_##FMT##_1, tile512_##FMT##_2}
/* [format][levels - 1] */
static const tile512_fn TILE512[TL_NFMT][2] = {
    TILE512_ROW(TL_Q4_0), TILE512_ROW(TL_Q4_1), TILE512_ROW(TL_Q8), TILE512_ROW(TL_Q5_0),
    TILE512_ROW(TL_Q4_K), TILE512_ROW(TL_Q5_K), TILE512_ROW(TL_Q6_K)};

static void tile_avx512(KERNEL_ARGS) {
    const tile512_fn fn = TILE512[fmt][levels - 1];
    for (int64_t r = 0; r < rows; r += MR_MAX) {
        const int mr = rows - r < MR_MAX ? (int)(rows - r) : MR_MAX;
        fn(mr, tile, nb, xq + r * K, xd + r * nb, xs + r * nb, xh + r * 2 * nb, K,
                    y + r * ldy, ldy, ncols, xplane);
    }
}

/* quantize_rows with AVX-512: a block's 32 activations are two vectors, so its scale, codes and
 * sums take a few dozen instructions instead of ~100 scalar steps each. The same rounding as the
 * scalar loop (round to nearest even, the error term as one fused multiply-add), the same codes.
 * At 64 rows the scalar loop took ~20 % of an AMX matmul. */
AVX512_TARGET static void quantize_rows512(const float *x, int64_t ldx, int64_t m0, int64_t m1,
                                           int64_t M, int64_t K, int levels, int8_t *xq, float *xd,
                                           float *xs, float *xh) {
    const int64_t nb = K / QK;
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (int64_t m = m0; m < m1; m++) {
        const float *xr = x + m * ldx;
        for (int64_t j = 0; j < nb; j++) {
            const __m512 a = _mm512_loadu_ps(xr + j * QK), b = _mm512_loadu_ps(xr + j * QK + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            float d = amax / 127.0f;
            const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id));
            const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
            int8_t *q1 = xq + m * K + j * QK;
            _mm_storeu_si128((__m128i *)q1, _mm512_cvtepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(q1 + 16), _mm512_cvtepi32_epi8(qb));
            int h0 = _mm512_reduce_add_epi32(qa), h1 = _mm512_reduce_add_epi32(qb);
            if (levels == 2) {
                const __m512 dv = _mm512_set1_ps(d), id2 = _mm512_set1_ps(d > 0.0f ? 256.0f / d : 0.0f);
                __m512i ra = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_fnmadd_ps(dv, _mm512_cvtepi32_ps(qa), a), id2));
                __m512i rb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_fnmadd_ps(dv, _mm512_cvtepi32_ps(qb), b), id2));
                ra = _mm512_min_epi32(_mm512_max_epi32(ra, lo), hi);
                rb = _mm512_min_epi32(_mm512_max_epi32(rb, lo), hi);
                int8_t *q2 = xq + M * K + m * K + j * QK;
                _mm_storeu_si128((__m128i *)q2, _mm512_cvtepi32_epi8(ra));
                _mm_storeu_si128((__m128i *)(q2 + 16), _mm512_cvtepi32_epi8(rb));
                d /= 256.0f;
                h0 = 256 * h0 + _mm512_reduce_add_epi32(ra);
                h1 = 256 * h1 + _mm512_reduce_add_epi32(rb);
            }
            xd[m * nb + j] = d;
            xs[m * nb + j] = d * (float)(h0 + h1);
            xh[m * 2 * nb + 2 * j] = d * (float)h0;
            xh[m * 2 * nb + 2 * j + 1] = d * (float)h1;
        }
    }
}
