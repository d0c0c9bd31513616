/* One K step of the 32 x 32 output block of a bf16 tile product (and of a 16 x 32 one), shared
 * by amx_gemm.c (weights packed to bf16 at load) and quant_gemm_amx_bf16.inc (a quantized
 * weight's panel dequantized to bf16 per call): tiles 0-3 sum rows a0 | a1 (16 each) times
 * columns b0 | b1 (16 each), 32 k per step, each operand tile 1 KiB (512 bf16) further on per
 * step. Tiles 4-7 hold the operands.
 *
 * K chunks: at step kb == *kflush (every kbchunk steps; nkb when the call sums K in one go) the
 * sums of the chunk just finished are stored to c and added into c2 in order, and the tiles
 * start the next chunk from zero, which is how oneDNN's bf16 matmul sums K for calls of more
 * than 32 rows (ops/amx.py). After the last step the caller stores the tiles to c and adds c2
 * when there were chunks. */
#ifndef TL_AMX_BF16_STEP_H
#define TL_AMX_BF16_STEP_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Tiles 0-3 (the 32 x 32 block's sums) to c, row-major with 32 floats a row. */
static inline __attribute__((always_inline, target("amx-tile"))) void
amx_bf16_store_sums(float *c) {
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    _tile_stored(2, c + 512, 128);
    _tile_stored(3, c + 528, 128);
}

/* Tiles 0-3 back from c (as amx_bf16_store_sums left them), to go on summing. */
static inline __attribute__((always_inline, target("amx-tile"))) void
amx_bf16_load_sums(const float *c) {
    _tile_loadd(0, c, 128);
    _tile_loadd(1, c + 16, 128);
    _tile_loadd(2, c + 512, 128);
    _tile_loadd(3, c + 528, 128);
}

/* The K step of a 16 x 32 block (one row tile: at most 16 rows, summed in one go): tiles 0-1
 * sum rows a0 times columns b0 | b1; tiles 2-3 stay zero. Each element is summed over the same
 * k in the same order as in amx_bf16_k_step, so the results are the same bits. */
static inline __attribute__((always_inline, target("amx-tile,amx-bf16"))) void
amx_bf16_k_step_1row(int64_t kb, const uint16_t *a0, const uint16_t *b0, const uint16_t *b1) {
    _tile_loadd(4, a0 + kb * 512, 64);
    _tile_loadd(6, b0 + kb * 512, 64);
    _tile_loadd(7, b1 + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
}

static inline __attribute__((always_inline, target("avx512f,amx-tile,amx-bf16"))) void
amx_bf16_k_step(int64_t kb, int64_t *kflush, int64_t kbchunk, const uint16_t *a0,
                const uint16_t *a1, const uint16_t *b0, const uint16_t *b1, float *c, float *c2) {
    if (kb == *kflush) { /* c2 (+)= the chunk just summed */
        *kflush += kbchunk;
        amx_bf16_store_sums(c);
        if (kb == kbchunk) {
            memcpy(c2, c, 32 * 32 * sizeof(float));
        } else {
            for (int i = 0; i < 32 * 32; i += 16)
                _mm512_store_ps(c2 + i, _mm512_add_ps(_mm512_load_ps(c2 + i), _mm512_load_ps(c + i)));
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    _tile_loadd(4, a0 + kb * 512, 64);
    _tile_loadd(5, a1 + kb * 512, 64);
    _tile_loadd(6, b0 + kb * 512, 64);
    _tile_loadd(7, b1 + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}
#endif
