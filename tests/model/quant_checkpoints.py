"""Pre-quantized HF checkpoints for the tests, written by the formats' own tools, and their float32
references: compressed-tensors' compressors (scales from its `calculate_qparams` on each weight's
min/max, as its observers compute them), and the `fp8` block format (DeepSeek / Qwen FP8) written
by hand as its config describes, read back by compressed-tensors' FP8BlockDequantizer."""
from __future__ import annotations

import json
import os

import torch


def _observe(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """min and max of `w` per scale of `args.strategy` (a min/max observer's)."""
    N, K = w.shape
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == "group":
        g = w.reshape(N, K // args.group_size, args.group_size)
        return g.amin(-1), g.amax(-1)
    bn, bk = args.block_structure  # block
    p = torch.nn.functional.pad(w, (0, -K % bk, 0, -N % bn))
    b = p.reshape(p.shape[0] // bn, bn, p.shape[1] // bk, bk)
    return b.amin((1, 3)), b.amax((1, 3))


def ct_checkpoint(model, tokenizer, directory: str, scheme: dict, fmt: str | None = None) -> str:
    """`model` (a float32 transformers causal LM, changed in place) quantized with the
    compressed-tensors `scheme` (QuantizationScheme fields but targets) on every Linear but the LM
    head, compressed in format `fmt` (None: the one compressed-tensors infers) and saved with
    `tokenizer`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            args = module.quantization_scheme.weights
            scale, _ = calculate_qparams(*_observe(module.weight.detach(), args), args)
            module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _float_model(directory: str, state: dict[str, torch.Tensor]):
    """A float32 transformers model of the checkpoint's config (its quantization_config dropped)
    holding `state`."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model


def _tensors(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def ct_reference(directory: str):
    """The float32 model of a compressed-tensors checkpoint: every weight dequantized by
    compressed-tensors' own decompressor for its group's scheme."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    with open(os.path.join(directory, "config.json")) as f:
        (group,) = json.load(f)["quantization_config"]["config_groups"].values()
    scheme = QuantizationScheme(**group)
    tensors = _tensors(directory)
    state = {}
    for name, t in tensors.items():
        module, _, param = name.rpartition(".")
        if param == "weight" and f"{module}.weight_scale" in tensors:
            parts = {"weight": t, "weight_scale": tensors[f"{module}.weight_scale"]}
            state[name] = NaiveQuantizationCompressor.decompress(parts, scheme)["weight"].float()
        elif not param.startswith(("weight_scale", "weight_zero_point", "input_")):
            state[name] = t.float()
    return _float_model(directory, state)


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def fp8_checkpoint(model, tokenizer, directory: str, block: tuple[int, int] | None = (128, 128)) -> str:
    """`model` saved as a quant_method "fp8" checkpoint as DeepSeek-V3 and Qwen3 FP8 (block-wise:
    a float32 `weight_scale_inv` per `block`, the last blocks of a row or column partial) or the
    per-tensor fp8 checkpoints (block None: a scalar `weight_scale` and a static `input_scale`)
    ship: every decoder Linear's weight in float8_e4m3fn, the LM head, embedding and norms as
    they are."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    bn, bk = block or (None, None)
    out = {}
    for name, w in state.items():
        if not (name.endswith("_proj.weight") and name.startswith("model.layers.")):
            out[name] = w
            continue
        N, K = w.shape
        if block is None:
            scale = (w.abs().amax() / FP8_MAX).reshape(())
            full = scale
            out[name.removesuffix("weight") + "weight_scale"] = scale.float()
            out[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.01)
        else:
            padded = torch.nn.functional.pad(w, (0, -K % bk, 0, -N % bn))
            blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
            scale = (blocks.abs().amax((1, 3)) / FP8_MAX).clamp_min(1e-12)
            full = scale.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
            out[name.removesuffix("weight") + "weight_scale_inv"] = scale.float()
        out[name] = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    save_file(out, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3"} | (
        {"activation_scheme": "dynamic", "weight_block_size": list(block)} if block else {"activation_scheme": "static"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tokenizer.save_pretrained(directory)
    return directory


def fp8_reference(directory: str):
    """The float32 model of an `fp8` checkpoint, dequantized by compressed-tensors: its
    FP8BlockDequantizer (block scales), its `dequantize` for a per-tensor scale."""
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    with open(os.path.join(directory, "config.json")) as f:
        block = json.load(f)["quantization_config"].get("weight_block_size")
    tensors = _tensors(directory)
    if block is not None:
        targets = {n.rpartition(".")[0] for n in tensors if n.endswith(".weight_scale_inv")}
        state = FP8BlockDequantizer(targets=targets, weight_block_size=tuple(block), dtype=torch.float32).process(tensors)
    else:
        args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
        state = {}
        for name, t in tensors.items():
            if name.endswith(("weight_scale", "input_scale")):
                continue
            scale = tensors.get(name + "_scale")
            state[name] = t if scale is None else dequantize(t, scale.reshape(1), args=args, dtype=torch.float32)
    return _float_model(directory, {k: v.float() for k, v in state.items()})
