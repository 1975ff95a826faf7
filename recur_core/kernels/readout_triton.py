"""Fused readout statistics in Triton: softmax(h @ W^T) moments without materialising the logits.

PyTorch reference: recur_core.exits.readout.readout_stats_reference (ground truth) and
readout_stats_chunked (the same slice moments, computed chunk by chunk with torch ops).

The grid is (token blocks, vocabulary splits). A program takes BLOCK_T tokens and one contiguous
split of the vocabulary, walks it in BLOCK_V tiles, and for each tile computes the logits of h and
of h_prev with the same W tile (W is read once per token block), updating online-softmax moments:
max, sum of exps, the entropy and both KL numerators (KL(p || p_prev) and the reverse
KL(p_prev || p)), argmax and the target logit. Each (split, token)
writes a ReadoutPartials entry; recur_core.exits.readout.combine_partials merges the splits in PyTorch.
Splitting the vocabulary keeps the GPU busy when there are few token blocks (short sequences).

No top-k here: readout_stats routes topk > 0 to the chunked backend.

Float32 inputs are multiplied in IEEE fp32 (not TF32) so that statistics match the float32
reference; bf16 / fp16 inputs use tensor cores with fp32 accumulation. Runs under TRITON_INTERPRET=1
on CPU tensors (float32 / float16 only there), which is how the tests check it without a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Running maxima start at this finite value rather than -inf so that, before the first tile,
# s * (m_old - m_new) is 0 * (-huge) = 0 and not 0 * (-inf) = NaN.
_NEG_INIT = tl.constexpr(-1e30)


@triton.jit
def _readout_partials_kernel(
    h_ptr, hp_ptr, w_ptr, tgt_ptr,
    m_ptr, s_ptr, u_ptr, arg_ptr, m_prev_ptr, s_prev_ptr, k_ptr, k_rev_ptr, t_ptr,  # (P, N) outputs
    N, V, D, span, stride_h, stride_hp, stride_w,
    HAS_PREV: tl.constexpr, HAS_TARGET: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    v_start = split * span
    v_end = tl.minimum(v_start + span, V)

    m = tl.full((BLOCK_T,), _NEG_INIT, tl.float32)   # max a
    s = tl.zeros((BLOCK_T,), tl.float32)             # sum e^(a-m)
    u = tl.zeros((BLOCK_T,), tl.float32)             # sum e^(a-m) (a-m)
    arg = tl.zeros((BLOCK_T,), tl.int32)
    m_prev = tl.full((BLOCK_T,), _NEG_INIT, tl.float32)
    s_prev = tl.zeros((BLOCK_T,), tl.float32)
    k = tl.zeros((BLOCK_T,), tl.float32)             # sum e^(a-m) ((a-m) - (b-m_prev))
    k_rev = tl.zeros((BLOCK_T,), tl.float32)         # sum e^(b-m_prev) ((b-m_prev) - (a-m))
    t = tl.zeros((BLOCK_T,), tl.float32)             # target logit, if in this split
    if HAS_TARGET:
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)

    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        a = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
        b = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            d_ok = ds < D
            # W tile loaded transposed, (BLOCK_D, BLOCK_V); masked entries are 0.
            w = tl.load(w_ptr + cols.to(tl.int64)[None, :] * stride_w + ds[:, None],
                        mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            x = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_h + ds[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            a = tl.dot(x, w, a, input_precision="ieee")
            if HAS_PREV:
                xp = tl.load(hp_ptr + rows.to(tl.int64)[:, None] * stride_hp + ds[None, :],
                             mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                b = tl.dot(xp, w, b, input_precision="ieee")

        tile_max, tile_arg = tl.max(tl.where(col_ok[None, :], a, float("-inf")), axis=1,
                                    return_indices=True, return_indices_tie_break_left=True)
        m_new = tl.maximum(m, tile_max)
        arg = tl.where(tile_max > m, v0 + tile_arg, arg)  # strict: earlier tiles win ties
        shift = m - m_new                                  # <= 0
        alpha = tl.exp(shift)
        z = a - m_new[:, None]
        e = tl.where(col_ok[None, :], tl.exp(z), 0.0)
        if HAS_PREV:
            mb_new = tl.maximum(m_prev, tl.max(tl.where(col_ok[None, :], b, float("-inf")), axis=1))
            shift_prev = m_prev - mb_new
            zb = b - mb_new[:, None]
            eb = tl.where(col_ok[None, :], tl.exp(zb), 0.0)
            alpha_prev = tl.exp(shift_prev)
            k_rev = alpha_prev * (k_rev + s_prev * (shift_prev - shift)) + tl.sum(eb * (zb - z), axis=1)
            s_prev = alpha_prev * s_prev + tl.sum(eb, axis=1)
            k = alpha * (k + s * (shift - shift_prev)) + tl.sum(e * (z - zb), axis=1)
            m_prev = mb_new
        u = alpha * (u + s * shift) + tl.sum(e * z, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new
        if HAS_TARGET:
            t += tl.sum(tl.where(cols[None, :] == tgt[:, None], a, 0.0), axis=1)

    at = split * N + rows
    tl.store(m_ptr + at, m, mask=row_ok)
    tl.store(s_ptr + at, s, mask=row_ok)
    tl.store(u_ptr + at, u, mask=row_ok)
    tl.store(arg_ptr + at, arg, mask=row_ok)
    if HAS_PREV:
        tl.store(m_prev_ptr + at, m_prev, mask=row_ok)
        tl.store(s_prev_ptr + at, s_prev, mask=row_ok)
        tl.store(k_ptr + at, k, mask=row_ok)
        tl.store(k_rev_ptr + at, k_rev, mask=row_ok)
    if HAS_TARGET:
        tl.store(t_ptr + at, t, mask=row_ok)


def _default_blocks(device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_V, BLOCK_D). Small token blocks in the interpreter keep row masking exercised.

    On CUDA, 64 x 128 tiles with 8 warps hold both fp32 accumulators in registers: compiled offline
    for sm_90, bf16 uses 224 registers without spills; fp32 ("ieee") spills ~340 bytes.
    """
    return (64, 128, 32) if device.type == "cuda" else (16, 128, 32)


def _auto_splits(n_token_blocks: int, vocab_tiles: int, device: torch.device) -> int:
    """About 4 programs per streaming multiprocessor (1 'SM' off CUDA), at most one split per tile."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(triton.cdiv(4 * sms, n_token_blocks), vocab_tiles))


def readout_partials_triton(h: Tensor, W: Tensor, targets: Tensor | None = None, h_prev: Tensor | None = None,
                            *, splits: int | None = None, blocks: tuple[int, int, int] | None = None):
    """The kernel's per-split moments for h (N, d): (m, s, u, arg, (m_prev, s_prev, k, k_rev),
    target_logit), each (P, N) but target_logit (N,); the prev moments are None without h_prev and
    target_logit None without targets. recur_core.exits.readout.readout_stats_triton merges them
    into ReadoutStats (the fields are those of its ReadoutPartials).

    splits: number of vocabulary splits (default: enough programs to fill the GPU).
    blocks: (BLOCK_T, BLOCK_V, BLOCK_D), powers of two >= 16 (tl.dot's minimum).
    h and h_prev are cast to W's dtype (tl.dot needs equal operand dtypes).
    """
    N, D = h.shape
    V = W.shape[0]
    block_t, block_v, block_d = blocks or _default_blocks(h.device)
    W = W.contiguous()
    h = h.to(W.dtype).contiguous()
    hp = h if h_prev is None else h_prev.to(W.dtype).contiguous()
    tgt = h.new_empty(0, dtype=torch.int64) if targets is None else targets.to(torch.int64).contiguous()

    token_blocks = triton.cdiv(N, block_t)
    vocab_tiles = triton.cdiv(V, block_v)
    P = min(splits or _auto_splits(token_blocks, vocab_tiles, h.device), vocab_tiles)
    span = triton.cdiv(vocab_tiles, P) * block_v
    P = triton.cdiv(V, span)  # no empty split
    m, s, u, m_prev, s_prev, k, k_rev, t = torch.empty(8, P, N, dtype=torch.float32, device=h.device)
    arg = torch.empty(P, N, dtype=torch.int32, device=h.device)
    _readout_partials_kernel[(token_blocks, P)](
        h, hp, W, tgt, m, s, u, arg, m_prev, s_prev, k, k_rev, t,
        N, V, D, span, h.stride(0), hp.stride(0), W.stride(0),
        HAS_PREV=h_prev is not None, HAS_TARGET=targets is not None,
        BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_D=block_d, num_warps=8,
    )
    prev = (m_prev, s_prev, k, k_rev) if h_prev is not None else (None, None, None, None)
    return m, s, u, arg, prev, None if targets is None else t.sum(0)
