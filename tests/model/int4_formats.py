"""Tiny weight-only int4 checkpoints in the formats people deploy, each with its float32
reference: a transformers model holding the weights as the format's own dequantization gives them.

- compressed-tensors `pack-quantized`: quantized and packed by the library itself (its
  `ModelCompressor`), and its `decompress_model` is the reference.
- AutoAWQ GEMM and GPTQ: packed here as each format documents it (AutoAWQ's `pack` with the
  interleaved order 0 2 4 6 1 3 5 7; AutoGPTQ's `QuantLinear.pack`, zeros stored minus 1); the
  reference weights come from unpackers written from those libraries' dequantization
  (`awq.utils.packing_utils.dequantize_gemm`, AutoGPTQ's `dequantize_weight`), in torch bit
  operations, apart from tokenloom's numpy reader.
Scales are float16 in every format (bfloat16-valued for compressed-tensors, as llm-compressor's
bf16 models store them): the kernels keep them exactly.
"""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import torch
from safetensors.torch import save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _linears(model):
    for i, layer in enumerate(model.model.layers):
        for name in LINEARS:
            block = layer.self_attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp
            yield f"model.layers.{i}.{'self_attn' if block is layer.self_attn else 'mlp'}.{name}", getattr(block, name)


def _save(model, tensors: dict[str, torch.Tensor], directory: str, quantization_config: dict, tokenizer) -> str:
    """config.json with `quantization_config`, the tensors, and the tokenizer."""
    os.makedirs(directory, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"))
    model.config.architectures = [type(model).__name__]
    model.config.to_json_file(os.path.join(directory, "config.json"))
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


# --------------------------------------------------------------------------- compressed-tensors
def compressed_tensors_checkpoint(model, directory: str, group_size: int | None, symmetric: bool,
                                  tokenizer=None):
    """`model` (float32, left as it is) quantized W4A16 by compressed-tensors and saved in its
    pack-quantized format; returns (directory, the float32 reference model from the library's
    decompression). `group_size` None: channel-wise scales."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    model = copy.deepcopy(model)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric,
                            strategy="channel" if group_size is None else "group", group_size=group_size)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"], quantization_status="frozen")
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for _, module in _linears(model):
            w = module.weight
            g = w.reshape(w.shape[0], -1, w.shape[1] if group_size is None else group_size)
            scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
            module.weight_scale.copy_(scale.to(torch.bfloat16).float().reshape(module.weight_scale.shape))
            if not symmetric:
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    _save(model, dict(model.state_dict()), directory, {}, tokenizer)
    compressor.update_config(directory)  # the library's own quantization_config
    compressor.decompress_model(model)
    return directory, _plain(model)


def _plain(model):
    """A model with compressed-tensors' hooks and parameters gone: plain float32 Linears."""
    import transformers

    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in model.config.to_dict().items() if k != "quantization_config"})).eval()
    state = {k: v for k, v in model.state_dict().items() if k in ref.state_dict()}
    ref.load_state_dict(state, strict=True)
    return ref.float()


# ------------------------------------------------------------------------------- AWQ and GPTQ
def quantize_groups(w: torch.Tensor, group: int, symmetric: bool, columns: np.ndarray | None = None):
    """float [N, K] -> codes uint8 [N, K] (0..15), float16 scales [N, G], zeros int [N, G], with
    group g made of input columns columns[g*group:(g+1)*group] (GPTQ's act-order; default in order)."""
    N, K = w.shape
    cols = np.arange(K) if columns is None else columns
    codes = np.zeros((N, K), np.uint8)
    scales = np.zeros((N, K // group), np.float16)
    zeros = np.zeros((N, K // group), np.int64)
    for g in range(K // group):
        c = cols[g * group:(g + 1) * group]
        x = w[:, c].double().numpy()
        if symmetric:
            s = (np.abs(x).max(1) / 7).astype(np.float16)
            z = np.full(N, 8)
        else:
            lo, hi = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
            s = ((hi - lo) / 15).astype(np.float16)
            z = np.clip(np.round(-lo / s.astype(np.float64)), 0, 15).astype(np.int64)
        s = np.where(s == 0, np.float16(1e-3), s)
        q = np.clip(np.round(x / s.astype(np.float64)[:, None]) + z[:, None], 0, 15)
        codes[:, c], scales[:, g], zeros[:, g] = q.astype(np.uint8), s, z
    return codes, scales, zeros


def _pack_words(values: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """[R, C] ints 0..15 -> int32 [R, C/8]: nibble i of word c holds column 8c + order[i]."""
    v = values.astype(np.uint32).reshape(values.shape[0], -1, 8)
    words = np.zeros(v.shape[:2], np.uint32)
    for i, col in enumerate(order):
        words |= v[:, :, col] << np.uint32(4 * i)
    return words.view(np.int32)


def awq_tensors(prefix: str, w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM packing of `w` (asymmetric, zero points)."""
    codes, scales, zeros = quantize_groups(w, group, symmetric=False)
    return {f"{prefix}.qweight": torch.from_numpy(_pack_words(codes.T, AWQ_ORDER)),
            f"{prefix}.qzeros": torch.from_numpy(_pack_words(zeros.T, AWQ_ORDER)),
            f"{prefix}.scales": torch.from_numpy(np.ascontiguousarray(scales.T))}


def awq_dequantize(t: dict[str, torch.Tensor], prefix: str, group: int) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm: unpack the nibbles, undo the interleave, (q - z) * s; float [N, K]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)

    def unpack(words):
        x = torch.bitwise_right_shift(words[:, :, None], shifts[None, None, :]).reshape(words.shape[0], -1)
        order = torch.arange(x.shape[-1]).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)].reshape(-1)
        return x[:, order] & 15

    q, z = unpack(t[f"{prefix}.qweight"]), unpack(t[f"{prefix}.qzeros"])
    s = t[f"{prefix}.scales"].float()
    w = (q - z.repeat_interleave(group, 0)).float() * s.repeat_interleave(group, 0)
    return w.t().contiguous()


def gptq_tensors(prefix: str, w: torch.Tensor, group: int, symmetric: bool, desc_act: bool,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """AutoGPTQ's packing (checkpoint_format "gptq", v1: zeros stored minus 1); with `desc_act`
    the groups are a random order of the input columns, as act-order makes them."""
    N, K = w.shape
    columns = np.random.default_rng(seed).permutation(K) if desc_act else np.arange(K)
    codes, scales, zeros = quantize_groups(w, group, symmetric, columns)
    g_idx = np.empty(K, np.int32)
    g_idx[columns] = np.arange(K) // group
    return {f"{prefix}.qweight": torch.from_numpy(_pack_words(codes)).t().contiguous(),  # [K/8, N]
            f"{prefix}.qzeros": torch.from_numpy(_pack_words((zeros.T - 1) & 15)),  # [G, N/8]
            f"{prefix}.scales": torch.from_numpy(np.ascontiguousarray(scales.T)),
            f"{prefix}.g_idx": torch.from_numpy(g_idx)}


def gptq_dequantize(t: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """AutoGPTQ's dequantize_weight (v1): zeros + 1, each input's group from g_idx; float [N, K]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    qweight, qzeros = t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"]
    zeros = (torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]) & 15).reshape(qzeros.shape[0], -1) + 1
    weight = (torch.bitwise_right_shift(qweight[:, None, :], shifts[None, :, None]) & 15).reshape(-1, qweight.shape[1])
    g_idx = t[f"{prefix}.g_idx"].long()
    w = t[f"{prefix}.scales"].float()[g_idx] * (weight - zeros[g_idx]).float()
    return w.t().contiguous()


def packed_checkpoint(model, directory: str, method: str, group_size: int = 128, symmetric: bool = False,
                      desc_act: bool = False, tokenizer=None):
    """`model` (float32, left as it is) as an AWQ (`method` "awq") or GPTQ ("gptq") checkpoint;
    returns (directory, the float32 reference model holding the unpacked weights)."""
    ref = copy.deepcopy(model)
    tensors = {k: v for k, v in model.state_dict().items()
               if not k.endswith(tuple(f"{n}.weight" for n in LINEARS))}
    inputs = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    for prefix, module in _linears(ref):
        if method == "awq":
            packed = awq_tensors(prefix, module.weight.detach(), group_size)
            w = awq_dequantize(packed, prefix, group_size)
        else:
            # act-order follows the input's statistics: one column order for the layers that share an input
            layer, name = prefix.split(".")[2], prefix.rsplit(".", 1)[1]
            seed = sum(map(ord, f"{layer}.{inputs.get(name, name)}"))
            packed = gptq_tensors(prefix, module.weight.detach(), group_size, symmetric, desc_act, seed=seed)
            w = gptq_dequantize(packed, prefix)
        tensors |= packed
        with torch.no_grad():
            module.weight.copy_(w)
    if method == "awq":
        qc = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group_size, "zero_point": True}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": symmetric, "desc_act": desc_act,
              "checkpoint_format": "gptq", "static_groups": False, "true_sequential": True}
    return _save(model, tensors, directory, qc, tokenizer), ref
