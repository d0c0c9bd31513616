"""Kernels the model and the attention backends call, and what they need to know about the CPU:
C kernels for float32 and bfloat16 (`cpu_kernels`, sources in `csrc/`, built for the ISA level
`cpu_features` detects), the thread policy (`cpu_threads`) and lazily committed CPU buffers
(`cpu_memory`). Triton's GPU kernels live with their backend in `attention/`."""
