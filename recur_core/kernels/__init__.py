"""Kernels: the Triton readout (CUDA) and the CPU's bfloat16 -> float32 matmul; each has a plain
PyTorch reference in the module it accelerates."""
