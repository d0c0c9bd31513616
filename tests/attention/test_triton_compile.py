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


@pytest.mark.slow
@pytest.mark.parametrize("arch,dtype,head_dim,group", [
    (90, "bf16", 128, 4),
    (80, "fp16", 80, 8),
    (90, "fp32", 64, 1),
])
def test_kernels_compile_for_gpu(arch, dtype, head_dim, group):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(arch), dtype, str(head_dim), str(group)],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("compiled in") == 8, proc.stdout
