"""What an engine core builds at start-up: the model, not the tokenizer or the grammar backend.
Those load with the first structured output (on the grammar thread), as vLLM loads its grammar
backend: transformers' import, xgrammar's and the vocabulary cost ~2.5 s of CPU per engine start
for SmolLM2 (~8 s for Gemma 3's 262k tokens), which an engine that never constrains an output
never pays. A structured request then still gets its grammar, with the tokenizer's EOS as a
stop token."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_engine_core_starts_without_tokenizer_or_xgrammar_then_loads_them_for_a_grammar():
    code = textwrap.dedent("""
        import sys, time
        from tokenloom.config import EngineConfig
        from tokenloom.core.engine_core import EngineCore
        from tokenloom.sampling_params import StructuredOutputsParams

        core = EngineCore(EngineConfig(kv_cache_memory_bytes=32 * 1024**2, max_model_len=256))
        loaded = core.executor.driver_worker.loaded
        print("start", sorted(m for m in ("transformers", "xgrammar") if m in sys.modules),
              loaded._tokenizer is None)
        manager = core.structured_output_manager
        request = manager.request_grammar(StructuredOutputsParams(choice=["yes", "no"]))
        deadline = time.monotonic() + 120
        while not request.ready() and time.monotonic() < deadline:
            time.sleep(0.01)
        print("grammar", request.error, request.matcher is not None,
              loaded.tokenizer.eos_token_id in manager.stop_token_ids,
              sorted(m for m in ("transformers", "xgrammar") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2] == "start [] True", out.stdout
    assert lines[-1] == "grammar None True True ['transformers', 'xgrammar']", out.stdout
