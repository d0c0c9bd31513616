"""Every environment variable tokenloom reads: the `TOKENLOOM_*` switches and the `VLLM_*` ones
it honours as fallbacks, each read here and nowhere else (as vLLM's `vllm/envs.py`).

`envs.TOKENLOOM_CPU_ISA` (a module attribute) reads the variable when it is asked for, not at
import, so a test that sets one with `monkeypatch.setenv` sees it at once. Setting variables for
child processes (`os.environ[...] = ...`, a worker's `runtime_env`) is left to the callers.
`tests/house/test_envs.py` fails when another module of `src/tokenloom` reads a `TOKENLOOM_`
variable through `os.environ` or `os.getenv`.

This module sits at the bottom of the import order: it imports nothing from tokenloom.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _str(name: str, default: str | None = None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


def _on_unless_zero(name: str) -> Callable[[], bool]:
    """A switch that is on unless set to "0" (the A/B switches' convention)."""
    return lambda: os.environ.get(name, "1") != "0"


def _optional_int(name: str) -> Callable[[], int | None]:
    """An integer, None when unset or empty (C's atoi: a malformed value reads as 0)."""
    def read() -> int | None:
        value = os.environ.get(name, "").strip()
        if not value:
            return None
        try:
            return int(value)
        except ValueError:
            return 0
    return read


def _true_words(name: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "").lower() in ("1", "true")


# name -> (reader, doc line). The doc lines are what `tokenloom env` prints beside each value.
environment_variables: dict[str, tuple[Callable[[], Any], str]] = {
    # --- which kernel runs (ops/kernel_plan.py turns these into the KernelPlan)
    "TOKENLOOM_CPU_KERNELS": (_on_unless_zero("TOKENLOOM_CPU_KERNELS"),
                              "0: never build or load the C kernels; every op runs its PyTorch path"),
    "TOKENLOOM_CPU_ISA": (lambda: os.environ.get("TOKENLOOM_CPU_ISA", "").strip().lower(),
                          "avx512 | avx2 | scalar: cap the ISA level the C kernels are built for"),
    "TOKENLOOM_QUANT_ISA": (lambda: os.environ.get("TOKENLOOM_QUANT_ISA") or None,
                            "amx_bf16 | amx | avx512 | avx2 | c: cap the quantized matmul's kernel level"),
    "TOKENLOOM_QUANT_BF16_ROWS": (_optional_int("TOKENLOOM_QUANT_BF16_ROWS"),
                                  "rows from which quantized matmuls run on AMX-BF16 tiles (0: never)"),
    "TOKENLOOM_QUANT_F32_ROWS": (_optional_int("TOKENLOOM_QUANT_F32_ROWS"),
                                 "rows from which quantized matmuls run on float32 panels on AVX2 (0: never)"),
    "TOKENLOOM_F32_GEMV": (_on_unless_zero("TOKENLOOM_F32_GEMV"),
                           "0: no C GEMV for decode-sized float32 matmuls on plain weights"),
    "TOKENLOOM_F32_PANEL": (_on_unless_zero("TOKENLOOM_F32_PANEL"),
                            "0: no panel-packed float32 weights on AVX2 (oneDNN, the C GEMV and MKL)"),
    "TOKENLOOM_AMX_BF16": (_on_unless_zero("TOKENLOOM_AMX_BF16"),
                           "0: bfloat16 matmuls not on our AMX tile kernel"),
    "TOKENLOOM_BF16_DP": (_on_unless_zero("TOKENLOOM_BF16_DP"),
                          "0: bfloat16 matmuls not on our AVX512-BF16 dot-product kernel"),
    "TOKENLOOM_FUSED_DECODE": (_on_unless_zero("TOKENLOOM_FUSED_DECODE"),
                               "0: decode steps run the eager layers, never the one-call C step"),
    "TOKENLOOM_FUSED_MOE": (_on_unless_zero("TOKENLOOM_FUSED_MOE"),
                            "0: quantized experts run one matmul call per chosen expert, never the one-call C layer"),
    # --- resources
    "TOKENLOOM_NUM_THREADS": (lambda: os.environ.get("TOKENLOOM_NUM_THREADS", "").strip(),
                              "a fixed thread count per rank (no governor); empty: follow free cores"),
    "TOKENLOOM_HUGEPAGES": (_on_unless_zero("TOKENLOOM_HUGEPAGES"),
                            "0: no transparent huge pages asked for the packed weights"),
    "TOKENLOOM_CACHE_DIR": (lambda: os.environ.get("TOKENLOOM_CACHE_DIR") or None,
                            "the cache folder (built kernels, ...); default ~/.cache/tokenloom"),
    # --- processes, logs, servers
    "TOKENLOOM_LOG_LEVEL": (_str("TOKENLOOM_LOG_LEVEL", "WARNING"),
                            "the log level of engine core and worker processes"),
    "TOKENLOOM_STARTUP_TIMEOUT_S": (lambda: float(os.environ.get("TOKENLOOM_STARTUP_TIMEOUT_S", "600")),
                                    "seconds a client waits for its engine core to start"),
    "TOKENLOOM_TORCH_PROFILER_DIR": (lambda: os.environ.get("TOKENLOOM_TORCH_PROFILER_DIR") or None,
                                     "where start_profile() writes torch profiler traces"),
    "VLLM_TORCH_PROFILER_DIR": (lambda: os.environ.get("VLLM_TORCH_PROFILER_DIR") or None,
                                "vLLM's name for TOKENLOOM_TORCH_PROFILER_DIR (the fallback)"),
    "TOKENLOOM_API_KEY": (lambda: os.environ.get("TOKENLOOM_API_KEY") or None,
                          "the key the server asks for (--api-key's default), and its clients send"),
    "VLLM_API_KEY": (lambda: os.environ.get("VLLM_API_KEY") or None,
                     "vLLM's name for the server's TOKENLOOM_API_KEY (the fallback)"),
    "TOKENLOOM_ALLOW_RUNTIME_LORA_UPDATING": (_true_words("TOKENLOOM_ALLOW_RUNTIME_LORA_UPDATING"),
                                              "1 | true: allow POST /v1/load_lora_adapter and unload"),
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": (_true_words("VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
                                         "vLLM's name for TOKENLOOM_ALLOW_RUNTIME_LORA_UPDATING"),
    # --- the model hub (huggingface_hub's own variables, read when a hub id is downloaded rather
    # than when huggingface_hub was imported, so a script may set them after importing it)
    "HF_ENDPOINT": (lambda: os.environ.get("HF_ENDPOINT") or None,
                    "the hub that hub ids are downloaded from (default https://huggingface.co)"),
    "HF_HUB_OFFLINE": (lambda: os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"),
                       "1: hub ids resolve from the local cache only, with no network"),
    "HF_HUB_CACHE": (lambda: os.environ.get("HF_HUB_CACHE") or None,
                     "the hub cache downloads go to (default $HF_HOME/hub); --download-dir overrides it"),
    "HF_HOME": (lambda: os.environ.get("HF_HOME") or None,
                "huggingface_hub's home (default ~/.cache/huggingface); its hub/ is the cache"),
}


def hf_endpoint() -> str | None:
    """$HF_ENDPOINT (None: huggingface_hub's default)."""
    return _get("HF_ENDPOINT")


def hf_hub_offline() -> bool:
    return _get("HF_HUB_OFFLINE")


def hf_hub_cache() -> str | None:
    """$HF_HUB_CACHE, else $HF_HOME/hub (None: huggingface_hub's default)."""
    home = _get("HF_HOME")
    return _get("HF_HUB_CACHE") or (os.path.join(os.path.expanduser(home), "hub") if home else None)


def torch_profiler_dir() -> str | None:
    """$TOKENLOOM_TORCH_PROFILER_DIR, else vLLM's $VLLM_TORCH_PROFILER_DIR."""
    return _get("TOKENLOOM_TORCH_PROFILER_DIR") or _get("VLLM_TORCH_PROFILER_DIR")


def server_api_key() -> str | None:
    """$TOKENLOOM_API_KEY, else vLLM's $VLLM_API_KEY: the key a server started without
    --api-key asks for."""
    return _get("TOKENLOOM_API_KEY") or _get("VLLM_API_KEY")


def runtime_lora_updating() -> bool:
    """Whether either name of the runtime-LoRA switch is on."""
    return _get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") or _get("TOKENLOOM_ALLOW_RUNTIME_LORA_UPDATING")


def _get(name: str) -> Any:
    return environment_variables[name][0]()


def is_set(name: str) -> bool:
    """Whether `name` (one of `environment_variables`) is in the environment."""
    return name in os.environ


def describe() -> list[tuple[str, str, str]]:
    """(name, raw value or "" when unset, doc line) for every variable, in declaration order:
    what `tokenloom env` prints."""
    return [(name, os.environ.get(name, ""), doc) for name, (_, doc) in environment_variables.items()]


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return _get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *environment_variables])
