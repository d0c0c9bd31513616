"""Time tokenloom's Triton attention kernels on a CUDA GPU.

    .venv/bin/python benchmarks/kernels.py [--quick]

For each case it prints milliseconds, TFLOP/s (attention matmul FLOPs actually needed: causal
pairs only) and GB/s (the bytes that must move at least once: Q, the K/V context read, the
output), for the Triton kernels and for `torch.nn.functional.scaled_dot_product_attention` on the
same problem laid out densely (no paging: the best case for torch), plus flash-attn when it is
installed. On a machine without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py: a CUDA device is required (torch "
              f"{torch.__version__} sees none); nothing to time.")
        return 0
    import triton.testing

    from tokenloom.attention import triton_kernels as tk
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "attention"))
    from attn_helpers import make_batch  # noqa: E402
    from tokenloom.attention.triton_backend import TritonAttentionBackend

    try:
        import flash_attn  # noqa: F401
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError:
        flash_attn_varlen_func = flash_attn_with_kvcache = None

    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    F = torch.nn.functional
    hq, hkv, d, block_size = 32, 8, 128, 16  # Llama-3-8B-like attention
    elt = torch.finfo(dtype).bits // 8
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton "
          f"{triton.__version__}, {args.dtype}, Hq={hq} Hkv={hkv} D={d} block_size={block_size}"
          f", flash-attn {'yes' if flash_attn_varlen_func else 'not installed'}")
    header = f"{'case':<34} {'impl':<16} {'ms':>9} {'TFLOP/s':>9} {'GB/s':>9}"

    def report(case, impl, fn, flops, nbytes):
        ms = triton.testing.do_bench(fn, warmup=10, rep=50)
        print(f"{case:<34} {impl:<16} {ms:9.4f} {flops / ms / 1e9:9.2f} {nbytes / ms / 1e6:9.1f}",
              flush=True)

    def dense_kv(batch, seq_lens):
        # The same context, contiguous and padded to the longest: [B, Hkv, L, D].
        meta, cache = batch.meta, batch.kv_cache
        L = max(seq_lens)
        pos = torch.arange(L, device=dev)
        blk = meta.block_table[:, (pos // block_size)].long()
        k = cache[0][blk, pos % block_size].transpose(1, 2).contiguous()
        v = cache[1][blk, pos % block_size].transpose(1, 2).contiguous()
        return k, v

    # ----------------------------------------------------------------- KV cache write
    print("\n" + header)
    for T in ([4096] if args.quick else [512, 8192, 65536]):
        b = make_batch([T], [T], hq, hkv, d, block_size, dtype=dtype, device=dev, extra_blocks=0)
        nbytes = 2 * 2 * T * hkv * d * elt  # read K/V, write K/V
        report(f"kv write T={T}", "triton",
               lambda: tk.kv_cache_write(b.key, b.value, b.kv_cache, b.meta.slot_mapping, T),
               0, nbytes)
        flat_k = b.kv_cache[0].view(-1, hkv, d)
        flat_v = b.kv_cache[1].view(-1, hkv, d)
        slots = b.meta.slot_mapping

        def torch_write():
            flat_k[slots] = b.key
            flat_v[slots] = b.value

        report(f"kv write T={T}", "torch index_put", torch_write, 0, nbytes)

    # ----------------------------------------------------------------- decode
    print("\n" + header)
    grid = [(8, 2048), (64, 1024)] if args.quick else [
        (1, 1024), (1, 16384), (8, 2048), (8, 16384), (64, 512), (64, 2048), (256, 1024)]
    for B, ctx in grid:
        seq_lens = [ctx] * B
        b = make_batch([1] * B, seq_lens, hq, hkv, d, block_size, dtype=dtype, device=dev,
                       extra_blocks=0)
        flops = 4 * B * ctx * hq * d
        nbytes = (2 * B * ctx * hkv * d + 2 * B * hq * d) * elt
        case = f"decode B={B} ctx={ctx}"
        out = torch.empty_like(b.query)
        for mode in ("unified", "split_kv"):
            be = TritonAttentionBackend(mode=mode)
            plan = be.prepare(b.meta)
            report(case, f"triton {mode}",
                   lambda: be.forward(b.query, b.key, b.value, b.kv_cache, plan, b.scale),
                   flops, nbytes)
        k, v = dense_kv(b, seq_lens)
        q = b.query.view(B, hq, 1, d)
        report(case, "torch sdpa dense",
               lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), flops, nbytes)
        if flash_attn_with_kvcache is not None:
            kc, vc = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
            qf = b.query.view(B, 1, hq, d)
            sl = b.meta.seq_lens
            report(case, "flash-attn dense",
                   lambda: flash_attn_with_kvcache(qf, kc, vc, cache_seqlens=sl, causal=True),
                   flops, nbytes)
        del out

    # ----------------------------------------------------------------- prefill (no context)
    print("\n" + header)
    grid = [(4, 1024)] if args.quick else [(1, 4096), (8, 1024), (64, 128), (32, 512)]
    for B, L in grid:
        b = make_batch([L] * B, [L] * B, hq, hkv, d, block_size, dtype=dtype, device=dev,
                       extra_blocks=0)
        flops = 4 * B * (L * (L + 1) // 2) * hq * d
        nbytes = (2 * B * L * hq * d + 2 * B * L * hkv * d) * elt
        case = f"prefill B={B} L={L}"
        for mode in ("varlen", "unified"):
            be = TritonAttentionBackend(mode=mode)
            plan = be.prepare(b.meta)
            report(case, f"triton {mode}",
                   lambda: be.forward(b.query, b.key, b.value, b.kv_cache, plan, b.scale),
                   flops, nbytes)
        q = b.query.view(B, L, hq, d).transpose(1, 2)
        k = b.key.view(B, L, hkv, d).transpose(1, 2)
        v = b.value.view(B, L, hkv, d).transpose(1, 2)
        report(case, "torch sdpa dense",
               lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
               flops, nbytes)
        if flash_attn_varlen_func is not None:
            cu = b.meta.query_start_loc
            report(case, "flash-attn varlen",
                   lambda: flash_attn_varlen_func(b.query, b.key, b.value, cu, cu, L, L,
                                                  causal=True), flops, nbytes)

    # ----------------------------------------------------------------- mixed batch
    print("\n" + header)
    grid = [(32, 1024, 2, 512)] if args.quick else [(32, 1024, 2, 512), (128, 2048, 4, 256)]
    for nd, ctx, nc, chunk in grid:
        q_lens = [1] * nd + [chunk] * nc
        seq_lens = [ctx] * nd + [ctx + chunk] * nc
        b = make_batch(q_lens, seq_lens, hq, hkv, d, block_size, dtype=dtype, device=dev,
                       extra_blocks=0)
        pairs = nd * ctx + nc * (chunk * ctx + chunk * (chunk + 1) // 2)
        flops = 4 * pairs * hq * d
        nbytes = (sum(seq_lens) * 2 * hkv * d + 2 * sum(q_lens) * hq * d) * elt
        be = TritonAttentionBackend(mode="unified")
        plan = be.prepare(b.meta)
        report(f"mixed {nd}x1@{ctx} + {nc}x{chunk}@{ctx}", "triton unified",
               lambda: be.forward(b.query, b.key, b.value, b.kv_cache, plan, b.scale),
               flops, nbytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
