from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def make_llm() -> Callable:
    """Builds LLMs on the embedded model with a small KV cache, and shuts them down after the
    module. Their engine cores run single-threaded unless OMP_NUM_THREADS says otherwise: these
    tests measure the ledger, not the model, and on a small shared machine OpenMP's spinning
    threads make every step many times slower."""
    from tokenloom import LLM

    llms = []

    def make(warmup: bool = False, **kwargs):
        """`warmup`: one request first, so a fresh engine's first (slow) step holds up no one
        the test measures: requests that arrive during it wait for it, and say so."""
        kwargs.setdefault("kv_cache_memory_bytes", 64 * 1024**2)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
            llm = LLM(**kwargs)
        llms.append(llm)
        if warmup:
            from tokenloom import SamplingParams

            # A prefill over a block and a few decodes: the first steps of each shape are slow.
            llm.generate([list(range(1000, 1024))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        return llm

    yield make
    for llm in llms:
        llm.shutdown()


@pytest.fixture
def check_plot():
    """Draws a trace's picture and checks it: the verdict, in a sentence, is its title. With
    TOKENLOOM_LEDGER_PLOTS=DIR the picture is kept there as <verdict>.png (how docs/ledger/ is
    made)."""
    from tokenloom.analysis.plot import figure_title, plot_trace
    from tokenloom.metrics.timeline import VERDICT_HEADLINES

    def check(trace: dict, report: dict, verdict: str, tmp_path: Path) -> Path:
        assert VERDICT_HEADLINES[verdict].lower() in figure_title(report).lower()
        out = Path(os.environ.get("TOKENLOOM_LEDGER_PLOTS") or tmp_path) / f"{verdict}.png"
        plot_trace(trace, out, report)
        assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 20_000
        return out

    return check
