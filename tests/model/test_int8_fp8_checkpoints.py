"""Pre-quantized 8-bit HF checkpoints: compressed-tensors `int-quantized` W8A8 (computed on the
int8 kernels with the checkpoint's own codes and scales), compressed-tensors FP8 and the `fp8`
block format (dequantized once at load). Each tiny checkpoint is written by compressed-tensors'
own compressors (the block `fp8` one by hand, as its config describes); the reference is
transformers in float32 on the weights dequantized by compressed-tensors (its decompressor, its
FP8BlockDequantizer)."""
from __future__ import annotations

import contextlib
import json
import os
import re

import pytest
import torch
from model_helpers import byte_tokenizer, run_flat_batch, hf_last_logits, tiny_hf_model

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization.quant_scheme import FP8_BLOCK, FP8_DYNAMIC, INT8_W8A8, W8A16  # noqa: E402
from quant_checkpoints import ct_checkpoint, ct_reference, fp8_checkpoint, fp8_reference  # noqa: E402

from tokenloom import LLM, SamplingParams  # noqa: E402
from tokenloom.model.errors import ModelLoadError  # noqa: E402
from tokenloom.model.loader import load_model  # noqa: E402
from tokenloom.model.quant_config import detect_quantization  # noqa: E402
from tokenloom.model.quant_linear import QuantLinear  # noqa: E402
from tokenloom.ops import cpu_kernels, lowp, quant  # noqa: E402
from tokenloom.ops.lowp import LowpWeight  # noqa: E402

N_TOKENS = 32
# 256 x 320 matrices: FP8 128x128 blocks, the last column of blocks partial.
BLOCK_DIMS = dict(hidden_size=256, intermediate_size=320)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, len(tokenizer), (n,), generator=g).tolist() for n in (5, 17, 40)]


def _checkpoint(kind: str, tokenizer, directory: str) -> str:
    if kind == "fp8_block":
        return fp8_checkpoint(tiny_hf_model("llama", len(tokenizer), seed=5, **BLOCK_DIMS), tokenizer, directory)
    if kind == "fp8_tensor":
        return fp8_checkpoint(tiny_hf_model("llama", len(tokenizer), seed=6), tokenizer, directory, block=None)
    scheme, fmt, dims = {
        "w8a8": (INT8_W8A8, "int-quantized", {}),
        "w8a8_glm4": (INT8_W8A8, "int-quantized", {}),
        "w8a16_group": (W8A16 | dict(weights=W8A16["weights"].model_copy(update=dict(strategy="group", group_size=32))),
                        "int-quantized", {}),
        "fp8_w8a16": (dict(weights=FP8_DYNAMIC["weights"]), None, {}),  # compressed-tensors names it naive-quantized
        "fp8_dynamic": (FP8_DYNAMIC, "float-quantized", {}),
        "fp8_ct_block": (FP8_BLOCK, "float-quantized", BLOCK_DIMS),
    }[kind]
    if kind == "w8a8_glm4":  # interleaved RoPE: q/k rows reordered at load, codes with their scales
        import transformers
        from model_helpers import randomize_

        config = transformers.Glm4Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, max_position_embeddings=256, pad_token_id=0)
        torch.manual_seed(0)
        model = transformers.Glm4ForCausalLM(config).to(torch.float32).eval()
        randomize_(model, 4)
    else:
        model = tiny_hf_model("llama", len(tokenizer), seed=sum(map(ord, kind)), tie_word_embeddings=False, **dims)
    return ct_checkpoint(model, tokenizer, directory, scheme, fmt)


@pytest.fixture(scope="module")
def checkpoints(tokenizer, tmp_path_factory):
    """kind -> (directory, float32 reference model), built on first use."""
    made: dict[str, tuple[str, object]] = {}

    def get(kind: str):
        if kind not in made:
            directory = _checkpoint(kind, tokenizer, str(tmp_path_factory.mktemp(kind)))
            ref = fp8_reference(directory) if kind in ("fp8_block", "fp8_tensor") else ct_reference(directory)
            made[kind] = directory, ref
        return made[kind]
    return get


def _hf_greedy(ref, prompts: list[list[int]]) -> list[list[int]]:
    with torch.inference_mode():
        return [ref.generate(torch.tensor([p]), max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS, do_sample=False,
                             pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _greedy(directory: str, prompts: list[list[int]], **kwargs) -> tuple[str, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    with LLM(directory, multiprocess=False, num_kv_blocks=64, block_size=4, max_num_batched_tokens=32,
             **kwargs) as llm:
        info = llm.llm_engine.engine_core.info
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return info.quantization, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the int8 kernels")
def test_quantize_lm_head_is_asked_for(checkpoints, prompts, tmp_path):
    """The float LM head a quantizer left alone stays the checkpoint's unless `quantize_lm_head`
    asks for Q8_0 codes (the int8 path's head), for W8A8 and FP8 alike; the logits stay within the
    W8A8 test's bound. A float model has no such head to quantize: a clear error."""
    for kind in ("w8a8", "fp8_w8a16"):
        directory, ref = checkpoints(kind)
        head = load_model(directory).model.quant_lm_head  # float: the checkpoint's (float32 here)
        assert head is None or not isinstance(head.parts[0], quant.TiledQuantWeight)
        loaded = load_model(directory, dtype="float32", quantize_lm_head=True)
        (part,) = loaded.model.quant_lm_head.parts
        assert isinstance(part, quant.TiledQuantWeight) and part.format_name == "Q8_0"
        assert "Q8_0x1" in loaded.quantization
        got, want = run_flat_batch(loaded, prompts), hf_last_logits(ref, prompts)
        assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()
    plain = tmp_path / "plain"
    tiny_hf_model("llama", 64).save_pretrained(plain)
    with pytest.raises(ValueError, match="quantize_lm_head applies to a pre-quantized HF checkpoint"):
        load_model(str(plain), quantize_lm_head=True)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the int8 kernels")
def test_w8a8_runs_on_the_int8_kernels_with_its_own_codes(checkpoints, prompts):
    """W8A8 (per-channel int8 weights, dynamic per-token int8 activations): every decoder matrix
    is the checkpoint's int8 codes in Q8 tiles (no float copy), the LM head (ignored by the
    quantization) float. Logits within 2% of the largest reference logit: the kernels quantize the
    activations per 32 elements in two int8 planes (an error of 1/65024 of the block's largest,
    finer than the per-token int8 the checkpoint was calibrated for, which the float reference does
    not apply at all), and from 16 rows on AMX-BF16 CPUs multiply on bfloat16 tiles (an 8-bit
    mantissa: the prefill of the longer prompts). Greedy tokens, 3 prompts x 32, through the
    engine: identical to the reference on at least 2 of 3 (a near tie may flip on the quantized
    activations)."""
    directory, ref = checkpoints("w8a8")
    loaded = load_model(directory)
    assert loaded.quantization.startswith("compressed-tensors W8A8 Q8_0x14 ")  # 2 layers x 7 tensors
    assert loaded.dtype == torch.float32
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 8 and all(len(m.parts) == 1 for m in linears)  # q|k|v and gate|up fused
    assert not [n for n, p in loaded.model.named_parameters() if p.dim() == 2 and "layers" in n]
    got = run_flat_batch(loaded, prompts)
    want = hf_last_logits(ref, prompts)
    assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()
    quantization, tokens = _greedy(directory, prompts)
    assert quantization == loaded.quantization
    expected = _hf_greedy(ref, prompts)
    assert sum(t == e for t, e in zip(tokens, expected)) >= 2, (tokens, expected)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the int8 kernels")
@pytest.mark.parametrize("kind,formats", [("w8a16_group", "W8A16 Q8_0x14"), ("w8a8_glm4", "W8A8 Q8_0x12")])
def test_int8_group_scales_and_rope_order(checkpoints, prompts, kind, formats):
    """int8 weights with a scale per 32 weights (W8A16): each group is one Q8 block; GLM-4's
    q/k rows, reordered for its interleaved RoPE, take their scales along (its checkpoint stores
    gate|up fused: 6 tensors a layer). Logits as in the W8A8 test."""
    directory, ref = checkpoints(kind)
    loaded = load_model(directory)
    assert loaded.quantization.startswith(f"compressed-tensors {formats} ")
    got, want = run_flat_batch(loaded, prompts), hf_last_logits(ref, prompts)
    assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the int8 kernels")
def test_w8a8_dtype_choices(checkpoints, prompts):
    """dtype="bfloat16" runs W8A8 with bfloat16 activations on AMX-BF16 CPUs (the bf16 tiles, as a
    GGUF there; logits within bfloat16's rounding of the reference), and is refused by name
    elsewhere; on CUDA the int8 kernels do not exist."""
    directory, ref = checkpoints("w8a8")
    if quant.bf16_activations_pay():
        loaded = load_model(directory, dtype="bfloat16")
        assert loaded.dtype == torch.bfloat16 and loaded.quantization.startswith("compressed-tensors W8A8")
        got, want = run_flat_batch(loaded, prompts), hf_last_logits(ref, prompts)
        assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()
    else:
        with pytest.raises(ValueError, match="dtype float32"):
            load_model(directory, dtype="bfloat16")
    with pytest.raises(ValueError, match="on the CPU"):
        load_model(directory, device="cuda")


# The block checkpoint's 256-wide model through the engine in the slow tier; its logits in the fast one
# (test_fp8_scales).
@pytest.mark.parametrize("kind", ["fp8_w8a16", pytest.param("fp8_block", marks=pytest.mark.slow),
                                  pytest.param("fp8_dynamic", marks=pytest.mark.slow)])
def test_fp8_greedy_matches_the_dequantized_reference(checkpoints, prompts, kind):
    """FP8 weights kept in their bytes (ops/lowp), each widened times its scale to the float32
    dequantization's value: in float32 the engine computes what transformers computes on
    compressed-tensors' dequantized weights, so greedy tokens are identical (3 prompts x 32
    through the engine; the AMX bf16 tiles, which round to bfloat16 from 16 rows, off, and the
    KV cache in float32, not the quantized paths' bfloat16). Every
    matrix holds one byte a weight, in the default dtype too."""
    directory, ref = checkpoints(kind)
    with _float32_sums():
        quantization, tokens = _greedy(directory, prompts, dtype="float32", kv_cache_dtype="float32")
    assert "F8_E4M3x14" in quantization and "dequantized" not in quantization
    assert tokens == _hf_greedy(ref, prompts)
    loaded = load_model(directory)
    for layer in loaded.model.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            (part,) = m.parts
            assert isinstance(part, LowpWeight) and part.format_name == "F8_E4M3"
            assert part.data.element_size() == 1 and part.data.numel() <= 1.5 * part.out_features * part.in_features
    assert not [n for n, p in loaded.model.layers.named_parameters() if p.dim() >= 2]


@contextlib.contextmanager
def _float32_sums():
    previous = lowp.set_amx_rows(0) if lowp.available() else None
    try:
        yield
    finally:
        if previous is not None:
            lowp.set_amx_rows(previous)


@pytest.mark.parametrize("kind,method", [("fp8_block", "fp8 128x128 blocks"), ("fp8_tensor", "fp8"),
                                         ("fp8_ct_block", "compressed-tensors float-quantized 128x128 blocks")])
def test_fp8_scales(checkpoints, prompts, kind, method):
    """128x128 weight blocks (partial ones at the edges), as `fp8` (weight_scale_inv, DeepSeek /
    Qwen) and compressed-tensors' FP8_BLOCK (weight_scale) write them, and `fp8` per-tensor scales
    (a static input_scale, not applied): kept as stored, the float32 logits are the reference's."""
    directory, ref = checkpoints(kind)
    loaded = load_model(directory, dtype="float32")
    assert loaded.quantization.startswith(f"{method} F8_E4M3x14")
    with _float32_sums():
        got, want = run_flat_batch(loaded, prompts), hf_last_logits(ref, prompts)
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


def _with_config(directory: str, dest: str, edit) -> str:
    """A copy of `directory` (linked tensors) whose config.json's quantization_config `edit` changed."""
    os.makedirs(dest)
    for name in os.listdir(directory):
        if name != "config.json":
            os.symlink(os.path.join(directory, name), os.path.join(dest, name))
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    edit(cfg["quantization_config"])
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dest


def _group(q: dict) -> dict:
    return q["config_groups"]["group_0"]


REFUSED = {
    "asymmetric activations": ("w8a8", lambda q: _group(q)["input_activations"].update(symmetric=False),
                               "config_groups.group_0.input_activations.symmetric=False"),
    "asymmetric weights": ("w8a8", lambda q: _group(q)["weights"].update(symmetric=False),
                           "config_groups.group_0.weights.symmetric=False"),
    "output activations": ("w8a8", lambda q: _group(q).update(output_activations=_group(q)["input_activations"]),
                           "config_groups.group_0.output_activations="),
    "kv cache scheme": ("w8a8", lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
                        "kv_cache_scheme="),
    "per-group activations": ("w8a8", lambda q: _group(q)["input_activations"].update(strategy="group"),
                              "config_groups.group_0.input_activations.strategy='group'"),
    "group of 48": ("w8a16_group", lambda q: _group(q)["weights"].update(group_size=48),
                    "config_groups.group_0.weights.group_size=48"),
    "fp8 e5m2": ("fp8_block", lambda q: q.update(fmt="e5m2"), "fmt='e5m2'"),
    "fp8 one block dimension": ("fp8_block", lambda q: q.update(weight_block_size=[128]), "weight_block_size=[128]"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_options_are_refused_by_name(checkpoints, tmp_path, case):
    kind, edit, option = REFUSED[case]
    directory = _with_config(checkpoints(kind)[0], str(tmp_path / "edited"), edit)
    with pytest.raises(ModelLoadError, match=re.escape(f"quantization_config: {option}")):
        load_model(directory)


def test_static_w8a8_activation_scales_are_not_needed():
    """Static per-tensor int8 activation scales (older W8A8 checkpoints): accepted, since the
    kernels quantize the activations themselves at run time (finer than one scale per tensor)."""
    group = {"targets": ["Linear"], "format": "int-quantized",
             "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
             "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                                   "dynamic": False}}
    spec = detect_quantization({"quantization_config": {"quant_method": "compressed-tensors",
                                                        "format": "int-quantized", "config_groups": {"g": group}}})
    assert spec.scheme == "W8A8" and spec.format == "int-quantized"
