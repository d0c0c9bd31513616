"""A pre-quantized HF checkpoint's format, read from `quantization_config` in config.json as vLLM
reads it (`quant_method`, and compressed-tensors' `format`), and the loader that computes it.

`detect_quantization(cfg)` -> a `QuantSpec` (None for a float checkpoint), or a ModelLoadError
naming the option this engine does not compute. `LOADERS` maps (method, format) to the module
whose `install_checkpoint(model, spec, directory) -> (consumed HF tensor names,
quant_linear.QuantSummary)` swaps the model's linear layers for the checkpoint's quantized ones
before the float loader reads the rest (imported on use, so that the caller process, which only
validates the config, never imports torch for it).
No tensor library here: source.py validates the config in the caller's process.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from tokenloom.model.errors import ModelLoadError
from tokenloom.model.quant_spec import QuantSpec

__all__ = ["CHECKPOINT_METHODS", "LOADERS", "QuantSpec", "detect_quantization", "loader_for"]

# vLLM's names for the methods a checkpoint declares (`quantization=` accepts them too).
CHECKPOINT_METHODS = ("compressed-tensors", "awq", "gptq", "fp8")


# (method, format) -> the module of its loader (`install_checkpoint`).
LOADERS: dict[tuple[str, str], str] = {
    ("compressed-tensors", "pack-quantized"): "tokenloom.model.int4_checkpoint",
    ("awq", "awq-gemm"): "tokenloom.model.int4_checkpoint",
    ("gptq", "gptq"): "tokenloom.model.int4_checkpoint",
    ("compressed-tensors", "int-quantized"): "tokenloom.model.int8_checkpoint",
    ("compressed-tensors", "float-quantized"): "tokenloom.model.fp8_checkpoint",
    ("fp8", "fp8"): "tokenloom.model.fp8_checkpoint",
}


def loader_for(spec: QuantSpec) -> Callable[..., Any]:
    """The installer of `spec`'s format (see LOADERS)."""
    _check_loader(spec)
    return importlib.import_module(LOADERS[spec.method, spec.format]).install_checkpoint


def _check_loader(spec: QuantSpec) -> None:
    if (spec.method, spec.format) not in LOADERS:
        raise ModelLoadError(f"quantization_config: {spec.method} format {spec.format!r} is not supported "
                             f"(supported: {', '.join(f'{m} {f}' for m, f in LOADERS)})")


def _refuse(option: str, value: Any, supported: str) -> ModelLoadError:
    return ModelLoadError(f"quantization_config: {option}={value!r} is not supported ({supported})")


def _compressed_tensors(q: dict[str, Any]) -> QuantSpec:
    groups = q.get("config_groups") or {}
    if not groups:
        raise _refuse("config_groups", groups, "compressed-tensors needs at least one quantization scheme")
    formats = {g.get("format") or q.get("format") for g in groups.values()}
    if len(formats) != 1 or None in formats:
        raise _refuse("format", sorted(map(str, formats)), "one compressed-tensors format per checkpoint")
    fmt = formats.pop()
    if q.get("quantization_status", "compressed") != "compressed":
        raise _refuse("quantization_status", q.get("quantization_status"), "a compressed checkpoint")
    for option in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.get(option):
            raise _refuse(option, q[option], "quantized weights and activations only")
    if fmt == "pack-quantized":
        return _ct_pack_quantized(q, groups)
    types = {(g.get("weights") or {}).get("type", "int") for g in groups.values()}
    if fmt == "int-quantized" or (fmt == "naive-quantized" and types == {"int"}):
        return _ct_int8(q, groups)
    if fmt in ("float-quantized", "naive-quantized"):  # naive: the same tensors, another name
        return _ct_fp8(q, groups)
    raise _refuse("format", fmt, "pack-quantized, int-quantized, float-quantized")


def _ct_8bit_weights(name: str, g: dict[str, Any], kind: str, strategies: tuple[str, ...]) -> dict[str, Any]:
    """A compressed-tensors group's 8-bit weight args (checked); for int8 and FP8."""
    w = g.get("weights") or {}
    where = f"config_groups.{name}"
    if w.get("type", "int") != kind or int(w.get("num_bits", 0)) != 8:
        raise _refuse(f"{where}.weights.num_bits", w.get("num_bits"), f"8-bit {kind} weights in this format")
    if not w.get("symmetric", True):
        raise _refuse(f"{where}.weights.symmetric", False, "symmetric 8-bit weights (no zero point)")
    if w.get("dynamic"):
        raise _refuse(f"{where}.weights.dynamic", w["dynamic"], "static weight scales")
    if w.get("strategy") not in strategies:
        raise _refuse(f"{where}.weights.strategy", w.get("strategy"), " or ".join(strategies))
    if g.get("output_activations") is not None:
        raise _refuse(f"{where}.output_activations", g["output_activations"], "unquantized outputs")
    return w


def _ct_int8(q: dict[str, Any], groups: dict[str, Any]) -> QuantSpec:
    """int-quantized: int8 weights per tensor, channel or group of a multiple of 32 (the int8
    kernels' blocks), activations none (W8A16) or symmetric int8 (W8A8; dynamic or static scales,
    both quantized per 32 elements at run time by the kernels: the static scales are not read)."""
    acts = set()
    for name, g in groups.items():
        w = _ct_8bit_weights(name, g, "int", ("tensor", "channel", "group"))
        if w["strategy"] == "group" and (int(w.get("group_size") or 0) <= 0 or int(w["group_size"]) % 32):
            raise _refuse(f"config_groups.{name}.weights.group_size", w.get("group_size"), "a multiple of 32")
        a = g.get("input_activations")
        if a is not None:
            if a.get("type", "int") != "int" or int(a.get("num_bits", 0)) != 8:
                raise _refuse(f"config_groups.{name}.input_activations.num_bits", a.get("num_bits"),
                              "8-bit int activations with int8 weights")
            if not a.get("symmetric", True):
                raise _refuse(f"config_groups.{name}.input_activations.symmetric", False,
                              "symmetric int8 activations; asymmetric W8A8 is not computed")
            if a.get("strategy") not in ("token", "tensor"):
                raise _refuse(f"config_groups.{name}.input_activations.strategy", a.get("strategy"), "token or tensor")
        acts.add(a is not None)
    return QuantSpec("compressed-tensors", "int-quantized", 8, act_bits=8 if True in acts else None, raw=q)


def _ct_fp8(q: dict[str, Any], groups: dict[str, Any]) -> QuantSpec:
    """float-quantized: FP8 e4m3 weights per tensor, channel or block, dequantized at load; FP8
    activation args (static or dynamic) are accepted and not applied: computed weight-only."""
    shapes = set()
    for name, g in groups.items():
        w = _ct_8bit_weights(name, g, "float", ("tensor", "channel", "block"))
        block = w.get("block_structure")
        if w["strategy"] == "block" and not (isinstance(block, list) and len(block) == 2
                                             and all(isinstance(b, int) and b > 0 for b in block)):
            raise _refuse(f"config_groups.{name}.weights.block_structure", block, "two positive ints")
        a = g.get("input_activations")
        if a is not None and (a.get("type") != "float" or int(a.get("num_bits", 0)) != 8):
            raise _refuse(f"config_groups.{name}.input_activations", a, "none, or FP8 (computed weight-only)")
        shapes.add((w["strategy"], tuple(block) if w["strategy"] == "block" else None))
    if len(shapes) != 1:
        raise _refuse("config_groups", sorted(groups), "one FP8 weight strategy for every layer")
    return QuantSpec("compressed-tensors", "float-quantized", 8, raw=q)


def _ct_pack_quantized(q: dict[str, Any], groups: dict[str, Any]) -> QuantSpec:
    schemes = []
    for name, g in groups.items():
        w = g.get("weights") or {}
        if g.get("input_activations") is not None:
            raise _refuse(f"config_groups.{name}.input_activations", g["input_activations"],
                          "pack-quantized is computed weight-only (W4A16)")
        if w.get("type", "int") != "int" or int(w.get("num_bits", 0)) != 4:
            raise _refuse(f"config_groups.{name}.weights.num_bits", w.get("num_bits"), "4-bit int weights")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise _refuse(f"config_groups.{name}.weights.strategy", strategy, "group or channel")
        if w.get("dynamic"):
            raise _refuse(f"config_groups.{name}.weights.dynamic", w["dynamic"], "static weight scales")
        gs = int(w["group_size"]) if strategy == "group" else None
        if gs is not None and (gs <= 0 or gs % 32):
            raise _refuse(f"config_groups.{name}.weights.group_size", gs, "a multiple of 32")
        if w.get("actorder") not in (None, "group", "weight", "static", "dynamic"):
            raise _refuse(f"config_groups.{name}.weights.actorder", w["actorder"], "group or weight")
        schemes.append((gs, bool(w.get("symmetric", True)), w.get("actorder") == "group"))
    if len(set(schemes)) != 1:
        raise _refuse("config_groups", sorted(groups), "one weight scheme for every layer")
    gs, sym, act = schemes[0]
    return QuantSpec("compressed-tensors", "pack-quantized", 4, gs, sym, act, raw=q)


def _awq(q: dict[str, Any]) -> QuantSpec:
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", q.get("version"), "AutoAWQ's GEMM layout")
    bits = int(q.get("bits", q.get("w_bit", 4)))
    if bits != 4:
        raise _refuse("bits", bits, "4")
    gs = int(q.get("group_size", q.get("q_group_size", 128)))
    if gs <= 0 or gs % 32:
        raise _refuse("group_size", gs, "a positive multiple of 32")
    if not q.get("zero_point", True):
        raise _refuse("zero_point", q.get("zero_point"), "AWQ with zero points")
    return QuantSpec("awq", "awq-gemm", bits, gs, symmetric=False, raw=q)


def _gptq(q: dict[str, Any]) -> QuantSpec:
    bits = int(q.get("bits", 4))
    if bits != 4:
        raise _refuse("bits", bits, "4")
    gs = int(q.get("group_size", 128))
    if gs != -1 and (gs <= 0 or gs % 32):
        raise _refuse("group_size", gs, "-1 or a positive multiple of 32")
    ckpt = q.get("checkpoint_format", "gptq")
    if ckpt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", ckpt, "gptq or gptq_v2")
    if q.get("static_groups"):
        raise _refuse("static_groups", q["static_groups"], "groups in g_idx order")
    return QuantSpec("gptq", "gptq", bits, None if gs == -1 else gs, bool(q.get("sym", True)),
                     bool(q.get("desc_act", False)), zeros_minus_one=ckpt == "gptq", raw=q)


def _fp8(q: dict[str, Any]) -> QuantSpec:
    """quant_method fp8 (transformers' FineGrainedFP8 / vLLM's Fp8Config): e4m3 weights with a
    per-tensor `weight_scale`, or a `weight_scale_inv` per block of `weight_block_size`; the
    activation scheme (static or dynamic) is not applied: computed weight-only."""
    fmt = str(q.get("fmt", q.get("format", "e4m3"))).lower()
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise _refuse("fmt", q.get("fmt", q.get("format")), "e4m3")
    if q.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise _refuse("activation_scheme", q["activation_scheme"], "dynamic or static")
    block = q.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse("weight_block_size", block, "two positive ints, or none for per-tensor scales")
    return QuantSpec("fp8", "fp8", 8, raw=q)


_DETECTORS: dict[str, Callable[[dict[str, Any]], QuantSpec]] = {
    "compressed-tensors": _compressed_tensors,
    "awq": _awq,
    "gptq": _gptq,
    "fp8": _fp8,
}


def detect_quantization(cfg: dict[str, Any]) -> QuantSpec | None:
    """config.json (a dict) -> the checkpoint's QuantSpec, None when it has no
    `quantization_config`; a ModelLoadError naming an unsupported method or option."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower().replace("_", "-")
    if method == "mxfp4":  # gpt-oss's experts as shipped: the model computes them (model/gpt_oss.py)
        arch = (cfg.get("architectures") or [None])[0]
        if arch != "GptOssForCausalLM":
            raise _refuse("quant_method", q.get("quant_method"), "MXFP4 experts are read for GptOssForCausalLM only")
        return None
    detect = _DETECTORS.get(method)
    if detect is None:
        raise _refuse("quant_method", q.get("quant_method"), f"supported: {', '.join(CHECKPOINT_METHODS)}")
    spec = detect(q)
    _check_loader(spec)
    return spec
