/* The decoder's element-wise steps on the CPU, each one pass over its rows instead of the 2-7
 * PyTorch ops (and as many temporaries) it takes in eager mode, in float32 and in bfloat16:
 *
 *   tl_add_rms_norm_{f32,bf16}  residual += x (optional), out = weight * (r * 1/sqrt(mean(r^2) + eps))
 *   tl_silu_and_mul_{f32,bf16}  out = silu(gate) * up, gate and up the two halves of a fused row
 *   tl_rope_{f32,bf16}          rotate-half RoPE in place on a [T, heads, head_dim] strided view
 *
 * One pass saves the temporaries' memory traffic at prefill sizes and the eager ops' dispatch at
 * decode sizes (benchmarks/cpu_kernels.py). The arithmetic follows
 * the reference's order (the norm scales by 1/sqrt and then by the weight; silu is
 * x / (1 + exp(-x))), so float32 results differ from PyTorch's only by rounding of the
 * reductions and of exp (~1 ulp). The bfloat16 kernels compute in float32 and round to bfloat16
 * wherever the reference (transformers in bfloat16) keeps a bfloat16 intermediate, so they follow
 * its rounding, not only its math.
 *
 * Rows go to OpenMP threads when a call has enough of them to pay for waking the second thread
 * (TL_PAR_MIN elements). Built with the decode kernel (see ops/cpu_kernels.py), with AVX-512
 * loops where the build's ISA level has them and AVX2 / plain loops otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TL_PAR_MIN 32768

#include "vec_math.h"

void tl_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, int64_t r_stride,
                         const float *weight, float *out, int64_t out_stride, int32_t T,
                         int32_t H, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)T * H >= TL_PAR_MIN)
    for (int32_t t = 0; t < T; t++) {
        const float *xr = x + t * x_stride;
        float *o = out + t * out_stride;
        const float *r = xr;
        int i = 0;
        if (residual) {  /* r = residual += x, kept in place for the next block's add */
            float *rr = residual + t * r_stride;
            for (; i < H; i++) rr[i] += xr[i];
            r = rr;
        }
        float ss = 0.0f;
        i = 0;
#if TL_HAVE_AVX2
        /* 8 lanes by hand: the compiler's own AVX-512 loop for this was slower than its AVX2
         * one (benchmarks/cpu_isa_ab.py). */
        __m256 ss8 = _mm256_setzero_ps();
        for (; i + 8 <= H; i += 8) {
            const __m256 v = _mm256_loadu_ps(r + i);
            ss8 = _mm256_fmadd_ps(v, v, ss8);
        }
        ss = tl_hsum8(ss8);
#endif
        for (; i < H; i++) ss += r[i] * r[i];
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        i = 0;
#if TL_HAVE_AVX2
        const __m256 inv8 = _mm256_set1_ps(inv);
        for (; i + 8 <= H; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i),
                                                  _mm256_mul_ps(_mm256_loadu_ps(r + i), inv8)));
#endif
        for (; i < H; i++) o[i] = weight[i] * (r[i] * inv);
    }
}

/* 1 / sqrt(mean(r[i]^2) + eps) of a bfloat16 row in float32, the squares added in the order of
 * PyTorch's CPU sum over a contiguous last dimension (aten's cascade sum, as this torch build runs
 * it): 8-lane vectors dealt round-robin to 4 accumulators, each summed in levels of 16 vectors;
 * the vectors left over go to the first; the four are added in order, then the scalar tail and
 * the 8 lanes in order. transformers' bf16 RMSNorm takes `pow(2).mean(-1)` of the float32 row
 * (the squares of bf16 values are exact in float32) and then `torch.rsqrt`, so following that
 * order makes the norm match it bit for bit; one 16-lane accumulator rounded the output of ~1
 * row in 10^4 differently, enough to flip a greedy reply (benchmarks/CHANGELOG.md, "bf16 parity").
 * The build's -ffast-math would let the compiler reorder the sums and approximate the 1 / sqrt,
 * so this function is compiled without it. */
__attribute__((noinline, optimize("no-fast-math")))
static float torch_rms_inv_bf16(const uint16_t *r, int32_t H, float eps) {
    enum { L = 8, ILP = 4, LEVELS = 4, STEP = 16 };
    const int64_t nvec = H / L, size = nvec / ILP;
    float total = 0.0f, lanes[L] __attribute__((aligned(32)));
#if TL_HAVE_AVX2
    /* 8 lanes in registers: each lane's additions are the order below, as plain C would be */
    __m256 acc[LEVELS][ILP];
#pragma GCC unroll 16
    for (int l = 0; l < LEVELS; l++)
#pragma GCC unroll 4
        for (int k = 0; k < ILP; k++) acc[l][k] = _mm256_setzero_ps();
#define TL_SQ8(v) ({ const __m256 x_ = _mm256_castsi256_ps(_mm256_slli_epi32(                     \
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r + (v) * L))), 16));           \
        _mm256_mul_ps(x_, x_); })
    int64_t i = 0;
    while (i + STEP <= size) {
        for (int j = 0; j < STEP; j++, i++)
#pragma GCC unroll 4
            for (int k = 0; k < ILP; k++) acc[0][k] = _mm256_add_ps(acc[0][k], TL_SQ8(i * ILP + k));
        for (int l = 1; l < LEVELS; l++) {
#pragma GCC unroll 4
            for (int k = 0; k < ILP; k++) {
                acc[l][k] = _mm256_add_ps(acc[l][k], acc[l - 1][k]);
                acc[l - 1][k] = _mm256_setzero_ps();
            }
            if (i & ((int64_t)(STEP - 1) << (l * 4))) break;
        }
    }
    for (; i < size; i++)
#pragma GCC unroll 4
        for (int k = 0; k < ILP; k++) acc[0][k] = _mm256_add_ps(acc[0][k], TL_SQ8(i * ILP + k));
#pragma GCC unroll 4
    for (int l = 1; l < LEVELS; l++)
#pragma GCC unroll 4
        for (int k = 0; k < ILP; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[l][k]);
    for (int64_t v = size * ILP; v < nvec; v++) acc[0][0] = _mm256_add_ps(acc[0][0], TL_SQ8(v));
#undef TL_SQ8
    __m256 p = acc[0][0];
#pragma GCC unroll 4
    for (int k = 1; k < ILP; k++) p = _mm256_add_ps(p, acc[0][k]);
    _mm256_store_ps(lanes, p);
#else
    float acc[LEVELS][ILP][L];
    memset(acc, 0, sizeof acc);
#define TL_ADD_SQ(dst, v)                                                                          \
    for (int e_ = 0; e_ < L; e_++) {                                                              \
        const float x_ = tl_bf16_to_f32(r[(v) * L + e_]);                                         \
        (dst)[e_] += x_ * x_;                                                                     \
    }
    int64_t i = 0;
    while (i + STEP <= size) {
        for (int j = 0; j < STEP; j++, i++)
            for (int k = 0; k < ILP; k++) TL_ADD_SQ(acc[0][k], i * ILP + k);
        for (int l = 1; l < LEVELS; l++) {
            for (int k = 0; k < ILP; k++)
                for (int e = 0; e < L; e++) {
                    acc[l][k][e] += acc[l - 1][k][e];
                    acc[l - 1][k][e] = 0.0f;
                }
            if (i & ((int64_t)(STEP - 1) << (l * 4))) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < ILP; k++) TL_ADD_SQ(acc[0][k], i * ILP + k);
    for (int l = 1; l < LEVELS; l++)
        for (int k = 0; k < ILP; k++)
            for (int e = 0; e < L; e++) acc[0][k][e] += acc[l][k][e];
    for (int64_t v = size * ILP; v < nvec; v++) TL_ADD_SQ(acc[0][0], v);
#undef TL_ADD_SQ
    for (int k = 1; k < ILP; k++)
        for (int e = 0; e < L; e++) acc[0][0][e] += acc[0][k][e];
    memcpy(lanes, acc[0][0], sizeof lanes);
#endif
    for (int64_t e = nvec * L; e < H; e++) { const float v = tl_bf16_to_f32(r[e]); total += v * v; }
    for (int e = 0; e < L; e++) total += lanes[e];
    /* then as torch: mean = sum / H (a division), rsqrt = 1 / sqrt, both rounded once */
    return 1.0f / sqrtf(total / (float)H + eps);
}

/* bfloat16 rows and weight; the sum of squares in float32. The reference rounds the residual
 * sum, the normalized row and the product with the weight to bfloat16. */
void tl_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                          int64_t r_stride, const uint16_t *weight, uint16_t *out,
                          int64_t out_stride, int32_t T, int32_t H, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)T * H >= TL_PAR_MIN)
    for (int32_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * x_stride;
        uint16_t *o = out + t * out_stride;
        const uint16_t *r = xr;
        int i = 0;
        if (residual) {
            uint16_t *rr = residual + t * r_stride;
#if TL_HAVE_AVX512
            for (; i + 16 <= H; i += 16)
                tl_store16_bf16(rr + i, _mm512_add_ps(tl_load16_bf16(rr + i),
                                                      tl_load16_bf16(xr + i)));
#endif
            for (; i < H; i++) rr[i] = tl_f32_to_bf16(tl_bf16_to_f32(rr[i]) + tl_bf16_to_f32(xr[i]));
            r = rr;
        }
        const float inv = torch_rms_inv_bf16(r, H, eps);
        i = 0;
#if TL_HAVE_AVX512
        const __m512 inv16 = _mm512_set1_ps(inv);
        for (; i + 16 <= H; i += 16)
            tl_store16_bf16(o + i, _mm512_mul_ps(tl_load16_bf16(weight + i),
                                                 tl_round16_bf16(_mm512_mul_ps(tl_load16_bf16(r + i), inv16))));
#endif
        for (; i < H; i++)
            o[i] = tl_f32_to_bf16(tl_bf16_to_f32(weight[i]) * tl_round_bf16(tl_bf16_to_f32(r[i]) * inv));
    }
}

void tl_silu_and_mul_f32(const float *gate_up, int64_t in_stride, float *out, int64_t out_stride,
                         int32_t T, int32_t I) {
#pragma omp parallel for schedule(static) if ((int64_t)T * I >= TL_PAR_MIN)
    for (int32_t t = 0; t < T; t++) {
        const float *g = gate_up + t * in_stride, *u = g + I;
        float *o = out + t * out_stride;
        int i = 0;
#if TL_HAVE_AVX512
        for (; i + 16 <= I; i += 16)
            _mm512_storeu_ps(o + i, tl_silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#endif
#if TL_HAVE_AVX2
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = tl_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)),
                                                  _mm256_loadu_ps(u + i)));
        }
#endif
        /* exp clamped below overflow: -ffast-math assumes no inf, and x / inf would give NaN */
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(fminf(-g[i], 88.0f))) * u[i];
    }
}

/* silu(x) rounded to bfloat16 for every bfloat16 x (65,536 entries, indexed by x's bits, one
 * more to pad the vector gather), computed by F.silu itself and handed over by
 * ops/cpu_kernels.py at load; NULL: computed here. bf16 inputs take only 2^16 values, so the
 * table gives F.silu's bits exactly (torch's x / (1 + exp(-x)) with its own expf, Sleef's, whose
 * last bit ours missed now and then: ~1 output in 2,000 rounded to the other bf16 value,
 * benchmarks/CHANGELOG.md, "bf16 parity") and costs a gather instead of an exp and a division. */
static const uint16_t *silu_bf16_table;

void tl_set_silu_bf16_table(const uint16_t *table) { silu_bf16_table = table; }

/* bfloat16: silu(gate) is rounded to bfloat16 before the product, as the reference's two ops. */
void tl_silu_and_mul_bf16(const uint16_t *gate_up, int64_t in_stride, uint16_t *out,
                          int64_t out_stride, int32_t T, int32_t I) {
    const uint16_t *table = silu_bf16_table;
#pragma omp parallel for schedule(static) if ((int64_t)T * I >= TL_PAR_MIN)
    for (int32_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * in_stride, *u = g + I;
        uint16_t *o = out + t * out_stride;
        int i = 0;
#if TL_HAVE_AVX512
        if (table) {
            for (; i + 16 <= I; i += 16) {
                const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + i)));
                /* 4 bytes at table + 2 idx: the entry in the low half (hence the pad entry) */
                const __m512i e = _mm512_i32gather_epi32(idx, (const void *)table, 2);
                const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(e, 16));
                tl_store16_bf16(o + i, _mm512_mul_ps(sv, tl_load16_bf16(u + i)));
            }
        } else {
            const __m512 one16 = _mm512_set1_ps(1.0f);
            for (; i + 16 <= I; i += 16) {
                const __m512 gv = tl_load16_bf16(g + i);
                const __m512 e = tl_exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
                const __m512 sv = tl_round16_bf16(_mm512_div_ps(gv, _mm512_add_ps(one16, e)));
                tl_store16_bf16(o + i, _mm512_mul_ps(sv, tl_load16_bf16(u + i)));
            }
        }
#endif
        for (; i < I; i++) {
            float sv;
            if (table) {
                sv = tl_bf16_to_f32(table[g[i]]);
            } else {
                const float gv = tl_bf16_to_f32(g[i]);
                sv = tl_round_bf16(gv / (1.0f + expf(fminf(-gv, 88.0f))));
            }
            o[i] = tl_f32_to_bf16(sv * tl_bf16_to_f32(u[i]));
        }
    }
}

void tl_rope_f32(float *x, int64_t row_stride, int32_t T, int32_t num_heads, int32_t head_dim,
                 const int64_t *positions, const float *cos_sin, int64_t cs_stride) {
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) if ((int64_t)T * num_heads * head_dim >= TL_PAR_MIN)
    for (int32_t t = 0; t < T; t++) {
        const float *c = cos_sin + positions[t] * cs_stride, *s = c + half;
        for (int h = 0; h < num_heads; h++) {
            float *x1 = x + t * row_stride + (int64_t)h * head_dim, *x2 = x1 + half;
            for (int i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* bfloat16 rows over the float32 table: the reference casts cos and sin to bfloat16 and rounds
 * each product and the sum. head_dim/2 <= 256. */
void tl_rope_bf16(uint16_t *x, int64_t row_stride, int32_t T, int32_t num_heads,
                  int32_t head_dim, const int64_t *positions, const float *cos_sin,
                  int64_t cs_stride) {
    const int half = head_dim / 2;
    if (half > 256) return;
#pragma omp parallel for schedule(static) if ((int64_t)T * num_heads * head_dim >= TL_PAR_MIN)
    for (int32_t t = 0; t < T; t++) {
        const float *ct = cos_sin + positions[t] * cs_stride, *st = ct + half;
        float c[256], s[256];
        for (int i = 0; i < half; i++) { c[i] = tl_round_bf16(ct[i]); s[i] = tl_round_bf16(st[i]); }
        for (int h = 0; h < num_heads; h++) {
            uint16_t *x1 = x + t * row_stride + (int64_t)h * head_dim, *x2 = x1 + half;
            int i = 0;
#if TL_HAVE_AVX512
            for (; i + 16 <= half; i += 16) {
                const __m512 a = tl_load16_bf16(x1 + i), b = tl_load16_bf16(x2 + i);
                const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
                const __m512 nb = _mm512_sub_ps(_mm512_setzero_ps(), b);
                tl_store16_bf16(x1 + i, _mm512_add_ps(tl_round16_bf16(_mm512_mul_ps(a, cv)),
                                                      tl_round16_bf16(_mm512_mul_ps(nb, sv))));
                tl_store16_bf16(x2 + i, _mm512_add_ps(tl_round16_bf16(_mm512_mul_ps(b, cv)),
                                                      tl_round16_bf16(_mm512_mul_ps(a, sv))));
            }
#endif
            for (; i < half; i++) {
                const float a = tl_bf16_to_f32(x1[i]), b = tl_bf16_to_f32(x2[i]);
                x1[i] = tl_f32_to_bf16(tl_round_bf16(a * c[i]) + tl_round_bf16(-b * s[i]));
                x2[i] = tl_f32_to_bf16(tl_round_bf16(b * c[i]) + tl_round_bf16(a * s[i]));
            }
        }
    }
}

/* out[t] = the index of the first largest of x[t, 0..V) (float32 rows, stride x_stride), a NaN
 * counting as larger than any number, as torch.argmax has it: the greedy sampler's pick. torch's
 * argmax keeps an index beside every compared value, which makes it far slower than its max
 * without indices (benchmarks/CHANGELOG.md, "Greedy argmax"); here one vectorised pass finds the
 * row's maximum and
 * whether it has a NaN, and a second stops at its first occurrence (16 lanes at a time). NaN is
 * told by its bits, which -ffast-math leaves alone. */
void tl_argmax_f32(const float *x, int64_t x_stride, int32_t T, int64_t V, int64_t *out) {
#pragma omp parallel for schedule(static) if ((int64_t)T * V >= 8 * TL_PAR_MIN)
    for (int32_t t = 0; t < T; t++) {
        const float *r = x + t * x_stride;
        const uint32_t *u = (const uint32_t *)r;
        float m = -INFINITY;
        uint32_t nan = 0;
        for (int64_t j = 0; j < V; j++) {
            m = r[j] > m ? r[j] : m;
            nan |= (u[j] & 0x7FFFFFFFu) > 0x7F800000u;
        }
        int64_t j = 0;
        if (nan) {
            while (j < V && (u[j] & 0x7FFFFFFFu) <= 0x7F800000u) j++;
        } else {
            for (; j + 16 <= V; j += 16) {
                int hit = 0;
                for (int k = 0; k < 16; k++) hit |= r[j + k] == m;
                if (hit) break;
            }
            while (j < V && r[j] != m) j++;
        }
        out[t] = j < V ? j : 0;
    }
}
