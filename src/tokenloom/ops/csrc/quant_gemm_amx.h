/* The AMX int8 kernels of quant_gemm.c (Sapphire Rapids and later), included by it after the
 * AVX-512 helpers (load_codes512, params512, k_scales512): used for matmuls of at least
 * AMX_MIN_ROWS activation rows (8 with two activation planes), where the VNNI kernel is
 * compute-bound.
 *
 * Why AMX: one TDPBSUD multiplies a 16-row x 32-byte tile of activation codes (one 32-block of
 * K, signed) by an 8 x 64-byte tile of weight codes (unsigned) into 16 x 16 int32 sums. The
 * weight tile is exactly one block of the tiled layout (8 groups of 4 k x 16 columns x 4 bytes:
 * AMX's "VNNI" B layout), so Q8 codes load straight from the weight; the 4-to-6-bit codes of a
 * column tile are expanded by load_codes512 into a per-thread buffer of K x 16 bytes (L1/L2, never
 * resident) once per 64 rows. That takes the 256 VPDPBUSD of a 16 x 16 block (two activation
 * planes) down to two tile products; what is left is the per-block float scaling, which AMX
 * cannot do.
 *
 * Per-block scales: the int32 tiles cover one 32-block (one per activation plane), are stored
 * to L1 and scaled there with AVX-512 exactly as the VNNI kernel scales its sums
 * (acc += cvt(256 S1 + S2) * d dx + m xs), so both kernels give the same bits. A K = 64 tile
 * would halve the tile products but add two blocks' sums together, and their scales differ.
 * So a product uses half of what a tile multiply can do, and each 16 x 16 block result costs a
 * tile store, a reload and ~6 vector instructions per row: measured at 64 rows, the tile
 * products, the tile stores and the scaling each take about a quarter of the time (README).
 *
 * Tiles (palette 1): 0, 1 plane 1's sums and 2, 3 plane 2's, alternating between blocks so one
 * block's products can start while the last one's sums are stored; 4, 5 the two activation
 * planes (16 rows x 32 bytes); 6, 7 the weight codes (alternating). Activation rows are padded
 * with zero codes to a multiple of 16 (the scratch is sized for it), so every tile keeps the one
 * configuration and the padding rows' sums are never read.
 *
 * Linux hands out AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA, once per process), and the tile configuration is per thread: every OpenMP
 * thread loads it (LDTILECFG) before its first tile instruction and releases the tiles after the
 * matmul (so a context switch saves no tile data). */
#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__)) && \
    defined(__linux__)
#define TL_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,amx-tile,amx-int8")))
#define INLINE_AMX static inline __attribute__((always_inline)) AMX_TARGET
/* Rows from which AMX beats VNNI (one thread, SmolLM2 shapes, Q4_1 and Q8_0; figures in
 * benchmarks/README.md): with two activation planes 8 (6 rows: VNNI 9.5-9.8 ms per step against
 * AMX 9.8-10.5, 8 rows: 12.3 against 10.5-10.9), with one plane 16 (8 rows: VNNI 8.4 against
 * 9.1). Below it the 16-row tiles are mostly padding. */
#define AMX_MIN_ROWS(levels) ((levels) == 2 ? 8 : 16)

/* 1: AMX int8 usable, 0: the CPU has none, -1: the kernel refused the tile state. */
static int amx_request(void) {
    __builtin_cpu_init();
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return 0; /* AMX-TILE, AMX-INT8 */
    if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) return 0;
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
}

struct amx_tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

AMX_TARGET static void amx_configure(void) {
    struct amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }     /* int32 sums */
    for (int t = 4; t < 6; t++) { cfg.rows[t] = 16; cfg.colsb[t] = QK; }     /* activations */
    for (int t = 6; t < 8; t++) { cfg.rows[t] = QK / 4; cfg.colsb[t] = 64; } /* weight codes */
    _tile_loadconfig(&cfg);
}

AMX_TARGET static void amx_release(void) { _tile_release(); }

/* Up to M_BLOCK rows (`rows` real, codes padded with zeros to a multiple of 16) against NT (1, 2)
 * column tiles, the first at `tile`, the next tile_bytes further on; FMT, LEVELS and NT are
 * constants in every instance. ncols: the columns of the last tile that exist. */
/* One block's tile product for a 16-row tile into sums tiles SLOT (plane 1) and SLOT + 2 (plane
 * 2), stored to `out` ([plane][row][col]); the weight codes are loaded into tile 6 + SLOT. */
INLINE_AMX void amx_step(const int SLOT, const int LEVELS, const int8_t *xb, const uint8_t *wb,
                         int64_t K, int64_t xplane, int32_t (*out)[TILE_N][TILE_N]) {
    if (SLOT == 0) {
        _tile_loadd(6, wb, 64);
        _tile_zero(0);
        _tile_loadd(4, xb, K);
        _tile_dpbsud(0, 4, 6);
        if (LEVELS == 2) {
            _tile_zero(2);
            _tile_loadd(5, xb + xplane, K);
            _tile_dpbsud(2, 5, 6);
        }
        _tile_stored(0, out[0], 64);
        if (LEVELS == 2) _tile_stored(2, out[1], 64);
    } else {
        _tile_loadd(7, wb, 64);
        _tile_zero(1);
        _tile_loadd(4, xb, K);
        _tile_dpbsud(1, 4, 7);
        if (LEVELS == 2) {
            _tile_zero(3);
            _tile_loadd(5, xb + xplane, K);
            _tile_dpbsud(3, 5, 7);
        }
        _tile_stored(1, out[0], 64);
        if (LEVELS == 2) _tile_stored(3, out[1], 64);
    }
}

/* Scales block j's sums of one 16-row tile (r1 real rows) into the accumulators: the VNNI
 * kernel's arithmetic, so both give the same bits. dm: the block's d and m, 16 columns each. */
INLINE_AMX void amx_scale(const int LEVELS, int32_t (*sums)[TILE_N][TILE_N], __m512 acc[16],
                          int r1, int64_t j, int64_t nb, const float *xd, const float *xs,
                          const float *dm) {
    const __m512 d = _mm512_load_ps(dm), mn = _mm512_load_ps(dm + 16);
    for (int r = 0; r < 16; r++) {
        if (r >= r1) break;
        __m512i v = _mm512_load_si512((const void *)sums[0][r]);
        if (LEVELS == 2)
            v = _mm512_add_epi32(_mm512_slli_epi32(v, 8), _mm512_load_si512((const void *)sums[1][r]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(d, _mm512_set1_ps(xd[r * nb + j])), acc[r]);
        acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[r * nb + j]), acc[r]);
    }
}

/* Per-thread scratch of the AMX kernel: one column tile's codes expanded to bytes (K x 16) and
 * its per-block d and m (K / 32 x 128 bytes): grown to the largest K seen, never per weight. */
static __thread uint8_t *amx_buf;
static __thread int64_t amx_buf_bytes;

static uint8_t *amx_scratch(int64_t K) {
    const int64_t need = K * TILE_N + (K / QK) * 128;
    if (need > amx_buf_bytes) {
        free(amx_buf);
        amx_buf = (uint8_t *)aligned_alloc(64, (size_t)need);
        amx_buf_bytes = amx_buf ? need : 0;
    }
    return amx_buf;
}

/* Up to M_BLOCK rows (`rows` real, codes padded with zeros to a multiple of 16) against one column
 * tile; FMT and LEVELS are constants in every instance. ncols: the columns that exist.
 * The tile's codes are expanded and its scales decoded once for all K, then each 16-row tile
 * runs through the blocks with its 16 accumulators in registers. Pipelined: block j's tile
 * products go to one of two sets of tiles and buffers while block j - 1's sums are scaled. */
INLINE_AMX void amx_body(const int FMT, const int LEVELS, const uint8_t *tile, int64_t nb,
                         const int8_t *xq, const float *xd, const float *xs, int64_t K, int rows,
                         float *y, int64_t ldy, int ncols, int64_t xplane, uint8_t *buf) {
    const int ub = UB(FMT), cb = CB(FMT), unit = UNIT_BYTES(FMT);
    int32_t sums[2][2][TILE_N][TILE_N] __attribute__((aligned(64))); /* [slot][plane] */
    uint8_t kbytes[256] __attribute__((aligned(64)));
    uint8_t *wcodes = buf;
    float *dm = (float *)(buf + K * TILE_N);
    __m512 kd = _mm512_setzero_ps(), kdmin = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        const int s = (int)(j % ub);
        const uint8_t *u = tile + (j / ub) * unit, *p = u + ub * cb;
        if (FMT != TL_Q8) { /* Q8's codes are tiles as they are */
            __m512i w[8];
            load_codes512(u + s * cb, FMT, w);
            for (int g = 0; g < 8; g++) _mm512_store_si512((void *)(wcodes + j * 512 + 64 * g), w[g]);
        }
        __m512 d, mn;
        if (FMT == TL_Q4_K || FMT == TL_Q5_K) {
            if (s == 0) {
                k_scales512(p, kbytes);
                kd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
                kdmin = _mm512_sub_ps(_mm512_setzero_ps(),
                                      _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32))));
            }
            d = _mm512_mul_ps(kd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(kbytes + 16 * s)))));
            mn = _mm512_mul_ps(kdmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(kbytes + 128 + 16 * s)))));
        } else {
            __m512 dd[2], mm[2];
            params512(p, FMT, s, dd, mm);
            d = dd[0];
            mn = mm[0];
        }
        _mm512_store_ps(dm + 32 * j, d);
        _mm512_store_ps(dm + 32 * j + 16, mn);
    }
    const __mmask16 keep = (__mmask16)((1u << ncols) - 1u);
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const int r1 = rows - r0 < 16 ? rows - r0 : 16;
        const int8_t *xr = xq + (int64_t)r0 * K;
        const float *xdr = xd + r0 * nb, *xsr = xs + r0 * nb;
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t j = 0; j < nb; j++) {
            const uint8_t *wb = FMT == TL_Q8 ? tile + j * unit : wcodes + j * 512;
            if (j & 1) amx_step(1, LEVELS, xr + j * QK, wb, K, xplane, sums[1]);
            else amx_step(0, LEVELS, xr + j * QK, wb, K, xplane, sums[0]);
            if (j > 0) amx_scale(LEVELS, sums[(j - 1) & 1], acc, r1, j - 1, nb, xdr, xsr, dm + 32 * (j - 1));
        }
        amx_scale(LEVELS, sums[(nb - 1) & 1], acc, r1, nb - 1, nb, xdr, xsr, dm + 32 * (nb - 1));
        for (int r = 0; r < r1; r++) _mm512_mask_storeu_ps(y + (r0 + r) * ldy, keep, acc[r]);
    }
}

typedef void (*amx_fn)(const uint8_t *, int64_t, const int8_t *, const float *, const float *,
                       int64_t, int, float *, int64_t, int, int64_t, uint8_t *);

#define DEFINE_AMX(FMT, LEVELS)                                                                  \
AMX_TARGET static void amx_##FMT##_##LEVELS(const uint8_t *tile, int64_t nb, const int8_t *xq,   \
        const float *xd, const float *xs, int64_t K, int rows, float *y, int64_t ldy, int ncols, \
        int64_t xplane, uint8_t *buf) {                                                          \
    amx_body(FMT, LEVELS, tile, nb, xq, xd, xs, K, rows, y, ldy, ncols, xplane, buf);            \
}
#define DEFINE_AMX_FMT(FMT) DEFINE_AMX(FMT, 1) DEFINE_AMX(FMT, 2)
DEFINE_AMX_FMT(TL_Q4_0)
DEFINE_AMX_FMT(TL_Q4_1)
DEFINE_AMX_FMT(TL_Q8)
DEFINE_AMX_FMT(TL_Q5_0)
DEFINE_AMX_FMT(TL_Q4_K)
DEFINE_AMX_FMT(TL_Q5_K)

#define AMX_ROW(FMT) {amx_##FMT##_1, amx_##FMT##_2}
/* [format][levels - 1]; Q6_K (its scales change every 16 weights, so a block would need two
 * K = 16 tile products per plane) stays on the VNNI kernel. */
static const amx_fn AMX_KERNELS[TL_NFMT][2] = {
    AMX_ROW(TL_Q4_0), AMX_ROW(TL_Q4_1), AMX_ROW(TL_Q8), AMX_ROW(TL_Q5_0), AMX_ROW(TL_Q4_K),
    AMX_ROW(TL_Q5_K), {NULL, NULL}};
#endif
