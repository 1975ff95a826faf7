"""The per-loop signals an exit policy reads, computed in one place for every caller: the tracer
(recur_core.analysis.trace), the exact harness, batch-1 / lockstep decoding and the pool.

After loop i a token has a core state s_i and, where the caller reads out, a distribution
p_i = softmax(coda(s_i) W^T). Loop 1 is measured against the initial noise state s_0 and its readout
p_0. Every KL is in nats; kl_prev is KL(p_i || p_{i-1}) (A1's direction), kl_prev_reverse is
KL(p_{i-1} || p_i) (Huginn's).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .readout import ReadoutStats, readout_stats_sequence


@dataclass
class LoopSignals:
    """Per-token signals after loop i, each of leading shape (B, T).

    state         (B, T, d) core state s_i.
    state_change  ||s_i - s_{i-1}|| / ||s_i|| (at loop 1, s_0 is the initial noise state).
    kl_prev       KL(p_i || p_{i-1}) in nats (at loop 1, p_0 is the readout of the noise state);
                  None when the caller skipped the readout (policies with needs_readout False).
                  NaN never halts.
    kl_prev_reverse, entropy, argmax   KL(p_{i-1} || p_i) in nats, H(p_i) in nats, argmax of p_i;
                  None without the readout.
    cosine_change 1 - cos(s_i, s_{i-1}); None when the caller did not compute it.
    state_step    ||s_i - s_{i-1}||, the state's step size (absolute; Accel's delta_i); None when not computed.
    state_norm    ||s_i||, the hidden-state norm; None when not computed.
    margin        log p_i(top 1) - log p_i(top 2), the top-1 - top-2 logit margin in nats; None without
                  the readout (or, from readout_stats, without its top-2).
    """

    state: torch.Tensor
    state_change: torch.Tensor
    kl_prev: torch.Tensor | None = None
    kl_prev_reverse: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    cosine_change: torch.Tensor | None = None
    state_step: torch.Tensor | None = None
    state_norm: torch.Tensor | None = None
    margin: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.state_change.shape

    @classmethod
    def of_states(cls, new: Tensor, old: Tensor, **readout) -> LoopSignals:
        """The state signals of a loop from the states after / before it, plus readout fields
        (`readout_fields` / `readout_signals`) where the caller read out."""
        return cls(state=new, **state_signals(new, old), **readout)


def state_signals(new: Tensor, old: Tensor) -> dict[str, Tensor]:
    """The state fields of LoopSignals from the states after / before a loop, float32 (L2 over the
    model dim): every caller (tracer, harness, decoder, pool) builds them here, so a rule reads the
    same values on the fast and the online face."""
    new, old = new.float(), old.float()
    return {"state_change": relative_change(new, old), "cosine_change": cosine_change(new, old),
            "state_step": (new - old).norm(dim=-1), "state_norm": new.norm(dim=-1)}


def relative_change(new: Tensor, old: Tensor) -> Tensor:
    """||new - old|| / ||new|| per token (L2 over the model dim), float32."""
    new, old = new.float(), old.float()
    return (new - old).norm(dim=-1) / new.norm(dim=-1).clamp_min(1e-30)


def cosine_change(new: Tensor, old: Tensor) -> Tensor:
    """1 - cos(new, old) per token (over the model dim), float32."""
    return 1 - torch.nn.functional.cosine_similarity(new.float(), old.float(), dim=-1, eps=1e-30)


def loops_readout(model, states: list[Tensor], h_prev: Tensor | None, targets: Tensor | None, topk: int = 0):
    """The readout of several consecutive loops' states (each (B, T, d)) through the model's coda and
    head, in one coda call and one pass over the head: (the last state's hidden, ReadoutStats of
    leading shape (G, B, T)), each loop against the one before it: kl_prev = KL(p_cur || p_prev) and
    kl_prev_reverse = KL(p_prev || p_cur) in nats, clamped at 0 (they are >= 0; float rounding can dip
    below). h_prev: the hidden of the state before states[0], or None: then
    states[0] is that state and G = len(states) - 1 (else G = len(states))."""
    hs = model.coda(torch.cat(states)).unflatten(0, (len(states), states[0].shape[0]))
    if h_prev is not None:
        hs = torch.cat([h_prev[None], hs])
    return hs[-1], _clamped(readout_stats_sequence(hs, model.head_weight, targets, topk=topk))


def _clamped(stats: ReadoutStats) -> ReadoutStats:
    stats.kl_prev = stats.kl_prev.clamp_min(0.0)
    stats.kl_prev_reverse = stats.kl_prev_reverse.clamp_min(0.0)
    return stats


def readout_fields(stats: ReadoutStats) -> dict[str, Tensor]:
    """The LoopSignals fields of a readout computed by readout_stats: the KLs (clamped at 0) where it had an
    h_prev, the margin where the stats hold a top-2."""
    fields = {"entropy": stats.entropy, "argmax": stats.argmax}
    if stats.kl_prev is not None:
        fields["kl_prev"] = stats.kl_prev.clamp_min(0.0)
        fields["kl_prev_reverse"] = stats.kl_prev_reverse.clamp_min(0.0)
    if stats.topk_probs is not None and stats.topk_probs.shape[-1] >= 2:
        fields["margin"] = top2_margin(stats.topk_probs)
    return fields


def top2_margin(topk_probs):
    """log p(top 1) - log p(top 2) from descending top-k probabilities (..., k >= 2); torch or numpy."""
    log = torch.log if isinstance(topk_probs, Tensor) else np.log
    return log(topk_probs[..., 0]) - log(topk_probs[..., 1])


KL_FIELDS = frozenset({"kl_prev", "kl_prev_reverse"})  # the readout fields that need the previous readout
READOUT_FIELDS = KL_FIELDS | {"entropy", "argmax", "margin"}


def readout_signals(logp: Tensor, logp_prev: Tensor, fields: frozenset[str] = READOUT_FIELDS) -> dict[str, Tensor]:
    """The LoopSignals readout `fields` (a policy's `readout_fields`; each one more pass over the
    vocabulary) from log-probabilities of this and the previous readout (decoding has the logits
    already): kl_prev = KL(p || p_prev) and kl_prev_reverse = KL(p_prev || p) in nats per token, clamped
    at 0 (float rounding); entropy (nats), argmax and the top-2 margin of p."""
    out = {}
    if "kl_prev" in fields or "entropy" in fields:
        p = logp.exp()
    if "kl_prev" in fields:
        out["kl_prev"] = (p * (logp - logp_prev)).sum(-1).clamp_min(0.0)
    if "kl_prev_reverse" in fields:
        out["kl_prev_reverse"] = (logp_prev.exp() * (logp_prev - logp)).sum(-1).clamp_min(0.0)
    if "entropy" in fields:
        out["entropy"] = -(p * logp).sum(-1)
    if "argmax" in fields:
        out["argmax"] = logp.argmax(-1)
    if "margin" in fields:
        top = logp.topk(2, dim=-1).values
        out["margin"] = top[..., 0] - top[..., 1]
    return out
