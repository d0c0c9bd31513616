#!/usr/bin/env bash
# GPU check for the attention kernels: native kernel tests, kernel timings, end-to-end throughput.
# Run from anywhere on a machine with an NVIDIA GPU and a CUDA build of torch in .venv:
#     bash benchmarks/gpu_check.sh 2>&1 | tee gpu_check.log
# Each stage has its own time limit (200 + 150 + 110 s): the whole script stays under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
status=0
stage() { echo; echo "=== $1 ($(date +%T))"; }

stage "device"
if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; then
    echo "gpu_check: no NVIDIA GPU visible (nvidia-smi failed)"; exit 1
fi
if ! $PY -c 'import sys, torch; print("torch", torch.__version__, "cuda", torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: the torch in .venv has no CUDA support; the checks below need a CUDA build"
    exit 1
fi
$PY -c 'import triton; print("triton", triton.__version__)' || exit 1

stage "attention kernel tests, native (TRITON_INTERPRET=0)"
TRITON_INTERPRET=0 timeout 200 .venv/bin/pytest -q -s -p no:cacheprovider \
    tests/attention/test_triton_kernels.py tests/attention/test_torch_backend.py || status=1

stage "kernel benchmark"
timeout 150 $PY benchmarks/kernels.py || status=1

stage "end-to-end throughput"
timeout 110 .venv/bin/tokenloom bench throughput --device cuda \
    --num-prompts 64 --input-len 128 --output-len 128 || status=1

stage "done: exit status $status"
exit $status
