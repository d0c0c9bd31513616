"""The Triton kernels lower to NVIDIA cubins (real compiler, no GPU needed): see
triton_aot_check.py for why the interpreter tests are not enough on their own."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("triton_aot_check.py")


# (arch, dtype, head_dim, group): Hopper and Ampere, each dtype, padded and unpadded head dims,
# grouped and plain attention.
CONFIGS = [(90, "bf16", 128, 4), (80, "fp16", 80, 8), (90, "fp32", 64, 1)]


@pytest.mark.slow
def test_kernels_compile_for_gpu():
    """Every kernel (8 with the windowed variants) for every config, in ONE subprocess: importing
    torch, triton and the kernels once instead of once per config."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *(str(x) for config in CONFIGS for x in config)],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for arch, dtype, head_dim, group in CONFIGS:
        prefix = f"sm_{arch} {dtype} D={head_dim} group={group} "
        compiled = [line for line in proc.stdout.splitlines() if line.startswith(prefix) and "compiled in" in line]
        assert len(compiled) == 8, (prefix, proc.stdout)
