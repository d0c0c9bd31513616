"""The C decode-attention kernel at batch-64 decode shapes against the floor of reading its K/V
bytes once, and optionally against the kernel of an earlier commit, in one process
(benchmarks/README.md, "Decode attention at batch 64").

    PYTHONPATH=src .venv/bin/python benchmarks/decode_attention.py [--rev HEAD~1] [--threads 1 2]

30 layers, one paged cache each (so K/V come from memory as in a decode step), SmolLM2's heads
(9 query, 3 KV, head_dim 64), block size 16, 64 sequences with contexts spread over 128..256
(what a 64 x 128 x 128 run decodes through). Three cases, the entry points the engine uses:
float32 queries over a float32 cache (the GGUF path's default), float32 queries over a bfloat16
cache (`--kv-cache-dtype bfloat16`) and a bfloat16 model's bfloat16 queries and cache
(`--quantization none` on a CPU with AVX512-BF16). The floor is a plain sum over the same
layers' cache bytes (every block the batch owns, read once, side by side): the kernel's time
over it says how far it is from bound by memory. Figures: the fastest of the rounds, the
candidates alternating within each round (and the median of the rounds' ratios for --rev);
with one thread its CPU time (which other processes on a shared machine barely move), with
more the wall time.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tokenloom.ops import cpu_features, cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "attention"))
from attn_helpers import make_batch  # noqa: E402
from decode_kernel_ab import _build, _sources_at  # noqa: E402

_CASES = {  # name: (query dtype, cache dtype, entry point)
    "f32/f32kv": (torch.float32, torch.float32, "tl_paged_decode_f32"),
    "f32/bf16kv": (torch.float32, torch.bfloat16, "tl_paged_decode_f32_bf16kv"),
    "bf16/bf16kv": (torch.bfloat16, torch.bfloat16, "tl_paged_decode_bf16"),
}


def _caller(lib: ctypes.CDLL, entry: str):  # noqa: ANN202 - a closure
    fn = getattr(lib, entry)
    c = ctypes
    fn.restype = c.c_int32
    fn.argtypes = [c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p, c.c_void_p, c.c_int64, c.c_void_p,
                   c.c_void_p, c.c_int64, *[c.c_int32] * 5, c.c_float, c.c_int32]

    def call(q, kv, bt, sl, out, scale):
        k = kv.data_ptr()
        v = k + kv.element_size() * kv.stride(0)
        if fn(q.data_ptr(), q.stride(0), k, v, bt.data_ptr(), bt.stride(0), sl.data_ptr(),
              out.data_ptr(), out.stride(0), q.shape[0], q.shape[1], kv.shape[3], q.shape[2],
              kv.shape[2], scale, 0) != 0:
            raise RuntimeError("kernel rejected the shapes")
    return call


def _engine_layout(ctx: list[int], bs: int, prompt_len: int,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache and block table laid out as the engine's pool fills them for a batch whose
    prompts were prefilled together, then decoded in lockstep: sequence i's prompt blocks
    side by side, then its decode blocks one in every len(ctx)."""
    B, pb = len(ctx), -(-prompt_len // bs)
    most = max(-(-n // bs) for n in ctx)
    table = torch.zeros(B, most + 1, dtype=torch.int32)
    for i, n in enumerate(ctx):
        for j in range(-(-n // bs)):
            table[i, j] = i * pb + j if j < pb else B * pb + (j - pb) * B + i
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, int(table.max()) + 1, bs, 3, 64, generator=g)
    return kv, table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default=None, help="also time the kernel of this commit")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, nargs=2, default=[128, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layout", choices=["shuffled", "engine"], default="shuffled",
                    help="blocks in random places, or as the engine's block pool hands them out "
                         "to a batch prefilled together: each prompt's blocks side by side, then "
                         "one block per sequence in turn as decoding goes")
    ap.add_argument("--prompt-len", type=int, default=128, help="the engine layout's prompt")
    ap.add_argument("--cases", nargs="+", default=list(_CASES), choices=list(_CASES))
    ap.add_argument("--isa", choices=cpu_features.ISA_LEVELS, default=None,
                    help="build for this ISA level instead of this CPU's (e.g. avx2 on an AVX-512 "
                         "machine: the AVX2 loops on this machine's memory)")
    args = ap.parse_args()
    f = cpu_features.detect()
    isa = args.isa or f.isa
    print(f"{f.summary()}; kernels built for {isa}; batch {args.batch}, contexts "
          f"{args.context[0]}..{args.context[1]}, {args.layers} layers, block size {args.block_size}, "
          f"{args.layout} blocks", flush=True)
    libs = {"new": _build(Path(cpu_kernels.__file__).with_name("csrc"), isa)}
    if args.rev:
        with tempfile.TemporaryDirectory() as tmp:
            libs[args.rev] = _build(_sources_at(args.rev, Path(tmp)), isa)
    for lib in libs.values():  # the summation order the engine's load picks (MKL's, probed)
        if hasattr(lib, "tl_paged_decode_set_mkl_avx2_order"):
            cpu_kernels._follow_mkl_order(lib)
    lo, hi = args.context
    ctx = [lo + (hi - lo) * i // max(args.batch - 1, 1) for i in range(args.batch)]
    for case in args.cases:
        qdt, kvdt, entry = _CASES[case]
        layers = []
        for i in range(args.layers):
            b = make_batch([1] * args.batch, ctx, 9, 3, 64, args.block_size, seed=i)
            q = b.query.to(qdt).contiguous()
            kv, bt = b.kv_cache, b.meta.block_table.to(torch.int32)
            if args.layout == "engine":
                kv, bt = _engine_layout(ctx, args.block_size, args.prompt_len, seed=i)
            layers.append((q, kv.to(kvdt), bt, b.meta.seq_lens.to(torch.int32),
                           torch.empty_like(q), b.scale))
        # The floor reads the blocks the batch owns, copied side by side, as float32 words (a
        # bfloat16 cache's pairs reinterpreted).
        floors = []
        for kv, bt, sl in ((layer[1], layer[2], layer[3]) for layer in layers):
            used = torch.cat([bt[i, :-(-int(n) // args.block_size)] for i, n in enumerate(sl)])
            floors.append(kv[:, used.long()].contiguous().view(torch.float32))
        mb = sum(x.numel() * 4 for x in floors) / 1e6
        calls = {name: _caller(lib, entry) for name, lib in libs.items()}

        def run(name: str) -> torch.Tensor:
            for layer in layers:
                calls[name](*layer)
            return torch.stack([layer[4] for layer in layers]).float()

        outs = {name: run(name) for name in calls}
        ref = next(iter(outs.values()))
        same = {name: torch.equal(o, ref) for name, o in outs.items()}
        for threads in args.threads:
            torch.set_num_threads(threads)
            clock = time.thread_time if threads == 1 else time.perf_counter
            times: dict[str, list[float]] = {name: [] for name in [*calls, "floor"]}
            for _ in range(args.repeat):
                for name in calls:
                    t = clock()
                    run(name)
                    times[name].append(clock() - t)
                t = clock()
                for x in floors:
                    x.sum()
                times["floor"].append(clock() - t)
            ms = {name: min(ts) * 1e3 for name, ts in times.items()}
            cells = "  ".join(f"{name} {t:6.2f} ms ({t / ms['floor']:.2f}x floor)"
                              for name, t in ms.items() if name != "floor")
            # paired: the median of the rounds' ratios (a busy neighbour slows both of a round)
            ratio = statistics.median(o / n for o, n in zip(times[args.rev], times["new"])) \
                if args.rev else 0.0
            ab = (f" | {args.rev}/new {ms[args.rev] / ms['new']:.2f}x (median of rounds "
                  f"{ratio:.2f}x)"
                  f"{'' if same[args.rev] else ' (outputs differ)'}" if args.rev else "")
            print(f"{case:>11} {threads} thr: floor {ms['floor']:6.2f} ms ({mb:.0f} MB, "
                  f"{mb / ms['floor']:.1f} GB/s)  {cells}{ab}", flush=True)


if __name__ == "__main__":
    main()
