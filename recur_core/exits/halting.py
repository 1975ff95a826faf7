"""The halting contract, written once for every run that halts tokens loop by loop. Who takes which part:

  * the exact harness (recur_core.analysis.harness): `start_loops`, `HaltSchedule.met` (one schedule
    per policy; a remembering rule recalls each lane's memory) and a `Freezing` per lane (numpy);
  * the lockstep Decoder (recur_core.decoding.decode), hence the fixed point and teacher-forced
    decoding built on it: `read_start` for p_0, the schedule's readouts and `consult`, and a
    `Freezing` for its prefill and for B > 1 rows of its step (a batch-1 step stops at `halt`);
  * the pool (recur_core.decoding.serve): `read_start`, the schedule (`halt`, or `halt_at` for
    tokens at different loops in one call) and a `Freezing` per prompt chunk (a decoded token is
    one row: it leaves at its halt);
  * the tracer (recur_core.analysis.trace) halts nothing: it reads p_0 here (`start_loops`).

How they batch (lanes, lockstep rows, a pool's mixed loops) stays theirs; the order of a loop is this one:

  0. before loop 1 the state is `model.start_state(noise, e)`, and p_0 is its readout (`read_start`):
     the tracer reads it out always, the harness for a readout policy, a decoder where the
     schedule's first readout (`HaltSchedule.first_readout`: check_every loops before the first
     time it asks) is loop 0;
  1. the core step: new = core_step(old), frozen tokens keeping their state;
  2. the signals of the loop: the state signals of (new, old), the readout signals where the
     schedule reads out (`HaltSchedule.wants_readout`);
  3. the consultation: the policy where the schedule asks it (`HaltSchedule.asks`: at its checks,
     min_loops (FIRST_CHECK for A1) and then every check_every loops; a rule that remembers earlier
     loops, checked every loop, at every loop from 1, so its memory starts at loop 1 in every caller,
     as on its fast face): `HaltSchedule.consult` for the decoders, which skip the cap's loop,
     `HaltSchedule.met` (the rule alone, the cap's loop included) for the exact harness;
  4. the freezing (`Freezing.update`): a live token whose rule is met halts after this loop; at the
     cap = min(policy.r_max, loops available) every live token halts; a halted token's exit depth
     is this loop, and it counts as converged only where its rule was met.

Not through it: training's per-token depths (`LoopedLM.forward(..., token_loops)`). recur_core.model
may not import recur_core.exits (tests/test_layering.py), and that path has nothing to consult: each
token's depth is drawn before the run, and its gradients flow through its own last k loops, which no
run here keeps. It freezes as step 4 does (a token past its depth keeps its state, and later tokens
read its keys at that exit state); tests/test_per_token_depth.py checks it against the exact harness
halting each token at the same depth.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from ..model.looped_lm import LoopedLM
from .policies import Policy
from .signals import LoopSignals, state_signals


def start_loops(model: LoopedLM, inputs: torch.Tensor, noise: torch.Tensor, read_out: bool):
    """(e, s_0, h_0) of windows before loop 1: the prelude's e, the initial state (the noise, or e on
    a model without one: Ouro) and, when read_out, p_0's hidden (`read_start`)."""
    e = model.prelude(inputs)
    state = model.start_state(noise.to(inputs.device), e)
    return e, state, read_start(model, state) if read_out else None


def read_start(model: LoopedLM, state: Tensor, positions: Tensor | None = None, kv=None) -> Tensor:
    """p_0's hidden, the one readout of the initial state s_0 (step 0 of the module doc) that every
    caller takes (the tracer and the harness through `start_loops`, the decoders' step and prefill,
    the pool): the coda and final norm of s_0, whose LM-head readout p_0 is what loop 1's kl_prev
    compares p_1 with. Decoding passes its cache views (kv at positions)."""
    return model.coda(state, positions, kv)


class HaltSchedule:
    """When a policy is consulted and read out, and its halt decision (steps 2-4 of the module doc),
    for one run: a policy that remembers earlier loops gets its own memory (`Policy.private`).

    The policy is consulted at min_loops, then every check_every loops; every token halts at the
    cap = min(policy.r_max, max_loops). Readout policies (A1) read out at each check and once
    before the first (loop min_loops - check_every, 0 = the initial state), so kl_prev is
    KL(p_i || p_{i - check_every}) in nats.
    """

    def __init__(self, policy: Policy, max_loops: int, check_every: int = 1):
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.policy, self.every = policy.private(), check_every
        self.cap = policy.cap(max_loops)
        self.min_loops = policy.min_loops
        # a rule that remembers earlier loops, checked every loop, is asked from loop 1: its memory
        # covers the loops before min_loops, as its fast face (`Policy.exits`) reads them
        self.first_ask = 1 if policy.remembers_loops and check_every == 1 else self.min_loops
        self.needs_readout, self.readout_fields = policy.needs_readout, policy.readout_fields
        self.first_readout = max(0, self.first_ask - check_every) if self.needs_readout else None
        # one `halt_at` call can decide tokens at different loops: the policy takes a tensor of
        # loops, is consulted every loop and needs no readout
        self.per_token_loops = policy.per_token_loops and check_every == 1 and not self.needs_readout

    def is_check(self, loop: int) -> bool:
        """Whether a token may halt by its rule after `loop` (from min_loops, every check_every loops)."""
        return loop >= self.min_loops and (loop - self.min_loops) % self.every == 0

    def asks(self, loop: int) -> bool:
        """Whether the policy is asked after `loop`: at its checks, and a remembering rule checked
        every loop at every loop from 1 (its answer before min_loops is False, its memory kept)."""
        return loop >= self.first_ask and (loop - self.first_ask) % self.every == 0

    def at_cap(self, loop: int) -> bool:
        return loop >= self.cap

    def wants_readout(self, loop: int) -> bool:
        return self.first_readout is not None and (loop == self.first_readout or self.asks(loop))

    def met(self, loop: int, signals: LoopSignals) -> Tensor:
        """Where the policy's own rule holds after `loop` (bool, signals.shape): the one halt decision
        of every caller. False where the policy is not asked (`asks`) and, from the policy itself,
        before min_loops."""
        if not self.asks(loop):
            return torch.zeros(signals.shape, dtype=torch.bool, device=signals.state_change.device)
        return self.policy.rule_met(loop, signals)

    def consult(self, loop: int, new: Tensor, old: Tensor, readout: dict | None, states: dict | None = None) -> Tensor:
        """The policy's halt decision (`Policy.halt`) at a check before the cap, from the states before /
        after the loop, the readout signals (`readout_signals`, None without a readout at this loop)
        and states: `state_signals(new, old)` when the caller has them already (they are computed only
        at a check); False elsewhere. A decoder does not consult the policy at the cap, where every
        token halts anyway (so no token counts as converged there; the exact harness asks `met`)."""
        if self.at_cap(loop) or not self.asks(loop):
            return torch.zeros(new.shape[:2], dtype=torch.bool, device=new.device)
        states = state_signals(new, old) if states is None else states
        return self.policy.halt(loop, LoopSignals(state=new, **states, **(readout or {})))

    def halt(self, loop: int, new: Tensor, old: Tensor, readout: dict | None, states: dict | None = None) -> Tensor:
        """The halt decision after `loop` (bool (B, T)): every token at the cap, else `consult`."""
        if self.at_cap(loop):
            return torch.ones(new.shape[:2], dtype=torch.bool, device=new.device)
        return self.consult(loop, new, old, readout, states)

    def halt_at(self, loops: Tensor, new: Tensor, states: dict) -> Tensor:
        """The halt decision of tokens each after its own loop (loops: LongTensor (B, T)), in one
        policy call (the pool's step; requires per_token_loops); states: `state_signals` of them."""
        stop = self.policy.halt(loops, LoopSignals(state=new, **states))
        return stop | (loops >= self.cap)


@dataclass
class Freezing:
    """Which tokens have halted (frozen), after which loop (exit_depth; 0 while live), and whether
    their rule halted them (converged) rather than the cap: torch tensors or numpy arrays of one
    shape. `update` rebinds the fields and never writes into them, so `copy` is cheap and a copy
    (an exact-harness lane that splits) never sees its twin's later loops."""

    frozen: Tensor | np.ndarray
    exit_depth: Tensor | np.ndarray
    converged: Tensor | np.ndarray

    @classmethod
    def start(cls, shape, device=None) -> Freezing:
        """Nothing halted yet, as torch tensors (on device), or numpy arrays when device is "numpy"."""
        if device == "numpy":
            return cls(np.zeros(shape, bool), np.zeros(shape, np.int64), np.zeros(shape, bool))
        frozen = torch.zeros(shape, dtype=torch.bool, device=device)
        return cls(frozen, torch.zeros(shape, dtype=torch.long, device=device), frozen.clone())

    @property
    def live(self):
        return ~self.frozen

    def copy(self) -> Freezing:
        return replace(self)

    def update(self, loop: int, met, at_cap: bool):
        """Freeze after `loop` the live tokens whose rule is `met` (bool, this shape), and at the cap
        every live token; returns the tokens halted now."""
        met = met & self.live
        halt = self.live if at_cap else met
        where = torch.where if isinstance(halt, Tensor) else np.where
        self.exit_depth = where(halt, loop, self.exit_depth)
        self.converged = self.converged | met
        self.frozen = self.frozen | halt
        return halt
