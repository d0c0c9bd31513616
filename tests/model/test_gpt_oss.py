"""gpt-oss (`GptOssForCausalLM`): a tiny random transformers GptOss saved as an HF directory, run
through `LLM(dir, dtype="float32")`; greedy tokens must be transformers' own (float32), 3 prompts
x 32 tokens, past the sliding window (8) on the sliding layers, with chunked prefill.

The config makes every difference count: sinks of a size that moves the softmax, a SwiGLU limit
that the gate and up values cross, router and expert biases. The experts' weights are MXFP4
values: packed by `pack_mxfp4` below and unpacked for the reference by transformers' own
`convert_moe_packed_tensors` (integrations/mxfp4.py), so the same model is saved twice, with
float experts and with the packed bytes as gpt-oss ships them (`quantization_config` mxfp4). The
same model is also written as llama.cpp's `gpt-oss` GGUF (names from gguf's tensor map, the
experts' gate and up apart, MXFP4 blocks by gguf's quantizer) and checked against transformers
on the weights gguf's dequantizer reads back from it."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from model_helpers import byte_tokenizer, gguf_add_byte_tokenizer, gguf_writer, randomize_, save_hf_dir
from test_families import _greedy
from test_moe import _hf_greedy, _prompts

from tokenloom.model import mxfp4
from tokenloom.model.errors import ModelLoadError
from tokenloom.model.hf_config import hf_model_config

CONFIG = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
              sliding_window=8, max_position_embeddings=256, swiglu_limit=1.0, rms_norm_eps=2.0 ** -20,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] float -> (blocks [..., rows, cols / 32, 16], scales [..., rows, cols / 32])
    uint8, the inverse of transformers' unpacking: per group of 32, the smallest power of two that
    brings the largest magnitude within E2M1's 6, each value rounded to the nearest E2M1 value,
    element 2j in the low nibble of byte j."""
    *lead, rows, cols = w.shape
    g = w.float().reshape(*lead, rows, cols // 32, 32)
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127)).clamp(-127, 127)
    lut = torch.tensor(mxfp4.FP4_VALUES)
    idx = ((g / torch.exp2(e).unsqueeze(-1)).unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    return idx[..., 0::2] | (idx[..., 1::2] << 4), (e + 127).to(torch.uint8)


def _mxfp4_dir(float_dir: str, packed: dict[str, tuple[torch.Tensor, torch.Tensor]], directory: str) -> str:
    """`float_dir` with each expert matrix replaced by its blocks and scales, as gpt-oss ships them."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(float_dir, directory)
    for f in os.listdir(directory):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(directory, f))
            for name, (blocks, scales) in packed.items():
                if tensors.pop(name, None) is not None:
                    tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            save_file(tensors, os.path.join(directory, f), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                     "model.layers.*.mlp.router",
                                                                                     "model.embed_tokens", "lm_head"]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return directory


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(float directory, MXFP4 directory, the transformers model)."""
    import transformers
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    ref = transformers.GptOssForCausalLM(transformers.GptOssConfig(vocab_size=len(tokenizer), **CONFIG)).float().eval()
    randomize_(ref, seed=7)
    packed = {}
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            layer.self_attn.sinks.copy_(torch.randn(CONFIG["num_attention_heads"], generator=g))
            x = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):  # [E, in, out]; MXFP4 packs [E, out, in]
                blocks, scales = pack_mxfp4(getattr(x, name).transpose(1, 2))
                getattr(x, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"model.layers.{i}.mlp.experts.{name}"] = (blocks, scales)
    float_dir = save_hf_dir(ref, tokenizer, str(tmp_path_factory.mktemp("gpt_oss") / "float"))
    mxfp4_dir = _mxfp4_dir(float_dir, packed, str(tmp_path_factory.mktemp("gpt_oss") / "mxfp4"))
    return float_dir, mxfp4_dir, ref


@pytest.fixture(scope="module")
def expected(gpt_oss):
    """(prompts, transformers' greedy tokens)."""
    prompts = _prompts(byte_tokenizer())
    return prompts, _hf_greedy(gpt_oss[2], prompts)


def test_config_translation(gpt_oss):
    float_dir, mxfp4_dir, _ = gpt_oss
    cfg = hf_model_config(float_dir)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("gpt_oss", 4, 2, 64)
    assert cfg.attention_sinks and cfg.attention_bias and cfg.o_proj_bias and not cfg.experts_mxfp4
    assert (cfg.sliding_window, cfg.layer_types) == (8, ("sliding_attention", "full_attention"))
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (1.0, 1.702)
    assert hf_model_config(mxfp4_dir).experts_mxfp4


def test_unpacking_is_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(1, 255, (3, 8, 2), dtype=torch.uint8, generator=g)  # E8M0 but its NaN
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
        assert torch.equal(mxfp4.dequantize(blocks, scales, dtype), theirs.transpose(1, 2))


def test_mxfp4_experts_match_transformers(gpt_oss, expected):
    """The checkpoint as gpt-oss ships it (the float experts' test below is the same model)."""
    prompts, tokens = expected
    assert _greedy(gpt_oss[1], prompts) == tokens


@pytest.mark.slow
def test_float_experts_match_transformers(gpt_oss, expected):
    prompts, tokens = expected
    assert _greedy(gpt_oss[0], prompts) == tokens


def test_mxfp4_experts_stay_packed(gpt_oss):
    from tokenloom.model.loader import load_model

    model = load_model(gpt_oss[1], dtype="float32").model
    experts = model.layers[0].mlp.experts
    assert experts.w13_weight is None and experts.w2_weight is None
    assert experts.w13_blocks.dtype == torch.uint8 and experts.w13_blocks.shape == (4, 128, 2, 16)


def test_other_quantization_is_refused(gpt_oss, tmp_path):
    directory = shutil.copytree(gpt_oss[0], str(tmp_path / "awq"))
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "awq"}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ModelLoadError, match="quant_method 'awq'"):
        hf_model_config(directory)


def test_dummy_weights_fill_the_packed_experts(gpt_oss):
    from tokenloom.model.loader import load_model

    experts = load_model(gpt_oss[1], dtype="float32", load_format="dummy").model.layers[1].mlp.experts
    w = mxfp4.dequantize(experts.w2_blocks[0], experts.w2_scales[0])
    assert torch.isfinite(w).all() and 0 < w.abs().max() <= 6 / 64 and w.std() > 0.01


def test_int8_keeps_the_router_and_the_biased_experts(gpt_oss):
    """quantization="int8": attention in Q8, the router float (its rounding would move the choice
    of experts), the MXFP4 experts as shipped; a decode step reads top_k experts' packed bytes."""
    from tokenloom.model.loader import load_model
    from tokenloom.model.quant_linear import weight_bytes_per_token

    loaded = load_model(gpt_oss[1], dtype="float32", quantization="int8")
    block = loaded.model.layers[0].mlp
    assert type(block.router).__name__ == "Linear" and block.experts.w13_blocks.dtype == torch.uint8
    assert type(loaded.model.layers[0].self_attn.qkv_proj).__name__ == "QuantLinear"
    per_expert = (128 * 2 * 16 + 128 * 2) + (64 * 2 * 16 + 64 * 2)  # blocks and scales of w13, w2
    assert weight_bytes_per_token(loaded.model) > 2 * 2 * per_expert


# ----------------------------------------------------------------------------- GGUF
def _gguf_experts(ref) -> dict[str, torch.Tensor]:
    """Each layer's experts as llama.cpp's converter writes them, by HF name: gate and up apart
    (the interleaved columns of gate_up_proj), each part [E, out, in], biases [E, out]."""
    out = {}
    for i, layer in enumerate(ref.model.layers):
        x, p = layer.mlp.experts, f"model.layers.{i}.mlp.experts."
        gate_up = x.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], gate|up rows interleaved
        out |= {p + "gate_proj": gate_up[:, 0::2], p + "up_proj": gate_up[:, 1::2],
                p + "down_proj": x.down_proj.detach().transpose(1, 2),
                p + "gate_proj.bias": x.gate_up_proj_bias.detach()[:, 0::2],
                p + "up_proj.bias": x.gate_up_proj_bias.detach()[:, 1::2], p + "down_proj.bias": x.down_proj_bias.detach()}
    return out


def _write_gpt_oss_gguf(ref, tokenizer, path: str, matrix_type=None, mxfp4_experts: bool = True) -> str:
    """ref as llama.cpp's converter writes a gpt-oss GGUF, the expert matrices in MXFP4 (float32
    without `mxfp4_experts`); with `matrix_type` (a GGMLQuantizationType) the other matrices
    (attention, router, embedding, head) quantized by gguf's quantizer."""
    import gguf
    import numpy as np

    c, arch = ref.config, gguf.MODEL_ARCH.GPT_OSS
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    w = gguf_writer(path, arch, c)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_sliding_window(c.sliding_window)
    rope = c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    gguf_add_byte_tokenizer(w, tokenizer)
    for name, t in ref.state_dict().items():
        if ".mlp.experts." not in name:
            base, suffix = (name[:-len(".weight")], ".weight") if name.endswith(".weight") else \
                (name[:-len(".bias")], ".bias") if name.endswith(".bias") else (name, ".weight")
            a = t.detach().float().numpy()
            if matrix_type is not None and a.ndim == 2:
                w.add_tensor(names.get_name(base) + suffix, gguf.quants.quantize(a, matrix_type), raw_dtype=matrix_type)
            else:
                w.add_tensor(names.get_name(base) + suffix, a)
    for name, t in _gguf_experts(ref).items():
        if name.endswith(".bias") or not mxfp4_experts:
            base, suffix = (name.removesuffix(".bias"), ".bias") if name.endswith(".bias") else (name, ".weight")
            w.add_tensor(names.get_name(base) + suffix, np.ascontiguousarray(t.float().numpy()))
        else:
            q = gguf.quants.quantize(np.ascontiguousarray(t.float().numpy()), gguf.GGMLQuantizationType.MXFP4)
            w.add_tensor(names.get_name(name) + ".weight", q, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_dequantized(ref, matrix_type=None):
    """A copy of ref whose expert matrices (and with `matrix_type` the other matrices) went
    through gguf's quantizer and back, with the SwiGLU limit llama.cpp fixes for gpt-oss (7.0: a
    GGUF has no key for it)."""
    import copy

    import gguf

    q = copy.deepcopy(ref)
    MX = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for name, p in q.named_parameters():
            if matrix_type is not None and p.ndim == 2:
                rows = p.detach().numpy()
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(rows, matrix_type), matrix_type)))
        for layer in q.model.layers:
            x = layer.mlp.experts
            x.limit = 7.0
            for name in ("gate_up_proj", "down_proj"):  # [E, in, out]: rows of out are quantized
                rows = getattr(x, name).transpose(1, 2).contiguous().numpy()
                back = gguf.quants.dequantize(gguf.quants.quantize(rows, MX), MX)
                getattr(x, name).copy_(torch.from_numpy(back).transpose(1, 2))
    return q


def test_gguf_mxfp4_experts_match_transformers(gpt_oss, tmp_path):
    """llama.cpp's gpt-oss GGUF: config from its keys, the MXFP4 experts kept packed (ggml's
    nibble order made the checkpoint's), greedy tokens transformers' on the dequantized weights."""
    from test_moe import _hf_greedy as hf_tokens

    from tokenloom.model.loader import load_model, load_model_config

    tokenizer = byte_tokenizer()
    ref = gpt_oss[2]
    path = _write_gpt_oss_gguf(ref, tokenizer, str(tmp_path / "gpt-oss.gguf"))
    cfg, hf = load_model_config(path), hf_model_config(gpt_oss[0])
    for field in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "attention_sinks",
                  "attention_bias", "o_proj_bias", "sliding_window", "layer_types", "swiglu_alpha", "head_dim",
                  "rope_theta", "rms_norm_eps"):
        assert getattr(cfg, field) == getattr(hf, field), field
    assert cfg.experts_mxfp4 and cfg.swiglu_limit == 7.0 and cfg.mlp_only_layers == ()
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    experts = load_model(path, dtype="float32").model.layers[1].mlp.experts
    assert experts.w13_weight is None and experts.w13_blocks.shape == (4, 128, 2, 16)
    prompts = _prompts(tokenizer)
    assert _greedy(path, prompts) == hf_tokens(_gguf_dequantized(ref), prompts)


def test_gguf_quantized_matrices_beside_the_mxfp4_experts(gpt_oss, tmp_path):
    """Attention, router, embedding and head in Q8_0 (computed by the quantized kernels, q/k/v/o
    biases and the router's bias beside them), the experts MXFP4: logits within the activations'
    rounding of transformers' on the dequantized weights."""
    import gguf
    from model_helpers import hf_last_logits, run_flat_batch

    from tokenloom.model.loader import load_model

    q8 = gguf.GGMLQuantizationType.Q8_0
    tokenizer = byte_tokenizer()
    path = _write_gpt_oss_gguf(gpt_oss[2], tokenizer, str(tmp_path / "gpt-oss-q8.gguf"), matrix_type=q8)
    loaded = load_model(path, dtype="float32")
    assert loaded.quantization.startswith("gguf Q8_0x12 ")  # per layer q|k|v, o, router; embedding, head
    prompts = _prompts(tokenizer)
    theirs = hf_last_logits(_gguf_dequantized(gpt_oss[2], q8), prompts)
    assert (run_flat_batch(loaded, prompts) - theirs).abs().max() < 0.02 * theirs.abs().max()


def test_gguf_float_experts(gpt_oss, tmp_path):
    """A gpt-oss GGUF whose experts are float32 (llama.cpp converts a float checkpoint so): stacked
    float experts, the logits transformers' (with llama.cpp's SwiGLU limit)."""
    import copy

    from model_helpers import hf_last_logits, run_flat_batch

    from tokenloom.model.loader import load_model

    tokenizer = byte_tokenizer()
    path = _write_gpt_oss_gguf(gpt_oss[2], tokenizer, str(tmp_path / "gpt-oss-f32.gguf"), mxfp4_experts=False)
    loaded = load_model(path, dtype="float32", quantization=None)
    experts = loaded.model.layers[0].mlp.experts
    assert not loaded.config.experts_mxfp4 and experts.w13_weight is not None
    ref = copy.deepcopy(gpt_oss[2])
    for layer in ref.model.layers:
        layer.mlp.experts.limit = 7.0
    prompts = _prompts(tokenizer)
    torch.testing.assert_close(run_flat_batch(loaded, prompts), hf_last_logits(ref, prompts), rtol=1e-4, atol=1e-4)
