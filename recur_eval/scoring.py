"""Scoring continuations with real per-token halting: what the lm-eval model `recur` computes.

A request is (inputs, targets): the token ids the model reads and the ids it must predict at the
last len(targets) input positions (inputs = context + continuation[:-1], targets = continuation).
Every input sequence is decoded teacher-forced by `recur_core.decoding.teacher_forced`: by the
fixed point of parallel passes (mode "fixed_point", the default: exactly what `generate` computes,
recur_core.decoding.fixed_point), token by token (mode "decode", the reference) or in one parallel
pass (mode "prefill": exact for rules that read only the state), each token looping until its
policy halts it, halted tokens frozen with their exit state in the KV cache exactly as in decoding.

Two things make this cheap without changing a number:
  * Causality. A position's logits depend only on the positions before it (and its own noise row),
    so requests whose inputs are a prefix of another request's inputs read their positions off that
    one run: the queries of one hops program, the choices of one multiple-choice question whose
    continuations are one token each, share a single run.
  * Lockstep batches. Runs are decoded in batches, right-padded (the padding comes after every real
    position, so it changes none of them). Every run gets noise row 0, the noise `generate` gives a
    sequence decoded alone, so a score does not depend on the batch it was run in, up to float
    rounding: a batch's matmuls round the last bits differently from a lone sequence's, which moves a
    token's exit by a loop when its signal sits within rounding of the threshold (seen for A1 at
    ε = 1e-7 on a tiny model, where KLs are at float32 resolution; at 1e-5 every exit agreed).
    batch_size=1 computes exactly what `teacher_forced` does for each sequence alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from recur_core.decoding.teacher_forced import teacher_forced
from recur_core.exits.policies import Policy
from recur_core.model.checkpoint import resolve_model
from recur_core.settings import SETTINGS

LOGITS_BUDGET = 2 ** 27  # floats of kept logits per batch (512 MB): bounds the rows per batch for big vocabularies


@dataclass(frozen=True)
class Request:
    inputs: tuple[int, ...]
    targets: tuple[int, ...]

    def __post_init__(self):
        if not self.targets or len(self.targets) > len(self.inputs):
            raise ValueError(f"a request scores 1..len(inputs) targets, got {len(self.targets)} for "
                             f"{len(self.inputs)} inputs")


@dataclass(frozen=True)
class Score:
    """log p(targets | inputs) in nats, whether every target is the argmax, and the exit loop of each
    scored position (the positions whose logits predict the targets)."""

    logprob: float
    greedy: bool
    loops: tuple[int, ...]


def group_runs(inputs: list[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """(runs, run of each input): every input is read off the longest input it is a prefix of.

    In lexicographic order an input that is a prefix of others comes right before one of them (anything
    sorted between a prefix and its extension starts with the prefix), so one backward pass over the
    sorted distinct inputs finds each one's run."""
    distinct = sorted(set(inputs))
    run_of: dict[tuple[int, ...], int] = {}
    runs: list[tuple[int, ...]] = []
    for i in range(len(distinct) - 1, -1, -1):
        seq = distinct[i]
        after = distinct[i + 1] if i + 1 < len(distinct) else None
        if after is not None and after[:len(seq)] == seq:
            run_of[seq] = run_of[after]
        else:
            run_of[seq] = len(runs)
            runs.append(seq)
    return runs, [run_of[seq] for seq in inputs]


@dataclass
class Scoring:
    """What `score_requests` returns: a Score per request, and the exit loop of every position the
    runs computed (each shared position once): the compute the requests cost."""

    scores: list[Score]
    run_loops: list[int]


def score_requests(ckpt, requests: list[Request], policy: Policy, *, kv_rule: str = SETTINGS.kv_rule,
                   seed: int = SETTINGS.seed, max_loops: int | None = None, batch_size: int = 16,
                   mode: str = "fixed_point", check_every: int = 1, pad_id: int = 0, progress=None) -> Scoring:
    """Score every request under `policy` (see the module docstring); progress(done_runs, runs) is
    called after each batch."""
    runs, run_of = group_runs([r.inputs for r in requests])
    by_run: dict[int, list[int]] = {}
    for i, run in enumerate(run_of):
        by_run.setdefault(run, []).append(i)
    order = sorted(range(len(runs)), key=lambda r: -len(runs[r]))
    scores: list[Score | None] = [None] * len(requests)
    run_loops: list[int] = []
    done = 0
    while done < len(order):
        longest = len(runs[order[done]])
        rows = max(1, min(batch_size, LOGITS_BUDGET // (longest * resolve_model(ckpt)[0].cfg.vocab_size)))
        batch = order[done:done + rows]
        # the inputs, right-padded, plus one dummy target column (teacher_forced scores windows (N, T + 1))
        windows = torch.full((len(batch), longest + 1), pad_id, dtype=torch.long)
        for row, run in enumerate(batch):
            windows[row, :len(runs[run])] = torch.tensor(runs[run])
        tf = teacher_forced(ckpt, windows, policy, kv_rule, seed=seed, max_loops=max_loops, batch_size=len(batch),
                            mode=mode, keep_logits=True, check_every=check_every, noise_rows=[0] * len(batch))
        logp = torch.log_softmax(tf.logits, dim=-1)
        for row, run in enumerate(batch):
            run_loops.extend(tf.exit_loop[row, :len(runs[run])].tolist())
            for i in by_run[run]:
                scores[i] = _read_off(logp[row], tf.exit_loop[row], requests[i])
        done += len(batch)
        if progress is not None:
            progress(done, len(runs))
    return Scoring(scores, run_loops)


def _read_off(logp: torch.Tensor, exit_loop: torch.Tensor, request: Request) -> Score:
    """A request's score from its run's log-probs (T, V) and exit loops (T,)."""
    n, c = len(request.inputs), len(request.targets)
    pos = torch.arange(n - c, n)
    targets = torch.tensor(request.targets)
    chosen = logp[pos, targets]
    return Score(float(chosen.double().sum()), bool((logp[pos].argmax(-1) == targets).all()),
                 tuple(int(x) for x in exit_loop[pos]))
