/* bfloat16 matmul on AMX tiles, with the weight packed once at load.
 *
 * Why our own: on AMX CPUs the decode steps' matmuls were either oneDNN's packed bf16
 * matmul, reached only through a PyTorch op call per matmul (which the fused decode step in
 * decode_step.c cannot make), or MKL's cblas_gemm_bf16bf16f32, which torch exports but which
 * re-packs the weight on every call: perf put MKL's copy routine at as much time as its AMX
 * kernel at 64 rows. Here the weight is packed once, in the layout a tile load reads, so a call
 * only streams it (benchmarks/amx_matmul.py).
 *
 * Layout of a packed [N, K] weight (K padded to 32, N to 32 with zeros): tiles of 16 columns x
 * 32 k, ordered [N/16][K/32]; a tile is 16 rows (k pairs) x 16 columns x 2 bf16 -- row kk, lane
 * n holds (w[n][2kk], w[n][2kk + 1]), which TDPBF16PS multiplies with the activation rows' pairs.
 * Activations are read in 16-row tiles of 32 k from a zero-padded copy (the caller's scratch,
 * tl_amx_bf16_scratch_bytes). Each 16 x 32 output block is four float32 tiles summed over K in
 * hardware (in one go, or in chunks added in order, as oneDNN sums, see tl_amx_bf16_linear) and
 * rounded once to bfloat16 (nearest even) after the bias is added, as a bf16 F.linear rounds.
 *
 * Linux hands out AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), and every thread
 * must load a tile configuration before its first tile instruction; other libraries' AMX kernels
 * (oneDNN) load their own, so each call configures the tiles of the threads it runs on.
 * Without AMX in the build or the permission, tl_amx_bf16_available() is 0 and callers keep
 * their library path.
 */
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define TL_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_bf16_step.h" /* the K step of a 32 x 32 block, as quant_gemm_amx_bf16.inc */
#include "work_steal.h"
#include <omp.h>
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int64_t up32(int64_t n) { return (n + 31) & ~(int64_t)31; }

int32_t tl_amx_bf16_available(void) {
#ifdef TL_AMX
    static int ok = -1;
    if (ok < 0) ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ok;
#else
    return 0;
#endif
}

/* How outputs are written (tl_amx_bf16_set_stores). An output of at least g_stream_min bytes
 * is larger than the L2 it would be written into and leaves it before its reader gets to it:
 * streaming (non-temporal) stores write its lines without fetching them first. Smaller ones
 * stay cached for the next op, and g_prefetch_w requests the next block's output lines for
 * writing while a block's tiles work. */
static int64_t g_stream_min = (int64_t)4 << 20;
static int g_prefetch_w = 1;
static int g_prefetch_b = 1; /* the next column pair's weight tiles, see tl_amx_bf16_linear */

void tl_amx_bf16_set_stores(int64_t stream_min, int32_t prefetch_w) {
    g_stream_min = stream_min;
    g_prefetch_w = prefetch_w;
}

/* Whether items request the next column pair's weight tiles (for benchmarks; same bits). */
void tl_amx_bf16_set_weight_prefetch(int32_t on) { g_prefetch_b = on; }

/* Elements (bf16) of the packed copy of an [N, K] weight. */
int64_t tl_amx_bf16_packed_elems(int64_t N, int64_t K) { return up32(N) * up32(K); }

/* Bytes of activation scratch for M rows of K. */
int64_t tl_amx_bf16_scratch_bytes(int64_t M, int64_t K) {
    return ((M + 31) & ~(int64_t)31) * up32(K) * 2 + 64;
}

void tl_amx_bf16_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *packed) {
    const int64_t Np = up32(N), nkb = up32(K) / 32;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < Np / 16; nb++)
        for (int64_t kb = 0; kb < nkb; kb++) {
            uint16_t *tile = packed + (nb * nkb + kb) * 512;
            for (int kk = 0; kk < 16; kk++)
                for (int n = 0; n < 16; n++)
                    for (int p = 0; p < 2; p++) {
                        const int64_t row = nb * 16 + n, col = kb * 32 + 2 * kk + p;
                        tile[kk * 32 + n * 2 + p] = row < N && col < K ? w[row * K + col] : 0;
                    }
        }
}

#ifdef TL_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tl_tilecfg;

static void configure_tiles(void) {
    tl_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* Rows x cols of a 32 x 32 float32 block (+ bias) rounded to bfloat16, nearest even: 16 at a
 * time with AVX-512 BF16's conversion (every AMX CPU has it), which rounds as tl_f32_to_bf16 does
 * for all but denormal inputs (flushed to zero). The scalar loop took as long as the tile
 * products at K = 576. A whole 32-column block whose rows are 64-byte aligned is one line per
 * row; `stream` writes those lines around the caches (see tl_amx_bf16_linear). c2: the earlier
 * K chunks' sum, added first (see kchunk), or NULL. */
static void store_block(const float *c, const float *c2, int rows, int cols, const float *bias,
                        uint16_t *y, int64_t ldy, int stream) {
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias && m1 ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    const int whole_lines = stream && cols == 32 && !((uintptr_t)y & 63) && !((ldy * 2) & 63);
    for (int r = 0; r < rows; r++) {
        const float *cr = c + r * 32;
        uint16_t *out = y + r * ldy;
        __m512 s0 = _mm512_load_ps(cr), s1 = _mm512_load_ps(cr + 16);
        if (c2) { /* the earlier K chunks' sum (see tl_amx_bf16_linear's kchunk) */
            s0 = _mm512_add_ps(_mm512_load_ps(c2 + r * 32), s0);
            s1 = _mm512_add_ps(_mm512_load_ps(c2 + r * 32 + 16), s1);
        }
        s0 = _mm512_add_ps(s0, b0);
        s1 = _mm512_add_ps(s1, b1);
        if (whole_lines) {
            _mm512_stream_si512((void *)out, (__m512i)_mm512_cvtne2ps_pbh(s1, s0));
            continue;
        }
        _mm256_mask_storeu_epi16(out, m0, (__m256i)_mm512_cvtneps_pbh(s0));
        if (m1) _mm256_mask_storeu_epi16(out + 16, m1, (__m256i)_mm512_cvtneps_pbh(s1));
    }
}

#endif

/* y[M, N] (row stride ldy, bfloat16) = x[M, K] (row stride ldx, bfloat16) W^T (+ bias, float32),
 * W packed by tl_amx_bf16_pack. `kchunk` (a multiple of 32 below K; else 0 for one sum over K):
 * sum K in chunks of kchunk, each from zero, and add the chunks' sums in order before rounding,
 * which is how oneDNN's bf16 matmul sums some shapes at some row counts (ops/amx.py says which),
 * so that results can match a bf16 F.linear bit for bit. Returns 0, or -1 without AMX. */
/* Item it of a matmul's (row block, column pair, row pair) order -> its column pair *np and row
 * pair *mp: row blocks of `block` row pairs (the last one shorter), within a block the column
 * pairs outermost, so a thread's run streams its share of the weight once per block and a pair's
 * weight tiles stay in L1 across the block's rows. */
static inline void amx_item(int64_t it, int64_t npairs, int64_t mpairs, int64_t block, int64_t *np,
                            int64_t *mp) {
    const int64_t b = it / (npairs * block), rem = it - b * npairs * block;
    const int64_t mcount = mpairs - b * block < block ? mpairs - b * block : block;
    *np = rem / mcount;
    *mp = b * block + rem % mcount;
}

int32_t tl_amx_bf16_linear(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *packed,
                           int64_t N, int64_t K, const float *bias, uint16_t *y, int64_t ldy,
                           void *scratch, int64_t kchunk) {
#ifdef TL_AMX
    if (!tl_amx_bf16_available()) return -1;
    if (M <= 0) return 0;
    const int64_t Kp = up32(K), nkb = Kp / 32, Mp = (M + 31) & ~(int64_t)31;
    const int64_t npairs = up32(N) / 32;
    uint16_t *a = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    /* The activations in tile order, zero-padded: [Mp/16][K/32] tiles of 16 rows x 32 k, so a
     * tile load reads 1 KiB in a row (with the rows' own stride, large prefills ran slower). */
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < Mp; m++) {
        uint16_t *dst = a + (m / 16) * nkb * 512 + (m % 16) * 32;
        for (int64_t kb = 0; kb < nkb; kb++, dst += 512) {
            const int64_t k0 = kb * 32, n = m >= M ? 0 : K - k0 < 32 ? K - k0 : 32;
            if (n) memcpy(dst, x + m * ldx + k0, (size_t)n * 2);
            if (n < 32) memset(dst + n, 0, (size_t)(32 - n) * 2);
        }
    }
    /* Blocks of up to 256 rows (their activations stay in L2); within a block, column pairs of
     * tiles outermost, so each thread streams its share of the weight once per block and a
     * pair's weight tiles stay in L1 across the block's rows. */
    const int64_t mpairs = Mp / 32, block = 8;
    const int stream = M * N * 2 >= g_stream_min, prefetch_w = g_prefetch_w;
    /* k blocks per chunk (nkb: one chunk) */
    const int64_t kbchunk = kchunk > 0 && kchunk < K && kchunk % 32 == 0 ? kchunk / 32 : nkb;
    const int64_t items = npairs * mpairs; /* (row block, column pair, row pair), in that order */
    /* At most 16 rows summed in one go (decode steps of up to 16 sequences): one row tile per
     * item, half the tile products and activation loads of the 32-row items */
    const int one_row_tile = M <= 16 && kbchunk == nkb;
    tl_run runs[TL_STEAL_MAX_THREADS];
#pragma omp parallel
    {
        configure_tiles();
        float c[32 * 32] __attribute__((aligned(64)));
        float c2[32 * 32] __attribute__((aligned(64)));
        /* A contiguous run of items per thread, the rest taken over from the back of a slower
         * thread's run (work_steal.h); no barrier between row blocks either. */
        tl_items walk = tl_items_start(runs, items);
        for (int64_t it, nx; (it = tl_items_next(&walk, &nx)) >= 0;) {
            int64_t np, mp, nnp = -1, nmp = 0;
            amx_item(it, npairs, mpairs, block, &np, &mp);
            if (nx >= 0) amx_item(nx, npairs, mpairs, block, &nnp, &nmp);
            const uint16_t *b0 = packed + (2 * np) * nkb * 512, *b1 = b0 + nkb * 512;
            const uint16_t *a0 = a + 2 * mp * nkb * 512, *a1 = a0 + nkb * 512;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            /* The next block's output rows (of the item this thread most likely takes next),
             * requested for writing a few per step of K while the tiles work: a block's stores
             * go to 32 rows in as many pages, which the hardware prefetchers do not follow, and
             * each line fetch would otherwise wait at the end of the block, a large part of a
             * prefill-sized matmul (benchmarks/amx_matmul.py). */
            int64_t nrows = 0;
            if (!stream && prefetch_w && nnp >= 0) nrows = M - nmp * 32 < 32 ? M - nmp * 32 : 32;
            const char *ny = (const char *)(y + nmp * 32 * ldy + (nnp < 0 ? 0 : nnp) * 32);
            const int64_t per = (nrows + nkb - 1) / nkb;
            int64_t pr = 0;
            /* The next column pair's weight tiles, requested into L2 while this item's tiles
             * work, each of the pair's row-pair items of this block a share of them (k tiles
             * [pf_k0, pf_k0 + pf_n)), a few per k step. At decode row counts the weight streams
             * from memory, which the tile products alone left idle between their loads
             * (benchmarks/matmul_builds_ab.py). The next pair is the owner's next one;
             * a thread that takes items over from the back of another's run requests a pair
             * already done, which costs only the requests. */
            const int64_t blk = mp / block, r = mp - blk * block;
            const int64_t mcount = mpairs - blk * block < block ? mpairs - blk * block : block;
            const uint16_t *pf = packed + (2 * np + 2) * nkb * 512;
            const int pf_on = g_prefetch_b && np + 1 < npairs;
            const int64_t pf_k0 = pf_on ? nkb * r / mcount : 0;
            const int64_t pf_n = pf_on ? nkb * (r + 1) / mcount - pf_k0 : 0;
            int64_t pf_i = 0;
            for (int64_t kb = 0, kflush = kbchunk; kb < nkb; kb++) {
                for (const int64_t e = pr + per; pr < e && pr < nrows; pr++)
                    _mm_prefetch(ny + pr * ldy * 2, _MM_HINT_ET0);
                for (const int64_t e = (kb + 1) * pf_n / nkb; pf_i < e; pf_i++) {
                    const char *p0 = (const char *)(pf + (pf_k0 + pf_i) * 512);
                    const char *p1 = p0 + nkb * 1024;
                    for (int l = 0; l < 1024; l += 64) {
                        _mm_prefetch(p0 + l, _MM_HINT_T1);
                        _mm_prefetch(p1 + l, _MM_HINT_T1);
                    }
                }
                if (one_row_tile) /* tiles 2-3 (rows 16-31) would hold zero padding */
                    amx_bf16_k_step_1row(kb, a0, b0, b1);
                else
                    amx_bf16_k_step(kb, &kflush, kbchunk, a0, a1, b0, b1, c, c2);
            }
            amx_bf16_store_sums(c);
            const int64_t m0 = mp * 32, n0 = np * 32;
            const int rows = (int)(M - m0 < 32 ? M - m0 : 32);
            const int cols = (int)(N - n0 < 32 ? N - n0 : 32);
            store_block(c, kbchunk < nkb ? c2 : NULL, rows, cols, bias ? bias + n0 : NULL,
                        y + m0 * ldy + n0, ldy, stream);
        }
        if (stream) _mm_sfence(); /* streamed lines visible before the region's barrier */
        _tile_release();
    }
    return 0;
#else
    (void)x; (void)ldx; (void)M; (void)packed; (void)N; (void)K; (void)bias; (void)y; (void)ldy;
    (void)scratch; (void)kchunk;
    return -1;
#endif
}
