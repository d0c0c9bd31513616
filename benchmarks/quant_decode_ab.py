"""The quantized decode matmul (M = 1..4 rows) of an earlier commit against the working tree's, on
a GGUF's own weights, side by side in one process (benchmarks/CHANGELOG.md, "Decode prefetch and huge pages").

    .venv/bin/python benchmarks/quant_decode_ab.py --rev HEAD~1 \
        --gguf /tmp/speed/shapes/llama-3.1-8b-Q4_K_M.gguf [--layers 6] [--threads 1] [--isa avx512,avx2]

Both kernel libraries are built from source for each ISA level asked for (cpu_kernels' build,
cached by hash); the first `--layers` layers' matmul weights (q, k, v, o, gate, up, down: the
file's own Q4_K / Q6_K / ... bytes) are tiled once, more bytes than the last-level cache holds on
the machines this runs on, and every round runs each build over all of them in turn. `--pages`
places the tiled weights on 4 KiB or 2 MiB pages (both: each build on each). The figure is the
bytes of weights read per second: with one thread the median of the thread's CPU time, which
other processes barely move; with more, the best wall time of the rounds. The builds' outputs are
checked against each other first.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from pathlib import Path

_MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True, help="the commit whose kernel is the baseline")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rows", default="1", help="comma-separated activation row counts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--pages", choices=("huge", "small", "both"), default="huge")
    ap.add_argument("--isa", default="avx512", help="comma-separated quant levels: avx512, avx2")
    return ap.parse_args()


def main() -> None:
    args = _args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before the OpenMP runtime starts
    import torch

    from decode_kernel_ab import _build, _sources_at
    from tokenloom.model.gguf_file import read_gguf
    from tokenloom.ops import cpu_features, cpu_kernels, cpu_memory, quant

    torch.set_num_threads(args.threads)
    print(f"{cpu_features.detect().summary()}; threads {args.threads}; baseline {args.rev}", flush=True)
    f = read_gguf(args.gguf)
    weights = {"small": [], "huge": []}
    for i in range(args.layers):
        for name in _MATS:
            info = f.tensors[f"blk.{i}.{name}.weight"]
            w = quant.tile_gguf(f.raw(info), info.ggml_type, info.name)
            f.release(info)
            for pages in (("small", "huge") if args.pages == "both" else (args.pages,)):
                data = (cpu_memory.empty_huge(tuple(w.data.shape), torch.uint8) if pages == "huge"
                        else torch.empty(tuple(w.data.shape), dtype=torch.uint8))
                weights[pages].append(quant.TiledQuantWeight(w.fmt, data.copy_(w.data), w.out_features,
                                                             w.in_features))
    total = sum(w.nbytes for w in next(v for v in weights.values() if v))
    kinds = sorted({w.format_name for v in weights.values() for w in v})
    print(f"{args.layers} layers, {len(_MATS)} matmuls each, {total / 1e6:.0f} MB ({', '.join(kinds)})")
    # ops/quant's ISA names -> cpu_kernels' build levels and the library's kernel level
    builds = {"avx512": ("avx512", 2), "avx2": ("avx2", 1)}
    new_src = Path(cpu_kernels.__file__).with_name("csrc")
    libs = {}
    with tempfile.TemporaryDirectory() as tmp:
        old_src = _sources_at(args.rev, Path(tmp))
        for isa in args.isa.split(","):
            build, level = builds[isa]
            for tag, src in ((args.rev, old_src), ("new", new_src)):
                lib = _build(src, build)
                lib.tl_q_limit_isa.argtypes = [ctypes.c_int32]
                lib.tl_q_limit_isa(level)
                libs[f"{tag} {isa}"] = lib
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    agg = statistics.median if args.threads == 1 else min
    for M in (int(r) for r in args.rows.split(",")):
        xs = {K: torch.randn(M, K) for K in {w.in_features for v in weights.values() for w in v}}
        ys = [torch.empty(M, w.out_features) for w in next(v for v in weights.values() if v)]
        scratch = torch.empty(max(quant._lib().tl_q_scratch_bytes(M, K) for K in xs) * 2, dtype=torch.uint8)

        def run(lib: ctypes.CDLL, ws: list) -> list[torch.Tensor]:
            for w, y in zip(ws, ys, strict=True):
                x = xs[w.in_features]
                rc = lib.tl_q_linear(w.fmt, ctypes.c_void_p(w.data.data_ptr()), ctypes.c_int64(w.out_features),
                                     ctypes.c_int64(w.in_features), ctypes.c_void_p(x.data_ptr()),
                                     ctypes.c_int64(w.in_features), ctypes.c_int64(M),
                                     ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(w.out_features), None,
                                     ctypes.c_void_p(scratch.data_ptr()), quant.ACT_LEVELS)
                assert rc == 0, rc
            return [y.clone() for y in ys]

        cases = [(name, pages) for name in libs for pages in weights if weights[pages]]
        first = None
        for name, pages in cases:
            out = run(libs[name], weights[pages])
            first = out if first is None else first
            assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-3) for a, b in zip(out, first)), name
        times: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
        for _ in range(args.repeat):
            for c in cases:
                t = clock()
                run(libs[c[0]], weights[c[1]])
                times[c].append(clock() - t)
        rate = {c: total / agg(ts) / 1e9 for c, ts in times.items()}
        cells = "  ".join(f"{name} {pages}: {r:5.2f} GB/s" for (name, pages), r in rate.items())
        print(f"M={M}: {cells}", flush=True)


if __name__ == "__main__":
    main()
