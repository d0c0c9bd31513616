/* One decode step of a Llama-family decoder on block-quantized weights, every layer in one call.
 *
 * Why: at batch 1 a quantized decode step of SmolLM2-135M reads ~96 MB of weights, which the
 * kernels stream in a few milliseconds, but the eager layer issues ~13 Python-level calls per
 * layer (norm, matmul, views, RoPE, two index_copy_ for the KV write, the attention call, ...):
 * 400 dispatches a step, during which the second OpenMP thread spins idle. perf on the Xeon
 * (benchmarks/README.md, "Quantized weights") put half of a 14 ms step there. This file runs
 * the same C kernels in the same order from one ctypes call, so the results are the eager
 * path's bit for bit (tests/model/test_fused_decode.py compares them) and only the dispatch is
 * gone.
 *
 * What it covers (the caller, model/fused_decode.py, checks it once per step and otherwise
 * runs the eager layers): float32 activations, a float32 or bfloat16 KV cache (the latter
 * written as torch's `.to(torch.bfloat16)` rounds: to nearest even), every token a decode (one query
 * token per request, in request order), full attention, no tensor parallelism, every linear one
 * tiled quantized weight (ops/quant.py), optional q/k/v bias, no q/k norm.
 */
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

/* The kernels this step strings together (quant_gemm.c, elementwise.c, paged_decode.c). */
int64_t tl_q_scratch_bytes(int64_t M, int64_t K);
int32_t tl_q_linear(int32_t fmt, const uint8_t *w, int64_t N, int64_t K, const float *x,
                    int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias,
                    void *scratch, int32_t levels);
void tl_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, int64_t r_stride,
                         const float *weight, float *out, int64_t out_stride, int32_t T,
                         int32_t H, float eps);
void tl_silu_and_mul_f32(const float *gate_up, int64_t in_stride, float *out, int64_t out_stride,
                         int32_t T, int32_t I);
void tl_rope_f32(float *x, int64_t row_stride, int32_t T, int32_t num_heads, int32_t head_dim,
                 const int64_t *positions, const float *cos_sin, int64_t cs_stride);
#define TL_DECODE_PARAMS const void *q, int64_t q_stride, const void *k_cache, \
    const void *v_cache, const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens, \
    void *out, int64_t out_stride, int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, \
    int32_t head_dim, int32_t block_size, float scale, int32_t window
int tl_paged_decode_f32(TL_DECODE_PARAMS);
int tl_paged_decode_f32_bf16kv(TL_DECODE_PARAMS);

/* A quantized linear layer: the tiled weight's bytes, its format and output rows. */
typedef struct {
    const uint8_t *w;
    const float *bias; /* NULL for none */
    int64_t n;
    int32_t fmt;
    int32_t pad_;
} tl_qmat;

/* One decoder layer's parameters and KV cache (both [num_blocks * block_size, Hkv, D], float32
 * or bfloat16 as tl_qmodel.kv_bf16 says). */
typedef struct {
    const float *input_norm, *post_norm;
    tl_qmat qkv, o, gate_up, down;
    void *k_cache, *v_cache;
} tl_qlayer;

/* The model's shape, fixed at load. */
typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size,
        act_levels;
    float eps, scale;
    int32_t kv_bf16, pad_;
    const float *final_norm;
    const float *cos_sin;
    int64_t cs_stride;
} tl_qmodel;

static int64_t align64(int64_t n) { return (n + 63) & ~(int64_t)63; }

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Bytes of workspace `tl_llama_decode_q` needs for T tokens. */
int64_t tl_llama_decode_q_workspace(const tl_qmodel *m, int64_t T) {
    const int64_t H = m->hidden, qd = (int64_t)m->num_heads * m->head_dim;
    const int64_t nqkv = qd + 2 * (int64_t)m->num_kv_heads * m->head_dim, I = m->intermediate;
    const int64_t floats = T * (3 * H + nqkv + qd + 3 * I);
    return align64(floats * 4) + 64 + tl_q_scratch_bytes(T, max3(H, qd, I));
}

/* h [T, hidden]: the embeddings of the step's tokens (overwritten). out [T, hidden]: the final
 * norm's output. positions, slots (int64 [T]), block_table (int32 [T, bt_stride]) and seq_lens
 * (int32 [T]) as the attention plan has them. Returns 0, or the first kernel's error code. */
int32_t tl_llama_decode_q(const tl_qmodel *m, const tl_qlayer *layers, float *h, float *out,
                          int32_t T, const int64_t *positions, const int64_t *slots,
                          const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                          void *workspace) {
    const int32_t H = m->hidden, Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim;
    const int64_t qd = (int64_t)Hq * D, kvd = (int64_t)Hkv * D, nqkv = qd + 2 * kvd;
    const int64_t I = m->intermediate;
    float *residual = (float *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63);
    float *x = residual + (int64_t)T * H;
    float *y = x + (int64_t)T * H;
    float *qkv = y + (int64_t)T * H;
    float *attn = qkv + T * nqkv;
    float *gu = attn + T * qd;
    float *act = gu + T * 2 * I;
    void *scratch = (void *)(((uintptr_t)(act + T * I) + 63) & ~(uintptr_t)63);
    int32_t rc;

    for (int32_t l = 0; l < m->num_layers; l++) {
        const tl_qlayer *L = layers + l;
        if (l == 0) { /* the residual stream starts as the embeddings */
            memcpy(residual, h, sizeof(float) * (size_t)T * H);
            tl_add_rms_norm_f32(h, H, NULL, 0, L->input_norm, x, H, T, H, m->eps);
        } else {
            tl_add_rms_norm_f32(y, H, residual, H, L->input_norm, x, H, T, H, m->eps);
        }
        rc = tl_q_linear(L->qkv.fmt, L->qkv.w, nqkv, H, x, H, T, qkv, nqkv, L->qkv.bias, scratch,
                         m->act_levels);
        if (rc) return rc;
        /* q and k heads are adjacent in a row: one RoPE over both */
        tl_rope_f32(qkv, nqkv, T, Hq + Hkv, D, positions, m->cos_sin, m->cs_stride);
        for (int32_t t = 0; t < T; t++) {
            const float *row = qkv + t * nqkv;
            if (m->kv_bf16) {
                uint16_t *kc = (uint16_t *)L->k_cache + slots[t] * kvd;
                uint16_t *vc = (uint16_t *)L->v_cache + slots[t] * kvd;
                for (int64_t i = 0; i < kvd; i++) {
                    kc[i] = tl_f32_to_bf16(row[qd + i]);
                    vc[i] = tl_f32_to_bf16(row[qd + kvd + i]);
                }
            } else {
                memcpy((float *)L->k_cache + slots[t] * kvd, row + qd, sizeof(float) * (size_t)kvd);
                memcpy((float *)L->v_cache + slots[t] * kvd, row + qd + kvd, sizeof(float) * (size_t)kvd);
            }
        }
        rc = (m->kv_bf16 ? tl_paged_decode_f32_bf16kv : tl_paged_decode_f32)(
            qkv, nqkv, L->k_cache, L->v_cache, block_table, bt_stride, seq_lens, attn, qd, T, Hq,
            Hkv, D, m->block_size, m->scale, 0);
        if (rc) return rc;
        rc = tl_q_linear(L->o.fmt, L->o.w, H, qd, attn, qd, T, y, H, L->o.bias, scratch,
                         m->act_levels);
        if (rc) return rc;
        tl_add_rms_norm_f32(y, H, residual, H, L->post_norm, x, H, T, H, m->eps);
        rc = tl_q_linear(L->gate_up.fmt, L->gate_up.w, 2 * I, H, x, H, T, gu, 2 * I,
                         L->gate_up.bias, scratch, m->act_levels);
        if (rc) return rc;
        tl_silu_and_mul_f32(gu, 2 * I, act, I, T, (int32_t)I);
        rc = tl_q_linear(L->down.fmt, L->down.w, H, I, act, I, T, y, H, L->down.bias, scratch,
                         m->act_levels);
        if (rc) return rc;
    }
    tl_add_rms_norm_f32(y, H, residual, H, m->final_norm, out, H, T, H, m->eps);
    return 0;
}
