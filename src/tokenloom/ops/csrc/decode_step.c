/* One decode step of a Llama-family decoder, every layer in one call: on block-quantized weights
 * (float32 or bfloat16 activations), on bfloat16 weights (bfloat16 activations) or on float32
 * ones (float32 activations, a few tokens: f32_gemv.c).
 *
 * Why: at batch 1 a quantized decode step of SmolLM2-135M reads ~96 MB of weights, which the
 * kernels stream in a few milliseconds, but the eager layer issues ~13 Python-level calls per
 * layer (norm, matmul, views, RoPE, two index_copy_ for the KV write, the attention call, ...):
 * 400 dispatches a step, during which the second OpenMP thread spins idle: perf put a large
 * share of the step there (benchmarks/CHANGELOG.md). This file runs
 * the same C kernels in the same order from one ctypes call, so the results are the eager
 * path's bit for bit (tests/model/test_fused_decode.py compares them) and only the dispatch is
 * gone.
 *
 * The bfloat16 variant multiplies on AMX tiles (amx_gemm.c, the weights packed in tile order at
 * load), or with AVX512-BF16 dot products on the same packed weights where the CPU has no AMX
 * (bf16_dp_gemm.c); each output is rounded to bfloat16 once, as a bf16 `F.linear` rounds, and
 * summed over K as a one-row bf16 `F.linear` sums it on that CPU (transformers' decode). The float32-weight variant calls the kernel the eager layers call for the same
 * few rows (model/packed_linear.py), so its results are theirs bit for bit too.
 *
 * What it covers (the caller, model/fused_decode.py, checks it once per step and otherwise
 * runs the eager layers): float32 activations over a float32 or bfloat16 KV cache (the latter
 * written as torch's `.to(torch.bfloat16)` rounds: to nearest even), or bfloat16 activations
 * and cache; every token a decode (one query token per request, in request order), full
 * attention, no tensor parallelism, optional q/k/v bias, optional q/k norm (Qwen3), and in float32
 * with quantized experts a mixture-of-experts block in place of a layer's MLP (Qwen3-MoE: the
 * float32 router, softmax, top-k, the chosen experts through quant_moe.inc's tl_q_moe).
 */
#include <math.h>
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
void tl_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                          int64_t r_stride, const uint16_t *weight, uint16_t *out,
                          int64_t out_stride, int32_t T, int32_t H, float eps);
void tl_silu_and_mul_bf16(const uint16_t *gate_up, int64_t in_stride, uint16_t *out,
                          int64_t out_stride, int32_t T, int32_t I);
void tl_rope_bf16(uint16_t *x, int64_t row_stride, int32_t T, int32_t num_heads,
                  int32_t head_dim, const int64_t *positions, const float *cos_sin,
                  int64_t cs_stride);
void tl_silu_and_mul_f32(const float *gate_up, int64_t in_stride, float *out, int64_t out_stride,
                         int32_t T, int32_t I);
int32_t tl_q_linear_silu(int32_t fmt, const uint8_t *w, int64_t N, int64_t K, const float *x,
                         int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias,
                         void *scratch);
void tl_rope_f32(float *x, int64_t row_stride, int32_t T, int32_t num_heads, int32_t head_dim,
                 const int64_t *positions, const float *cos_sin, int64_t cs_stride);
#define TL_DECODE_PARAMS const void *q, int64_t q_stride, const void *k_cache, \
    const void *v_cache, const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens, \
    void *out, int64_t out_stride, int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, \
    int32_t head_dim, int32_t block_size, float scale, int32_t window
int tl_paged_decode_f32(TL_DECODE_PARAMS);
int tl_paged_decode_f32_bf16kv(TL_DECODE_PARAMS);
int tl_paged_decode_bf16(TL_DECODE_PARAMS);
int64_t tl_amx_bf16_scratch_bytes(int64_t M, int64_t K);
int64_t tl_q_bf16_scratch_bytes(int64_t M, int64_t N, int64_t K);
int32_t tl_q_linear_bf16(int32_t fmt, const uint8_t *w, int64_t N, int64_t K, const uint16_t *x,
                         int64_t ldx, int64_t M, uint16_t *y, int64_t ldy, const float *bias,
                         void *scratch, int32_t levels, int64_t kchunk);
int32_t tl_f32_linear(const float *w, int64_t N, int64_t K, const float *x, int64_t ldx,
                      int64_t M, float *y, int64_t ldy, const float *bias);
int32_t tl_f32_panel_linear(const float *pw, int64_t N, int64_t K, const float *x, int64_t ldx,
                            int64_t M, float *y, int64_t ldy, const float *bias);
int32_t tl_bf16_packed_linear(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *packed,
                              int64_t N, int64_t K, const float *bias, uint16_t *y, int64_t ldy,
                              void *scratch, int64_t kchunk);
int64_t tl_q_moe_scratch_bytes(int64_t P, int64_t H, int64_t I);
int32_t tl_q_moe(int32_t fmt13, const uint8_t *const *w13, int32_t fmt2, const uint8_t *const *w2,
                 int64_t E, int64_t H, int64_t I, const float *x, int64_t T, int64_t k,
                 const int64_t *topk_ids, const float *topk_w, float *out, void *scratch, int32_t levels);
/* LoRA adapters (lora_decode.c): opaque here, NULL for a step without one. */
typedef struct tl_lora tl_lora;
int32_t tl_lora_touches(const tl_lora *lo, int32_t layer, int32_t which, int32_t T);
void tl_lora_add(const tl_lora *lo, int32_t layer, int32_t which, const float *x, int64_t K,
                 int32_t T, float *y, int64_t N);
enum { TL_QKV, TL_O, TL_GATE_UP, TL_DOWN };

/* A linear layer: a tiled quantized weight (fmt >= 0, ops/quant.py), a bfloat16 one packed in
 * AMX tile order (fmt = TL_BF16, amx_gemm.c / bf16_dp_gemm.c), a plain row-major float32 one
 * (fmt = TL_F32, f32_gemv.c) or a panel-packed float32 one (fmt = TL_F32_PANEL, f32_panel.c),
 * and an optional float32 bias. */
#define TL_BF16 (-1)
#define TL_F32 (-2)
#define TL_F32_PANEL (-3)
typedef struct {
    const void *w;
    const float *bias; /* NULL for none */
    int64_t n;
    int32_t fmt;
    int32_t pad_;
} tl_mat;

/* A mixture-of-experts block (float32 activations): the router [E, hidden] (plain float32) and
 * per expert the tiled gate|up and down weights' addresses (tl_model's moe_* give the shapes). */
typedef struct {
    const float *router;
    const uint8_t *const *w13;
    const uint8_t *const *w2;
    int32_t fmt13, fmt2;
} tl_moe;

/* One decoder layer's parameters (norm weights in the activations' dtype) and KV cache (both
 * [num_blocks * block_size, Hkv, D], float32 or bfloat16 as tl_model.kv_bf16 says); q_norm and
 * k_norm [head_dim] (float32) or NULL; moe NULL for a dense MLP (gate_up, down). */
typedef struct {
    const void *input_norm, *post_norm;
    tl_mat qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    const float *q_norm, *k_norm;
    const tl_moe *moe;
    /* q, k and v as three quantized weights where their formats differ (a Q4_K_M file's Q6_K
     * attn_v): qkv then holds q's rows, these k's and v's (w NULL: qkv holds all three) */
    tl_mat k_part, v_part;
} tl_layer;

/* The model's shape and dtypes, fixed at load. */
typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size,
        act_levels;
    float eps, scale;
    int32_t kv_bf16, act_bf16; /* bfloat16 KV cache; bfloat16 activations (and bf16 weights) */
    const void *final_norm;
    const float *cos_sin;
    int64_t cs_stride;
    int32_t moe_experts, moe_top_k, moe_width, moe_renorm; /* 0 experts: no MoE layer */
} tl_model;

static int64_t align64(int64_t n) { return (n + 63) & ~(int64_t)63; }

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Bytes of workspace `tl_llama_decode` needs for T tokens. */
int64_t tl_llama_decode_workspace(const tl_model *m, int64_t T) {
    const int64_t H = m->hidden, qd = (int64_t)m->num_heads * m->head_dim;
    const int64_t nqkv = qd + 2 * (int64_t)m->num_kv_heads * m->head_dim, I = m->intermediate;
    const int64_t elems = T * (3 * H + nqkv + qd + 3 * I);
    const int64_t kmax = max3(H, qd, I), nmax = max3(nqkv, H, 2 * I);
    int64_t extra = tl_q_scratch_bytes(T, kmax);
    if (m->act_bf16) { /* bf16 weights, or quantized ones with bf16 activations */
        const int64_t a = tl_amx_bf16_scratch_bytes(T, kmax), q = tl_q_bf16_scratch_bytes(T, nmax, kmax);
        extra = a > q ? a : q;
    }
    int64_t moe = 0;
    if (m->moe_experts > 0) { /* router logits, the top k's ids and weights, tl_q_moe's scratch */
        const int64_t P = T * m->moe_top_k;
        moe = align64(T * m->moe_experts * 4) + align64(P * 8) + align64(P * 4) + 64 +
              tl_q_moe_scratch_bytes(P, H, m->moe_width);
    }
    return align64(elems * 4) + 64 + (extra > moe ? extra : moe);
}

/* softmax over each token's E router logits, the top k (lower id first among equals), their
 * weights renormalised to sum 1 where `renorm`: ops/moe.select_experts' "softmax" scoring. */
static void route(const float *logits, int32_t T, int32_t E, int32_t k, int32_t renorm,
                  int64_t *ids, float *w) {
    for (int32_t t = 0; t < T; t++) {
        const float *l = logits + (int64_t)t * E;
        float mx = l[0], sum = 0.0f;
        for (int32_t e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        for (int32_t e = 0; e < E; e++) sum += expf(l[e] - mx);
        int64_t *id = ids + (int64_t)t * k;
        float *wt = w + (int64_t)t * k, chosen = 0.0f;
        for (int32_t j = 0; j < k; j++) {
            int32_t best = -1;
            for (int32_t e = 0; e < E; e++) {
                int taken = 0;
                for (int32_t i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            id[j] = best;
            wt[j] = expf(l[best] - mx) / sum;
            chosen += wt[j];
        }
        if (renorm)
            for (int32_t j = 0; j < k; j++) wt[j] /= chosen;
    }
}

/* y[T, n] = x[T, K] W^T (+ bias) in the activations' dtype; `tmp` is the kernel's scratch. */
static int32_t linear(const tl_model *m, const tl_mat *w, const void *x, int64_t K, int32_t T,
                      void *y, void *tmp) {
    if (w->fmt == TL_F32)
        return tl_f32_linear((const float *)w->w, w->n, K, (const float *)x, K, T, (float *)y,
                             w->n, w->bias);
    if (w->fmt == TL_F32_PANEL)
        return tl_f32_panel_linear((const float *)w->w, w->n, K, (const float *)x, K, T,
                                   (float *)y, w->n, w->bias);
    if (w->fmt == TL_BF16)
        return tl_bf16_packed_linear((const uint16_t *)x, K, T, (const uint16_t *)w->w, w->n, K,
                                     w->bias, (uint16_t *)y, w->n, tmp, -1);
    if (m->act_bf16) /* a quantized weight in a bfloat16 model: one sum over K, as above */
        return tl_q_linear_bf16(w->fmt, (const uint8_t *)w->w, w->n, K, (const uint16_t *)x, K, T,
                                (uint16_t *)y, w->n, w->bias, tmp, m->act_levels, 0);
    return tl_q_linear(w->fmt, (const uint8_t *)w->w, w->n, K, (const float *)x, K, T,
                       (float *)y, w->n, w->bias, tmp, m->act_levels);
}

static void norm(const tl_model *m, const void *x, void *residual, const void *weight, void *out,
                 int32_t T) {
    const int32_t H = m->hidden;
    if (m->act_bf16)
        tl_add_rms_norm_bf16((const uint16_t *)x, H, (uint16_t *)residual, H,
                             (const uint16_t *)weight, (uint16_t *)out, H, T, H, m->eps);
    else
        tl_add_rms_norm_f32((const float *)x, H, (float *)residual, H, (const float *)weight,
                            (float *)out, H, T, H, m->eps);
}

/* h [T, hidden]: the embeddings of the step's tokens. out [T, hidden]: the final norm's output.
 * Both in the activations' dtype. positions, slots (int64 [T]), block_table (int32 [T,
 * bt_stride]) and seq_lens (int32 [T]) as the attention plan has them. lora: the step's LoRA
 * adapters, added to each projection's output before what follows it (RoPE, the norm,
 * SiLU-and-mul), as the eager LoRALinear does; float32 activations only; NULL for none. Returns 0,
 * or the first kernel's error code. */
int32_t tl_llama_decode(const tl_model *m, const tl_layer *layers, const void *h, void *out,
                        int32_t T, const int64_t *positions, const int64_t *slots,
                        const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                        void *workspace, const tl_lora *lora) {
    const int32_t H = m->hidden, Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim;
    const int64_t qd = (int64_t)Hq * D, kvd = (int64_t)Hkv * D, nqkv = qd + 2 * kvd;
    const int64_t I = m->intermediate, es = m->act_bf16 ? 2 : 4;
    if (m->num_layers < 1 || (m->act_bf16 && !m->kv_bf16) || (lora && m->act_bf16)) return -1;
    char *base = (char *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63);
    char *residual = base, *x = residual + T * H * es, *y = x + T * H * es;
    char *qkv = y + T * H * es, *attn = qkv + T * nqkv * es, *gu = attn + T * qd * es;
    char *act = gu + T * 2 * I * es;
    void *tmp = (void *)(((uintptr_t)(act + T * I * es) + 63) & ~(uintptr_t)63);
    int32_t rc;

    for (int32_t l = 0; l < m->num_layers; l++) {
        const tl_layer *L = layers + l;
        if (l == 0) { /* the residual stream starts as the embeddings */
            memcpy(residual, h, (size_t)(T * H * es));
            norm(m, h, NULL, L->input_norm, x, T);
        } else {
            norm(m, y, residual, L->input_norm, x, T);
        }
        if (L->k_part.w) { /* three quantized parts side by side in each row (float32 only) */
            const tl_mat *parts[3] = {&L->qkv, &L->k_part, &L->v_part};
            int64_t col = 0;
            if (m->act_bf16) return -1;
            for (int i = 0; i < 3; i++) {
                if ((rc = tl_q_linear(parts[i]->fmt, (const uint8_t *)parts[i]->w, parts[i]->n, H,
                                      (const float *)x, H, T, (float *)qkv + col, nqkv, parts[i]->bias,
                                      tmp, m->act_levels))) return rc;
                col += parts[i]->n;
            }
        } else if ((rc = linear(m, &L->qkv, x, H, T, qkv, tmp))) return rc;
        tl_lora_add(lora, l, TL_QKV, (const float *)x, H, T, (float *)qkv, nqkv);
        if (L->q_norm) { /* Qwen3: each q and k head RMS-normed before the rotation, in place */
            if (m->act_bf16) return -1;
            for (int32_t t = 0; t < T; t++) {
                float *row = (float *)qkv + (int64_t)t * nqkv;
                tl_add_rms_norm_f32(row, D, NULL, 0, L->q_norm, row, D, Hq, D, m->eps);
                tl_add_rms_norm_f32(row + qd, D, NULL, 0, L->k_norm, row + qd, D, Hkv, D, m->eps);
            }
        }
        /* q and k heads are adjacent in a row: one RoPE over both */
        if (m->act_bf16)
            tl_rope_bf16((uint16_t *)qkv, nqkv, T, Hq + Hkv, D, positions, m->cos_sin, m->cs_stride);
        else
            tl_rope_f32((float *)qkv, nqkv, T, Hq + Hkv, D, positions, m->cos_sin, m->cs_stride);
        /* the tokens' K and V into their cache slots: scattered stores that miss, split
         * between the threads (each token its own slot) */
#pragma omp parallel for if (T >= 16) schedule(static)
        for (int32_t t = 0; t < T; t++) {
            const char *k = qkv + (t * nqkv + qd) * es, *v = k + kvd * es;
            if (m->kv_bf16 && !m->act_bf16) {
                uint16_t *kc = (uint16_t *)L->k_cache + slots[t] * kvd;
                uint16_t *vc = (uint16_t *)L->v_cache + slots[t] * kvd;
                for (int64_t i = 0; i < kvd; i++) {
                    kc[i] = tl_f32_to_bf16(((const float *)k)[i]);
                    vc[i] = tl_f32_to_bf16(((const float *)v)[i]);
                }
            } else { /* the cache has the activations' dtype */
                memcpy((char *)L->k_cache + slots[t] * kvd * es, k, (size_t)(kvd * es));
                memcpy((char *)L->v_cache + slots[t] * kvd * es, v, (size_t)(kvd * es));
            }
        }
        rc = (m->act_bf16 ? tl_paged_decode_bf16
                          : m->kv_bf16 ? tl_paged_decode_f32_bf16kv : tl_paged_decode_f32)(
            qkv, nqkv, L->k_cache, L->v_cache, block_table, bt_stride, seq_lens, attn, qd, T, Hq,
            Hkv, D, m->block_size, m->scale, 0);
        if (rc) return rc;
        if ((rc = linear(m, &L->o, attn, qd, T, y, tmp))) return rc;
        tl_lora_add(lora, l, TL_O, (const float *)attn, qd, T, (float *)y, H);
        norm(m, y, residual, L->post_norm, x, T);
        if (L->moe) { /* the router, then the chosen experts in one call */
            const tl_moe *mo = L->moe;
            const int32_t E = m->moe_experts, k = m->moe_top_k;
            if (m->act_bf16 || lora) return -1;
            char *mb = (char *)tmp;
            float *logits = (float *)mb;
            int64_t *ids = (int64_t *)(mb + align64(T * E * 4));
            float *wts = (float *)((char *)ids + align64(T * k * 8));
            void *ms = (void *)(((uintptr_t)((char *)wts + align64(T * k * 4)) + 63) & ~(uintptr_t)63);
            if ((rc = tl_f32_linear(mo->router, E, H, (const float *)x, H, T, logits, E, NULL))) return rc;
            route(logits, T, E, k, m->moe_renorm, ids, wts);
            if ((rc = tl_q_moe(mo->fmt13, mo->w13, mo->fmt2, mo->w2, E, H, m->moe_width, (const float *)x,
                               T, k, ids, wts, (float *)y, ms, m->act_levels))) return rc;
            continue;
        }
        /* float32 on a quantized gate|up: SiLU-and-mul in the matmul's epilogue where the bf16
         * tiles run (1: they do not, two passes as below), the same bits as the two passes; an
         * adapter's product must come before the activation: two passes too */
        rc = m->act_bf16 || L->gate_up.fmt < 0 || tl_lora_touches(lora, l, TL_GATE_UP, T) ? 1
             : tl_q_linear_silu(L->gate_up.fmt, (const uint8_t *)L->gate_up.w, L->gate_up.n, H,
                                (const float *)x, H, T, (float *)act, I, L->gate_up.bias, tmp);
        if (rc < 0) return rc;
        if (rc) {
            if ((rc = linear(m, &L->gate_up, x, H, T, gu, tmp))) return rc;
            tl_lora_add(lora, l, TL_GATE_UP, (const float *)x, H, T, (float *)gu, 2 * I);
            if (m->act_bf16)
                tl_silu_and_mul_bf16((const uint16_t *)gu, 2 * I, (uint16_t *)act, I, T, (int32_t)I);
            else
                tl_silu_and_mul_f32((const float *)gu, 2 * I, (float *)act, I, T, (int32_t)I);
        }
        if ((rc = linear(m, &L->down, act, I, T, y, tmp))) return rc;
        tl_lora_add(lora, l, TL_DOWN, (const float *)act, I, T, (float *)y, H);
    }
    norm(m, y, residual, m->final_norm, out, T);
    return 0;
}
