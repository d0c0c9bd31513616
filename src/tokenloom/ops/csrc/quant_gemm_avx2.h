/* The AVX2 kernels of quant_gemm.c, included by it after the shared layout helpers (UB, CB,
 * UNIT_BYTES, code_offset, KERNEL_ARGS, tile_portable): one body per format, specialised at
 * compile time, dispatched through TILE2. Kept apart only to keep each file readable. */
/* ----------------------------------------------------------------------- AVX2 kernel */
/* VPMADDUBSW multiplies unsigned by signed bytes into saturating int16 pairs: safe for codes up
 * to 6 bits (2 * 63 * 127 < 32767). Q8's 8-bit codes would saturate, so they are taken back to
 * signed weights w and multiplied as |w| times x with w's sign (2 * 128 * 127 < 32767), with no
 * offset left to correct. Two 4-bit groups can share one int16 sum (4 * 15 * 127); wider codes
 * are widened per group.
 * Columns are done 8 at a time (half h of the tile); a block's codes and parameters are expanded
 * once per row block and applied to every row, accumulating in `acc`. */
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define INLINE2 static inline __attribute__((always_inline)) AVX2_TARGET

INLINE2 void load_codes256(const uint8_t *c, const int fmt, int h, __m256i w[8]) {
    if (fmt == TL_Q8) { /* signed weights */
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int g = 0; g < 8; g++)
            w[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(c + 64 * g + 32 * h)), flip);
        return;
    }
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int v = 0; v < 4; v++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(c + 64 * v + 32 * h));
        w[v] = _mm256_and_si256(raw, low);
        w[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    if (fmt == TL_Q5_0 || fmt == TL_Q5_K) {
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(c + 256 + 32 * h));
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        for (int g = 0; g < 8; g++) {
            const __m256i t = g <= 4 ? _mm256_slli_epi32(hb, 4 - g) : _mm256_srli_epi32(hb, g - 4);
            w[g] = _mm256_or_si256(w[g], _mm256_and_si256(t, bit4));
        }
    } else if (fmt == TL_Q6_K) {
        const __m256i bits45 = _mm256_set1_epi8(0x30);
        for (int half = 0; half < 2; half++) {
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(c + 256 + 64 * half + 32 * h));
            const __m256i t[4] = {_mm256_slli_epi32(hb, 4), _mm256_slli_epi32(hb, 2), hb,
                                  _mm256_srli_epi32(hb, 2)};
            for (int r = 0; r < 4; r++)
                w[4 * half + r] = _mm256_or_si256(w[4 * half + r], _mm256_and_si256(t[r], bits45));
        }
    }
}

INLINE2 void params256(const uint8_t *p, const int fmt, int s, int h, __m256 d[2], __m256 m[2]) {
    if (fmt == TL_Q4_K || fmt == TL_Q5_K) {
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 64 + 16 * s + 8 * h)));
        const __m256i hi = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64((const __m128i *)(p + 64 + 16 * (8 + (s & 3)) + 8 * h)));
        const __m256i three = _mm256_set1_epi32(3);
        const int sh = 2 * (s >> 2);
        const __m256i sc = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, sh), three), 4));
        const __m256i mn = _mm256_or_si256(_mm256_srli_epi32(lo, 4),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, sh + 4), three), 4));
        const __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 + 16 * h)));
        d[0] = d[1] = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(sc));
        m[0] = m[1] = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), dm), _mm256_cvtepi32_ps(mn));
    } else if (fmt == TL_Q6_K) {
        const __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 256 + 16 * h)));
        for (int k = 0; k < 2; k++) {
            const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 16 * (2 * s + k) + 8 * h)));
            d[k] = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(sc));
            m[k] = _mm256_mul_ps(d[k], _mm256_set1_ps(-32.0f));
        }
    } else {
        d[0] = d[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
        m[0] = m[1] = fmt == TL_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 + 16 * h)))
                    : fmt == TL_Q8   ? _mm256_setzero_ps() /* signed weights: no offset */
                                     : _mm256_mul_ps(d[0], _mm256_set1_ps(-code_offset(fmt)));
    }
}

/* Groups g0..g1-1 of the codes times the activation codes at xb, int32 per column. */
INLINE2 __m256i block_dot256(const __m256i w[8], const int8_t *xb, int g0, int g1, int narrow,
                             int is_signed) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    for (int g = g0; g < g1; g += 1 + narrow) {
        int32_t a4;
        memcpy(&a4, xb + 4 * g, 4);
        __m256i p = is_signed
            ? _mm256_maddubs_epi16(_mm256_abs_epi8(w[g]), _mm256_sign_epi8(_mm256_set1_epi32(a4), w[g]))
            : _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(a4));
        if (narrow) {
            int32_t b4;
            memcpy(&b4, xb + 4 * (g + 1), 4);
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[g + 1], _mm256_set1_epi32(b4)));
        }
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
    }
    return s;
}

INLINE2 void tile_avx2_body(const int FMT, KERNEL_ARGS) {
    (void)fmt;
    const int ub = UB(FMT), cb = CB(FMT), unit = UNIT_BYTES(FMT);
    const int narrow = FMT == TL_Q4_0 || FMT == TL_Q4_1 || FMT == TL_Q4_K;
    float acc[M_BLOCK][TILE_N];
    memset(acc, 0, sizeof(float) * TILE_N * (size_t)rows);
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *u = tile + (j / ub) * unit;
        for (int h = 0; h < 2; h++) {
            __m256i w[8];
            load_codes256(u + (j % ub) * cb, FMT, h, w);
            __m256 d[2], mn[2];
            params256(u + ub * cb, FMT, (int)(j % ub), h, d, mn);
            for (int64_t r = 0; r < rows; r++) {
                __m256 a = _mm256_loadu_ps(acc[r] + 8 * h);
                const __m256 dx = _mm256_set1_ps(xd[r * nb + j]);
                for (int part = 0; part < (FMT == TL_Q6_K ? 2 : 1); part++) {
                    const int g0 = FMT == TL_Q6_K ? 4 * part : 0, g1 = FMT == TL_Q6_K ? g0 + 4 : 8;
                    const int8_t *xb = xq + r * K + j * QK;
                    __m256i s = block_dot256(w, xb, g0, g1, narrow, FMT == TL_Q8);
                    if (levels == 2)
                        s = _mm256_add_epi32(_mm256_slli_epi32(s, 8),
                                             block_dot256(w, xb + xplane, g0, g1, narrow, FMT == TL_Q8));
                    const float sx = FMT == TL_Q6_K ? xh[r * 2 * nb + 2 * j + part] : xs[r * nb + j];
                    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d[part], dx), a);
                    a = _mm256_fmadd_ps(mn[part], _mm256_set1_ps(sx), a);
                }
                _mm256_storeu_ps(acc[r] + 8 * h, a);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) memcpy(y + r * ldy, acc[r], sizeof(float) * (size_t)ncols);
}

#define DEFINE_TILE2(FMT) \
AVX2_TARGET static void tile2_##FMT(KERNEL_ARGS) { \
    tile_avx2_body(FMT, tile, fmt, nb, xq, xd, xs, xh, K, rows, y, ldy, ncols, levels, xplane); \
}
TL_EACH_FORMAT(DEFINE_TILE2)
#define TILE2_NAME(FMT) tile2_##FMT,

typedef void (*tile_fn)(KERNEL_ARGS);
static const tile_fn TILE2[TL_NFMT] = {TL_EACH_FORMAT(TILE2_NAME)};
