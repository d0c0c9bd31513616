/* Paged-attention decode for the CPU: one query token per sequence, its keys and values read in
 * place from the paged KV cache through the block table (no gather copy).
 *
 * Layout (the torch backend's): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim],
 * contiguous; q and out [num_seqs, num_heads, head_dim] with a row stride per sequence;
 * block_table [num_seqs, bt_stride] int32; seq_lens [num_seqs] int32 (>= 1). With a sliding
 * `window` (> 0) the query at position p = seq_len - 1 attends keys p - window < j <= p; blocks
 * wholly before the window are never read (their table entries may name any block).
 *
 * Work items are (sequence, run of query heads, part of the context). Per cache block, the query
 * heads that share a KV head go through it together, up to three at a time: each K and V row is
 * loaded and widened to float32 once for all of them (GQA), Q.K runs as (heads x rows)
 * independent FMA chains reduced by one transposing tree, and P.V keeps (heads x columns)
 * accumulators in registers. Softmax is online per block (running max and sum, rescaling the
 * accumulator), as in FlashAttention, so nothing of size seq_len is allocated. A batch too small
 * to give every thread several items splits each sequence's context into parts whose partial
 * results are merged at the end (flash-decoding); the threads take contiguous runs of items of
 * about equal work. The next block is prefetched a few lines per step while this one is computed
 * (see pf_stream). The vector loops exist for AVX-512 (16 lanes, head_dim a multiple of 16) and AVX2 (8
 * lanes, a multiple of 8); other head sizes take plain loops.
 *
 * A bfloat16 row is widened 2 x lanes elements at a time with one load, a shift (the even
 * elements) and a mask (the odd ones), so within each such chunk the kernel keeps the query and
 * the accumulator in that even/odd order and restores the columns' order at the end.
 *
 * Built by tokenloom/ops/cpu_kernels.py with -O3 -march=native -ffast-math. The code never
 * produces inf or NaN (the running max starts at -FLT_MAX, not -inf; exp of anything below -87
 * is 0), which -ffast-math's finite-math assumption requires. The library is linked without
 * -ffast-math so that loading it does not switch the process to flush-to-zero.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#define TL_MAX_BLOCK_SIZE 128
/* Most query heads in one work item (a run of whole KV-head groups where they fit). */
#define TL_GC 16
/* Most query heads of one KV head that go through a block's rows together: their accumulators
 * (3 heads x 64 columns) and Q.K chains (3 heads x 8 rows) fill the AVX-512 register file. */
#define TL_GS 3
/* Most parts a small batch splits a sequence's context into. */
#define TL_MAX_PARTS 16
/* Most threads the work is split between by cost (more: by count). */
#define TL_MAX_THREADS 512
/* A bfloat16 model's decode goes through its context in chunks of this many rows (whole blocks),
 * as torch's fused SDPA kernel does (its key split for long contexts), so that it rounds the
 * probabilities to bfloat16 against the same running max; see kv_chunk_fn. */
#define TL_CHUNK_ROWS 512

/* One work item's running state: its query heads (pre-scaled, in the kernel's column order),
 * their accumulators, this block's (or chunk's) scores (padded to the vector width), the
 * online-softmax max and sum. */
typedef struct {
    float qs[TL_GC][256] __attribute__((aligned(64)));
    float acc[TL_GC][256] __attribute__((aligned(64)));
    float s[TL_GC][TL_CHUNK_ROWS + 32] __attribute__((aligned(64)));
    float m[TL_GC], l[TL_GC][16] __attribute__((aligned(64)));  /* l: the sum of lane i in l[g][i] */
    float scale;  /* the chunk path's: it scales the scores, not the query (see kv_chunk_fn) */
} item_state;

#include "vec_math.h"
#include "work_steal.h"

/* The end of the chunk path's softmax of head g (see chunk_softmax in paged_decode_impl.inc): the
 * last n scores at s, which do not fill a vector of torch's, exponentiated with expf (glibc's,
 * as torch's scalar loop calls it) against the max m and added one by one to `sum` (the vector
 * part's), the probabilities rounded to bfloat16; then the running max and sum updated, the old
 * sum rescaled by expf(old max - m) in one fused multiply-add. Compiled without -ffast-math, which
 * would vectorize the loop with another expf and reorder the sum. Returns the rescaling factor. */
__attribute__((noinline, optimize("no-fast-math"), unused))
static float tl_softmax_tail(item_state *st, int g, float *s, int n, float m, float sum) {
    for (int j = 0; j < n; j++) {
        const float p = expf(s[j] - m);
        sum += p;
        s[j] = tl_round_bf16(p);
    }
    const float alpha = expf(st->m[g] - m);  /* 0 on the first chunk (m[g] = -FLT_MAX) */
    st->l[g][0] = fmaf(alpha, st->l[g][0], sum);
    st->m[g] = m;
    return alpha;
}

#define TL_CAT3_(a, b, c) a##_##b##_##c
#define TL_CAT3(a, b, c) TL_CAT3_(a, b, c)

/* A query or accumulator row in the kernel's column order: with `pw` lanes (a bfloat16 cache on
 * a vector path), each full chunk of 2 x pw columns holds its even columns first, then its odd
 * ones; everything else is in order. Written as stride-2 loops with a constant pw so that the
 * compiler vectorizes them. */
static inline __attribute__((always_inline)) void order_pw(float *dst, const float *src, int D,
                                                           const int pw, float scale, int back) {
    int c = 0;
    for (; pw && c + 2 * pw <= D; c += 2 * pw)
        for (int j = 0; j < pw; j++) {
            if (back) {
                dst[c + 2 * j] = src[c + j] * scale;
                dst[c + 2 * j + 1] = src[c + pw + j] * scale;
            } else {
                dst[c + j] = src[c + 2 * j] * scale;
                dst[c + pw + j] = src[c + 2 * j + 1] * scale;
            }
        }
    for (; c < D; c++) dst[c] = src[c] * scale;
}

/* dst = src * scale into the kernel's order (back = 0) or out of it (back = 1). */
static void reorder(float *dst, const float *src, int D, int pw, float scale, int back) {
    if (pw == 16) order_pw(dst, src, D, 16, scale, back);
    else if (pw == 8) order_pw(dst, src, D, 8, scale, back);
    else order_pw(dst, src, D, 0, scale, back);
}

/* q0 and o0 are float32, or bfloat16 when io_bf16 (a bfloat16 model's queries and outputs; the
 * arithmetic stays float32). The block path scales the query once; the chunk path (chunk) keeps
 * it as it is and scales the scores, as torch's kernel does. */
static void item_begin(item_state *st, const void *q0, int io_bf16, int nh, int D, float scale,
                       int pw, int chunk) {
    float row[256];
    st->scale = scale;
    for (int g = 0; g < nh; g++) {
        st->m[g] = -FLT_MAX;
        for (int i = 0; i < 16; i++) st->l[g][i] = 0.0f;
        const float *q = (const float *)q0 + g * D;
        if (io_bf16) {
            for (int i = 0; i < D; i++) row[i] = tl_bf16_to_f32(((const uint16_t *)q0)[g * D + i]);
            q = row;
        }
        reorder(st->qs[g], q, D, pw, chunk ? 1.0f : scale, 0);
        for (int i = 0; i < D; i++) st->acc[g][i] = 0.0f;
    }
}

/* The running sum of head g (kept per lane by the vector loops). */
static inline float item_sum(const item_state *st, int g) {
    float l = 0.0f;
    for (int i = 0; i < 16; i++) l += st->l[g][i];
    return l;
}

static void item_end(const item_state *st, int nh, int D, void *o0, int io_bf16, int pw) {
    float row[256];
    for (int g = 0; g < nh; g++) {
        const float l = item_sum(st, g), inv = l > 0.0f ? 1.0f / l : 0.0f;
        if (!io_bf16) {
            reorder((float *)o0 + g * D, st->acc[g], D, pw, inv, 1);
            continue;
        }
        reorder(row, st->acc[g], D, pw, inv, 1);
        for (int i = 0; i < D; i++) ((uint16_t *)o0)[g * D + i] = tl_f32_to_bf16(row[i]);
    }
}

/* Prefetches of the rows an item reads next (the next block, all the item's heads: one
 * contiguous range), spread over the steps of the current block's loops: each step issues the
 * next `per` bytes' lines. Blocks are scattered in memory, so without software prefetches the
 * kernel stalls at every block; but a whole block's prefetches issued at once stalled the core
 * until most of it had arrived, so that loading and computing took turns
 * (benchmarks/decode_attention.py), and in the order of the range they
 * also train the hardware's streaming prefetcher. */
typedef struct {
    const char *p, *end;
    int64_t per;
    const char *fp, *fend; /* the far range (pf_far_init), fper bytes a step, to L2 */
    int64_t fper;
} pf_stream;

static inline void pf_init(pf_stream *s, const void *p, int64_t bytes, int steps) {
    s->p = (const char *)p;
    s->end = p ? s->p + bytes : s->p;
    s->per = ((bytes + 63) / 64 + steps - 1) / (steps > 0 ? steps : 1) * 64;
    s->fp = s->fend = NULL;
    s->fper = 0;
}

/* Besides the next rows (to L1), the rows a few blocks further on, to L2 at the same pace: a
 * block TL_PF_FAR blocks ahead of the one being read (K blocks, then V blocks). With the next
 * block alone in flight the loops waited on memory at every block; a block's worth of L2
 * prefetches sent at once gained less than paced ones (benchmarks/decode_attention.py). */
#define TL_PF_FAR 3
static inline void pf_far_init(pf_stream *s, const void *p, int64_t bytes, int steps) {
    s->fp = (const char *)p;
    s->fend = p ? s->fp + bytes : s->fp;
    s->fper = ((bytes + 63) / 64 + steps - 1) / (steps > 0 ? steps : 1) * 64;
}

static inline __attribute__((always_inline)) void pf_run(pf_stream *s) {
    const char *e = s->p + s->per < s->end ? s->p + s->per : s->end;
    for (; s->p < e; s->p += 64) __builtin_prefetch(s->p);
    const char *fe = s->fp + s->fper < s->fend ? s->fp + s->fper : s->fend;
    for (; s->fp < fe; s->fp += 64) __builtin_prefetch(s->fp, 0, 2);
}

/* The rows at p (bytes) to L2 at once (a chunk's first far block, before the paced stream
 * starts). */
static inline __attribute__((unused)) void pf_far(const void *p, int64_t bytes) {
    for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch((const char *)p + x, 0, 2);
}

/* Heads g0 .. g0 + gn - 1 of an item (one KV head's) over n rows of a block: kb, vb point at
 * the first row's K and V of that KV head, rows tok_stride elements apart. pk, pv (NULL: none):
 * the prefetch streams of the rows read next, advanced as Q.K and P.V go. */
typedef void (*kv_block_fn)(item_state *st, int g0, int gn, const void *kb, const void *vb,
                            int n, int64_t tok_stride, int D, pf_stream *pk, pf_stream *pv);
/* An item's query heads by KV head, up to TL_GS at a time: group i is heads g0[i] ..
 * g0[i] + gn[i] - 1 of the KV head whose columns start off[i] bytes into a cache row. */
typedef struct {
    int n, g0[TL_GC], gn[TL_GC];
    int64_t off[TL_GC];
} item_groups;
/* The item's head groups over a chunk of nb blocks (K and V pointers at each block's first row
 * the item reads, and row counts), for a bfloat16 model, where the reference (transformers in
 * bfloat16: torch's fused SDPA kernel) takes up to TL_CHUNK_ROWS keys at a time: this path
 * computes what it computes, bit for bit -- its softmax (exp approximation, sums, probabilities
 * rounded to bfloat16) and its matmuls' summation order (paged_decode_chunk.inc). The softmax of
 * the whole chunk at once is no slower than per block: the same passes over the same rows.
 * nxt: the block (nxtn rows) the item, or the next one, reads after this chunk (NULL: none),
 * prefetched during the last V block. */
typedef void (*kv_chunk_fn)(item_state *st, const item_groups *gr, const void *const *kbs,
                            const void *const *vbs, const int *ns, int nb, int64_t tok_stride,
                            int D, const void *nxt, int nxtn);

/* Whether MKL's bf16 gemm sums in its AVX2 order on this AVX-512 CPU (it picks its kernel by the
 * CPU: on AMD's AVX512-BF16 CPUs it runs the AVX2 one) while torch's vectors are AVX-512's, set at load by
 * ops/cpu_kernels.py from a probe of MKL. Then a bfloat16 model's decode follows MKL's AVX2 order
 * with the 16-lane softmax, which follows torch's (paged_decode_chunk.inc), so that it stays
 * torch's SDPA bit for bit: with AVX512-BF16 dot products where the build has them (1), else
 * (or when set to 2, which tests use to compare the two) with the 8-lane loops. */
static int g_mkl_avx2_order = 0;

void tl_paged_decode_set_mkl_avx2_order(int32_t on) { g_mkl_avx2_order = on; }

/* Whether this build has the dot-product loops of MKL's AVX2 order (kv_chunk_dp). */
#if TL_HAVE_AVX512 && defined(__AVX512BF16__)
#define TL_DECODE_DP 1
#else
#define TL_DECODE_DP 0
#endif
int32_t tl_paged_decode_dp_built(void) { return TL_DECODE_DP; }

/* Each vector width's kv_block_fn and kv_chunk_fn. */
#include "paged_decode_kernels.inc"

typedef struct {
    const char *q; int64_t q_stride;
    const char *k_cache, *v_cache;
    const int32_t *block_table; int64_t bt_stride;
    const int32_t *seq_lens;
    char *out; int64_t out_stride;
    int num_heads, G, D, block_size, window, io_bf16, parts;
    int pair_w;  /* see reorder() */
    int64_t esz_kv, tok_stride, blk_stride;
    float scale;
    kv_block_fn fn;
    kv_chunk_fn chunk_fn;  /* set for a bfloat16 model (io_bf16): see kv_chunk_fn */
    int chunk_blocks;      /* blocks per chunk there */
    int qk_rows;           /* rows per Q.K step of fn's loops (its prefetch pace) */
} decode_args;

/* The blocks lo .. hi - 1 of sequence b that part `part` of it reads; its first block's rows
 * start at row `first` - blk0 * block_size. */
typedef struct { int L, first, blk0, lo, hi; } item_range;

static item_range range_of(const decode_args *a, int b, int part) {
    item_range r;
    const int bs = a->block_size;
    r.L = a->seq_lens[b];
    r.first = a->window > 0 && r.L > a->window ? r.L - a->window : 0;
    r.blk0 = r.first / bs;
    const int nblk = (r.L + bs - 1) / bs - r.blk0;
    /* The chunk path splits the context between parts at chunk boundaries only. */
    const int unit = a->chunk_fn ? a->chunk_blocks : 1, nunit = (nblk + unit - 1) / unit;
    r.lo = r.blk0 + (int)((int64_t)part * nunit / a->parts) * unit;
    r.hi = r.blk0 + (int)((int64_t)(part + 1) * nunit / a->parts) * unit;
    if (r.hi > r.blk0 + nblk) r.hi = r.blk0 + nblk;
    return r;
}

/* Row r0 of block blk that the item reads first, and the rows it reads there. */
static inline int range_r0(const item_range *r, int blk, int bs) {
    return blk == r->blk0 ? r->first - blk * bs : 0;
}
static inline int range_rows(const item_range *r, int blk, int bs) {
    return (r->L - blk * bs < bs ? r->L - blk * bs : bs) - range_r0(r, blk, bs);
}

/* One work item: query heads hq0 .. hq0 + nh - 1 of sequence b, over part `part` of its
 * context's blocks. With one part the result goes to `out`; otherwise the unnormalized
 * accumulators, max and sum go to `partial` ([nh][D + 2]). nb, npart: the item computed next
 * on this thread (nb < 0: none), whose first block is prefetched during this one's last. */
static void run_item(const decode_args *a, int b, int hq0, int nh, int part, float *partial,
                     int nb, int npart) {
    item_state st;
    const int D = a->D, bs = a->block_size;
    const int64_t qesz = a->io_bf16 ? 2 : 4;
    item_begin(&st, a->q + (b * a->q_stride + (int64_t)hq0 * D) * qesz, a->io_bf16, nh, D,
               a->scale, a->pair_w, a->chunk_fn != NULL);
    const item_range r = range_of(a, b, part);
    const int lo = r.lo, hi = r.hi;
    const int32_t *bt = a->block_table + b * a->bt_stride;
    const int64_t row_bytes = a->tok_stride * a->esz_kv, blk_bytes = a->blk_stride * a->esz_kv;
    /* The item's heads, grouped by KV head, up to TL_GS at a time. */
    item_groups gr = {.n = 0};
    for (int g = 0; g < nh;) {
        const int kvh = (hq0 + g) / a->G;
        int gn = (kvh + 1) * a->G - (hq0 + g);
        if (gn > nh - g) gn = nh - g;
        if (gn > TL_GS) gn = gn == TL_GS + 1 ? 2 : TL_GS;  /* 4 = 2 + 2, not 3 + 1 */
        gr.g0[gr.n] = g;
        gr.gn[gr.n] = gn;
        gr.off[gr.n++] = (int64_t)kvh * D * a->esz_kv;
        g += gn;
    }
    /* The next item's first block (at the row it starts from), or -1. */
    int64_t after = -1;
    int after_n = 0;
    if (nb >= 0) {
        const item_range rn = range_of(a, nb, npart);
        if (rn.lo < rn.hi) {
            after = (int64_t)a->block_table[nb * a->bt_stride + rn.lo] * blk_bytes +
                    range_r0(&rn, rn.lo, bs) * row_bytes;
            after_n = range_rows(&rn, rn.lo, bs);
        }
    }
    if (a->chunk_fn) {
        const void *kbs[TL_CHUNK_ROWS], *vbs[TL_CHUNK_ROWS];
        int ns[TL_CHUNK_ROWS];
        for (int c0 = lo; c0 < hi; c0 += a->chunk_blocks) {
            const int c1 = c0 + a->chunk_blocks < hi ? c0 + a->chunk_blocks : hi;
            for (int blk = c0; blk < c1; blk++) {
                const int64_t at = (int64_t)bt[blk] * blk_bytes + range_r0(&r, blk, bs) * row_bytes;
                kbs[blk - c0] = a->k_cache + at;
                vbs[blk - c0] = a->v_cache + at;
                ns[blk - c0] = range_rows(&r, blk, bs);
            }
            const void *nxt = c1 < hi ? a->k_cache + (int64_t)bt[c1] * blk_bytes
                                      : after >= 0 ? a->k_cache + after : NULL;
            const int nxtn = c1 < hi ? range_rows(&r, c1, bs) : after_n;
            a->chunk_fn(&st, &gr, kbs, vbs, ns, c1 - c0, a->tok_stride, D, nxt, nxtn);
        }
    }
    for (int blk = lo; blk < hi && !a->chunk_fn; blk++) {
        const int64_t at = (int64_t)bt[blk] * blk_bytes + range_r0(&r, blk, bs) * row_bytes;
        const int n = range_rows(&r, blk, bs);
        /* the next block's rows (or the next item's first), prefetched as this one's are
         * computed */
        const int64_t nx = blk + 1 < hi ? (int64_t)bt[blk + 1] * blk_bytes : after;
        const int64_t nbytes = (blk + 1 < hi ? range_rows(&r, blk + 1, bs) : after_n) * row_bytes;
        pf_stream pk, pv;
        const int qsteps = gr.n * ((n + a->qk_rows - 1) / a->qk_rows);
        pf_init(&pk, nx < 0 ? NULL : a->k_cache + nx, nbytes, qsteps);
        pf_init(&pv, nx < 0 ? NULL : a->v_cache + nx, nbytes, gr.n * n);
        if (blk == lo && lo + 2 < hi) {
            const int64_t fat =
                (int64_t)bt[lo + 2] * blk_bytes + range_r0(&r, lo + 2, bs) * row_bytes;
            pf_far(a->k_cache + fat, range_rows(&r, lo + 2, bs) * row_bytes);
            pf_far(a->v_cache + fat, range_rows(&r, lo + 2, bs) * row_bytes);
        }
        if (blk + TL_PF_FAR < hi) {
            const int f = blk + TL_PF_FAR;
            const int64_t fat = (int64_t)bt[f] * blk_bytes + range_r0(&r, f, bs) * row_bytes;
            pf_far_init(&pk, a->k_cache + fat, range_rows(&r, f, bs) * row_bytes, qsteps);
            pf_far_init(&pv, a->v_cache + fat, range_rows(&r, f, bs) * row_bytes, gr.n * n);
        }
        for (int i = 0; i < gr.n; i++) {
            const int64_t off = gr.off[i];
            a->fn(&st, gr.g0[i], gr.gn[i], a->k_cache + at + off, a->v_cache + at + off, n,
                  a->tok_stride, D, &pk, &pv);
        }
    }
    if (a->parts == 1) {
        item_end(&st, nh, D, a->out + (b * a->out_stride + (int64_t)hq0 * D) * qesz, a->io_bf16,
                 a->pair_w);
        return;
    }
    for (int g = 0; g < nh; g++) {
        float *p = partial + (int64_t)g * (D + 2);
        for (int i = 0; i < D; i++) p[i] = st.acc[g][i];
        p[D] = st.m[g];
        p[D + 1] = item_sum(&st, g);
    }
}

/* Query head hq of sequence b from its parts' partial results (`partials` [parts][D + 2],
 * `step` floats apart). */
static void merge_parts(const decode_args *a, int b, int hq, const float *partials,
                        int64_t step) {
    const int D = a->D;
    float mx = -FLT_MAX, l = 0.0f, w[TL_MAX_PARTS];
    for (int k = 0; k < a->parts; k++) {
        const float mk = partials[k * step + D];
        mx = mk > mx ? mk : mx;
    }
    for (int k = 0; k < a->parts; k++) {
        const float *p = partials + k * step;
        w[k] = p[D + 1] > 0.0f ? expf(p[D] - mx) : 0.0f;
        l += p[D + 1] * w[k];
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int64_t qesz = a->io_bf16 ? 2 : 4;
    char *o = a->out + (b * a->out_stride + (int64_t)hq * D) * qesz;
    float sum[256], row[256];
    for (int i = 0; i < D; i++) {
        float v = 0.0f;
        for (int k = 0; k < a->parts; k++) v += partials[k * step + i] * w[k];
        sum[i] = v;
    }
    reorder(row, sum, D, a->pair_w, inv, 1);
    for (int i = 0; i < D; i++) {
        if (a->io_bf16) ((uint16_t *)o)[i] = tl_f32_to_bf16(row[i]);
        else ((float *)o)[i] = row[i];
    }
}

/* Splits the items (in their order) into nt contiguous runs of about equal work, bounds[t] ..
 * bounds[t + 1] for thread t: an item's work is its blocks times its heads, plus one block's for
 * its setup, so that a batch of mixed context lengths keeps both threads busy to the end (an
 * equal count of items left the thread with the longer contexts working alone). */
static void split_items(const decode_args *a, int64_t items, int nchunk, int hpc, int nt,
                        int64_t *bounds) {
    if (nt > TL_MAX_THREADS) return;  /* the caller splits by count */
    int64_t total = 0;
    for (int64_t it = 0; it < items; it++) {
        const int b = (int)(it / a->parts / nchunk), c = (int)(it / a->parts % nchunk);
        const int nh = a->num_heads - c * hpc < hpc ? a->num_heads - c * hpc : hpc;
        const item_range r = range_of(a, b, (int)(it % a->parts));
        total += (int64_t)(r.hi - r.lo + 1) * nh;
    }
    int64_t cum = 0;
    int t = 1;
    bounds[0] = 0;
    for (int64_t it = 0; it < items && t < nt; it++) {
        while (t < nt && cum * nt >= total * t) bounds[t++] = it;
        const int b = (int)(it / a->parts / nchunk), c = (int)(it / a->parts % nchunk);
        const int nh = a->num_heads - c * hpc < hpc ? a->num_heads - c * hpc : hpc;
        const item_range r = range_of(a, b, (int)(it % a->parts));
        cum += (int64_t)(r.hi - r.lo + 1) * nh;
    }
    while (t < nt) bounds[t++] = items;
    bounds[nt] = items;
}

/* q and out are float32, or bfloat16 when io_bf16; element strides. */
static int decode(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                  const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                  void *out, int64_t out_stride, int32_t num_seqs, int32_t num_heads,
                  int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale,
                  int32_t window, int kv_bf16, int io_bf16) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    if (head_dim > 256 || block_size > TL_MAX_BLOCK_SIZE) return -2;
    decode_args a = {
        .q = (const char *)q, .q_stride = q_stride, .k_cache = (const char *)k_cache,
        .v_cache = (const char *)v_cache, .block_table = block_table, .bt_stride = bt_stride,
        .seq_lens = seq_lens, .out = (char *)out, .out_stride = out_stride,
        .num_heads = num_heads, .G = num_heads / num_kv_heads, .D = head_dim,
        .block_size = block_size, .window = window, .io_bf16 = io_bf16, .parts = 1,
        .esz_kv = kv_bf16 ? 2 : 4, .tok_stride = (int64_t)num_kv_heads * head_dim,
        .scale = scale,
    };
    a.blk_stride = (int64_t)block_size * a.tok_stride;
    a.fn = kv_bf16 ? kv_block_scalar_bf16kv : kv_block_scalar_f32;
    a.qk_rows = 1;
    if (io_bf16) {
        a.chunk_fn = kv_chunk_scalar_bf16kv;
        a.chunk_blocks = TL_CHUNK_ROWS / block_size;
    }
    /* The widest loops the build has for this head_dim (TOKENLOOM_CPU_ISA builds a narrower
     * library, see ops/cpu_features.py). */
#if TL_HAVE_AVX2
    if (head_dim % 8 == 0) {
        a.fn = kv_bf16 ? kv_block_avx2_bf16kv : kv_block_avx2_f32;
        /* The chunk path (a bfloat16 model) keeps column order on AVX2 (paged_decode_chunk.inc). */
        a.pair_w = kv_bf16 && !io_bf16 ? 8 : 0;
        a.qk_rows = 4;  /* QK_ROWS there */
        if (io_bf16) a.chunk_fn = kv_chunk_avx2_bf16kv;
    }
#endif
#if TL_HAVE_AVX512
    /* MKL's AVX2 order (see g_mkl_avx2_order): the dot-product loops, else the 8-lane ones */
    const int mkl_avx2 = io_bf16 && g_mkl_avx2_order;
    const int dp = TL_DECODE_DP && mkl_avx2 && g_mkl_avx2_order != 2;
    if (head_dim % 16 == 0 && (!mkl_avx2 || dp)) {
        a.fn = kv_bf16 ? kv_block_avx512_bf16kv : kv_block_avx512_f32;
        a.pair_w = kv_bf16 ? 16 : 0;
        a.qk_rows = 8;
        if (io_bf16) a.chunk_fn = kv_chunk_avx512_bf16kv;
#if TL_DECODE_DP
        if (dp) {
            a.chunk_fn = kv_chunk_dp_avx512_bf16kv;
            a.pair_w = 0;
        }
#endif
    }
#endif
    /* Items: (sequence, run of whole KV-head groups of up to TL_GC query heads). A batch with
     * fewer than four items per thread takes one KV head's group per item, then splits each
     * context into parts until every thread has as many items as the others and at least two
     * (one thread never splits: the parts would only add their merge). */
    const int nth = omp_get_max_threads();
    int hpc = a.G <= TL_GC ? (TL_GC / a.G) * a.G : TL_GC;
    if (hpc > num_heads) hpc = num_heads;
    if ((int64_t)num_seqs * ((num_heads + hpc - 1) / hpc) < 4 * nth && a.G <= TL_GC) hpc = a.G;
    const int nchunk = (num_heads + hpc - 1) / hpc;
    while (nth > 1 && a.parts < TL_MAX_PARTS) {
        const int64_t n = (int64_t)num_seqs * nchunk * a.parts;
        if (n >= 2 * nth && n % nth == 0) break;
        if (n >= 4 * nth) break;
        a.parts++;
    }
    if (a.chunk_fn && a.parts > 1) {  /* no more parts than the longest context has chunks */
        int most = 1;
        for (int b = 0; b < num_seqs; b++) {
            const int rows = window > 0 && seq_lens[b] > window ? window + block_size : seq_lens[b];
            const int n = (rows + TL_CHUNK_ROWS - 1) / TL_CHUNK_ROWS;
            most = n > most ? n : most;
        }
        if (a.parts > most) a.parts = most;
    }
    const int64_t items = (int64_t)num_seqs * nchunk * a.parts;
    const int64_t step = (int64_t)hpc * (head_dim + 2);  /* one item's partial results */
    float *partials = NULL;
    if (a.parts > 1 && !(partials = malloc(sizeof(float) * items * step))) return -3;
    int64_t bounds[TL_MAX_THREADS + 1];
    tl_run runs[TL_STEAL_MAX_THREADS];
#pragma omp parallel
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int steal = nt <= TL_STEAL_MAX_THREADS;
#pragma omp single
        {
            split_items(&a, items, nchunk, hpc, nt, bounds);
            if (steal) tl_runs_init(runs, bounds, nt);
        }
        /* Each thread its contiguous run of items, so that the next item it takes is the
         * following one (whose first block run_item prefetches); a thread done with its run
         * takes items from the back of the fullest other (work_steal.h). */
        const int64_t i0 = nt <= TL_MAX_THREADS ? bounds[t] : items * t / nt;
        const int64_t i1 = nt <= TL_MAX_THREADS ? bounds[t + 1] : items * (t + 1) / nt;
        for (int64_t k = i0, it, nx; (it = tl_next_item(runs, steal, t, nt, &k, i1, &nx)) >= 0;) {
            const int part = (int)(it % a.parts);
            const int b = (int)(it / a.parts / nchunk), c = (int)(it / a.parts % nchunk);
            const int hq0 = c * hpc, nh = num_heads - hq0 < hpc ? num_heads - hq0 : hpc;
            run_item(&a, b, hq0, nh, part, partials ? partials + it * step : NULL,
                     nx < 0 ? -1 : (int)(nx / a.parts / nchunk), nx < 0 ? 0 : (int)(nx % a.parts));
        }
#pragma omp barrier
        if (partials) {
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < (int64_t)num_seqs * num_heads; bh++) {
                const int b = (int)(bh / num_heads), hq = (int)(bh % num_heads);
                const int64_t it0 = ((int64_t)b * nchunk + hq / hpc) * a.parts;
                merge_parts(&a, b, hq, partials + it0 * step + (int64_t)(hq % hpc) * (head_dim + 2),
                            step);
            }
        }
    }
    free(partials);
    return 0;
}

/* The exported entry points: float32 queries over a float32 cache, float32 queries over a
 * bfloat16 cache (kv_cache_dtype="bfloat16" under a float32 model), and a bfloat16 model's
 * bfloat16 queries, cache and output. window <= 0: no sliding window. */
#define TL_DECODE_ARGS const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, \
    const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens, void *out, \
    int64_t out_stride, int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, \
    int32_t head_dim, int32_t block_size, float scale, int32_t window
#define TL_DECODE_PASS q, q_stride, k_cache, v_cache, block_table, bt_stride, seq_lens, out, \
    out_stride, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window
int tl_paged_decode_f32(TL_DECODE_ARGS) { return decode(TL_DECODE_PASS, 0, 0); }
int tl_paged_decode_f32_bf16kv(TL_DECODE_ARGS) { return decode(TL_DECODE_PASS, 1, 0); }
int tl_paged_decode_bf16(TL_DECODE_ARGS) { return decode(TL_DECODE_PASS, 1, 1); }

/* For tests of work_steal.h: `items` items over the OpenMP threads as the kernels take them,
 * thread `slow` spinning 20,000 iterations per item (a descheduled thread's stand-in); counts[it] += 1 per
 * item taken. Returns how many items a thread took from another's run. */
int64_t tl_work_steal_check(int64_t items, int32_t slow, int32_t *counts) {
    tl_run runs[TL_STEAL_MAX_THREADS];
    int64_t stolen = 0;
#pragma omp parallel reduction(+ : stolen)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
#pragma omp single
        tl_runs_init_even(runs, items, nt < TL_STEAL_MAX_THREADS ? nt : TL_STEAL_MAX_THREADS);
        const int64_t i0 = items * t / nt, i1 = items * (t + 1) / nt;
        for (int64_t it, nx; nt <= TL_STEAL_MAX_THREADS && (it = tl_runs_next(runs, t, nt, &nx)) >= 0;) {
            if (t == slow) {
                volatile double x = 0;
                for (int i = 0; i < 20000; i++) x += i;
            }
#pragma omp atomic
            counts[it] += 1;
            stolen += it < i0 || it >= i1;
        }
    }
    return stolen;
}
