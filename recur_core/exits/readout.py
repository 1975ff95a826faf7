"""Per-token statistics of the readout distribution p = softmax(h @ W^T), without T x V logits.

After every loop i a looped LM has a final-normed hidden h_i (T, d) and shares the LM head W (V, d).
Analysis wants, per token and loop: log-sum-exp, cross-entropy of a target, entropy, argmax, top-1
probability, KL(p_i || p_{i-1}) and the reverse KL(p_{i-1} || p_i) (Huginn's exit criterion).
Materialising the (T, V) logits for every loop costs O(T * V)
memory, so the vocabulary is walked in slices instead and each slice is summarised by a few online
softmax moments (`ReadoutPartials`) that combine exactly (`combine_partials`).

Backends, all returning `ReadoutStats`:
  readout_stats_reference  materialises the float32 logits; the ground truth for tests.
  readout_stats_chunked    vectorised PyTorch over column chunks of W; peak memory O(T * chunk);
                           bfloat16 on a CPU multiplied by MKL into float32 (recur_core.kernels.cpu_gemm).
  readout_stats_triton     the fused kernel of recur_core.kernels.readout_triton (CUDA): h and h_prev
                           share each W tile, no logits leave the chip.
  readout_stats            picks one of these.
  readout_stats_sequence   the same for consecutive loops' hiddens (h_0, ..., h_G) at once, each
                           distribution's logits computed once (the tracer reads out loops in groups).

Conventions: all statistics are float32 and in nats, whatever the input dtype. A negative target id
(e.g. -1) means "no target"; ce is NaN there. h may be (T, d) or (B, T, d); outputs follow its
leading shape.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import os
import threading
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from ..kernels.cpu_gemm import bf16_matmul_nt, can_multiply

# Vocabulary ids per chunk: fewer, larger ops pay less thread-scheduling latency with 2 threads
# (the measurement is in docs/BENCHMARKS.md). Peak extra memory is ~3 * 2T * chunk floats.
DEFAULT_CHUNK = 8192
BACKENDS = ("auto", "chunked", "triton", "reference")
READOUT_ROWS = 512  # token rows the coda and head read out at once: loops are grouped up to this many


def readout_group(rows: int) -> int:
    """How many loops of a batch of `rows` token rows one readout call takes: enough to reach
    READOUT_ROWS (one loop at a time for a batch of 16 windows x 128 tokens, 16 loops of a 32-token
    text). At few rows every weight of the coda and the head is streamed from memory for a handful of
    multiplications; grouped, each is read once for hundreds (docs/benchmarks/fullsize.md). The
    tracer's readouts and a replayed decoding pass's (recur_core.decoding.decode) group by it."""
    return max(1, -(-READOUT_ROWS // max(rows, 1)))


@dataclass
class ReadoutStats:
    """Per-token statistics of p = softmax(h @ W^T); every tensor has h's leading shape (+ (k,)).

    lse        log-sum-exp of the logits.
    ce         -log p[target] in nats; NaN where target < 0; None without targets.
    entropy    -sum_v p log p in nats.
    argmax     int64 id of the largest logit (the lowest id on ties).
    top1_prob  p[argmax].
    kl_prev    KL(p_cur || p_prev) = sum_v p_cur (log p_cur - log p_prev) in nats, where p_prev is
               the distribution of h_prev; None without h_prev.
    kl_prev_reverse  KL(p_prev || p_cur) = sum_v p_prev (log p_prev - log p_cur) in nats, the
               direction of Huginn's KL exit; None without h_prev.
    topk_ids, topk_probs  (..., k) ids and probabilities of the k largest logits, descending;
               None when topk == 0.
    """

    lse: Tensor
    ce: Tensor | None
    entropy: Tensor
    argmax: Tensor
    top1_prob: Tensor
    kl_prev: Tensor | None = None
    topk_ids: Tensor | None = None
    topk_probs: Tensor | None = None
    kl_prev_reverse: Tensor | None = None

    def unflatten(self, lead: torch.Size) -> ReadoutStats:
        """Reshape every (N, ...) tensor to (*lead, ...)."""
        def reshape(t):
            return None if t is None else t.reshape(*lead, *t.shape[1:])
        return ReadoutStats(**{f.name: reshape(getattr(self, f.name)) for f in fields(self)})


def flatten_tokens(fn):
    """Let a backend written for h (N, d) accept any leading shape: flatten, call, reshape back."""
    @functools.wraps(fn)
    def wrapper(h: Tensor, W: Tensor, targets: Tensor | None = None, h_prev: Tensor | None = None,
                *args, **kwargs) -> ReadoutStats:
        _check_shapes(h, W, targets, h_prev)
        d = h.shape[-1]
        flat_targets = None if targets is None else targets.reshape(-1)
        flat_prev = None if h_prev is None else h_prev.reshape(-1, d)
        stats = fn(h.reshape(-1, d), W, flat_targets, flat_prev, *args, **kwargs)
        return stats.unflatten(h.shape[:-1])
    return wrapper


def _check_shapes(h, W, targets, h_prev):
    if W.dim() != 2 or h.shape[-1] != W.shape[1]:
        raise ValueError(f"h {tuple(h.shape)} and W {tuple(W.shape)} do not share the hidden dim")
    if h_prev is not None and h_prev.shape != h.shape:
        raise ValueError(f"h_prev {tuple(h_prev.shape)} differs from h {tuple(h.shape)}")
    if targets is not None and targets.shape != h.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match h's leading shape {tuple(h.shape[:-1])}")


def _check_topk(topk: int, vocab: int):
    if not 0 <= topk <= vocab:
        raise ValueError(f"topk must be in [0, {vocab}], got {topk}")


def _nan_where_ignored(ce: Tensor, targets: Tensor) -> Tensor:
    return ce.masked_fill(targets < 0, math.nan)


# --------------------------------------------------------------------------------------------------
# Reference: materialise the logits.

@flatten_tokens
def readout_stats_reference(h: Tensor, W: Tensor, targets: Tensor | None = None,
                            h_prev: Tensor | None = None, topk: int = 0) -> ReadoutStats:
    """Plain float32 computation on the full (N, V) logits. Obviously correct, O(N * V) memory."""
    _check_topk(topk, W.shape[0])
    Wf = W.float()
    logits = h.float() @ Wf.T
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    top1_logp, argmax = logp.max(dim=-1)
    stats = ReadoutStats(lse=torch.logsumexp(logits, dim=-1), ce=None,
                         entropy=-(p * logp).sum(-1), argmax=argmax, top1_prob=top1_logp.exp())
    if targets is not None:
        ce = -logp.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
        stats.ce = _nan_where_ignored(ce, targets)
    if h_prev is not None:
        logq = torch.log_softmax(h_prev.float() @ Wf.T, dim=-1)
        stats.kl_prev = (p * (logp - logq)).sum(-1)  # KL(p_cur || p_prev), nats
        stats.kl_prev_reverse = (logq.exp() * (logq - logp)).sum(-1)  # KL(p_prev || p_cur), nats
    if topk:
        top_logp, stats.topk_ids = logp.topk(topk, dim=-1)
        stats.topk_probs = top_logp.exp()
    return stats


# --------------------------------------------------------------------------------------------------
# Online-softmax moments of vocabulary slices, shared by the chunked and the Triton backends.

@dataclass
class ReadoutPartials:
    """Moments of P vocabulary slices, each tensor (P, N); slices are in ascending id order.

    For slice i and token n, with a the logits of h and b those of h_prev over the slice:
      m = max a          s = sum e^(a-m)          u = sum e^(a-m) (a-m)
      arg = global id of the first max of a
      m_prev = max b     s_prev = sum e^(b-m_prev)
      k = sum e^(a-m) ((a-m) - (b-m_prev))
      k_rev = sum e^(b-m_prev) ((b-m_prev) - (a-m))   (for the reverse KL)
    Keeping u and k relative to the maxima avoids the cancellation of lse - E_p[a] when logits are
    large (peaked distributions). The *_prev, k and k_rev fields are None without h_prev.
    """

    m: Tensor
    s: Tensor
    u: Tensor
    arg: Tensor
    m_prev: Tensor | None = None
    s_prev: Tensor | None = None
    k: Tensor | None = None
    k_rev: Tensor | None = None


def combine_partials(parts: ReadoutPartials, target_logit: Tensor | None = None,
                     targets: Tensor | None = None) -> ReadoutStats:
    """Merge the slices exactly and turn the moments into statistics.

    Moving slice i's moments from its max m_i to the global max m multiplies them by
    alpha_i = e^(m_i - m) and shifts the offsets: u_i -> u_i + s_i (m_i - m), likewise for k with
    both maxima. Then, with S, U, K the merged moments:
      lse = m + log S,  entropy = log S - U / S,  top1 = 1 / S,
      KL(p_cur || p_prev) = K / S - log S + log S_prev   (nats),
      KL(p_prev || p_cur) = K_rev / S_prev - log S_prev + log S, with K_rev merged like K, roles swapped.
    """
    m, first = parts.m.max(dim=0)  # first slice holding the max -> lowest id on ties
    shift = parts.m - m
    alpha = shift.exp()
    s = (alpha * parts.s).sum(0)
    u = (alpha * (parts.u + parts.s * shift)).sum(0)
    log_s = s.log()
    lse = m + log_s
    stats = ReadoutStats(lse=lse, ce=None, entropy=log_s - u / s,
                         argmax=parts.arg.gather(0, first[None]).squeeze(0).long(), top1_prob=s.reciprocal())
    if target_logit is not None:
        stats.ce = _nan_where_ignored(lse - target_logit, targets)
    if parts.k is not None:
        m_prev = parts.m_prev.amax(dim=0)
        shift_prev = parts.m_prev - m_prev
        s_prev = (shift_prev.exp() * parts.s_prev).sum(0)
        k = (alpha * (parts.k + parts.s * (shift - shift_prev))).sum(0)
        stats.kl_prev = k / s - log_s + s_prev.log()  # KL(p_cur || p_prev), nats
        if parts.k_rev is not None:
            k_rev = (shift_prev.exp() * (parts.k_rev + parts.s_prev * (shift_prev - shift))).sum(0)
            stats.kl_prev_reverse = k_rev / s_prev - s_prev.log() + log_s  # KL(p_prev || p_cur), nats
    return stats


# --------------------------------------------------------------------------------------------------
# Chunked PyTorch backend (CPU, or CUDA without Triton).

def _chunk_moments(z: Tensor, e: Tensor, scratch: Tensor | None, n: int, v0: int) -> tuple[Tensor, ...]:
    """Moments of one column chunk, as in ReadoutPartials, computed in place.

    z (S n, C) float32 holds the logits of S distributions, n rows each: one read out alone (S = 1,
    scratch None), or a sequence whose blocks 1 .. S - 1 are read out, each against the block before
    it. e and scratch are buffers of z's shape. Each pass covers all rows at once: few, large ops,
    on buffers reused across chunks. Returns (m, s, u, arg) of the read-out rows and, for a sequence,
    (m_prev, s_prev, k, k_rev).
    """
    first = 0 if scratch is None else n  # the read-out rows are z[first:]
    # max and argmax of the read-out rows in one pass (on a CPU argmax alone costs up to 10x amax, max ~5x)
    maxes, arg = z[first:].max(dim=1)
    if first:  # the previous distribution's rows need only their max
        maxes = torch.cat([z[:first].amax(dim=1), maxes])
    arg = arg + v0
    z.sub_(maxes[:, None])  # a - m per distribution: all <= 0
    sums = torch.exp(z, out=e).sum(dim=1)
    if scratch is not None:  # sum e_j z_{j-1} and sum e_{j-1} z_j over consecutive blocks j - 1, j
        cur_on_prev = torch.mul(z[:-n], e[n:], out=scratch).sum(dim=1)
        prev_on_cur = torch.mul(z[n:], e[:-n], out=scratch).sum(dim=1)
    dots = z.mul_(e).sum(dim=1)  # sum e^(a-m) (a-m); z is not read again
    m, s, u = maxes[first:], sums[first:], dots[first:]
    if scratch is None:
        return m, s, u, arg
    return m, s, u, arg, maxes[:-n], sums[:-n], u - cur_on_prev, dots[:-n] - prev_on_cur


_WORKSPACE = threading.local()
WORKSPACE_KEEP_BYTES = 256 << 20  # a thread keeps its readout buffers up to this size between calls


def _workspace(rows: int, numel: int, device: torch.device) -> Tensor:
    """A (rows, numel) float32 buffer on `device`, reused by the calling thread's later calls.

    A fresh buffer of this size is a new mapping on a CPU, and writing it first costs a page fault
    per 4 KiB page; reusing one pays that once (a 16-window trace ran 35-45% faster on a 2-core VM,
    docs/benchmarks/exact-harness.md). Per thread, so parallel batches (recur_core.analysis.parallel)
    never share one; buffers over WORKSPACE_KEEP_BYTES are not kept."""
    held = getattr(_WORKSPACE, "buffers", {})
    key = (device, torch.is_inference_mode_enabled())  # inference tensors stay in it
    buf = held.get(key)
    if buf is None or buf.numel() < rows * numel:
        buf = torch.empty(rows * numel, device=device)
        if buf.numel() * buf.element_size() <= WORKSPACE_KEEP_BYTES:
            _WORKSPACE.buffers = {**held, key: buf}
    return buf[:rows * numel].view(rows, numel)


def _target_logit(h: Tensor, W: Tensor, targets: Tensor) -> Tensor:
    """h . W[target] in float32 (ignored targets read row 0; combine_partials masks them)."""
    return torch.einsum("nd,nd->n", h.float(), W[targets.clamp(min=0)].float())


def _merge_topk(vals: list[Tensor], ids: list[Tensor], k: int) -> tuple[Tensor, Tensor]:
    top_vals, pos = torch.cat(vals, dim=1).topk(k, dim=1)
    return top_vals, torch.cat(ids, dim=1).gather(1, pos)


@flatten_tokens
def readout_stats_chunked(h: Tensor, W: Tensor, targets: Tensor | None = None,
                          h_prev: Tensor | None = None, topk: int = 0,
                          chunk: int = DEFAULT_CHUNK) -> ReadoutStats:
    """Walk W in chunks of `chunk` rows (vocabulary ids); extra memory ~ 3 R chunk floats (R = N, or
    2N with h_prev: both are multiplied by each W chunk at once, into reused buffers). See
    `_chunked_blocks` for the arithmetic."""
    if h_prev is None:
        return _chunked_blocks(h[None], W, targets, topk, chunk)
    return _chunked_blocks(torch.stack([h_prev, h]), W, targets, topk, chunk)


def _chunked_blocks(blocks: Tensor, W: Tensor, targets: Tensor | None, topk: int, chunk: int) -> ReadoutStats:
    """ReadoutStats of blocks (S, N, d): of block 0 alone (S = 1), or of blocks 1 .. S - 1 each against
    the block before it ((S - 1) N rows, targets (S - 1) N).

    bfloat16 h and W on a CPU are multiplied by MKL into float32 (recur_core.kernels.cpu_gemm); other
    inputs are upcast to float32 chunk by chunk. Either way the logits are float32 products of the
    stored values, as accurate as the float32 reference. Top-k keeps the k best logits of every chunk
    and merges them at the end.
    """
    S, n, d = blocks.shape
    V = W.shape[0]
    _check_topk(topk, V)
    first = n if S > 1 else 0
    x = blocks.reshape(S * n, d)
    mkl = can_multiply(x, W)
    x = x if mkl else x.float()
    chunk = min(chunk, V)
    logits_buf, e_buf, *scratch = _workspace(3 if S > 1 else 2, x.shape[0] * chunk, x.device)
    moments, top_vals, top_ids = [], [], []
    for v0 in range(0, V, chunk):
        W_chunk = W[v0:v0 + chunk]
        c = W_chunk.shape[0]
        logits = logits_buf[:x.shape[0] * c].view(-1, c)
        if mkl:
            bf16_matmul_nt(x, W_chunk, logits)
        else:
            torch.mm(x, W_chunk.float().T, out=logits)
        if topk:
            vals, ids = logits[first:].topk(min(topk, c), dim=1)
            top_vals.append(vals)
            top_ids.append(ids + v0)
        moments.append(_chunk_moments(logits, e_buf[:logits.numel()].view(-1, c),
                                      scratch[0][:(S - 1) * n * c].view(-1, c) if scratch else None, n, v0))
    parts = ReadoutPartials(*(torch.stack(field) for field in zip(*moments, strict=True)))
    target_logit = None if targets is None else _target_logit(x[first:], W, targets)
    stats = combine_partials(parts, target_logit, targets)
    if topk:
        vals, stats.topk_ids = _merge_topk(top_vals, top_ids, topk)
        stats.topk_probs = (vals - stats.lse[:, None]).exp()
    return stats


def readout_stats_sequence(hs: Tensor, W: Tensor, targets: Tensor | None = None, topk: int = 0,
                           backend: str | None = None) -> ReadoutStats:
    """Statistics of the distributions of hs[1], ..., hs[S - 1], each with its KLs against the one
    before it (kl_prev = KL(p_j || p_{j-1})): hs (S, ..., d), S >= 2, consecutive hiddens, e.g. of
    the same tokens after loops i - 1, i, ..., i + S - 2; targets (...) shared by every element. The
    result has leading shape (S - 1, ...). What S - 1 calls of readout_stats(hs[j], W, targets,
    hs[j - 1]) return, but the chunked backend computes each distribution's logits once, not twice.
    backend: as in readout_stats (the Triton kernel reads both hiddens of each pair)."""
    if hs.dim() < 3 or hs.shape[0] < 2:
        raise ValueError(f"hs must be (S >= 2, ..., d), got {tuple(hs.shape)}")
    lead = hs.shape[1:-1]
    repeated = None if targets is None else targets.expand(hs.shape[0] - 1, *lead)
    backend = _backend(backend, hs, topk)
    if backend != "chunked":
        return readout_stats(hs[1:], W, repeated, hs[:-1], topk=topk, backend=backend)
    _check_shapes(hs[0], W, targets, None)
    blocks = hs.reshape(hs.shape[0], -1, hs.shape[-1])
    flat = None if repeated is None else repeated.reshape(-1)
    return _chunked_blocks(blocks, W, flat, topk, DEFAULT_CHUNK).unflatten(torch.Size((hs.shape[0] - 1, *lead)))


# --------------------------------------------------------------------------------------------------
# Dispatch.

@flatten_tokens
def readout_stats_triton(h: Tensor, W: Tensor, targets: Tensor | None = None, h_prev: Tensor | None = None,
                         *, splits: int | None = None, blocks: tuple[int, int, int] | None = None) -> ReadoutStats:
    """ReadoutStats by the fused Triton kernel (recur_core.kernels.readout_triton; CUDA, or CPU
    under TRITON_INTERPRET=1): its per-split moments merged by combine_partials. splits / blocks:
    the kernel's vocabulary splits and tile sizes (defaults fill the device)."""
    from ..kernels.readout_triton import readout_partials_triton
    m, s, u, arg, prev, target_logit = readout_partials_triton(h, W, targets, h_prev, splits=splits, blocks=blocks)
    return combine_partials(ReadoutPartials(m, s, u, arg, *prev), target_logit, targets)


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _backend(backend: str | None, h: Tensor, topk: int) -> str:
    """The backend readout_stats runs for `backend` (None: $RECUR_READOUT_BACKEND or "auto")."""
    backend = backend or os.environ.get("RECUR_READOUT_BACKEND", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if h.is_cuda and topk == 0 and _triton_available() else "chunked"
    return backend


def readout_stats(h: Tensor, W: Tensor, targets: Tensor | None = None, h_prev: Tensor | None = None,
                  topk: int = 0, backend: str | None = None) -> ReadoutStats:
    """Readout statistics through the best available backend.

    backend: "auto" (default, overridable by the RECUR_READOUT_BACKEND environment variable) picks
    the Triton kernel for CUDA tensors when triton is installed and topk == 0 (the kernel has no
    top-k), else the chunked path. "chunked", "triton" and "reference" force one.
    """
    backend = _backend(backend, h, topk)
    if backend == "reference":
        return readout_stats_reference(h, W, targets, h_prev, topk=topk)
    if backend == "chunked":
        return readout_stats_chunked(h, W, targets, h_prev, topk=topk)
    if topk:
        raise ValueError("the triton backend computes no top-k; use backend='chunked' for topk > 0")
    return readout_stats_triton(h, W, targets, h_prev)
