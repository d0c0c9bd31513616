#!/usr/bin/env bash
# GPU check: the Triton attention kernels natively, the engine end to end on CUDA, kernel
# timings, and offline throughput against transformers on the same GPU.
#     bash benchmarks/gpu_check.sh [MODEL] 2>&1 | tee gpu_check.log
# MODEL: a GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct; on a
# machine without it, benchmarks/random_checkpoint.py writes one of its shape).
# PY: a python whose torch has CUDA (default .venv/bin/python, else python3). STAGES: which of
# "tests kernels throughput" to run (default all). Each stage has its own time limit (the tests
# 200 s, the kernel table 150 s, throughput 4 x 100 s): under 13 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
MODEL=${1:-}
STAGES=${STAGES:-tests kernels throughput}
status=0
stage() { echo; echo "=== $1 ($(date +%T))"; }

stage "device"
if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; then
    echo "gpu_check: no NVIDIA GPU visible (nvidia-smi failed)"; exit 1
fi
if ! $PY -c 'import sys, torch; print("torch", torch.__version__, "cuda", torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: the torch of $PY has no CUDA support; the checks below need a CUDA build"
    exit 1
fi
$PY -c 'import triton; print("triton", triton.__version__)' || exit 1

# The kernel tests print their max errors per kernel and dtype (-s, one process); the end-to-end
# tests run beside them (their time is mostly Triton compiling and CUDA starting, not the GPU).
if [[ " $STAGES " == *" tests "* ]]; then
    stage "tests, native (TRITON_INTERPRET=0): attention kernels | engine end to end on CUDA"
    TRITON_INTERPRET=0 timeout 200 $PY -m pytest -q -s -n 0 -p no:cacheprovider \
        tests/attention/test_triton_kernels.py tests/attention/test_torch_backend.py > gpu_check.kernels.log 2>&1 &
    kernels=$!
    TRITON_INTERPRET=0 timeout 200 $PY -m pytest -q -n 0 -p no:cacheprovider -rs \
        tests/entrypoints/test_llm_cuda.py --durations=8 > gpu_check.e2e.log 2>&1
    e2e=$?
    wait $kernels; k=$?
    grep -v "leaked\|nanobind\|skipped remainder" gpu_check.kernels.log | tail -40
    echo "--- end to end"
    grep -v "leaked\|nanobind\|skipped remainder" gpu_check.e2e.log | tail -60
    [ $k -eq 0 ] && [ $e2e -eq 0 ] || status=1
fi

if [[ " $STAGES " == *" kernels "* ]]; then
    stage "kernel benchmark"
    timeout 150 $PY benchmarks/kernels.py || status=1
fi

# Decode steps from CUDA graphs (the default), then every step eager (--enforce-eager): each
# against transformers run side by side in the same command.
if [[ " $STAGES " == *" throughput "* ]]; then
    for n in 64 1; do
        for eager in "" --enforce-eager; do
            stage "end-to-end throughput, $n x 128 x 128 ${eager:-(CUDA graphs)}, against transformers generate() on the same GPU"
            timeout 100 $PY -m tokenloom.entrypoints.cli bench throughput --device cuda ${MODEL:+--model "$MODEL"} $eager \
                --num-prompts $n --input-len 128 --output-len 128 --baseline hf --num-iters 3 || status=1
        done
    done
fi

stage "done: exit status $status"
exit $status
