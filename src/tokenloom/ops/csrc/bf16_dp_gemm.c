/* bfloat16 matmul with AVX512-BF16 dot products (VDPBF16PS), on weights packed for AMX.
 *
 * Why: CPUs with AVX512-BF16 but no AMX (AMD's, for one) multiply bf16 pairs natively, and
 * there the float path's matmuls were oneDNN's packed bf16 ones, reached only through a PyTorch
 * op per matmul: the fused decode step (decode_step.c) could not call them, so every decode step
 * of a bf16 model ran a few hundred Python-level calls, during which the second thread waited
 * (perf, benchmarks/CHANGELOG.md). This
 * kernel reads the AMX kernel's packed layout (amx_gemm.c): row kk of a 16-column tile holds
 * (w[n][2kk], w[n][2kk + 1]) for 16 columns n, which is exactly VDPBF16PS's second operand; so
 * one packed copy serves both kernels, and tl_bf16_packed_linear picks the tiles where the CPU
 * has them.
 *
 * Each output is summed over k pairs in order, one VDPBF16PS per pair, as oneDNN's AVX512-BF16
 * matmul sums (a bf16 F.linear on such a CPU), in one go or in K chunks added in order (kchunk,
 * as tl_amx_bf16_linear; ops/amx.py says which oneDNN takes), then the bias is added and the sum
 * rounded to bfloat16 once, nearest even.
 */
#include <stdint.h>

#include "vec_math.h"

int32_t tl_amx_bf16_available(void);
int32_t tl_amx_bf16_linear(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *packed,
                           int64_t N, int64_t K, const float *bias, uint16_t *y, int64_t ldy,
                           void *scratch, int64_t kchunk);

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define TL_BF16DP 1
#include <immintrin.h>
#include <omp.h>

#include "work_steal.h"

/* Rows per item at most: 13 x 2 accumulators, 2 weight vectors, 1 broadcast of 32 registers.
 * M rows are split into ceil(M / 13) blocks of near-equal size (64 rows: 13, 13, 13, 13, 12),
 * so that no block is a small remainder that reads a column pair's weights for a few rows. */
#define TL_DP_MR 13

static int64_t dp_up32(int64_t n) { return (n + 31) & ~(int64_t)31; }

/* Rows [m0, m0 + mr) x columns [n0, n0 + 32) of y: mr is a constant in every call (the switch
 * below), so acc lives in registers. b0, b1: the two 16-column blocks' k-pair streams. pf,
 * pf + pf_gap: two streams to prefetch into L2 alongside, a line each per k pair (the next
 * column pair's, or b0 and b1 again when there is nothing to fetch). */
static inline __attribute__((always_inline)) void
dp_block(const int mr, const uint16_t *x, int64_t ldx, int64_t K, const uint16_t *b0,
         const uint16_t *b1, const uint16_t *pf, int64_t pf_gap, int64_t kpchunk,
         const float *bias, int cols, uint16_t *y, int64_t ldy) {
    __m512 acc[TL_DP_MR][2], sum[TL_DP_MR][2];
    const int32_t *xr[TL_DP_MR];
#pragma GCC unroll 13
    for (int r = 0; r < mr; r++) {
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        xr[r] = (const int32_t *)(x + r * ldx);
    }
    const int64_t kp_full = K / 2; /* whole pairs; an odd K's last k is a pair with zero */
    int chunks = 0;
    for (int64_t kp0 = 0; kp0 < kp_full; kp0 += kpchunk) {
        const int64_t kp1 = kp0 + kpchunk < kp_full ? kp0 + kpchunk : kp_full;
        if (kp0) { /* the chunk just summed: into sum, in order, and start the next from zero */
#pragma GCC unroll 13
            for (int r = 0; r < mr; r++)
                for (int j = 0; j < 2; j++) {
                    sum[r][j] = chunks ? _mm512_add_ps(sum[r][j], acc[r][j]) : acc[r][j];
                    acc[r][j] = _mm512_setzero_ps();
                }
            chunks++;
        }
        for (int64_t kp = kp0; kp < kp1; kp++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + kp * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + kp * 32);
            _mm_prefetch((const char *)(pf + kp * 32), _MM_HINT_T1);
            _mm_prefetch((const char *)(pf + pf_gap + kp * 32), _MM_HINT_T1);
#pragma GCC unroll 13
            for (int r = 0; r < mr; r++) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32(xr[r][kp]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
            }
        }
    }
    if (K & 1) { /* the odd k: (x[K - 1], 0) against (w[K - 1], 0 padding) */
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + kp_full * 32);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + kp_full * 32);
#pragma GCC unroll 13
        for (int r = 0; r < mr; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(x[r * ldx + K - 1]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
        }
    }
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
    const __m512 bb0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 bb1 = bias && m1 ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 13
    for (int r = 0; r < mr; r++) {
        __m512 s0 = acc[r][0], s1 = acc[r][1];
        if (chunks) {
            s0 = _mm512_add_ps(sum[r][0], s0);
            s1 = _mm512_add_ps(sum[r][1], s1);
        }
        s0 = _mm512_add_ps(s0, bb0);
        s1 = _mm512_add_ps(s1, bb1);
        uint16_t *out = y + r * ldy;
        if (cols == 32) { /* (two conversions: Bochs' VCVTNE2PS2BF16 gets the upper half wrong) */
            _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(s0));
            _mm256_storeu_si256((__m256i *)(out + 16), (__m256i)_mm512_cvtneps_pbh(s1));
        } else {
            _mm256_mask_storeu_epi16(out, m0, (__m256i)_mm512_cvtneps_pbh(s0));
            if (m1) _mm256_mask_storeu_epi16(out + 16, m1, (__m256i)_mm512_cvtneps_pbh(s1));
        }
    }
}

#define TL_DP_CASE(n) \
    case n: dp_block(n, x, ldx, K, b0, b1, pf, pf_gap, kpchunk, bias, cols, y, ldy); break;

static void dp_block_any(int mr, const uint16_t *x, int64_t ldx, int64_t K, const uint16_t *b0,
                         const uint16_t *b1, const uint16_t *pf, int64_t pf_gap, int64_t kpchunk,
                         const float *bias, int cols, uint16_t *y, int64_t ldy) {
    switch (mr) {
        TL_DP_CASE(1) TL_DP_CASE(2) TL_DP_CASE(3) TL_DP_CASE(4) TL_DP_CASE(5) TL_DP_CASE(6)
        TL_DP_CASE(7) TL_DP_CASE(8) TL_DP_CASE(9) TL_DP_CASE(10) TL_DP_CASE(11) TL_DP_CASE(12)
        TL_DP_CASE(13)
        default: break;
    }
}
#endif

/* 1 where this build has the AVX512-BF16 kernel (the CPU is checked by the caller: the library
 * is built for this machine's flags, ops/cpu_kernels). */
int32_t tl_bf16dp_available(void) {
#ifdef TL_BF16DP
    return 1;
#else
    return 0;
#endif
}

/* y[M, N] (row stride ldy, bfloat16) = x[M, K] (row stride ldx, bfloat16) W^T (+ bias, float32),
 * W packed by tl_amx_bf16_pack; kchunk as tl_amx_bf16_linear's. Returns 0, or -1 without the
 * kernel in this build. */
int32_t tl_bf16dp_linear(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *packed,
                         int64_t N, int64_t K, const float *bias, uint16_t *y, int64_t ldy,
                         int64_t kchunk) {
#ifdef TL_BF16DP
    if (M <= 0 || N <= 0) return 0;
    const int64_t nkb = dp_up32(K) / 32, npairs = dp_up32(N) / 32;
    const int64_t kpchunk = kchunk > 0 && kchunk < K && kchunk % 32 == 0 ? kchunk / 2 : (K + 1) / 2;
    const int64_t mblocks = (M + TL_DP_MR - 1) / TL_DP_MR;
    /* Items: (column pair, row block), the column pairs outermost, so a thread's contiguous run
     * streams its share of the weight once and a pair's weight (K x 32 bf16, in L2) serves all
     * its row blocks in a row. A thread's first block of a pair, in the direction it walks (a
     * thief walks back), prefetches the pair it will take next: the hardware prefetcher alone
     * left that first block waiting on memory (benchmarks/amx_matmul.py). */
    const int64_t items = npairs * mblocks;
    tl_run runs[TL_STEAL_MAX_THREADS];
#pragma omp parallel if (items > 1)
    {
        tl_items walk = tl_items_start(runs, items);
        for (int64_t it, nx; (it = tl_items_next(&walk, &nx)) >= 0;) {
            const int64_t np = it / mblocks, mb = it - np * mblocks;
            const int64_t m0 = M * mb / mblocks, n0 = np * 32;
            const int mr = (int)(M * (mb + 1) / mblocks - m0);
            const int cols = (int)(N - n0 < 32 ? N - n0 : 32);
            const uint16_t *b0 = packed + (2 * np) * nkb * 512, *b1 = b0 + nkb * 512;
            const int64_t dir = nx >= 0 && nx < it ? -1 : 1, pn = np + dir;
            const int entry = dir > 0 ? mb == 0 : mb == mblocks - 1;
            const uint16_t *pf =
                entry && pn >= 0 && pn < npairs ? packed + (2 * pn) * nkb * 512 : b0;
            dp_block_any(mr, x + m0 * ldx, ldx, K, b0, b1, pf, nkb * 512, kpchunk,
                         bias ? bias + n0 : NULL, cols, y + m0 * ldy + n0, ldy);
        }
    }
    return 0;
#else
    (void)x; (void)ldx; (void)M; (void)packed; (void)N; (void)K; (void)bias; (void)y; (void)ldy;
    (void)kchunk;
    return -1;
#endif
}

/* Which kernel tl_bf16_packed_linear runs (tl_bf16_set_kernel): 1 AMX tiles, 2 AVX512-BF16 dot
 * products, 0 the first this process has (tiles where granted). */
static int g_kernel = 0;

void tl_bf16_set_kernel(int32_t kernel) { g_kernel = kernel; }

/* The kernel tl_bf16_packed_linear runs: 1 tiles, 2 dot products, 0 neither. */
int32_t tl_bf16_kernel(void) {
    if (g_kernel == 1) return tl_amx_bf16_available() ? 1 : 0;
    if (g_kernel == 2) return tl_bf16dp_available() ? 2 : 0;
    return tl_amx_bf16_available() ? 1 : tl_bf16dp_available() ? 2 : 0;
}

/* The K chunks (0: one sum) a one-row bf16 F.linear sums K in on this kernel's CPUs, which the
 * kernel follows where asked for the one-row order (kchunk -1): one sum where the CPU has AMX
 * (ops/amx.py); in chunks of 512 with AVX512-BF16 only -- oneDNN's order there for one row (from
 * two rows it sums K > 1024 in chunks of 1024, ops/amx.py), found bit for bit against torch
 * 2.13's oneDNN on such a CPU for K = 576 to 3072 (benchmarks/CHANGELOG.md). */
int64_t tl_bf16_one_row_kchunk(int64_t K) {
    return tl_bf16_kernel() != 2 || K <= 512 ? 0 : 512;
}

/* The packed bf16 matmul on the kernel tl_bf16_kernel names. scratch: tl_amx_bf16_scratch_bytes
 * (M, K) (the tiles' activation copy). kchunk -1: the one-row order (tl_bf16_one_row_kchunk).
 * Returns 0, or -1 with neither kernel. */
int32_t tl_bf16_packed_linear(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *packed,
                              int64_t N, int64_t K, const float *bias, uint16_t *y, int64_t ldy,
                              void *scratch, int64_t kchunk) {
    if (kchunk < 0) kchunk = tl_bf16_one_row_kchunk(K);
    switch (tl_bf16_kernel()) {
    case 1: return tl_amx_bf16_linear(x, ldx, M, packed, N, K, bias, y, ldy, scratch, kchunk);
    case 2: return tl_bf16dp_linear(x, ldx, M, packed, N, K, bias, y, ldy, kchunk);
    default: return -1;
    }
}
