"""Triton decides at import time whether its jit functions (its own `tl.sum`, `tl.max`, ... and
ours) are interpreted: TRITON_INTERPRET must be set before anything imports triton. Without a
CUDA device, set it here, before any test module of this folder is imported."""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
