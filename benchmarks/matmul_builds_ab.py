"""The matmul kernels of an earlier commit against the working tree's, in one process, alternating
within each round (benchmarks/README.md, "Eighth session"): both builds are made from source and
called directly on the same weights and buffers, so a noisy host's slow minutes meet both.

    .venv/bin/python benchmarks/matmul_builds_ab.py --rev HEAD~3 [--rows 1 16 64] [--rounds 20]

- `amx`: the AMX bfloat16 matmul (the float path's, ops/amx) on SmolLM2's four matmuls for 30
  layers of random bf16 weights (weights streamed from memory, as in a decode step); CPUs with
  AMX-BF16 only.
- `quant`: the quantized matmul (ops/quant, `tl_q_linear`, float32 activations) on the embedded
  GGUF's own 120 tiled weights, as the engine loads them.

Prints, per row count, the median and fastest wall time of each build and the ratio of the
medians (> 1: the working tree is faster). The two builds' outputs are compared first.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_kernel_ab import _build, _sources_at  # noqa: E402

from tokenloom.ops import amx, cpu_features, cpu_kernels, quant  # noqa: E402

_i32, _i64, _p = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.tl_amx_bf16_linear.argtypes = [_p, _i64, _i64, _p, _i64, _i64, _p, _p, _i64, _p, _i64]
    lib.tl_amx_bf16_available.restype = _i32
    lib.tl_q_linear.argtypes = [_i32, _p, _i64, _i64, _p, _i64, _i64, _p, _i64, _p, _p, _i32]
    lib.tl_q_scratch_bytes.restype = _i64
    lib.tl_q_scratch_bytes.argtypes = [_i64, _i64]
    return lib


def _amx_calls(M: int) -> tuple[list, dict]:
    torch.manual_seed(0)
    weights = [amx.pack((torch.randn(n, k) * 0.05).bfloat16()) for _ in range(30) for n, k in SHAPES]
    xs = {k: torch.randn(M, k).bfloat16() for k in (576, 1536)}
    ys = {n: torch.empty(M, n, dtype=torch.bfloat16) for n in (960, 576, 3072)}
    scratch = torch.empty(amx._lib().tl_amx_bf16_scratch_bytes(M, 1536), dtype=torch.uint8)
    calls = [(xs[w.in_features].data_ptr(), w.in_features, M, w.data.data_ptr(), w.out_features,
              w.in_features, None, ys[w.out_features].data_ptr(), w.out_features,
              scratch.data_ptr(), 0) for w in weights]
    return calls, {"keep": (weights, xs, scratch), "out": ys}


def _gguf_weights() -> list[quant.TiledQuantWeight]:
    from tokenloom import LLM
    from tokenloom.model.quant_linear import QuantLinear
    llm = LLM(multiprocess=False, num_kv_blocks=64)
    model = llm.llm_engine.engine_core.engine_core.executor.driver_worker.model_runner.model
    return [p for m in model.modules() if isinstance(m, QuantLinear)
            for p in m.parts if isinstance(p, quant.TiledQuantWeight)]


def _quant_calls(weights: list[quant.TiledQuantWeight], M: int) -> tuple[list, dict]:
    torch.manual_seed(0)
    xs = {k: torch.randn(M, k) for k in {w.in_features for w in weights}}
    ys = {n: torch.empty(M, n) for n in {w.out_features for w in weights}}
    scratch = torch.empty(quant._lib().tl_q_scratch_bytes(M, max(xs)), dtype=torch.uint8)
    calls = [(w.fmt, w.data.data_ptr(), w.out_features, w.in_features, xs[w.in_features].data_ptr(),
              w.in_features, M, ys[w.out_features].data_ptr(), w.out_features, None,
              scratch.data_ptr(), quant.ACT_LEVELS) for w in weights]
    return calls, {"keep": (xs, scratch), "out": ys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True, help="the commit to compare the working tree with")
    ap.add_argument("--kernels", nargs="+", default=["amx", "quant"], choices=["amx", "quant"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16, 64])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    isa = cpu_features.detect().isa
    with tempfile.TemporaryDirectory() as tmp:
        old = _bind(_build(_sources_at(args.rev, Path(tmp)), isa))
        new = _bind(ctypes.CDLL(str(cpu_kernels._build(cpu_kernels._compiler(), isa))))
    libs = {args.rev: old, "working tree": new}
    print(f"{cpu_features.detect().model_name} | kernels {isa} | {args.threads} threads", flush=True)
    gguf = _gguf_weights() if "quant" in args.kernels else None
    for kind in args.kernels:
        if kind == "amx" and not (amx.available() and old.tl_amx_bf16_available()):
            print("amx: no AMX-BF16 here, skipped")
            continue
        for M in args.rows:
            calls, bufs = _amx_calls(M) if kind == "amx" else _quant_calls(gguf, M)
            fn = "tl_amx_bf16_linear" if kind == "amx" else "tl_q_linear"
            outs = {}
            for name, lib in libs.items():  # warm-up, and the outputs of both
                for c in calls:
                    getattr(lib, fn)(*c)
                outs[name] = {n: y.clone() for n, y in bufs["out"].items()}
            same = all(torch.equal(outs[args.rev][n], outs["working tree"][n]) for n in bufs["out"])
            times: dict[str, list[float]] = {name: [] for name in libs}
            for r in range(args.rounds):
                for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                    f = getattr(libs[name], fn)
                    t = time.perf_counter()
                    for c in calls:
                        f(*c)
                    times[name].append(time.perf_counter() - t)
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            print(f"{kind} {M:4d} rows: " + " | ".join(
                f"{k} median {med[k] * 1e3:.2f} ms, fastest {min(v) * 1e3:.2f}" for k, v in times.items())
                + f" | {med[args.rev] / med['working tree']:.2f}x | outputs {'identical' if same else 'DIFFER'}",
                flush=True)


if __name__ == "__main__":
    main()
