"""Exact evaluation of policies: the paper's masking harness, many thresholds in one pass.

Every window runs loop by loop up to the policy's cap. After each loop the policy sees that loop's
signals and decides which tokens halt; halted tokens are frozen (their state is kept bit-for-bit)
while the other tokens keep looping and still attend to the frozen states. When every token has
halted, the final states are read out once (coda + head, with each token attending to the others'
final states) and scored. No compute is saved; this measures what the policy's outputs would be.
The loop's order, the consultation, the freezing and the cap are the halting contract the decoders
share (recur_core.exits.halting: `start_loops`, `HaltSchedule.met`, `Freezing`).

This differs from the fast path (a token scored at its exit loop in the uniform run) in two ways:
later tokens see frozen rather than still-updated context, and the coda reads the final states of
the whole window. `allocation.allocation(..., exact=...)` / `curves.fast_minus_exact` report both and the gap.

`run_exact_sweep` evaluates a whole threshold sweep (every policy of every family) at once. A
*lane* is one window's run under one freeze history; all policies start in the window's root lane
(nothing frozen). After each loop the policies of a lane are grouped by the tokens they halt: a
group that halts nothing stays in the lane, every other group continues in its own lane. So the
thresholds are a batch dimension, and the work a lane saves is exact, not approximate:
  * policies that have frozen the same tokens so far share one computation (e.g. every A0 depth,
    and every small ε until its first exit, ride on the root lane);
  * a lane stops as soon as every token in it is frozen (the state can no longer change);
  * tokens after a lane's last unfrozen position are left out of its forward pass: attention is
    causal, so they cannot influence any token that still loops, and their state is frozen;
  * a policy that remembers earlier loops (Accel, the certified exit, Huginn's entropy and argmax
    criteria, a learned gate) keeps its memory per lane (`Policy.memory` / `recall`), handed on when
    a lane splits, so its thresholds share lanes as the others' do;
  * the last core block, and for a readout rule's signals the last coda block and the LM head, run only for
    the unfrozen tokens (a frozen token's own output is discarded; its keys and values are not);
    lanes of a batch have different numbers of them, and the MLPs, the head and the KL skip the
    padding (only the attention of those blocks runs padded); the previous readout is kept only in
    lanes with a rule that reads a KL, and the top-2 is taken only in lanes with a margin rule.
Lanes of all windows are batched together (`batch_size` lanes per forward pass).

Inputs and noise follow recur_core.analysis.trace: windows (N, T + 1) or one text (T,), and window n's noise
seeded by seed_for(seed, n) (LoopedLM.seeded_state), so the exact and fast paths start from identical states.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .. import cancel
from ..exits.halting import Freezing, HaltSchedule, start_loops
from ..exits.policies import Policy
from ..exits.readout import readout_stats
from ..exits.signals import KL_FIELDS, LoopSignals, readout_fields
from ..exits.trace_type import NO_TARGET, Trace
from ..model.checkpoint import Checkpoint, resolve_model
from ..model.looped_lm import LoopedLM, take_rows
from .parallel import map_batches
from .trace import progress_bar, split_inputs


@dataclass
class ExactResult:
    """Per-token outcome: ce (N, T) of the final readout (NaN without target), exit_depth (N, T)
    the loop after which each token froze, converged (N, T) False where only the cap stopped it,
    argmax (N, T) the final readout's prediction (what decoding would emit)."""

    ce: np.ndarray
    exit_depth: np.ndarray
    converged: np.ndarray
    targets: np.ndarray
    argmax: np.ndarray
    FIELDS: ClassVar[tuple[str, ...]] = ("ce", "exit_depth", "converged", "targets", "argmax")

    @property
    def has_target(self) -> np.ndarray:
        return self.targets != NO_TARGET


@dataclass
class SweepWork:
    """What a sweep computed: lane-loops (one window's forward through one loop) and, for
    comparison, the window-loops that one harness run per policy would have taken."""

    lane_loops: int = 0
    readout_lane_loops: int = 0  # of those, with the per-loop readout (A1's KL)
    token_loops: int = 0  # positions actually run (lanes are cut after their last unfrozen token)
    live_token_loops: int = 0  # of those, unfrozen ones (the rest are only context)
    readout_token_loops: int = 0  # positions run in lanes with A1's readout
    readout_live_token_loops: int = 0  # of those, unfrozen ones (read out)
    attention_pairs: int = 0  # (query, key) pairs of a causal pass over the positions run
    naive_window_loops: int = 0

    def add(self, other: "SweepWork") -> None:
        for name in self.as_dict():
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in (
            "lane_loops", "readout_lane_loops", "token_loops", "live_token_loops", "readout_token_loops",
            "readout_live_token_loops", "attention_pairs", "naive_window_loops")}


def run_exact(ckpt_or_model: Checkpoint | LoopedLM, ids, policy: Policy, max_loops: int, seed: int = 0, *,
              batch_size: int = 16, progress=None) -> ExactResult:
    """Evaluate one `policy` exactly on windows (N, T + 1) or a text (T,) with a budget of max_loops."""
    return run_exact_sweep(ckpt_or_model, ids, [policy], max_loops, seed, batch_size=batch_size,
                           progress=progress)[0]


def run_exact_sweep(ckpt_or_model: Checkpoint | LoopedLM, ids, policies: list[Policy], max_loops: int,
                    seed: int = 0, *, batch_size: int = 16, window_group: int = 8, progress=None,
                    work: SweepWork | None = None) -> list[ExactResult]:
    """Evaluate every policy exactly (one ExactResult each, in order) in one batched pass; policies with
    equal `rule_key`s halt alike and run once.

    Groups of window_group windows (which bound the memory of their lanes) run in parallel on a
    CPU (recur_core.analysis.parallel); `work`, if given, is filled with the amount of computation done.
    """
    if not policies:
        return []
    keys = [p.rule_key for p in policies]
    distinct = sorted({k: i for i, k in reversed(list(enumerate(keys)))}.values())  # first of each rule
    if len(distinct) < len(policies):  # policies that halt alike (e.g. equal probes) run once
        results = run_exact_sweep(ckpt_or_model, ids, [policies[i] for i in distinct], max_loops, seed,
                                  batch_size=batch_size, window_group=window_group, progress=progress, work=work)
        by_key = {keys[i]: r for i, r in zip(distinct, results, strict=True)}
        return [by_key[k] for k in keys]
    model, _ = resolve_model(ckpt_or_model)
    inputs, targets = split_inputs(ids)
    N, T = inputs.shape
    caps = [p.cap(max_loops) for p in policies]
    work = work if work is not None else SweepWork()
    work.naive_window_loops += N * sum(caps)
    outcome = _outcome_arrays(len(policies), N, T)  # (ce, exit_depth, converged, argmax)
    update, close = progress_bar(progress, N, f"exact harness ({len(policies)} policies; windows)")

    def run_lanes(rows: range) -> tuple[tuple[np.ndarray, ...], SweepWork]:
        """Every policy on the window group `rows`."""
        part = _outcome_arrays(len(policies), len(rows), T)
        part_work = SweepWork()
        sweep = _Sweep(model, inputs[rows.start:rows.stop], targets[rows.start:rows.stop],
                       model.seeded_state(rows, seed, T), policies, caps, batch_size, part_work)
        for i, w, *finals in sweep.run():
            for array, value in zip(part, finals, strict=True):
                array[i, w] = value
        return part, part_work

    def gather(rows: range, result) -> None:
        part, part_work = result
        for array, value in zip(outcome, part, strict=True):
            array[:, rows.start:rows.stop] = value
        work.add(part_work)
        update(len(rows))
    try:
        groups = [range(start, min(start + window_group, N)) for start in range(0, N, window_group)]
        map_batches(run_lanes, groups, next(model.parameters()).device, on_done=gather)
    finally:
        close()
    ce, depth, converged, argmax = outcome
    return [ExactResult(ce[p], depth[p], converged[p], targets.numpy(), argmax[p]) for p in range(len(policies))]


def uniform_run_result(tr: Trace, policy: Policy) -> ExactResult | None:
    """The policy's exact result read off the uniform trace, when on the trace's windows it halts no
    token before its cap: then nothing is ever frozen early, so its harness run *is* the uniform run
    (every A0 depth; A1 at eps = 0). None when it halts something earlier (it needs the harness)."""
    cap = policy.cap(tr.max_loops)
    exits = policy.exits(tr)
    if (exits.depth < cap).any():
        return None
    at = np.full(exits.depth.shape + (1,), cap - 1)
    ce, argmax = (np.take_along_axis(x, at, -1)[..., 0] for x in (tr.ce, tr.argmax))
    return ExactResult(ce.astype(np.float32), exits.depth, exits.converged, tr.targets, argmax.astype(np.int64))


def _outcome_arrays(n_policies: int, n_windows: int, T: int) -> tuple[np.ndarray, ...]:
    """Empty (ce, exit_depth, converged, argmax) arrays of shape (n_policies, n_windows, T)."""
    shape = (n_policies, n_windows, T)
    return (np.full(shape, np.nan, dtype=np.float32), np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=bool),
            np.full(shape, -1, dtype=np.int64))


@dataclass
class _Lane:
    """One window under one freeze history, shared by the policies that produced that history.
    state / h_prev are (T, d) tensors (never modified in place); freezing holds numpy (T,) arrays;
    memory: each remembering policy's memory of this lane's loops (`Policy.memory`, tensors per token)."""

    window: int
    state: torch.Tensor
    h_prev: torch.Tensor | None  # coda hidden of the previous loop, kept while a policy reads a KL
    freezing: Freezing
    policies: list[int]
    memory: dict[int, tuple]

    @property
    def active_len(self) -> int:
        """Positions up to and including the last unfrozen one."""
        live = np.flatnonzero(self.freezing.live)
        return int(live[-1]) + 1 if len(live) else 0


class _Sweep:
    """The lanes of one group of windows, advanced loop by loop until every policy has finished."""

    def __init__(self, model: LoopedLM, inputs, targets, noise, policies, caps, batch_size, work: SweepWork):
        self.model, self.policies, self.caps, self.batch_size, self.work = model, policies, caps, batch_size, work
        self.device = next(model.parameters()).device
        self.targets = targets.to(self.device)
        # one schedule per policy serves every lane: a remembering rule recalls each lane's memory
        self.schedules = [HaltSchedule(p, cap) for p, cap in zip(policies, caps, strict=True)]
        self.fields = [p.readout_fields for p in policies]
        with torch.inference_mode():
            self.e, start, h0 = start_loops(model, inputs.to(self.device), noise, any(self.fields))
        T = inputs.shape[1]
        self.lanes = [self._lane(w, start[w], None if h0 is None else h0[w], Freezing.start(T, "numpy"),
                                 list(range(len(policies))), {}) for w in range(inputs.shape[0])]
        self.finals: list[tuple[torch.Tensor, int, list[tuple[int, np.ndarray, np.ndarray]]]] = []

    def _lane(self, window, state, h, freezing, policies, memory) -> _Lane:
        """A lane of `policies`, keeping the previous readout only while one of them reads a KL."""
        keep_h = any(self.fields[p] & KL_FIELDS for p in policies)
        return _Lane(window, state, h if keep_h else None, freezing, policies,
                     {p: memory[p] for p in policies if p in memory})

    def reads(self, lane: _Lane) -> frozenset[str]:
        """The readout fields its policies read (empty: no readout)."""
        return frozenset().union(*(self.fields[p] for p in lane.policies))

    @torch.inference_mode()
    def run(self):
        """Yields (policy index, window, ce (T,), exit_depth (T,), converged (T,), argmax (T,)) per finished pair."""
        loop = 0
        while self.lanes:
            loop += 1
            lanes, self.lanes = self.lanes, []
            kinds: dict[tuple, list[_Lane]] = {}  # lanes that read out alike share forward passes
            for ln in lanes:
                fields = self.reads(ln)
                kinds.setdefault((bool(fields), bool(fields & KL_FIELDS), "margin" in fields), []).append(ln)
            for kind, group in sorted(kinds.items()):
                group.sort(key=lambda ln: ln.active_len)  # similar widths share a forward pass
                for at in range(0, len(group), self.batch_size):
                    self._advance(group[at:at + self.batch_size], loop, *kind)
            yield from self._score_finals()

    def _advance(self, chunk: list[_Lane], loop: int, readout: bool, reads_kl: bool, margin: bool) -> None:
        """Run one loop for a chunk of lanes, then split each lane by what its policies halt."""
        cancel.check()
        width = max(ln.active_len for ln in chunk)
        state = torch.stack([ln.state[:width] for ln in chunk])
        frozen_np = np.stack([ln.freezing.frozen[:width] for ln in chunk])
        frozen = torch.from_numpy(frozen_np).to(self.device)
        rows, valid = _live_rows(frozen_np)
        rows, valid = rows.to(self.device), valid.to(self.device)
        windows = [ln.window for ln in chunk]
        new = self.model.core_step(state, self.e[windows, :width], freeze=frozen, rows=rows, valid=valid)
        signals = LoopSignals.of_states(new, state)
        h_rows = None
        if readout:  # the readout of the unfrozen tokens only (coda's last block and the head)
            h_prev = torch.stack([ln.h_prev[:width] for ln in chunk]) if reads_kl else None
            h_rows = _live_readout(self.model, new, h_prev, rows, valid, signals, topk=2 if margin else 0)
            self.work.readout_lane_loops += len(chunk)
            self.work.readout_token_loops += len(chunk) * width
            self.work.readout_live_token_loops += int(valid.sum())
        self.work.lane_loops += len(chunk)
        self.work.token_loops += len(chunk) * width
        self.work.live_token_loops += int(valid.sum())
        self.work.attention_pairs += len(chunk) * width * (width + 1) // 2
        met = {p: self._met(p, chunk, loop, signals) for p in sorted({p for ln in chunk for p in ln.policies})}
        for b, lane in enumerate(chunk):
            full_state = _splice(new[b], lane.state, width)
            full_h = None
            if reads_kl:  # the readout hidden of the tokens still looping (others are never asked again)
                full_h = lane.h_prev.clone()
                full_h[rows[b][valid[b]]] = h_rows[b][valid[b]]
            self._split(lane, loop, full_state, full_h, {p: _pad(met[p][b], len(lane.freezing.frozen)) for p in lane.policies})

    def _met(self, p: int, chunk: list[_Lane], loop: int, signals: LoopSignals) -> np.ndarray:
        """Where policy p's rule holds on every lane of the chunk (B, width); a remembering rule
        goes on from each lane's memory (lanes without p lend theirs a blank) and leaves it there."""
        schedule = self.schedules[p]
        if not schedule.policy.remembers_loops:
            return schedule.met(loop, signals).cpu().numpy()
        schedule.policy.recall(_stack_memory([ln.memory.get(p) for ln in chunk], signals.shape[1]))
        met = schedule.met(loop, signals).cpu().numpy()
        memory = schedule.policy.memory()
        for b, lane in enumerate(chunk):
            if p in lane.policies:
                lane.memory[p] = _memory_row(memory, b)
        return met

    def _split(self, lane: _Lane, loop: int, state, h, met: dict[int, np.ndarray]) -> None:
        """Freeze each policy's tokens after this loop; policies that halt the same tokens go on in one
        lane, those at their cap or with every token frozen are finished."""
        groups: dict[bytes, list[int]] = {}
        finished: list[tuple[int, np.ndarray, np.ndarray]] = []
        for p, rule in met.items():
            if loop >= self.caps[p]:  # the cap stops every token still looping
                capped = lane.freezing.copy()
                capped.update(loop, rule, at_cap=True)
                finished.append((p, capped.exit_depth, capped.converged))
            else:
                groups.setdefault(np.packbits(rule & lane.freezing.live).tobytes(), []).append(p)
        for ps in groups.values():
            freezing = lane.freezing.copy()
            freezing.update(loop, met[ps[0]], at_cap=False)
            if freezing.frozen.all():
                finished.extend((p, freezing.exit_depth, freezing.converged) for p in ps)
            else:
                self.lanes.append(self._lane(lane.window, state, h, freezing, ps, lane.memory))
        if finished:
            self.finals.append((state, lane.window, finished))

    def _score_finals(self):
        """Read out the final states of the policies that finished this loop (one readout per state)."""
        finals, self.finals = self.finals, []
        for at in range(0, len(finals), self.batch_size):
            part = finals[at:at + self.batch_size]
            windows = [w for _, w, _ in part]
            state = torch.stack([s for s, _, _ in part])
            stats = readout_stats(self.model.coda(state), self.model.head_weight, self.targets[windows])
            ce, argmax = stats.ce.cpu().numpy(), stats.argmax.cpu().numpy()
            for b, (_, w, done) in enumerate(part):
                for p, exit_depth, conv in done:
                    yield p, w, ce[b], exit_depth, conv, argmax[b]


def _stack_memory(memories: list[tuple | None], width: int):
    """One memory (`Policy.memory`) for a chunk of lanes from each lane's (None: a lane that has none,
    whose rows get zeros), every per-token tensor cut or zero-padded to `width` positions: the
    positions past a lane's last unfrozen token are frozen, so what they remember is never read."""
    ref = next((m for m in memories if m is not None), None)
    if ref is None:
        return None

    def stack(leaves, ref_leaf):
        if isinstance(ref_leaf, torch.Tensor):
            return torch.stack([_fit(ref_leaf.new_zeros(ref_leaf.shape) if x is None else x, width) for x in leaves])
        if isinstance(ref_leaf, tuple):
            return tuple(stack([None if x is None else x[i] for x in leaves], r) for i, r in enumerate(ref_leaf))
        return ref_leaf  # the last loop asked (the same in every lane: lanes advance in lockstep), or None
    return stack(memories, ref)


def _memory_row(memory, b: int):
    """Lane b's part of a chunk's memory (`_stack_memory`'s inverse, at the chunk's width)."""
    if isinstance(memory, torch.Tensor):
        return memory[b]
    if isinstance(memory, tuple):
        return tuple(_memory_row(x, b) for x in memory)
    return memory


def _fit(x: torch.Tensor, width: int) -> torch.Tensor:
    """A per-token (T', ...) tensor cut or zero-padded to `width` positions."""
    if x.shape[0] >= width:
        return x[:width]
    return torch.cat([x, x.new_zeros((width - x.shape[0], *x.shape[1:]))])


def _live_readout(model: LoopedLM, new, h_prev, rows, valid, signals: LoopSignals, topk: int = 0):
    """Set the readout fields of `signals` (B, T) for the tokens at rows / valid (`_live_rows`) of states
    new (B, T, d): NaN elsewhere (never halts; argmax -1: no token), KLs against h_prev (B, T, d)
    when given. Only the coda's last block and the head run for them. Returns their hidden (B, M, d)."""
    h_rows = model.coda(new, rows=rows, valid=valid)  # (B, M, d), padding rows unfinished
    prev = None if h_prev is None else take_rows(h_prev, rows)[valid]
    stats = readout_stats(h_rows[valid], model.head_weight, None, prev, topk=topk)  # not the padding
    for name, value in readout_fields(stats).items():
        fill = -1 if name == "argmax" else float("nan")
        setattr(signals, name, torch.full(new.shape[:2], fill, dtype=value.dtype,
                                          device=new.device).index_put_(_live_index(rows, valid), value))
    return h_rows


def _live_index(rows, valid) -> tuple[torch.Tensor, torch.Tensor]:
    """(lane, position) of every valid entry of rows / valid (`_live_rows`), to scatter into (B, T)."""
    return torch.arange(len(rows), device=rows.device)[:, None].expand_as(rows)[valid], rows[valid]


def _live_rows(frozen: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (B, M), valid (B, M)): each lane's unfrozen positions, padded to the chunk's largest
    count by repeating its last one (a lane always has one: it ends when every token is frozen); valid
    is False on the padding (whose outputs are never used)."""
    live = [np.flatnonzero(~f) for f in frozen]
    M = max(len(x) for x in live)
    rows = np.stack([np.concatenate([x, np.full(M - len(x), x[-1])]) for x in live])
    valid = np.arange(M)[None, :] < np.array([len(x) for x in live])[:, None]
    return torch.from_numpy(rows), torch.from_numpy(valid)


def _splice(head: torch.Tensor, tail: torch.Tensor, width: int) -> torch.Tensor:
    """head's first `width` positions followed by tail's positions from `width` on."""
    return head if width >= tail.shape[0] else torch.cat([head, tail[width:]])


def _pad(x: np.ndarray, length: int) -> np.ndarray:
    """A (width,) bool decision padded with False to the window length (the cut-off tail is frozen)."""
    return x if len(x) >= length else np.concatenate([x, np.zeros(length - len(x), bool)])
