"""Weight-only int4 checkpoints as deployed (compressed-tensors pack-quantized W4A16, AutoAWQ
GEMM, GPTQ with and without act-order), built tiny in each format (int4_formats.py): detected
from config.json, computed on the packed codes (Q4_0 / Q4_1 tiles, no float copy of a matrix),
with the weights of the format's own dequantization and transformers' greedy tokens on them."""
from __future__ import annotations

import json
import os

import pytest
import torch
from int4_formats import compressed_tensors_checkpoint, packed_checkpoint
from model_helpers import tiny_hf_model

from tokenloom.model.errors import ModelLoadError
from tokenloom.model.loader import load_model, load_model_config
from tokenloom.model.quant_linear import PermutedQuantLinear, QuantLinear
from tokenloom.model.tensor_parallel import take_cols
from tokenloom.ops import cpu_kernels, quant

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the CPU kernels")

# hidden 128 and FFN 256: whole groups of 128 for every matrix (o_proj's input is 4 heads of 32);
# act-order in groups of 32 and 64, so that the groups of a 128-input matrix are scattered
DIMS = dict(hidden_size=128, intermediate_size=256)
# id -> (method, options); the fast tier checks the weights of the first four and the greedy
# tokens of the act-order one (the engine's every path but the fused decode step's)
CASES = {
    "ct-g64-asym": ("compressed-tensors", dict(group_size=64, symmetric=False)),
    "awq-g128": ("awq", dict(group_size=128)),
    "gptq-g32-asym-desc_act": ("gptq", dict(group_size=32, symmetric=False, desc_act=True)),
    "ct-g128-sym": ("compressed-tensors", dict(group_size=128, symmetric=True)),
    "ct-g32-sym": ("compressed-tensors", dict(group_size=32, symmetric=True)),
    "ct-channel-asym": ("compressed-tensors", dict(group_size=None, symmetric=False)),
    "ct-channel-sym": ("compressed-tensors", dict(group_size=None, symmetric=True)),
    "gptq-g128-sym": ("gptq", dict(group_size=128, symmetric=True)),
    "gptq-g128-asym": ("gptq", dict(group_size=128, symmetric=False)),
    "gptq-g64-sym-desc_act": ("gptq", dict(group_size=64, symmetric=True, desc_act=True)),
}
FAST_WEIGHTS = ("ct-g64-asym", "awq-g128", "gptq-g32-asym-desc_act", "ct-g128-sym")
FAST_GREEDY = ("gptq-g32-asym-desc_act",)


def _tiered(fast: tuple[str, ...]) -> list:
    return [c if c in fast else pytest.param(c, marks=pytest.mark.slow) for c in CASES]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from tokenloom.model.loader import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def base():
    # 512 of the tokenizer's ids: the LM head is a small part of a step, as in a real model
    return tiny_hf_model("llama", vocab_size=512, seed=11, **DIMS)


_built: dict[str, tuple[str, torch.nn.Module]] = {}


def _checkpoint(case: str, base, tokenizer, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """(directory, float32 reference) of a case, built once per module."""
    if case not in _built:
        method, options = CASES[case]
        directory = str(tmp_path_factory.mktemp(case))
        if method == "compressed-tensors":
            _built[case] = compressed_tensors_checkpoint(base, directory, tokenizer=tokenizer, **options)
        else:
            _built[case] = packed_checkpoint(base, directory, method, tokenizer=tokenizer, **options)
    return _built[case]


def _reference_matrices(ref) -> dict[str, torch.Tensor]:
    out = {}
    for i, layer in enumerate(ref.model.layers):
        a, m = layer.self_attn, layer.mlp
        out[f"{i}.qkv_proj"] = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
        out[f"{i}.o_proj"] = a.o_proj.weight.detach()
        out[f"{i}.gate_up_proj"] = torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach()
        out[f"{i}.down_proj"] = m.down_proj.weight.detach()
    return out


@pytest.mark.parametrize("case", _tiered(FAST_WEIGHTS))
def test_packed_weights_are_the_formats_dequantization(case, base, tokenizer, tmp_path_factory):
    """Every matrix is held in Q4_0 (symmetric) or Q4_1 tiles, none in float, and those tiles
    hold the weights of the format's own dequantization: exactly where the zero point is 8,
    to float16 rounding of scale * zero otherwise."""
    method, options = CASES[case]
    directory, ref = _checkpoint(case, base, tokenizer, tmp_path_factory)
    loaded = load_model(directory)
    fmt = "Q4_0" if options.get("symmetric") else "Q4_1"
    assert loaded.quantization.startswith(f"{method} {fmt}x14 ")  # 7 matrices x 2 layers
    assert "dequantized" not in loaded.quantization
    assert not [n for n, p in loaded.model.named_parameters() if p.dim() >= 2
                and not n.startswith(("embed_tokens", "lm_head"))]
    for name, want in _reference_matrices(ref).items():
        i, attr = name.split(".")
        layer = loaded.model.layers[int(i)]
        module = getattr(layer.self_attn if "proj" in attr and attr in ("qkv_proj", "o_proj") else layer.mlp, attr)
        assert isinstance(module, QuantLinear) and len(module.parts) == 1
        assert isinstance(module, PermutedQuantLinear) == bool(options.get("desc_act"))
        tiles = module.parts[0]
        got = quant.dequant_rows(tiles, torch.arange(tiles.out_features))
        if isinstance(module, PermutedQuantLinear):  # stored columns -> input order
            got = torch.empty_like(got).index_copy_(1, module.in_perm, got)
        tol = 0 if options.get("symmetric") else 1e-3 * want.abs().max().item()
        assert (got - want).abs().max().item() <= tol, name
        x = torch.randn(3, want.shape[1], generator=torch.Generator().manual_seed(0))
        assert torch.allclose(module(x), x @ want.t(), atol=2e-3 * (x @ want.t()).abs().max().item())
    if options.get("desc_act"):  # its columns are not in input order: no tensor-parallel cut
        with pytest.raises(ValueError, match="act-order"):
            take_cols(loaded.model.layers[0].mlp.down_proj, 0, 128, False, "down_proj")


def _hf_greedy(ref, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits that chose each, float32 [n, vocab]."""
    with torch.inference_mode():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                           pad_token_id=0, eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.scores).float()


PROMPTS = [[1, 409, 314, 260, 346, 28, 231, 30], [1, 283, 355, 121, 217, 47], [1, 23, 24, 25, 26, 27, 28]]
# A random 2-layer model's logits (spread over about +-4) have near-ties, top two within a few
# thousandths, that the int8 activations (1/65024 of each block's largest) and Q4_1's float16
# minimums (-scale * zero rounded: below 1/128 of a quantization step, but the same sign over a
# group) may break either way. Where a sequence leaves the reference at such a tie, the engine
# goes on from the reference's token (a new request whose prompt is the reference's prefix), so
# that every other token is still compared.
TIE = 5e-3
MAX_TIES = 1  # per case (3 x 32 tokens)


@pytest.mark.parametrize("case", _tiered(FAST_GREEDY))
def test_greedy_tokens_match_transformers_on_the_dequantized_weights(case, base, tokenizer, tmp_path_factory):
    """Through the engine (in process): 3 prompts x 32 greedy tokens, the same as transformers'
    float32 model holding the format's dequantized weights, but for near-ties (above). The
    checkpoint's arithmetic alone: with a float32 KV cache (the quantized path's default is
    float16, as llama.cpp's) and the bf16 tiles off (from 16 rows on AMX-BF16 CPUs they round
    weights and activations to bfloat16: the kernel plan's trade, tests/ops), each of which
    breaks more ties than the formats do."""
    from tokenloom import LLM, SamplingParams

    directory, ref = _checkpoint(case, base, tokenizer, tmp_path_factory)
    references = [_hf_greedy(ref, p, 32) for p in PROMPTS]
    ties = []
    previous = quant.set_amx_bf16_rows(0)
    try:
        with LLM(directory, multiprocess=False, num_kv_blocks=32, max_num_batched_tokens=64,
                 kv_cache_dtype="float32") as llm:
            assert llm.llm_engine.engine_core.info.quantization.startswith(CASES[case][0])

            def greedy(prompts: list[list[int]], n: int) -> list[list[int]]:
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
                return [list(o.outputs[0].token_ids) for o in outs]

            got = greedy(PROMPTS, 32)  # the three as one batch
            for prompt, (want, logits), tokens in zip(PROMPTS, references, got):
                start = 0
                while True:
                    same = next((i for i, (a, b) in enumerate(zip(tokens, want[start:])) if a != b), None)
                    if same is None:
                        break
                    at = start + same
                    top = logits[at].topk(2).values
                    assert (top[0] - top[1]).item() < TIE, f"left the reference at token {at}: {tokens} != {want}"
                    ties.append((at, round((top[0] - top[1]).item(), 5)))
                    start = at + 1
                    if start == len(want):
                        break
                    tokens = greedy([prompt + want[:start]], len(want) - start)[0]
    finally:
        quant.set_amx_bf16_rows(previous)
    print(f"{case}: near-ties broken the other way at tokens {ties}")
    assert len(ties) <= MAX_TIES, f"{len(ties)} near-ties broken the other way"


def _edit_config(directory: str, **changes) -> str:
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"].update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return directory


@pytest.mark.parametrize("method,changes,message", [
    ("gptq", dict(bits=8), "bits=8"),
    ("gptq", dict(group_size=16), "group_size=16"),
    ("gptq", dict(static_groups=True), "static_groups=True"),
    ("awq", dict(version="gemv"), "version='gemv'"),
    ("awq", dict(bits=8), "bits=8"),
    ("awq", dict(zero_point=False), "zero_point=False"),
    ("gptq", dict(quant_method="bitsandbytes"), "quant_method='bitsandbytes'"),
])
def test_unsupported_options_name_themselves(method, changes, message, base, tmp_path):
    directory, _ = packed_checkpoint(base, str(tmp_path / method), method)
    _edit_config(directory, **changes)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
        load_model_config(directory)  # in the caller, before any engine starts


def test_compressed_tensors_options_and_quantization_argument(base, tokenizer, tmp_path_factory, tmp_path):
    directory, _ = _checkpoint("ct-g64-asym", base, tokenizer, tmp_path_factory)
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    w4a8 = json.loads(json.dumps(cfg))
    w4a8["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    bits3 = json.loads(json.dumps(cfg))
    bits3["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 3
    for bad, message in ((w4a8, "input_activations"), (bits3, "num_bits=3")):
        d = tmp_path / message
        d.mkdir()
        (d / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ModelLoadError, match=message):
            load_model_config(str(d))
    assert load_model(directory, quantization="compressed-tensors").quantization.startswith("compressed-tensors")
    for wrong, message in (("awq", "quantized as compressed-tensors"), ("int8", "quantized as compressed-tensors"),
                           ("none", "quantized as compressed-tensors")):
        with pytest.raises(ValueError, match=message):
            load_model(directory, quantization=wrong)
    with pytest.raises(ValueError, match="dtype float32"):
        load_model(directory, dtype="bfloat16")


def test_a_bf16_lm_head_stays_bf16(base, tokenizer, tmp_path_factory, tmp_path):
    """An LM head the quantizer left in bfloat16 (llm-compressor's `ignore: [lm_head]`) is held as
    stored, 2 bytes a weight (ops/lowp), not widened to float32; its logits are the float32
    products of those values, and the model's are transformers' on the same head."""
    import shutil

    from model_helpers import hf_last_logits, run_flat_batch
    from safetensors.torch import load_file, save_file

    from tokenloom.ops.lowp import LowpWeight

    source, ref = _checkpoint("ct-g128-sym", base, tokenizer, tmp_path_factory)
    directory = str(tmp_path / "bf16-head")
    shutil.copytree(source, directory)
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"].bfloat16()
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    head = tensors["lm_head.weight"].float()

    loaded = load_model(directory)
    (part,) = loaded.model.quant_lm_head.parts
    assert isinstance(part, LowpWeight) and part.format_name == "BF16" and loaded.model.lm_head is None
    assert part.nbytes == 512 * 128 * 2  # vocab x hidden, already whole tiles
    hidden = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    want = hidden.double() @ head.double().t()
    assert (loaded.model.compute_logits(hidden).double() - want).abs().max() <= 1e-6 * want.abs().max()

    with torch.no_grad():
        ref.lm_head.weight.copy_(head)
    got, expected = run_flat_batch(loaded, PROMPTS), hf_last_logits(ref, PROMPTS)
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()
