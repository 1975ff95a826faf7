"""Exact teacher-forced decoding as the fixed point of parallel passes.

Token-by-token decoding (`Decoder.step`) is exact but runs one position at a time. Decoding is
causal, so the same result comes from batched passes over every position:

  * a token's core loop i reads the earlier tokens' core entries of loop i under the KV rule; one
    parallel pass (`Decoder.prefill`) computes those exactly, given every token's exit;
  * a readout rule (A1, Huginn's KL / entropy / argmax) reads token t's output at loop i through
    the coda, which attends to the earlier tokens' coda entries at their *exit* states, and those
    may lie at later loops than i. A pass takes them from a guess: the previous pass's exit states
    (`Decoder.exit_context`, kv.ExitContextKV).

Pass 1 is the plain prefill (the readout reads the earlier tokens at the current loop, the masking
harness's view); each later pass reads the exit states of the pass before. Pass n is exact on
positions 0 .. n - 1 (position 0 has no context; position t then reads exact earlier tokens), and
a position stays exact once every position before it has repeated its exit: the core depends on
the exits alone, so equal exits give bit-identical exit states and so an identical context. A pass
therefore restarts at the first position that may still change (`Decoder.prefill(start=...)`, the
earlier positions' cache entries kept), a window whose every position is settled leaves the batch
(`Decoder.select`), and the loop ends when every position is settled: at most T computed passes for
T positions, usually a few. A rule that reads only the state (A0, A2, the latent and
cosine rules, the gate), or a model without coda blocks (Ouro), needs one pass.

A guess of every exit seeds it: a prefill under the guessed exits writes their exit states and keeps
each loop's core output, and the first pass replays that core under the policy's readouts
(`Decoder.prefill(replay=...)`): exact up to the first exit that differs from the guess, so a
right guess costs one core pass and one pass of readouts (read out a group of loops per call, as
the tracer does), and a wrong one at most T - f computed passes after it (f: the positions before
its first wrong exit).

Passes pay only while they settle many positions each. Where a readout rule's threshold sits at the
float noise of its signal (A1 at ε ≤ 1e-6: successive-output KLs of 0, 6e-8, 1.2e-7 ...), a change of
one earlier exit state moves later tokens' signals across it, and each pass settles a few positions:
tens of passes. A pass over the rest costs in proportion to the windows it runs; decoding the rest
token by token (`Decoder.step`, the reference itself, on the exact prefix the passes left in the
cache) costs about what a pass over STEP_ROWS windows does, whatever the batch. The first two computed
passes settle little in every case (the first position 0, the second up to the first exit the first
got wrong) and a usual decoding's third settles most of the rest; so from the third computed pass on,
once the passes still needed at the last one's rate, times the windows still running, exceed
STEP_ROWS, the rest is decoded token by token. The switch depends on the settled counts alone, so the same
inputs give the same result.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import cancel
from ..exits.halting import HaltSchedule
from ..exits.policies import Policy
from .decode import Decoder

# The windows a pass would run for its cost to match decoding the rest token by token. On the former
# checkpoints/specimen (ae2b1e011316af91, with a coda; 1 thread) a pass cost ~1.1 ms per window-position and a
# step ~50-60 ms, whatever the batch (8 or 32 windows): about 45 windows' pass. On 32 windows x 256 positions
# a usual decoding's third computed pass settled 225 of the 250 positions per window left (A1 at ε 1e-3), A1 at
# ε 5.6e-7's 8-11 of 243.
STEP_ROWS = 64


@dataclass
class FixedPoint:
    """What `fixed_point` returns for B windows of T positions: logits (B, T, V) and exits (B, T) of
    exact decoding, the passes run (a guess's replay counts as one), and per pass the positions settled
    (summed over the windows) and the windows it ran (a window leaves the batch once every position
    of it is settled); stepped: the positions decoded token by token once that was cheaper than more
    passes (0 when the passes converged)."""

    logits: Tensor
    exits: Tensor
    passes: int
    settled: list[int]
    readouts: int
    rows: list[int]
    stepped: int = 0


class _GuessedExits(Policy):
    """Halts token t after loop depth[t] (a guess of every exit, to seed the first pass)."""

    per_token_loops = True
    threshold_name = "depth"

    def __init__(self, depth: Tensor):
        super().__init__(min_loops=1, r_max=None)
        self.depth = depth

    def _rule_online(self, loop, signals):
        return self.depth <= loop

    def __repr__(self) -> str:
        return f"_GuessedExits(depth={self.depth.tolist()})"


def needs_passes(model, policy: Policy) -> bool:
    """Whether a token's exit can depend on the earlier tokens' exits through the readout: a rule
    that reads the readout, on a model whose coda attends across positions."""
    return policy.needs_readout and len(model.coda_blocks) > 0


def first_difference(exits: Tensor, previous: Tensor) -> Tensor:
    """Per row (B,): the first position whose exit differs from `previous`'s (T where none does)."""
    changed = (exits != previous).cpu()
    return torch.where(changed.any(1), changed.int().argmax(1), torch.full((exits.shape[0],), exits.shape[1]))


def settled_prefix(exits: Tensor, previous: Tensor | None, passes: int) -> Tensor:
    """Per row (B,): how many leading positions are exact after `passes` passes, given this pass's
    exits and the previous pass's (None after the first pass, or after a replay)."""
    B, T = exits.shape
    exact = torch.full((B,), min(passes, T), dtype=torch.long)
    if previous is None:
        return exact
    return torch.maximum(exact, (first_difference(exits, previous) + 1).clamp_max(T))


@torch.inference_mode()
def fixed_point(model, ids: Tensor, schedule: HaltSchedule, *, noise: Tensor, kv_rule=None,
                guess: Tensor | None = None, on_pass: Callable[[int, int], None] | None = None) -> FixedPoint:
    """Exact teacher-forced decoding of the inputs ids (B, T): what `Decoder.step` position by
    position gives, by parallel passes until no exit can change, the rest decoded token by token once
    that is cheaper than the passes still needed (module docstring), under
    `schedule` (the policy, its loop cap and check period).

    guess: optional exits (B, T) to seed the first pass's context with (default: the plain prefill
    is the first pass); the result does not depend on it, only the work. A guess is checked first by
    replaying its pass's core with the policy's readouts (`Decoder.prefill(replay=...)`): a right one
    costs that core pass and one pass of readouts, and a wrong one is exact up to its first wrong exit.
    on_pass(settled positions summed over rows, B * T) is called after every pass."""
    B, T = ids.shape
    dec = Decoder(model, schedule, batch=B, kv_rule=kv_rule, noise=noise, max_len=T)
    passes_needed = needs_passes(model, schedule.policy)
    previous = replay = None
    if guess is not None and passes_needed:  # a pass that writes the guess's exit states, its core kept
        previous, replay = guess.to(ids.device).clamp(1, dec.cap), []
        Decoder(model, HaltSchedule(_GuessedExits(previous), dec.cap), batch=B, kv_rule=kv_rule, noise=noise,
                cache=dec.cache, max_len=T).prefill(ids, record=replay)
        dec.exit_context = True
    logits = exits = None
    settled, start, passes, computed, counts, rows = torch.zeros(B, dtype=torch.long), 0, 0, 0, [], []
    gain = 0.0  # positions per window the last computed pass settled
    replayed = torch.zeros(B, dtype=torch.long)  # per window, the positions a guess's replay settled
    active = torch.arange(B)  # the windows still unsettled, each a row of dec
    while True:
        part_logits, part_exits = dec.prefill(ids[active, start:], start, replay=replay)
        passes += 1
        rows.append(len(active))
        if logits is None:
            logits, exits = part_logits, part_exits
        else:
            logits[active, start:], exits[active, start:] = part_logits, part_exits
        if not passes_needed:
            settled[:] = T
        elif replay is not None:  # exact before the first exit that differs from the guess; past it, not a pass's
            settled[active] = replayed[active] = first_difference(exits[active], previous)
        else:
            # after n computed passes the n positions after those the replay settled are exact too
            computed += 1
            exact = torch.maximum(settled_prefix(exits[active], previous, computed), replayed[active] + computed)
            gain = float((exact.clamp_max(T) - settled[active]).clamp_min(0).float().mean())
            settled[active] = torch.maximum(settled[active], exact.clamp_max(T))
        counts.append(int(settled.sum()))
        if on_pass is not None:
            on_pass(counts[-1], B * T)
        unsettled = settled[active] < T
        if not bool(unsettled.any()):
            return FixedPoint(logits, exits, passes, counts, dec.readouts, rows)
        if not bool(unsettled.all()):  # settled windows leave the batch: later passes run the others
            dec, active = dec.select(unsettled.nonzero().squeeze(1)), active[unsettled]
        start = int(settled[active].min())
        if computed >= 3 and passes_left(settled[active], T, gain) * len(active) > STEP_ROWS:
            stepped = step_the_rest(dec, ids, start, active, (logits, exits), settled, on_pass)
            counts.append(int(settled.sum()))
            return FixedPoint(logits, exits, passes, counts, dec.readouts, rows, stepped)
        previous = None if replay is not None else exits[active].clone()
        dec.exit_context, replay = True, None


def passes_left(settled: Tensor, T: int, gain: float) -> float:
    """The passes still needed at the last one's rate: positions per window still to settle / gain."""
    return float((T - settled).float().mean()) / max(gain, 1.0)


def step_the_rest(dec: Decoder, ids: Tensor, start: int, active: Tensor, out: tuple[Tensor, Tensor],
                  settled: Tensor, on_pass: Callable[[int, int], None] | None) -> int:
    """Decode positions start .. T - 1 of the rows `active` of ids (B, T) token by token (`Decoder.step`,
    which reads every earlier position's entries as the cache holds them: exact before start) into
    out = (logits, exits), marking each position settled as it is decoded (`on_pass` hears it);
    returns the positions stepped."""
    logits, exits = out
    B, T = ids.shape
    dec.exit_context = False  # a step's readout writes its own coda entry, as in plain decoding
    for t in range(start, T):
        cancel.check()
        logits[active, t], exits[active, t] = dec.step(ids[active, t], t)
        settled[active] = settled[active].clamp_min(t + 1)
        if on_pass is not None:
            on_pass(int(settled.sum()), B * T)
    return T - start
