"""Teacher-forced decoding of windows with real per-token halting: every position scored on the true
next token, as decoding would have produced it.

    tf = teacher_forced(ckpt, windows, ConvergenceExit(1e-3), "recompute", mode="fixed_point")
    tf.ce, tf.exit_loop, tf.argmax, tf.passes

Three ways to the same kind of result: "decode" runs token by token (`Decoder.step`, the reference),
"fixed_point" gives exactly that by parallel passes (recur_core.decoding.fixed_point, a few passes
instead of T steps), "prefill" is one parallel pass (exact for rules that read only the state; for
readout rules the earlier tokens' readout context is their current loop, the masking harness's view).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import cancel
from ..exits.halting import HaltSchedule
from ..exits.policies import Policy
from ..model.checkpoint import resolve_model
from .decode import Decoder, default_max_loops
from .fixed_point import fixed_point, needs_passes

TEACHER_FORCED_MODES = ("decode", "fixed_point", "prefill")

# Which exact mode decodes a batch of windows (`exact_mode`). On a CPU a lockstep step of a small model is a few
# hundred small ops whose cost hardly grows with the batch, while the fixed point repeats every position's
# arithmetic over 3-5 passes: with 32 windows, lockstep decoding took 0.31-0.55x the fixed point's time on every
# shipped checkpoint (0.6M-3.8M parameters, docs/benchmarks/fixed-point.md). Passes pay for a few windows (8 hops
# programs: 1.4x faster than lockstep), and for a large model, whose weights a step reads for one token a row.
LOCKSTEP_MAX_PARAMS = 16_000_000
LOCKSTEP_MIN_BATCH = 16


def exact_mode(model, policy: Policy, batch: int) -> str:
    """The cheaper of the two exact modes for `batch` windows of `model` (a LoopedLM) under `policy`:
    "fixed_point" where one pass is exact (a rule that reads only the state, or a model without a coda:
    fixed_point.needs_passes); else "decode" (token by token in lockstep, the reference) for a small model
    on a CPU and a batch of LOCKSTEP_MIN_BATCH windows or more, else "fixed_point". Both give what real
    decoding gets; at a threshold at the float noise of its signal the order of their arithmetic can move
    an exit, so a result names the mode it came from."""
    small = sum(p.numel() for p in model.parameters()) <= LOCKSTEP_MAX_PARAMS
    on_cpu = model.embed.weight.device.type == "cpu"
    lockstep = needs_passes(model, policy) and on_cpu and small and batch >= LOCKSTEP_MIN_BATCH
    return "decode" if lockstep else "fixed_point"


@dataclass
class TeacherForced:
    """Per-token results of teacher-forced decoding of windows (N, T + 1): ce / exit_loop / argmax (N, T)
    (argmax: the token greedy decoding would emit at each position)."""

    ce: Tensor
    exit_loop: Tensor
    argmax: Tensor
    logits: Tensor | None = None
    readouts: int = 0
    passes: list[int] = field(default_factory=list)  # mode "fixed_point": the passes each batch took

    @property
    def loss(self) -> float:
        return float(self.ce.mean())

    @property
    def mean_loops(self) -> float:
        return float(self.exit_loop.float().mean())


@torch.inference_mode()
def teacher_forced(ckpt_or_model, windows, policy: Policy, kv_rule: str | None = None, *, seed: int = 0,
                   max_loops: int | None = None, batch_size: int = 16, mode: str = "decode",
                   keep_logits: bool = False, first_window: int = 0,
                   check_every: int = 1, noise_rows=None, progress=None, position_progress=None,
                   guess=None) -> TeacherForced:
    """Decode windows (N, T + 1) with the true next tokens and score every position.

    mode "decode": token by token, exactly what `generate` computes for each window (rows in
    lockstep, see docs/DECODING.md). mode "fixed_point": the same result by parallel passes
    (recur_core.decoding.fixed_point; `passes` records how many each batch took). mode "prefill":
    one pass, all positions in parallel (`Decoder.prefill`);
    with kv_rule "recompute" that is the masking harness, with "continue" (Ouro's default) the
    uniform forward with each token's output read at its exit loop (Ouro's reference).
    Window n's noise is model.seeded_state([first_window + n], seed), as in recur_core.analysis.trace;
    noise_rows (one row index per window) overrides that, e.g. [0] * N scores every window with the
    noise `generate` gives a sequence alone (what lm-eval's scoring does, so a score never depends on
    the batch it was run in). progress: None or a callable(windows done, N), called after each batch;
    position_progress: None or a callable(positions done, T), called after each position of a batch
    in mode "decode" (a long text's decoding reports token by token), after each pass in mode
    "fixed_point" (positions settled, averaged over the batch's windows). guess: exits (N, T) that seed
    mode "fixed_point"'s first pass (e.g. the fast path's); the result does not depend on it, only the
    number of passes.
    Returns per-token ce (nats), exit loops and argmax (N, T), and the kept logits when keep_logits.
    """
    if mode not in TEACHER_FORCED_MODES:
        raise ValueError(f"mode must be one of {', '.join(TEACHER_FORCED_MODES)}, got {mode!r}")
    model, ckpt = resolve_model(ckpt_or_model)
    windows = torch.as_tensor(windows, dtype=torch.long)
    cap = default_max_loops(policy, ckpt, max_loops)
    device = model.embed.weight.device
    N, T = windows.shape[0], (windows.shape[1] - 1 if windows.ndim == 2 else 0)
    if windows.ndim != 2 or T < 1:
        raise ValueError(f"teacher_forced takes windows (N, T + 1) of at least 2 tokens (an input and its target), "
                         f"got shape {tuple(windows.shape)}")
    if T > model.cfg.max_seq_len:
        raise ValueError(f"windows of {T} input tokens exceed the context (max_seq_len {model.cfg.max_seq_len})")
    rows_of = list(range(first_window, first_window + N)) if noise_rows is None else [int(r) for r in noise_rows]
    if len(rows_of) != N:
        raise ValueError(f"noise_rows has {len(rows_of)} entries for {N} windows")
    ces, exits, argmaxes, logits_out, readouts, passes = [], [], [], [], 0, []
    for start in range(0, N, batch_size):
        rows = range(start, min(start + batch_size, N))
        ids = windows[start:rows.stop].to(device)
        noise = model.seeded_state([rows_of[n] for n in rows], seed)
        if mode == "fixed_point":
            on_pass = None if position_progress is None else (
                lambda settled, total: position_progress(settled * T // total, T))
            dec = fixed_point(model, ids[:, :-1], HaltSchedule(policy, cap, check_every), noise=noise,
                              kv_rule=kv_rule, on_pass=on_pass,
                              guess=None if guess is None else torch.as_tensor(guess[start:rows.stop]).to(device))
            logits, ex = dec.logits, dec.exits
            passes.append(dec.passes)
        else:
            dec = Decoder(model, HaltSchedule(policy, cap, check_every), batch=len(rows), kv_rule=kv_rule,
                          noise=noise, max_len=T)
            if mode == "prefill":
                logits, ex = dec.prefill(ids[:, :-1])
            else:
                steps = []
                for t in range(T):
                    cancel.check()
                    steps.append(dec.step(ids[:, t], t))
                    if position_progress is not None:
                        position_progress(t + 1, T)
                logits = torch.stack([s[0] for s in steps], dim=1)
                ex = torch.stack([s[1] for s in steps], dim=1)
        readouts += dec.readouts
        logits = logits.float()
        ces.append(F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").cpu())
        exits.append(ex.cpu())
        argmaxes.append(logits.argmax(-1).cpu())
        if keep_logits:
            logits_out.append(logits.cpu())
        if progress is not None:
            progress(rows.stop, N)
    return TeacherForced(torch.cat(ces), torch.cat(exits), torch.cat(argmaxes),
                         torch.cat(logits_out) if keep_logits else None, readouts, passes)


