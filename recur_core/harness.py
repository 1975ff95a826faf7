"""Exact evaluation of a policy: the paper's masking harness.

Every window runs loop by loop up to the policy's cap. After each loop the policy sees that loop's
signals and decides which tokens halt; halted tokens are frozen (their state is kept bit-for-bit)
while the other tokens keep looping and still attend to the frozen states. When every token has
halted, the final states are read out once (coda + head, with each token attending to the others'
final states) and scored. No compute is saved; this measures what the policy's outputs would be.

This differs from the fast path (a token scored at its exit loop in the uniform run) in two ways:
later tokens see frozen rather than still-updated context, and the coda reads the final states of
the whole window. `analysis.fast_vs_exact` reports the gap.

Inputs and noise follow recur_core.trace: windows (N, T + 1) or one text (T,), and window n's noise
seeded by noise_seed(seed, n), so the exact and fast paths start from identical states.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .checkpoint import Checkpoint
from .model import LoopedLM
from .policies import LoopSignals, Policy
from .readout import readout_stats
from .trace import (NO_TARGET, cosine_change, loop_readout, progress_bar, relative_change, resolve_model, split_inputs,
                    window_noise)


@dataclass
class ExactResult:
    """Per-token outcome: ce (N, T) of the final readout (NaN without target), exit_depth (N, T)
    the loop after which each token froze, converged (N, T) False where only the cap stopped it."""

    ce: np.ndarray
    exit_depth: np.ndarray
    converged: np.ndarray
    targets: np.ndarray

    @property
    def has_target(self) -> np.ndarray:
        return self.targets != NO_TARGET


def run_exact(ckpt_or_model: Checkpoint | LoopedLM, ids, policy: Policy, max_loops: int, seed: int = 0, *,
              batch_size: int = 16, progress=None) -> ExactResult:
    """Evaluate `policy` exactly on windows (N, T + 1) or a text (T,) with a budget of max_loops."""
    model, _ = resolve_model(ckpt_or_model)
    inputs, targets = split_inputs(ids)
    N, T = inputs.shape
    cap = policy.cap(max_loops)
    update, close = progress_bar(progress, N, f"exact {policy}")
    parts = []
    try:
        for start in range(0, N, batch_size):
            rows = range(start, min(start + batch_size, N))
            parts.append(_exact_batch(model, inputs[start:rows.stop], targets[start:rows.stop],
                                      window_noise(model, rows, T, seed), policy, cap))
            update(len(rows))
    finally:
        close()
    ce, depth, converged = (torch.cat(p).numpy() for p in zip(*parts))
    return ExactResult(ce, depth, converged, targets.numpy())


@torch.inference_mode()
def _exact_batch(model: LoopedLM, inputs, targets, noise, policy: Policy, cap: int):
    device = next(model.parameters()).device
    inputs, targets = inputs.to(device), targets.to(device)
    e = model.prelude(inputs)
    state = noise.to(device)
    h_prev = model.coda(state) if policy.needs_readout else None  # p_0: readout of the noise state
    frozen = torch.zeros(inputs.shape, dtype=torch.bool, device=device)
    exit_depth = torch.full(inputs.shape, cap, dtype=torch.long, device=device)
    converged = torch.zeros_like(frozen)
    for loop in range(1, cap + 1):
        new = model.core_step(state, e, freeze=frozen)
        signals = LoopSignals(state=new, state_change=relative_change(new, state),
                              cosine_change=cosine_change(new, state))
        if policy.needs_readout:
            h_prev, stats = loop_readout(model, new, h_prev, None)
            signals.kl_prev, signals.kl_prev_reverse = stats.kl_prev, stats.kl_prev_reverse
            signals.entropy, signals.argmax = stats.entropy, stats.argmax
        met = policy.rule_met(loop, signals) & ~frozen
        halt = met | ~frozen if loop == cap else met
        exit_depth[halt] = loop
        converged |= met
        frozen |= halt
        state = new
        if frozen.all():
            break
    ce = readout_stats(model.coda(state), model.head_weight, targets).ce
    return ce.cpu(), exit_depth.cpu(), converged.cpu()

