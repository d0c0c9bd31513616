"""Tiny GGUF files of each quantized type loaded on the quantized path (the default for a GGUF):
every matrix is computed from the file's own blocks (no float copy), the logits follow the
dequantized float path on the same file, and the files run through the whole engine."""
from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from model_helpers import (llama_tensors, run_flat_batch, tiny_gguf, write_gguf, FFN, HEADS, HIDDEN, KV,
                           LAYERS)

from tokenloom.model.loader import load_model
from tokenloom.model.quant_linear import QuantEmbedding, QuantLinear
from tokenloom.ops import cpu_kernels, quant

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the CPU kernels")
Q = gguf.GGMLQuantizationType


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 6, 19, 70)]


K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# The K-quants' rows are whole 256-weight super-blocks: hidden and FFN sizes to match (4 heads of
# 64 for qwen3, whose head_dim sets the o_proj input).
K_DIMS = dict(hidden_size=256, intermediate_size=512)
QTYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, *K_QUANTS]


def _dims(qtype: int, kind: str = "llama") -> dict:
    if qtype not in K_QUANTS:
        return {}
    return K_DIMS | (dict(head_dim=64) if kind == "qwen3" else {})


def _no_float_matrices(model: torch.nn.Module) -> None:
    assert not [n for n, p in model.named_parameters() if p.dim() >= 2]
    assert isinstance(model.embed_tokens, QuantEmbedding) and isinstance(model.quant_lm_head, QuantLinear)


CASES = [("llama", {}), ("qwen2", dict(tie_word_embeddings=True)), ("qwen3", dict(head_dim=32))]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("kind,overrides", CASES, ids=[c[0] for c in CASES])
def test_quantized_logits_follow_the_float_path(tmp_path, kind, overrides, qtype):
    """Same file, two paths: the float path (dequantized; checked against transformers in
    test_tiny_models) and the quantized kernels, whose only extra error is the int8 activations."""
    path = tiny_gguf(tmp_path, kind, qtype, **(overrides | _dims(qtype, kind)))
    quantized = load_model(path)
    assert quantized.quantization.startswith(f"gguf {Q(qtype).name}x")
    _no_float_matrices(quantized.model)
    float_path = load_model(path, dtype="float32", quantization=None)
    assert float_path.quantization == "none"
    prompts = _prompts(quantized.config.vocab_size)
    want = run_flat_batch(float_path, prompts)
    got = run_flat_batch(quantized, prompts, chunk_sizes=[1, 3, 8, 16])
    err = (got - want).abs().max().item() / want.abs().max().item()
    print(f"{kind} {Q(qtype).name}: max |quantized - float| / max |float| = {err:.3g}")
    assert err < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75
    # Chunked prefill reads context back from the paged cache: float32 rounding differences of
    # ~1e-5 there can move an activation across an int8 rounding boundary, so the two agree to
    # within the quantization error, not bit for bit.
    one_shot = run_flat_batch(quantized, prompts)
    assert torch.equal(one_shot.argmax(-1), got.argmax(-1))
    assert (one_shot - got).abs().max().item() < 0.02 * want.abs().max().item()


def test_unsupported_type_is_dequantized_with_a_warning(tmp_path, caplog):
    tensors = llama_tensors()
    qtypes = {n: Q.Q4_1 for n, t in tensors.items() if t.ndim == 2}
    qtypes["blk.1.attn_v.weight"] = Q.Q5_1  # no kernel for Q5_1: this one tensor goes float
    qtypes["blk.0.ffn_down.weight"] = Q.F32  # stored unquantized: stays float, no warning
    path = write_gguf(str(tmp_path / "mixed.gguf"), "llama", tensors, block_count=LAYERS, hidden=HIDDEN, ffn=FFN,
                      heads=HEADS, kv_heads=KV, qtypes=qtypes)
    with caplog.at_level(logging.WARNING, logger="tokenloom.model.quant_linear"):
        loaded = load_model(path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "blk.1.attn_v.weight" in warnings[0] and "Q5_1" in warnings[0]
    assert "dequantized: 1 tensors" in loaded.quantization
    qkv = loaded.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and len(qkv.parts) == 3  # Q4_1 | Q4_1 | float
    assert loaded.model.layers[0].mlp.down_proj.__class__.__name__ == "Linear"
    prompts = _prompts(loaded.config.vocab_size)
    want = run_flat_batch(load_model(path, dtype="float32", quantization="none"), prompts)
    got = run_flat_batch(loaded, prompts)
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()


def test_quantization_option_errors(tmp_path, smollm2_path):
    path = write_gguf(str(tmp_path / "t.gguf"), "llama", llama_tensors(), block_count=LAYERS, hidden=HIDDEN,
                      ffn=FFN, heads=HEADS, kv_heads=KV)
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(path, quantization="q4")
    if quant.bf16_activations_pay():  # AMX-BF16: a GGUF computes quantized in bfloat16 too
        assert load_model(path, dtype="bfloat16", quantization="gguf").quantization.startswith("gguf")
    else:
        with pytest.raises(ValueError, match="dtype float32"):
            load_model(path, dtype="bfloat16", quantization="gguf")
        # "auto" under bfloat16 is the float path, not an error.
        assert load_model(path, dtype="bfloat16").quantization == "none"
    # An all-float GGUF has nothing to compute quantized: said so, float path.
    assert "no quantized tensors" in load_model(path).quantization
    from tokenloom.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be one of auto, gguf, int8, none"):
        EngineConfig(quantization="bitsandbytes").validate()
    EngineConfig(quantization=None).validate()


def _engine_greedy(path: str, prompt: list[int]) -> tuple[str, list[int]]:
    from tokenloom import LLM, SamplingParams

    with LLM(path, num_kv_blocks=16, max_num_batched_tokens=64) as llm:
        info = llm.llm_engine.engine_core.info
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return info.quantization, list(out[0].outputs[0].token_ids)


def _greedy(loaded, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(run_flat_batch(loaded, [seq])[0].argmax()))
    return seq[len(prompt):]


# Through the engine: the formats a Q4_K_M file holds (Q4_K, Q6_K) and Q8_0 in the fast tier; the
# rest (each checked against the gguf reference above) in the slow one.
@pytest.mark.parametrize("qtype", [q if q in (Q.Q8_0, Q.Q4_K, Q.Q6_K) else pytest.param(q, marks=pytest.mark.slow)
                                   for q in QTYPES], ids=lambda t: t.name)
def test_tiny_gguf_through_the_engine(tmp_path, qtype):
    """LLM on a tiny GGUF of each type, engine core in its own process: EngineInfo says which
    path ran, greedy tokens are the argmax of the quantized model's own logits, and the same
    as the dequantized float path's (quantization=None) on the same file."""
    path = tiny_gguf(tmp_path, "llama", qtype, seed=3, **_dims(qtype))
    prompt = _prompts(258)[2]
    quantization, tokens = _engine_greedy(path, prompt)
    assert quantization.startswith(f"gguf {Q(qtype).name}x")
    # where the kernel level is AVX2, matmuls of 16 rows and more run on dequantized panels
    panels = quant.f32_panel_rows(quant.GGML_FORMATS[int(qtype)])
    assert quantization.endswith(f", float32 panels from {panels} rows") == (panels > 0)
    assert len(tokens) == 6
    assert tokens == _greedy(load_model(path), prompt, 6)
    assert tokens == _greedy(load_model(path, dtype="float32", quantization=None), prompt, 6)


def test_q4_k_m_mix_through_the_engine(tmp_path):
    """A llama.cpp Q4_K_M-style file: Q4_K matrices, Q6_K attn_v / ffn_down and LM head, a Q8_0
    embedding: each tensor computed in its own format, EngineInfo naming all of them."""
    mix = {n: Q.Q6_K for n in ("blk.0.attn_v.weight", "blk.1.attn_v.weight", "blk.0.ffn_down.weight",
                               "blk.1.ffn_down.weight", "output.weight")}
    mix |= {"token_embd.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q5_K, "blk.1.attn_output.weight": Q.Q5_0}
    path = tiny_gguf(tmp_path, "llama", Q.Q4_K, seed=4, qtypes=mix, **K_DIMS)
    loaded = load_model(path)
    assert loaded.quantization.startswith("gguf Q4_Kx8+Q5_0x1+Q5_Kx1+Q6_Kx5+Q8_0x1 ")
    _no_float_matrices(loaded.model)
    qkv = loaded.model.layers[0].self_attn.qkv_proj
    assert [p.format_name for p in qkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]  # mixed: kept apart
    prompt = _prompts(258)[1]
    quantization, tokens = _engine_greedy(path, prompt)
    assert quantization == loaded.quantization
    assert tokens == _greedy(load_model(path, dtype="float32", quantization=None), prompt, 6)


def test_int8_path_for_a_float_checkpoint(tmp_path):
    """quantization="int8" on a float (F32) GGUF: every matrix in int8, logits close to float32."""
    path = tiny_gguf(tmp_path, "qwen2", Q.F32, seed=5)
    int8 = load_model(path, quantization="int8")
    assert int8.quantization.startswith("int8 Q8_0x")
    _no_float_matrices(int8.model)
    prompts = _prompts(int8.config.vocab_size)
    want = run_flat_batch(load_model(path, dtype="float32", quantization=None), prompts)
    got = run_flat_batch(int8, prompts)
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()
    assert np.mean((got.argmax(-1) == want.argmax(-1)).numpy()) >= 0.75


def test_silu_epilogue_keeps_the_greedy_output(smollm2_path):
    """The embedded GGUF with SiLU-and-mul in the gate|up matmul's epilogue (from the bf16
    tiles' 16 rows: the eager prefill's MLP and, with 20 requests, the fused decode step's) gives
    the same tokens and logprobs as with the two separate passes."""
    from tokenloom import LLM, SamplingParams

    if quant.silu_epilogue_rows(quant.FMT_Q4_1) == 0:
        pytest.skip("no SiLU epilogue here (it runs on the AMX-BF16 tiles)")
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (n,), generator=g).tolist()}
               for n in range(20, 60, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    runs = []
    with LLM(smollm2_path, multiprocess=False, num_kv_blocks=128,
             enable_prefix_caching=False) as llm:
        for on in (True, False):
            old = quant.set_silu_epilogue(on)
            try:
                outs = llm.generate(prompts, params, use_tqdm=False)
            finally:
                quant.set_silu_epilogue(old)
            runs.append([(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs])
                         for o in outs])
    assert runs[0] == runs[1]
