"""What this x86 CPU can do, detected once at run time: the ISA level the C kernels are built
for, whether it multiplies bfloat16 natively (AVX-512 BF16 or AMX), and the cores this process
may use.

The flags come from /proc/cpuinfo (Linux); elsewhere, or when it says nothing, from
`torch.backends.cpu.get_cpu_capability()` (which knows AVX2 / AVX512 but not BF16 or AMX).
`TOKENLOOM_CPU_ISA` (`avx512`, `avx2` or `scalar`) caps the level the kernels are built for, so
the narrower variants can be run and measured on a wider CPU.
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from tokenloom import envs

# Kernel ISA levels, widest first; each implies the ones after it.
ISA_LEVELS = ("avx512", "avx2", "scalar")
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl")


@dataclass(frozen=True)
class CpuFeatures:
    model_name: str
    flags: frozenset[str]
    isa: str  # the C kernels' level: "avx512" (F+BW+VL), "avx2" (AVX2+FMA) or "scalar"
    num_cores: int  # len(os.sched_getaffinity(0)): the cores this process may run on

    @property
    def avx512_vnni(self) -> bool:
        return "avx512_vnni" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    @property
    def amx(self) -> bool:
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def native_bf16(self) -> bool:
        """True where bfloat16 matmuls run on bf16 hardware (AVX-512 BF16 dot products or AMX
        tiles) instead of being widened to float32 in software."""
        return self.avx512_bf16 or self.amx

    def isa_flags(self) -> list[str]:
        """The matmul- and kernel-relevant flags this CPU has, in a fixed order."""
        wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                  "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")
        return [f for f in wanted if f in self.flags]

    def summary(self) -> str:
        """One line for logs, EngineInfo and bench reports."""
        return (f"{self.model_name} | {self.num_cores} cores | kernels {self.isa} | "
                f"{' '.join(self.isa_flags()) or 'no SIMD flags'}")


def _cpuinfo() -> tuple[str, frozenset[str]]:
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return platform.processor() or platform.machine(), frozenset()
    model, flags = "", frozenset()
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:  # x86, ARM
            flags = frozenset(value.split())
        if model and flags:
            break
    return model or platform.machine(), flags


def _torch_capability_flags() -> frozenset[str]:
    try:
        import torch
        cap = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        return frozenset()
    return {"AVX512": frozenset({"avx2", "fma", *_AVX512_FLAGS}),
            "AVX2": frozenset({"avx2", "fma"})}.get(cap, frozenset())


def isa_level(flags: frozenset[str]) -> str:
    if all(f in flags for f in _AVX512_FLAGS) and {"avx2", "fma"} <= flags:
        level = "avx512"
    elif {"avx2", "fma"} <= flags:
        level = "avx2"
    else:
        level = "scalar"
    cap = envs.TOKENLOOM_CPU_ISA
    if cap:
        if cap not in ISA_LEVELS:
            raise ValueError(f"TOKENLOOM_CPU_ISA must be one of {', '.join(ISA_LEVELS)}, got {cap!r}")
        level = ISA_LEVELS[max(ISA_LEVELS.index(level), ISA_LEVELS.index(cap))]
    return level


@functools.cache
def detect() -> CpuFeatures:
    model, flags = _cpuinfo()
    if not flags:
        flags = _torch_capability_flags()
    return CpuFeatures(model_name=model, flags=flags, isa=isa_level(flags),
                       num_cores=len(os.sched_getaffinity(0)))


def engine_cpu_line(features: CpuFeatures, dtype: str, kernels_isa: str | None, matmul: str,
                    threads: str) -> str:
    """What the engine chose on this CPU, for the start-up log and `EngineInfo.cpu`; `matmul`
    names the matmul path (e.g. "oneDNN packed bfloat16", "F.linear float32", a GGUF scheme)."""
    native = "native bf16" if features.native_bf16 else "no native bf16"
    return (f"{features.summary()} ({native}) -> dtype {dtype}, matmuls {matmul}, C kernels "
            f"{kernels_isa or 'off'}, threads {threads}")
