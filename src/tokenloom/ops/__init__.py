"""Kernels the model and the attention backends call: C for float32 on the CPU (`cpu_kernels`,
sources in `csrc/`). Triton's GPU kernels live with their backend in `attention/`."""
