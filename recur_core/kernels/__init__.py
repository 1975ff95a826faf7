"""Triton kernels; each has a plain PyTorch reference in the module it accelerates."""
