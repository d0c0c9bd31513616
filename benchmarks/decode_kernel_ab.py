"""The decode-attention kernel of an earlier commit against the working tree's, side by side in one
process (benchmarks/README.md, "Xeon with AMX"): both are built from source for each ISA level
asked for and called directly on the same paged caches, alternating within each round.

    .venv/bin/python benchmarks/decode_kernel_ab.py --rev HEAD~3 [--threads 1] [--isa avx512,avx2]

30 layers (one cache per layer, so K/V come from memory as in a decode step), SmolLM2's heads (9
query, 3 KV, head_dim 64), block size 16, at batch 64 with 192 tokens of context and at batch 1
with 512; float32 queries over a float32 cache and a bfloat16 model's bfloat16 queries and
cache. With one thread the figure is the median of the thread's CPU time, which other processes
barely move; with more, the fastest wall time of the rounds (on a shared machine the median
measures the neighbours). The two builds' outputs are checked against each other first.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch

from tokenloom.ops import cpu_features, cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "attention"))
from attn_helpers import make_batch  # noqa: E402

_CSRC = "src/tokenloom/ops/csrc"


def _sources_at(rev: str, into: Path) -> Path:
    """The kernel sources of commit `rev`, extracted under `into`."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).parent).stdout.strip()
    blob = subprocess.run(["git", "archive", "--format=tar", rev, _CSRC], capture_output=True,
                          check=True, cwd=root).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into / _CSRC


def _build(src: Path, isa: str) -> ctypes.CDLL:
    """cpu_kernels' build of the sources in `src` for `isa` (cached by their hash like any
    other build)."""
    saved = cpu_kernels._SOURCES, cpu_kernels._HEADERS
    cpu_kernels._SOURCES = [src / p.name for p in saved[0]]
    cpu_kernels._HEADERS = [src / p.name for p in saved[1] if (src / p.name).exists()]
    try:
        return ctypes.CDLL(str(cpu_kernels._build(cpu_kernels._compiler(), isa)))
    finally:
        cpu_kernels._SOURCES, cpu_kernels._HEADERS = saved


def _caller(lib: ctypes.CDLL, bf16: bool, with_window: bool):  # noqa: ANN202 - a closure
    """Calls the kernel (float32 or bfloat16 entry point) whether or not its build takes the
    sliding-window argument (kernels before it did not)."""
    fn = lib.tl_paged_decode_bf16 if bf16 else lib.tl_paged_decode_f32
    c = ctypes
    fn.restype = c.c_int32
    fn.argtypes = [c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p, c.c_void_p, c.c_int64, c.c_void_p,
                   c.c_void_p, c.c_int64, *[c.c_int32] * 5, c.c_float,
                   *([c.c_int32] if with_window else [])]

    def call(q, kv, bt, sl, out, scale):
        k = kv.data_ptr()
        v = k + kv.element_size() * kv.stride(0)
        args = [q.data_ptr(), q.stride(0), k, v, bt.data_ptr(), bt.stride(0), sl.data_ptr(),
                out.data_ptr(), out.stride(0), q.shape[0], q.shape[1], kv.shape[3], q.shape[2],
                kv.shape[2], scale]
        if fn(*args, *([0] if with_window else [])) != 0:
            raise RuntimeError("kernel rejected the shapes")
    return call


def _takes_window(src: Path) -> bool:
    return "int32_t window" in (src / "paged_decode.c").read_text()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True, help="the commit whose kernel is the baseline")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--isa", default=None, help="comma-separated levels (default: all this CPU has)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    f = cpu_features.detect()
    levels = (args.isa.split(",") if args.isa
              else cpu_features.ISA_LEVELS[cpu_features.ISA_LEVELS.index(f.isa):-1])
    print(f"{f.summary()}; threads {args.threads}; baseline {args.rev}", flush=True)
    new_src = Path(cpu_kernels.__file__).with_name("csrc")
    with tempfile.TemporaryDirectory() as tmp:
        old_src = _sources_at(args.rev, Path(tmp))
        libs = {}
        for isa in levels:
            libs[f"{args.rev} {isa}"] = (_build(old_src, isa), _takes_window(old_src))
            libs[f"new {isa}"] = (_build(new_src, isa), True)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    agg = statistics.median if args.threads == 1 else min
    for batch, context in ((64, 192), (1, 512)):
        for dtype in (torch.float32, torch.bfloat16):
            layers = []
            for i in range(args.layers):
                b = make_batch([1] * batch, [context] * batch, 9, 3, 64, 16, seed=i)
                q = b.query.to(dtype).contiguous()
                layers.append((q, b.kv_cache.to(dtype), b.meta.block_table.to(torch.int32),
                               b.meta.seq_lens.to(torch.int32), torch.empty_like(q), b.scale))
            calls = {name: _caller(lib, dtype == torch.bfloat16, win)
                     for name, (lib, win) in libs.items()}

            def run(name: str) -> torch.Tensor:
                for layer in layers:
                    calls[name](*layer)
                return torch.stack([layer[4] for layer in layers]).float()

            first = None
            for name in calls:
                out = run(name)
                first = out if first is None else first
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
                assert (out - first).abs().max().item() < tol, name
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.repeat):
                for name in calls:
                    t = clock()
                    run(name)
                    times[name].append(clock() - t)
            ms = {name: agg(ts) * 1e3 for name, ts in times.items()}
            cells = "  ".join(f"{name} {t:7.2f} ms" for name, t in ms.items())
            ratios = "  ".join(f"{isa} {ms[f'{args.rev} {isa}'] / ms[f'new {isa}']:.2f}x"
                               for isa in levels)
            print(f"B={batch} ctx={context} {str(dtype)[6:]:>8}: {cells} | speed-up {ratios}",
                  flush=True)


if __name__ == "__main__":
    main()
