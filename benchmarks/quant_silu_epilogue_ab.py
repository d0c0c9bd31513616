"""SiLU-and-mul in the quantized gate|up matmul's epilogue (csrc/quant_gemm_amx_bf16.inc,
`quant.qlinear_silu_and_mul`) against the two passes it replaces (`qlinear` writing [M, 2I],
then `silu_and_mul` reading it back), in one process, alternating: SmolLM2-135M's MLP (gate|up
3072 x 576, down 576 x 1536) for 30 distinct layers, random weights quantized by `gguf.quants`.

- fused: down(qlinear_silu_and_mul(x))
- two passes: down(silu_and_mul(qlinear(x)))

The two give the same bits (tests/ops/test_quant.py); this shows the time. Each round times
both, in turn; printed: the medians over `--reps` rounds and the median of the rounds' ratios
(a shared machine's noise moves both of a round together). Wall time with `--threads` (2: as the
engine runs a prefill on two cores), CPU time of the calling thread with 1.

    PYTHONPATH=src nice -n 19 python benchmarks/quant_silu_epilogue_ab.py --rows 64 2048

`--step`: instead, one 2,048-token prefill step (16 x 128 prompt tokens) of the embedded GGUF
model's forward, as the model runner calls it (tests/model/model_helpers.run_flat_batch), with
the epilogue switched on and off between alternating rounds; the logits must be equal. CPU time
of the thread with one thread (the engine's own threads and queues out of the way), else wall.

`--engine N`: instead, the whole prefill of N requests of 128 prompt tokens (1 output token) on
the embedded GGUF through `LLM.generate` in this process, the epilogue switched on and off
(`quant.set_silu_epilogue`) between alternating rounds, on `--threads` threads
(TOKENLOOM_NUM_THREADS); CPU time of the process with one thread, wall time with more.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from tokenloom.ops import elementwise, quant

HIDDEN, INTER = 576, 1536


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 2048])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--format", default="Q4_1", choices=["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--step", action="store_true",
                    help="time one 2048-token prefill step of the embedded model instead")
    ap.add_argument("--engine", type=int, default=0, metavar="N",
                    help="time the engine's prefill of N x 128 tokens instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.step:
        return model_step(args.reps)
    if args.engine:
        return engine_prefill(args.engine, args.reps, args.threads)
    if quant.silu_epilogue_rows(quant.FMT_Q8) == 0:
        raise SystemExit("no SiLU epilogue here: it runs on the AMX-BF16 tiles")
    qt = Q[args.format]
    rng = np.random.default_rng(0)

    def tiled(N: int, K: int) -> quant.TiledQuantWeight:
        raw = quants.quantize((rng.standard_normal((N, K)) * 0.05).astype(np.float32), qt)
        return quant.tile_gguf(raw.reshape(N, -1), qt)

    layers = [(tiled(2 * INTER, HIDDEN), tiled(HIDDEN, INTER)) for _ in range(args.layers)]
    clock = time.process_time if args.threads == 1 else time.perf_counter

    def step(x: torch.Tensor, fused: bool) -> float:
        start = clock()
        for gate_up, down in layers:
            act = quant.qlinear_silu_and_mul(x, gate_up) if fused else \
                elementwise.silu_and_mul(quant.qlinear(x, gate_up))
            quant.qlinear(act, down)
        return 1e3 * (clock() - start)

    print(f"{args.format}, {args.layers} layers' MLP, {args.threads} thread(s), median of "
          f"{args.reps} alternating rounds, ms per step")
    for M in args.rows:
        x = torch.randn(M, HIDDEN)
        step(x, True), step(x, False)  # warm: panel buffers, first-touch of the outputs
        fused, two = [], []
        for r in range(args.reps):
            order = (True, False) if r % 2 == 0 else (False, True)
            t = {f: step(x, f) for f in order}
            fused.append(t[True])
            two.append(t[False])
        ratio = statistics.median(b / a for a, b in zip(fused, two))
        print(f"M={M:5d}: fused {statistics.median(fused):8.1f}  two passes "
              f"{statistics.median(two):8.1f}   two passes / fused {ratio:.2f}x", flush=True)


def model_step(reps: int) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
    from model_helpers import run_flat_batch

    from tokenloom.model.loader import default_model_path, load_model

    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    loaded = load_model(default_model_path())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (128,), generator=g).tolist() for _ in range(16)]
    with torch.no_grad():
        logits = {}
        for on in (True, False):
            quant.set_silu_epilogue(on)
            logits[on] = run_flat_batch(loaded, prompts)
        assert torch.equal(logits[True], logits[False]), "the epilogue changed the logits"
        times = _alternate(lambda: run_flat_batch(loaded, prompts), reps, clock)
    print(f"one 2048-token prefill step, {torch.get_num_threads()} thread(s), {_summary(times, reps)}")


def engine_prefill(n: int, reps: int, threads: int) -> None:
    from tokenloom import LLM, SamplingParams

    os.environ["TOKENLOOM_NUM_THREADS"] = str(threads)
    clock = time.process_time if threads == 1 else time.perf_counter

    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (128,), generator=g).tolist()}
               for _ in range(n)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    with LLM(multiprocess=False, enable_prefix_caching=False) as llm:
        llm.generate(prompts[:4], params, use_tqdm=False)
        if quant.silu_epilogue_rows(quant.FMT_Q4_1) == 0:
            raise SystemExit("no SiLU epilogue here: it runs on the AMX-BF16 tiles")
        times = _alternate(lambda: llm.generate(prompts, params, use_tqdm=False), reps, clock)
    print(f"prefill of {n} x 128 tokens, {threads} thread(s), {_summary(times, reps)}")


def _alternate(run: Callable[[], object], reps: int, clock: Callable[[], float]) -> dict[bool, list[float]]:
    """`run`'s time with the epilogue on (True) and off (False), ABBA over `reps` rounds."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(reps):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            quant.set_silu_epilogue(on)
            start = clock()
            run()
            times[on].append(clock() - start)
    quant.set_silu_epilogue(True)
    return times


def _summary(times: dict[bool, list[float]], reps: int) -> str:
    ratio = statistics.median(b / a for a, b in zip(times[True], times[False]))
    return (f"median of {reps} alternating rounds: fused {statistics.median(times[True]):.3f} s, "
            f"two passes {statistics.median(times[False]):.3f} s   two passes / fused {ratio:.2f}x")


if __name__ == "__main__":
    main()
