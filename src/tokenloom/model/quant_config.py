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
    if fmt == "pack-quantized":
        return _ct_pack_quantized(q, groups)
    # int-quantized (W8A8) and float-quantized (FP8): the int8 helper's loaders (not yet here)
    return QuantSpec("compressed-tensors", fmt, bits=8, raw=q)


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
    return QuantSpec("fp8", "fp8", 8, raw=q)  # the int8 helper's loader (not yet here)


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
    detect = _DETECTORS.get(method)
    if detect is None:
        raise _refuse("quant_method", q.get("quant_method"), f"supported: {', '.join(CHECKPOINT_METHODS)}")
    spec = detect(q)
    _check_loader(spec)
    return spec
