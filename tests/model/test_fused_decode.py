"""A decode step of a Llama-family model as one C call (model/fused_decode.py). On quantized
weights it gives the eager layers' results bit for bit: the same greedy tokens and the same
logprobs, for the embedded SmolLM2 GGUF and for tiny GGUFs with a q/k/v bias (Qwen2), across
prefills, decodes, requests of different lengths joining and leaving, and preemption. So it
does on plain float32 weights (where the runner keeps them: AVX2), for steps of up to 15 tokens.
In bfloat16 (AMX CPUs) it follows the eager path within bf16 rounding."""
from __future__ import annotations

import gguf
import pytest
import torch
from model_helpers import byte_vocab, tiny_gguf

from tokenloom import LLM, SamplingParams
from tokenloom.model import packed_linear
from tokenloom.model.quant_linear import QuantLinear
from tokenloom.ops import amx, cpu_kernels, quant

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the CPU kernels")
Q = gguf.GGMLQuantizationType


def _model(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.executor.driver_worker.model_runner.model


def _run(llm: LLM, prompts: list[list[int]], fused: bool,
         lengths: list[int] | None = None) -> list[tuple]:
    model = _model(llm)
    if not hasattr(llm, "_fused_step"):
        llm._fused_step = model.fused_decode  # built by the model runner
    model.fused_decode = llm._fused_step if fused else None
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
              for n in (lengths or (12, 5, 9, 16))[:len(prompts)]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids), [sorted(d.items()) for d in o.outputs[0].logprobs])
            for o in outs]


def _compare(llm: LLM, prompts: list[list[int]]) -> None:
    """(Prefix caching is off: a hit would chunk the second run's prefills differently.)"""
    eager = _run(llm, prompts, fused=False)
    fused = _run(llm, prompts, fused=True)
    step = llm._fused_step
    assert step is not None and step.steps > 0, "the fused step never ran"
    assert fused == eager


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32"])
def test_smollm2_gguf_fused_decode_is_the_eager_path(smollm2_path, kv_cache_dtype):
    """Over the quantized path's default bfloat16 KV cache (written rounded to nearest even, as
    `.to(bfloat16)`) and over a float32 one."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (1, 37, 130, 8)]
    with LLM(smollm2_path, multiprocess=False, num_kv_blocks=64, max_num_batched_tokens=96,
             enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype) as llm:
        _compare(llm, prompts)


@pytest.mark.parametrize("kind,qtype", [("llama", Q.Q4_0), ("qwen2", Q.Q8_0)])
def test_tiny_gguf_fused_decode_is_the_eager_path(tmp_path, kind, qtype):
    """Qwen2 brings the q/k/v bias; 8 KV blocks of 16 for four requests of up to ~90 tokens
    force preemption and recomputation in the middle of decoding."""
    path = tiny_gguf(tmp_path, kind, qtype, seed=11)
    vocab = byte_vocab()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, len(vocab), (n,), generator=g).tolist() for n in (3, 70, 25, 50)]
    with LLM(path, multiprocess=False, num_kv_blocks=8, max_num_batched_tokens=64,
             enable_prefix_caching=False) as llm:
        _compare(llm, prompts)


@pytest.mark.skipif(not amx.available(), reason="the bfloat16 step runs on CPUs with AMX")
def test_bfloat16_fused_decode_follows_the_eager_path(smollm2_path):
    """The float path in bfloat16 on an AMX CPU: the fused step multiplies the same AMX-packed
    weights as the eager layers, rounding each output once to bfloat16. Greedy tokens as the
    eager path's, and logprobs within bf16 rounding of its."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (1, 37, 130, 8)]
    with LLM(smollm2_path, multiprocess=False, quantization=None, dtype="bfloat16", num_kv_blocks=64,
             max_num_batched_tokens=96, enable_prefix_caching=False) as llm:
        eager = _run(llm, prompts, fused=False)
        fused = _run(llm, prompts, fused=True)
        assert llm._fused_step is not None
        assert llm._fused_step.steps > 0
    # Allowed: a rare element rounding to the neighbouring bf16 value (logits move by a bf16
    # step, ~0.06-0.25 at their size), after which a near tie may flip a greedy token late in a
    # reply.
    identical = 0
    for (e_tokens, e_lps), (f_tokens, f_lps) in zip(eager, fused):
        n = next((i for i, (a, b) in enumerate(zip(e_tokens, f_tokens)) if a != b), len(e_tokens))
        identical += n == len(e_tokens)
        for e, f in zip(e_lps[:n], f_lps[:n]):
            e, f = dict(e), dict(f)
            diffs = [abs(e[t].logprob - f[t].logprob) for t in e.keys() & f.keys()]
            assert diffs and max(diffs) < 0.3, (e, f)
    assert identical >= 3, (eager, fused)


@pytest.mark.skipif(not (quant.bf16_activations_pay() and amx.available()),
                    reason="a GGUF runs in bfloat16 (and its decode steps fused) on CPUs with AMX-BF16")
def test_gguf_in_bfloat16_is_the_bf16_float_path(smollm2_path, request):
    """The embedded GGUF computed in bfloat16 with every matmul on the tiles (its weights
    dequantized to bf16 panels, never resident; by default from 16 rows, here from 1) gives the
    dequantized float path in bfloat16 bit for bit: the same greedy tokens and logprobs,
    prefills (oneDNN's K chunks) and fused decode steps alike."""
    old = quant.set_amx_bf16_rows(1)
    request.addfinalizer(lambda: quant.set_amx_bf16_rows(old))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (1, 37, 130, 8)]
    runs = []
    for quantization in ("gguf", None):
        with LLM(smollm2_path, multiprocess=False, quantization=quantization, dtype="bfloat16",
                 num_kv_blocks=64, max_num_batched_tokens=96, enable_prefix_caching=False) as llm:
            runs.append(_run(llm, prompts, fused=True))
            assert llm._fused_step is not None and llm._fused_step.steps > 0
            assert (quantization is None) == (type(_model(llm).layers[0].mlp.down_proj) is not QuantLinear)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("matmul", ["panels", "gemv"])
@pytest.mark.parametrize("kind", ["smollm2", "qwen2"])
def test_float32_fused_decode_is_the_eager_path(tmp_path, smollm2_path, kind, matmul, monkeypatch):
    """The float path in float32 on AVX2 CPUs: the fused step multiplies the weights with the C
    kernel the eager layers use, so greedy tokens and logprobs are the eager path's bit for bit.
    On panel-packed weights (the default there) every decode step runs fused; on plain ones
    (TOKENLOOM_F32_PANEL=0) the C GEMV below 16 rows, so the first decode steps of these 18
    requests (16 or more tokens) stay eager on oneDNN and the later ones run fused. Qwen2
    brings the q/k/v bias."""
    if matmul == "gemv":
        monkeypatch.setenv("TOKENLOOM_F32_PANEL", "0")
    path = smollm2_path if kind == "smollm2" else tiny_gguf(tmp_path, kind, Q.Q8_0, seed=5)
    high = 40000 if kind == "smollm2" else len(byte_vocab())
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, high, (n,), generator=g).tolist()
               for n in (1, 37, 90, 8, 3, 12, 25, 5, 60, 2, 17, 9, 4, 30, 6, 11, 7, 19)]
    with LLM(path, multiprocess=False, quantization=None, dtype="float32", num_kv_blocks=128,
             max_num_batched_tokens=128, enable_prefix_caching=False) as llm:
        model = _model(llm)
        in_use = packed_linear.panels_in_use(model) if matmul == "panels" else packed_linear.gemv_in_use(model)
        if not in_use:
            assert model.fused_decode is None
            pytest.skip(f"the model runner keeps only oneDNN's packed weights on this CPU ({matmul} not in use)")
        assert model.fused_decode is not None
        assert model.fused_decode.max_tokens == (None if matmul == "panels" else 15)
        eager = _run(llm, prompts, fused=False, lengths=[3 + 2 * i for i in range(len(prompts))])
        fused = _run(llm, prompts, fused=True, lengths=[3 + 2 * i for i in range(len(prompts))])
        assert llm._fused_step.steps > 0
    assert fused == eager


def test_qk_norm_fused_decode_is_the_eager_path(tmp_path):
    """Qwen3's per-head q/k norms run in the C step, bit for bit the eager layers' (the same norm
    kernel, a row per head)."""
    path = tiny_gguf(tmp_path, "qwen3", Q.Q8_0, seed=2, head_dim=32)
    with LLM(path, multiprocess=False, num_kv_blocks=16, enable_prefix_caching=False) as llm:
        _compare(llm, [[1, 2, 3], [4, 5, 6, 7, 8]])
