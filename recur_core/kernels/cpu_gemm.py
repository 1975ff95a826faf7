"""bfloat16 x bfloat16 -> float32 matrix products on the CPU, through the MKL inside torch's CPU library.

The readout wants float32 logits of bfloat16 hidden states and a bfloat16 LM head. torch 2.13 has no
CPU op for that (`torch.mm(..., out_dtype=)` is CUDA-only), so the chunked readout used to upcast
every W chunk to float32 and multiply in float32: on a 2-core Xeon with AMX that was 55% of a
full-size Huginn-0125 loop (docs/benchmarks/fullsize.md). MKL's `cblas_gemm_bf16bf16f32`, which
torch's x86 builds link and export, multiplies the bfloat16 operands on the AMX / AVX-512 BF16 units
and accumulates in float32. The product of two bfloat16 numbers is exact in float32, so the result
equals float32 math on the upcast operands up to the order of summation.

Reference: `x.float() @ W.float().T` (recur_core.exits.readout upcasts W chunks when this path
cannot run: no MKL, another dtype or device). MKL honours torch's per-thread thread count
(torch.set_num_threads sets MKL's local one), and ctypes releases the GIL during the call.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS_LAYOUT / CBLAS_TRANSPOSE values (mkl_cblas.h)


@functools.cache
def _gemm():
    """MKL's cblas_gemm_bf16bf16f32 (32-bit integers), or None where torch carries no MKL."""
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        fn = ctypes.CDLL(str(library)).cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    fn.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    fn.restype = None
    return fn


def _fits(t: Tensor) -> bool:
    """A CPU matrix whose rows MKL can walk: unit-stride rows that do not overlap (the leading
    dimension at least a row, as cblas requires), strides within its 32-bit integers."""
    return (t.dim() == 2 and t.device.type == "cpu" and t.stride(1) == 1
            and t.shape[1] <= t.stride(0) < 2 ** 31)


def can_multiply(x: Tensor, w: Tensor) -> bool:
    """Whether `bf16_matmul_nt(x, w, out)` runs here: both bfloat16 CPU matrices with unit-stride
    rows, and MKL present."""
    return (x.dtype == w.dtype == torch.bfloat16 and _fits(x) and _fits(w) and x.shape[1] == w.shape[1]
            and _gemm() is not None)


def bf16_matmul_nt(x: Tensor, w: Tensor, out: Tensor) -> Tensor:
    """out = x @ w^T in float32 for bfloat16 x (M, K) and w (N, K); out (M, N) float32, unit-stride
    rows (e.g. a slice of a reused buffer). Only where can_multiply(x, w)."""
    (m, k), n = x.shape, w.shape[0]
    if not can_multiply(x, w) or out.dtype != torch.float32 or not _fits(out) or tuple(out.shape) != (m, n):
        raise ValueError(f"bf16_matmul_nt: cannot multiply {x.dtype} {tuple(x.shape)} by {w.dtype} "
                         f"{tuple(w.shape)}^T into {out.dtype} {tuple(out.shape)}")
    if m and n:
        _gemm()(_ROW_MAJOR, _NO_TRANS, _TRANS, m, n, k, 1.0, x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0),
                0.0, out.data_ptr(), out.stride(0))
    return out
