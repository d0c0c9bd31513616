"""`tokenloom env`: what a bug report needs about this machine, in vLLM's `collect-env` spirit:
the versions of Python, torch and tokenloom, the CPU (model, ISA flags from /proc/cpuinfo or
`lscpu`), the TOKENLOOM_* variables that are set, and the kernel plan (ops/kernel_plan.py) as a
table: which C function runs for each op, dtype and row count here. It builds no kernels and
loads no model, so it answers in a second."""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
from importlib import metadata

from tokenloom import envs
from tokenloom.ops import cpu_features, kernel_plan


def add_env_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="print versions, the CPU, the TOKENLOOM_* variables and the kernel plan")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(func=run_env)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _lscpu_model() -> str:
    """lscpu's model name where it is installed (it also knows CPUs /proc/cpuinfo names vaguely)."""
    if shutil.which("lscpu") is None:
        return ""
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            return value.strip()
    return ""


def collect() -> dict:
    """Everything `tokenloom env` prints, as one JSON-encodable dict."""
    import torch

    features = cpu_features.detect()
    plan = kernel_plan.current()
    return {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "torch": torch.__version__, "tokenloom": _version("tokenloom"),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": _lscpu_model() or features.model_name, "cores": features.num_cores,
        "isa_flags": features.isa_flags(), "kernels_isa": features.isa,
        "env": {name: value for name, value, _ in envs.describe() if value},
        "kernel_plan_summary": plan.header(), "kernel_plan": plan.encode(),
    }


def run_env(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    for key in ("python", "platform", "torch", "tokenloom", "torch_cpu_capability", "cpu", "cores", "kernels_isa"):
        print(f"{key + ':':<22}{info[key]}")
    print(f"{'isa flags:':<22}{' '.join(info['isa_flags']) or 'none'}")
    docs = {name: doc for name, _, doc in envs.describe()}
    print("\nenvironment:" + ("" if info["env"] else " no TOKENLOOM_*/VLLM_* variable set"))
    for name, value in info["env"].items():
        print(f"  {name}={value}    # {docs[name]}")
    print(f"\nkernel plan: {info['kernel_plan_summary']}")
    print(kernel_plan.format_plan_rows(info["kernel_plan"]))
    return 0
