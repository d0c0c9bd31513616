"""Compile every Triton attention kernel for NVIDIA targets without a GPU (not a test module).

    .venv/bin/python tests/attention/triton_aot_check.py [arch] [dtype]   # e.g. 90 bf16
    .venv/bin/python tests/attention/triton_aot_check.py 90 bf16 128 4 80 fp16 80 8   # several

The interpreter (TRITON_INTERPRET=1) executes kernels with numpy and accepts things the GPU
compiler rejects (dot shapes, type mismatches, constexpr misuse). Lowering through Triton's real
pipeline down to a cubin with the bundled ptxas catches those on a machine without CUDA.
test_triton_compile.py runs this in a subprocess, because the kernels must be decorated with the
interpreter off.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tokenloom.attention import triton_kernels as tk  # noqa: E402


def compile_kernel(fn, types: dict, consts: dict, arch: int) -> float:
    # Unlisted runtime arguments are int32 scalars (strides, offsets, counts).
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    t0 = time.perf_counter()
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts),
                            target=GPUTarget("cuda", arch, 32))
    assert kernel.asm.get("cubin"), "no cubin produced"
    return time.perf_counter() - t0


def main(arch: int, dt: str, head_dim: int = 128, group: int = 4, block_size: int = 16) -> None:
    P = "*" + dt
    prec = "ieee" if dt == "fp32" else None
    d_pad = max(16, tk._pow2(head_dim))
    g_pad = tk._pow2(group)
    paged = dict(q_ptr=P, cache_ptr=P, block_table_ptr="*i32", query_start_loc_ptr="*i32",
                 seq_lens_ptr="*i32", scale_log2e="fp32")
    cases = [
        ("kv_cache_write", tk._kv_cache_write_kernel,
         dict(key_ptr=P, value_ptr=P, cache_ptr=P, slot_ptr="*i64"),
         dict(NUM_KV_HEADS=8, HEAD_DIM=head_dim, H_PAD=8, D_PAD=d_pad)),
        ("unified_attention", tk._unified_attention_kernel,
         dict(paged, out_ptr=P, prog_req_ptr="*i32", prog_qoff_ptr="*i32"),
         dict(HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=group, G_PAD=g_pad,
              BLOCK_Q=max(1, 16 // g_pad), BLOCK_SIZE=block_size, TILE_N=32, PRECISION=prec,
              UPCAST=False, WINDOW=0)),
        ("split_kv_decode", tk._split_kv_decode_kernel,
         dict(paged, part_out_ptr="*fp32", part_lse_ptr="*fp32"),
         dict(HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=group, M_PAD=max(16, g_pad),
              BLOCK_SIZE=block_size, TILE_N=32, PRECISION=prec, UPCAST=False, WINDOW=0)),
        ("split_kv_reduce", tk._split_kv_reduce_kernel,
         dict(out_ptr=P, part_out_ptr="*fp32", part_lse_ptr="*fp32", query_start_loc_ptr="*i32"),
         dict(HEAD_DIM=head_dim, D_PAD=d_pad, S_PAD=8)),
        ("varlen_flash", tk._varlen_flash_kernel,
         dict(out_ptr=P, q_ptr=P, k_ptr=P, v_ptr=P, cu_seqlens_ptr="*i32", prog_req_ptr="*i32",
              prog_qoff_ptr="*i32", scale_log2e="fp32"),
         dict(HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=group, BLOCK_M=64, BLOCK_N=64,
              PRECISION=prec, UPCAST=False, WINDOW=0)),
    ]
    # The sliding-window variants (Gemma 3's window) of the three attention kernels.
    cases += [(f"{name} window", fn, types, {**consts, "WINDOW": 512})
              for name, fn, types, consts in cases if "WINDOW" in consts]
    for name, fn, types, consts in cases:
        secs = compile_kernel(fn, types, consts, arch)
        print(f"sm_{arch} {dt} D={head_dim} group={group} {name}: compiled in {secs:.1f}s",
              flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) > 4:  # several whole configs in a row: one interpreter (and import) for them all
        if len(args) % 4:
            sys.exit("several configs: arch dtype head_dim group, repeated")
        for i in range(0, len(args), 4):
            main(int(args[i]), args[i + 1], int(args[i + 2]), int(args[i + 3]))
    else:
        main(int(args[0]) if args else 90, args[1] if len(args) > 1 else "bf16",
             *(int(a) for a in args[2:]))
