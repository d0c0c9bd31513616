"""What every bench report carries about the machine it ran on, and how a run shows progress.

Figures from different machines are not comparable (the issue that added this: the same code ran
ahead of vLLM on an AVX2 CPU and behind it on an AVX-512 one), so each report names the CPU, its
ISA flags, the usable cores and the load average; progress lines go to stderr, so `--json` output
on stdout stays one object.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

from tokenloom.ops import cpu_features


def _lscpu_model_name() -> str | None:
    if shutil.which("lscpu") is None:
        return None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            return value.strip()
    return None


def _cpu_family_model() -> str:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return ""
    info: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("cpu family", "model") and key not in info:
            info[key] = value.strip()
        if len(info) == 2:
            break
    return f"family {info['cpu family']} model {info['model']}" if len(info) == 2 else ""


def machine_info() -> dict[str, Any]:
    import torch

    f = cpu_features.detect()
    return {
        "cpu_model_name": _lscpu_model_name() or f.model_name,
        "cpu_family_model": _cpu_family_model(),
        "isa_flags": f.isa_flags(),
        "kernel_isa": f.isa,
        "native_bf16": f.native_bf16,
        "usable_cores": f.num_cores,
        "online_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else [],
    }


def format_machine(m: dict[str, Any]) -> str:
    load = " ".join(f"{x:.2f}" for x in m.get("load_average", []))
    fam = f" ({m['cpu_family_model']})" if m.get("cpu_family_model") else ""
    return (f"machine: {m['cpu_model_name']}{fam}, {m['usable_cores']} usable cores, "
            f"flags {' '.join(m['isa_flags']) or '-'}, torch {m['torch']} "
            f"({m['torch_cpu_capability']}), load average {load or '?'}")


class Progress:
    """Progress lines on stderr: `step(msg)` when a phase starts, and while one runs a line every
    `every_s` seconds, so a long run on a loaded machine is never silent."""

    def __init__(self, every_s: float = 30.0, stream: Any = None) -> None:
        self.start = time.perf_counter()
        self.every_s = every_s
        self.stream = stream or sys.stderr
        self._phase = ""
        self._phase_start = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="bench-progress", daemon=True)
        self._thread.start()

    def _print(self, msg: str) -> None:
        print(f"[bench {time.perf_counter() - self.start:7.1f}s] {msg}", file=self.stream,
              flush=True)

    def step(self, msg: str) -> None:
        self._phase, self._phase_start = msg, time.perf_counter()
        self._print(msg)

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            if self._phase:
                self._print(f"... {self._phase} ({time.perf_counter() - self._phase_start:.0f}s)")

    def close(self) -> None:
        self._stop.set()
        self._print("done")
