"""Kernels the model and the attention backends call, and what they need to know about the CPU:
the decoder's element-wise steps with the C-or-PyTorch choice made once (`elementwise`), C kernels
for float32 and bfloat16 (`cpu_kernels`, sources in `csrc/`, built for the ISA level
`cpu_features` detects), block-quantized matmuls (`quant`), the thread policy (`cpu_threads`) and
lazily committed CPU buffers (`cpu_memory`). Triton's GPU kernels live with their backend in
`attention/`."""
