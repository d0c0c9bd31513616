"""test_cuda_graph.py runs the Triton backend: without a CUDA device it needs Triton's interpreter,
which must be on before anything imports triton (as tests/attention/conftest.py sets it)."""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
