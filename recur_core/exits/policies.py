"""Depth-allocation policies: when does a token stop looping?

Every policy is one class with two faces that share the same rule:

  halt(loop, signals)  the online rule, for the exact masking harness and for decoding. Called after
                       loop `loop` (1-based) with that loop's per-token `LoopSignals`; returns a bool
                       (B, T) tensor, True = freeze this token now (its exit depth is `loop`).
  exits(trace)         the fast path: the exit loop of every token read off a cached uniform-depth
                       `Trace` (the first loop at which the rule holds), without running the model.

Common options: `min_loops` (the rule is not consulted before this loop) and `r_max` (every token
halts at r_max at the latest; None = the number of loops available, i.e. the trace's max_loops or
the harness's loop budget). A token that never meets its rule exits at that cap and is reported as
not converged.

  Uniform(r)               A0: every token gets exactly r loops.
  ConvergenceExit(eps)     A1: halt once kl_prev = KL(p_i || p_{i-1}) < eps; first checked at loop 2.
  LinearRouter(probe, tau) A2: halt once the probe's predicted chance of change is below tau.
  LatentDiff(delta)        Huginn's latent rule: halt once ||s_i - s_{i-1}|| / ||s_i|| < delta.

Huginn's other exit criteria (seal-rg/recurrent-pretraining's exit evaluators), for a side-by-side
comparison on the same tokens (defaults: Huginn's "auto" thresholds):
  ReverseKLExit(eps)       halt once KL(p_{i-1} || p_i) < eps: Huginn's KL, the *reverse* of A1's
                           KL(p_i || p_{i-1}) (Huginn starts p_0 uniform; here p_0 is the readout
                           of the initial state, as for A1).
  EntropyDiff(delta)       halt once |H(p_i) - H(p_{i-1})| < delta (nats); never at loop 1
                           (Huginn's previous entropy starts at 100 nats).
  ArgmaxStable(n)          halt once the argmax has not changed for n loops in a row (loop 1 has a
                           run of 0; the earliest exit is loop n + 1).
  CosineExit(delta)        halt once 1 - cos(s_i, s_{i-1}) < delta.

The second-order step-size exit (arXiv 2509.23314):
  Accel(tau)               halt once |delta_i - delta_{i-1}| < tau, delta_i = ||s_i - s_{i-1}|| the
                           state's step size (absolute, the paper's form; no relative form is
                           offered); never at loop 1 (there is no delta_0).

A sufficient-condition exit (arXiv 2608.18222):
  CertifiedExit(L)         halt once 2 L * delta_i rho / (1 - rho) < the top-1 - top-2 logit margin,
                           rho = delta_i / delta_{i-1}, L a measured Lipschitz bound of the readout.

A model trained with a learned exit gate (Ouro, recur_core.model.ouro):
  GateExit(q, gate)        Ouro's Q-exit: halt at the first loop whose exit CDF
                           1 - prod_{j<=i} (1 - lambda_j) is >= q, lambda_j = the gate's per-token
                           exit probability after loop j; may halt at loop 1.
                           GateExit.of_checkpoint(ckpt, q): a checkpoint's gate, capped at its
                           trained steps, q in (0, 1) (what decoding with Ouro takes).
EntropyDiff, Accel, ArgmaxStable, CertifiedExit and GateExit compare with earlier loops: their online face remembers the values of
its previous call (reset at loop 1), so it must be consulted at every loop (check_every 1; every
halting run then asks it from loop 1, before its min_loops too: `HaltSchedule.asks`); a call
that skips loops starts a new run.

`readout_fields` names the readout signals the rule reads (A1: kl_prev); `needs_readout` (some field)
says whether it needs the coda and LM head at every loop: A1 and Huginn's readout criteria do (A2's
probe reads the core state directly). A decoder computes only the fields its policy names.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from .signals import READOUT_FIELDS, LoopSignals

if TYPE_CHECKING:
    from .trace_type import Trace


@dataclass
class Exits:
    """Fast-path result: `depth` (N, T) int exit loop in 1..cap; `converged` (N, T) bool, False
    where the rule never held and the token was stopped by the cap."""

    depth: np.ndarray
    converged: np.ndarray


class RouterProbe(Protocol):
    """What LinearRouter needs from a probe (recur_core.analysis.probe.Probe implements it)."""

    probe_id: str

    def chance(self, state: torch.Tensor, loop) -> torch.Tensor: ...  # loop: an int or a tensor of loops


class Policy:
    """Base class: subclasses define `_rule_online` and `_rule_trace`; min_loops / r_max live here."""

    readout_fields: frozenset[str] = frozenset()  # the LoopSignals readout fields the rule reads
    needs_readout: bool = False  # some readout field: set from readout_fields (__init_subclass__)
    needs_margin: bool = False  # the rule reads the top-1 - top-2 margin (the readout's top-2)
    remembers_loops: bool = False  # the rule keeps memory of earlier loops per batch row (see _Remembering)
    per_token_loops: bool = False  # the online rule takes a tensor of loops, one per token (see halt)
    threshold_name: str = ""
    signal_floor: float | None = None  # a "signal < threshold" rule's signal is never below this (None: unknown)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        unknown = cls.readout_fields - READOUT_FIELDS
        if unknown:
            raise TypeError(f"{cls.__name__}.readout_fields names no readout signal: {sorted(unknown)}")
        cls.needs_readout, cls.needs_margin = bool(cls.readout_fields), "margin" in cls.readout_fields

    def __init__(self, min_loops: int = 1, r_max: int | None = None):
        if min_loops < 1:
            raise ValueError(f"min_loops must be >= 1, got {min_loops}")
        if r_max is not None and r_max < min_loops:
            raise ValueError(f"r_max {r_max} is below min_loops {min_loops}")
        self.min_loops, self.r_max = min_loops, r_max

    @property
    def threshold(self) -> float:
        return getattr(self, self.threshold_name)

    @property
    def never_halts(self) -> bool:
        """The rule can never hold (its threshold at or below its signal's floor, e.g. A1 at ε = 0): every
        token runs to the cap, which is A0 at the cap."""
        return self.signal_floor is not None and self.threshold <= self.signal_floor

    @property
    def rule_key(self) -> str:
        """Equal keys halt the same tokens on the same run (the harness evaluates such policies once)."""
        return repr(self)

    def private(self) -> "Policy":
        """The policy for one run of its own (one sequence, one batch): itself, or for a rule that
        remembers earlier loops a copy with empty memory, so runs that interleave or go on in
        parallel never read each other's loops."""
        return self

    def cap(self, available_loops: int) -> int:
        """The loop at which every token halts, given how many loops can be run."""
        if self.min_loops > available_loops:
            raise ValueError(f"{self}: min_loops {self.min_loops} exceeds the {available_loops} loops available")
        return available_loops if self.r_max is None else min(self.r_max, available_loops)

    # -- online -------------------------------------------------------------------------
    def halt(self, loop, signals: LoopSignals) -> torch.Tensor:
        """True where a token should freeze after `loop` (1-based): the rule holds, or loop has
        reached r_max. Callers also stop every token at their own loop budget. loop: an int, or
        (policies with per_token_loops) a LongTensor broadcastable to signals.shape when the tokens
        sit at different loops (the pool's step)."""
        if isinstance(loop, torch.Tensor):
            met = self.rule_met(loop, signals)
            return met if self.r_max is None else met | (loop >= self.r_max)
        if self.r_max is not None and loop >= self.r_max:
            return torch.ones(signals.shape, dtype=torch.bool, device=signals.state_change.device)
        return self.rule_met(loop, signals)

    def rule_met(self, loop, signals: LoopSignals) -> torch.Tensor:
        """True where the policy's own rule holds after `loop` (never before min_loops); unlike
        halt, r_max does not force it, so it tells a converged token from a capped one."""
        if isinstance(loop, torch.Tensor):
            return self._rule_online(loop, signals) & (loop >= self.min_loops)
        if loop < self.min_loops:
            return torch.zeros(signals.shape, dtype=torch.bool, device=signals.state_change.device)
        return self._rule_online(loop, signals)

    def _rule_online(self, loop: int, signals: LoopSignals) -> torch.Tensor:
        raise NotImplementedError

    # -- fast path ----------------------------------------------------------------------
    def exits(self, trace: Trace) -> Exits:
        """Exit loop of every token of a uniform-depth trace: the first loop >= min_loops where
        the rule holds, else the cap (min(r_max, trace.max_loops))."""
        cap = self.cap(trace.max_loops)
        rule = np.array(self._rule_trace(trace)[..., :cap], dtype=bool)  # (N, T, cap)
        rule[..., :self.min_loops - 1] = False
        converged = rule.any(axis=-1)
        depth = np.where(converged, rule.argmax(axis=-1) + 1, cap)
        return Exits(depth.astype(np.int64), converged)

    def exit_depth(self, trace: Trace) -> np.ndarray:
        return self.exits(trace).depth

    def _rule_trace(self, trace: Trace) -> np.ndarray:
        """(N, T, max_loops) bool: the rule holds at loop i (index i - 1)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.threshold_name}={self.threshold}, "
                f"min_loops={self.min_loops}, r_max={self.r_max})")


class Uniform(Policy):
    """A0: every token runs exactly r loops."""

    per_token_loops = True
    threshold_name = "r"

    def __init__(self, r: int):
        super().__init__(min_loops=r, r_max=r)
        self.r = r

    def _rule_online(self, loop, signals):
        return torch.ones(signals.shape, dtype=torch.bool, device=signals.state_change.device)

    def _rule_trace(self, trace):
        return np.broadcast_to(np.arange(1, trace.max_loops + 1) >= self.r, trace.kl_prev.shape)

    def __repr__(self) -> str:
        return f"Uniform(r={self.r})"


class ConvergenceExit(Policy):
    """A1: freeze a token after the first loop whose KL(p_i || p_{i-1}) is below eps.
    eps = 0 never halts (KL >= 0); eps = inf halts at min_loops.

    The first check is at loop FIRST_CHECK = 2 by default, the paper's convention: its KL series
    starts at loop 2, because loop 1's KL compares p_1 with p_0, the readout of the *noise* state,
    which says nothing about convergence. min_loops=1 is the other option (a loop-1 exit allowed).
    """

    FIRST_CHECK = 2
    readout_fields = frozenset({"kl_prev"})
    per_token_loops = True
    threshold_name = "eps"
    signal_floor = 0.0  # a KL, clamped at 0 where float rounding dips below

    def __init__(self, eps: float, min_loops: int = FIRST_CHECK, r_max: int | None = None):
        super().__init__(min_loops, r_max)
        self.eps = eps

    def _rule_online(self, loop, signals):
        if signals.kl_prev is None:
            raise ValueError("ConvergenceExit needs kl_prev: run the readout every loop")
        return signals.kl_prev < self.eps

    def _rule_trace(self, trace):
        return trace.kl_prev < self.eps


class LatentDiff(Policy):
    """Huginn's latent-difference exit: halt once ||s_i - s_{i-1}|| / ||s_i|| < delta."""

    per_token_loops = True
    threshold_name = "delta"

    def __init__(self, delta: float, min_loops: int = 1, r_max: int | None = None):
        super().__init__(min_loops, r_max)
        self.delta = delta

    def _rule_online(self, loop, signals):
        return signals.state_change < self.delta

    def _rule_trace(self, trace):
        return trace.state_change < self.delta


class LinearRouter(Policy):
    """A2: a linear probe on the core state (plus the loop index) predicts the chance that the
    output still changes after this loop; halt once that chance is below tau.

    The fast path reads the probe's chances from `trace.router_chance[probe.probe_id]`, which
    `trace(..., probes=[probe])` records.
    """

    per_token_loops = True
    threshold_name = "tau"

    def __init__(self, probe: RouterProbe, tau: float, min_loops: int = 1, r_max: int | None = None):
        super().__init__(min_loops, r_max)
        self.probe, self.tau = probe, tau

    def _rule_online(self, loop, signals):
        return self.probe.chance(signals.state, loop) < self.tau

    def _rule_trace(self, trace):
        chance = trace.router_chance.get(self.probe.probe_id)
        if chance is None:
            raise KeyError(f"the trace holds no chances of probe {self.probe.probe_id}; "
                           "trace it with probes=[probe]")
        return chance < self.tau

    def __repr__(self) -> str:
        return (f"LinearRouter(probe={self.probe.probe_id}, tau={self.tau}, min_loops={self.min_loops}, "
                f"r_max={self.r_max})")

    @property
    def rule_key(self) -> str:
        """Probes of two label kinds can fit the same weights (on demo "kl" and "kl_any" do): the
        key is the probe's parameters (`rule_id`), not its name."""
        rule_id = getattr(self.probe, "rule_id", self.probe.probe_id)
        return f"LinearRouter({rule_id}, {self.tau}, {self.min_loops}, {self.r_max})"


# -- Huginn's exit criteria ------------------------------------------------------------------------
def _needs(signals: LoopSignals, name: str, policy: Policy) -> torch.Tensor:
    value = getattr(signals, name)
    if value is None:
        raise ValueError(f"{type(policy).__name__} needs the {name} signal"
                         + (": run the readout every loop" if policy.needs_readout else ""))
    return value


class ReverseKLExit(Policy):
    """Huginn's KL exit: freeze a token once KL(p_{i-1} || p_i) < eps (the reverse of A1's direction)."""

    readout_fields = frozenset({"kl_prev_reverse"})
    per_token_loops = True
    threshold_name = "eps"
    signal_floor = 0.0  # a KL, clamped at 0 where float rounding dips below

    def __init__(self, eps: float = 1e-3, min_loops: int = 1, r_max: int | None = None):
        super().__init__(min_loops, r_max)
        self.eps = eps

    def _rule_online(self, loop, signals):
        return _needs(signals, "kl_prev_reverse", self) < self.eps

    def _rule_trace(self, trace):
        return trace.kl_prev_reverse < self.eps


class CosineExit(Policy):
    """Huginn's cosine exit: freeze a token once 1 - cos(s_i, s_{i-1}) < delta."""

    per_token_loops = True
    threshold_name = "delta"

    def __init__(self, delta: float = 1e-3, min_loops: int = 1, r_max: int | None = None):
        super().__init__(min_loops, r_max)
        self.delta = delta

    def _rule_online(self, loop, signals):
        return _needs(signals, "cosine_change", self) < self.delta

    def _rule_trace(self, trace):
        return trace.cosine_change < self.delta


class _Remembering(Policy):
    """A rule over consecutive loops: rule_met records this loop's value (every call, also before
    min_loops) and the rule compares it with the previous call's; a call that is not loop + 1 of
    the previous one (loop 1, or skipped loops) starts a new run."""

    signal = ""
    remembers_loops = True

    def __init__(self, min_loops: int = 1, r_max: int | None = None):
        super().__init__(min_loops, r_max)
        self.recall(None)

    def private(self) -> "Policy":
        twin = copy.copy(self)
        twin.recall(None)
        return twin

    def memory(self) -> tuple:
        """This run's memory of earlier loops: (the last loop asked, that loop's signal value, the
        rule's running state: None, a tensor or a tuple of them), per token of the batch."""
        return self._last_loop, self._prev, self._run

    def recall(self, memory: tuple | None) -> None:
        """Go on from `memory` (as `memory` returned it; None: nothing remembered). The exact harness
        keeps one memory per lane, so one policy object serves many runs in one batch."""
        self._last_loop, self._prev, self._run = (0, None, None) if memory is None else memory

    def rule_met(self, loop, signals):
        if isinstance(loop, torch.Tensor):
            raise TypeError(f"{type(self).__name__} remembers earlier loops: call it with one loop (an int)")
        value = _needs(signals, self.signal, self)
        fresh = loop != self._last_loop + 1 or self._prev is None or self._prev.shape != value.shape
        self._update(value, fresh)
        self._last_loop, self._prev = loop, value
        return super().rule_met(loop, signals)


class _FirstDifference(_Remembering):
    """Halt once |x_i - x_{i-1}| < threshold for the per-loop signal x = `signal`; never at loop 1
    (there is no x_0)."""

    def _update(self, value, fresh):
        self._run = None if fresh else (value - self._prev).abs()

    def _rule_online(self, loop, signals):
        if self._run is None:
            return torch.zeros(signals.shape, dtype=torch.bool, device=signals.state_change.device)
        return self._run < self.threshold

    def _rule_trace(self, trace):
        values = getattr(trace, self.signal)
        if values is None:
            raise KeyError(f"the trace holds no {self.signal}: {type(self).__name__} needs a trace that records it")
        diff = np.abs(np.diff(values, axis=-1))
        never = np.zeros(values.shape[:-1] + (1,), dtype=bool)
        return np.concatenate([never, diff < self.threshold], axis=-1)


class EntropyDiff(_FirstDifference):
    """Huginn's entropy-diff exit: freeze a token once |H(p_i) - H(p_{i-1})| < delta (nats); the
    rule never holds at loop 1 (there is no previous entropy)."""

    readout_fields = frozenset({"entropy"})
    threshold_name = "delta"
    signal = "entropy"
    signal_floor = 0.0  # an absolute difference

    def __init__(self, delta: float = 1e-3, min_loops: int = 1, r_max: int | None = None):
        super().__init__(min_loops, r_max)
        self.delta = delta


class Accel(_FirstDifference):
    """The second-order step-size exit (arXiv 2509.23314): freeze a token once
    |delta_i - delta_{i-1}| < tau, delta_i = ||s_i - s_{i-1}|| the state's step size (absolute, in
    the state's own units; loop 1's step is from the initial state s_0). Needs no readout; never
    halts at loop 1."""

    threshold_name = "tau"
    signal = "state_step"

    def __init__(self, tau: float, min_loops: int = 1, r_max: int | None = None):
        super().__init__(min_loops, r_max)
        self.tau = tau


class ArgmaxStable(_Remembering):
    """Huginn's argmax-stability exit: freeze a token once its argmax has stayed the same for n
    consecutive loops (the run is 0 at loop 1, so the earliest exit is loop n + 1)."""

    readout_fields = frozenset({"argmax"})
    threshold_name = "n"
    signal = "argmax"

    def __init__(self, n: int = 5, min_loops: int = 1, r_max: int | None = None):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        super().__init__(min_loops, r_max)
        self.n = n

    def _update(self, value, fresh):
        if fresh:
            self._run = torch.zeros(value.shape, dtype=torch.long, device=value.device)
        else:
            self._run = torch.where(value == self._prev, self._run + 1, 0)

    def _rule_online(self, loop, signals):
        return self._run >= self.n

    def _rule_trace(self, trace):
        run = np.zeros(trace.argmax.shape, dtype=np.int64)
        for i in range(1, trace.argmax.shape[-1]):
            run[..., i] = np.where(trace.argmax[..., i] == trace.argmax[..., i - 1], run[..., i - 1] + 1, 0)
        return run >= self.n



class CertifiedExit(_Remembering):
    """A sufficient-condition exit (after arXiv 2608.18222): freeze a token once no remaining motion of
    its state can move the top-1 token past the runner-up: 2 L · tail_i < m_i, where
      tail_i = δ_i ρ / (1 − ρ), ρ = δ_i / δ_{i−1}, δ_i = ‖s_i − s_{i−1}‖   the geometric bound on
               ‖s_∞ − s_i‖ if the steps keep shrinking by ρ (0 at an exact fixed point; ∞ when ρ ≥ 1),
      L      a Lipschitz bound of the readout, ‖z(s) − z(s')‖_∞ ≤ L ‖s − s'‖ (logits z), measured per
             checkpoint (recur_core.analysis.certify.readout_lipschitz),
      m_i    the top-1 − top-2 logit margin of p_i.
    The guarantee holds as far as its assumptions do (the contraction keeps its rate, L bounds the
    readout along the rest of the path); never halts at loop 1 (there is no δ_0)."""

    readout_fields = frozenset({"margin"})
    threshold_name = "lipschitz"
    signal = "state_step"

    def __init__(self, lipschitz: float, min_loops: int = 1, r_max: int | None = None):
        super().__init__(min_loops, r_max)
        self.lipschitz = lipschitz

    def _update(self, value, fresh):
        self._run = None if fresh else remaining_motion(value, self._prev)

    def _rule_online(self, loop, signals):
        if self._run is None:
            return torch.zeros(signals.shape, dtype=torch.bool, device=signals.state_change.device)
        return 2 * self.lipschitz * self._run < _needs(signals, "margin", self)

    def _rule_trace(self, trace):
        if trace.state_step is None or trace.topk_probs.shape[-1] < 2:
            raise KeyError("CertifiedExit's fast face needs a trace with state_step and a top-2 (topk >= 2)")
        margin = np.log(trace.topk_probs[..., 0]) - np.log(trace.topk_probs[..., 1])
        tail = remaining_motion(trace.state_step[..., 1:], trace.state_step[..., :-1])
        never = np.zeros(trace.state_step.shape[:-1] + (1,), dtype=bool)
        with np.errstate(invalid="ignore"):  # L = 0 with steps that do not shrink: 0 · ∞ is NaN, never certified (as online)
            return np.concatenate([never, 2 * self.lipschitz * tail < margin[..., 1:]], axis=-1)


def remaining_motion(step, prev):
    """The geometric tail δ ρ / (1 − ρ), ρ = step / prev, of step sizes (torch or numpy, float32): 0
    where step is 0 (a fixed point reached), ∞ where the steps do not shrink (ρ ≥ 1, or prev 0)."""
    where = torch.where if isinstance(step, torch.Tensor) else np.where
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = step / prev
        tail = step * rho / (1 - rho)
    return where(step == 0, 0.0, where(rho < 1, tail, float("inf")))


# -- a learned exit gate ---------------------------------------------------------------------------
class GateExit(_Remembering):
    """Ouro's Q-exit as a policy that really halts: after loop i the gate gives each token its exit
    probability (hazard) lambda_i = sigmoid(w . s_i + b); the exit distribution is
    p_i = lambda_i prod_{j<i} (1 - lambda_j), with what is left on the last loop, and its CDF after
    loop i is 1 - prod_{j<=i} (1 - lambda_j). A token halts at the first loop (1-based) whose CDF
    is >= q, else at the cap, which takes the remaining mass (Ouro's last step: pass r_max =
    total_ut_steps for its distribution exactly). q = 0 halts every token at loop 1.

    gate: a callable state (B, T, d) -> lambda (B, T), the model's `gate_lambda`; only the online
    face needs it (the fast face reads the lambdas the trace recorded, `trace.exit_lambda`). The
    online face keeps each token's survival prod (1 - lambda_j) between calls (one loop at a time).
    """

    threshold_name = "q"
    signal = "state"

    def __init__(self, q: float, gate=None, min_loops: int = 1, r_max: int | None = None):
        if not 0 <= q <= 1:
            raise ValueError(f"q must be in [0, 1], got {q}")
        super().__init__(min_loops, r_max)
        self.q, self.gate = q, gate

    @classmethod
    def of_checkpoint(cls, ckpt, q, max_loops: int | None = None, min_loops: int = 1) -> "GateExit":
        """Ouro's Q-exit at q as the halting policy of a checkpoint with a learned exit gate: its
        gate, capped at its trained steps (the last one takes what is left, as in Ouro's code), or
        at max_loops if that is fewer. q must lie in (0, 1): q <= 0 halts every token at loop 1 and
        q >= 1 runs every step, which Uniform(1) / Uniform(steps) say plainly (the analysis' curve
        takes those two ends from the constructor)."""
        gate = getattr(ckpt.model, "exit_gate", None)
        if gate is None:
            raise ValueError(f"{getattr(ckpt, 'path', 'this model')} has no learned exit gate (an Ouro checkpoint has one)")
        try:
            q = float(q)
        except (TypeError, ValueError):
            raise ValueError(f"a gate threshold q must be a number in (0, 1), got {q!r}") from None
        if not 0 < q < 1:
            raise ValueError(f"a gate threshold q must lie in (0, 1), got {q} (q <= 0 halts every token at loop 1, "
                             "q >= 1 runs every step: use Uniform for those)")
        steps = ckpt.recipe.depth
        return cls(q, ckpt.model.gate_lambda, min_loops, steps if max_loops is None else min(steps, int(max_loops)))

    def _update(self, value, fresh):
        if self.gate is None:
            raise ValueError("GateExit's online face needs the model's gate: GateExit(q, gate=model.gate_lambda)")
        lam = self.gate(value).float()
        if fresh:
            self._run = (torch.zeros_like(lam), torch.ones_like(lam))  # (CDF, survival) before loop 1
        cdf, survive = self._run
        self._run = (cdf + lam * survive, survive * (1 - lam))

    def _rule_online(self, loop, signals):
        return self._run[0] >= self.q

    def _rule_trace(self, trace):
        if trace.exit_lambda is None:
            raise KeyError("the trace holds no exit-gate lambdas: GateExit needs a model with an exit gate (Ouro)")
        return exit_cdf(trace.exit_lambda) >= self.q

    def __repr__(self) -> str:
        return f"GateExit(q={self.q}, min_loops={self.min_loops}, r_max={self.r_max})"


def exit_cdf(lam: np.ndarray) -> np.ndarray:
    """The exit CDF after each loop (last axis) from the gate's per-loop lambdas, in float32 and in the
    reference's order of operations: p_i = lambda_i * survival, survival *= 1 - lambda_i, CDF = the
    running sum of p (the cap's remaining mass is the policy's business)."""
    lam = lam.astype(np.float32)
    survive = np.concatenate([np.ones_like(lam[..., :1]), np.cumprod(1 - lam, axis=-1, dtype=np.float32)[..., :-1]],
                             axis=-1)
    return np.cumsum(lam * survive, axis=-1, dtype=np.float32)
