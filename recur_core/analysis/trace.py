"""Loop-by-loop traces: what the model outputs after every loop, per token.

`trace(ckpt, ids, max_loops, seed)` runs the model at uniform depth max_loops and records, per token
and loop i = 1..max_loops, the statistics of p_i = softmax(head(coda(s_i))):

  kl_prev       KL(p_i || p_{i-1}) in nats (this direction: expectation under the newer p_i).
  kl_prev_reverse  KL(p_{i-1} || p_i) in nats: the reverse direction, the one Huginn's KL exit uses.
  state_change  ||s_i - s_{i-1}|| / ||s_i|| of the core state (L2 over the model dim).
  cosine_change 1 - cos(s_i, s_{i-1}) of the core state (Huginn's cosine exit).
  state_step    ||s_i - s_{i-1}||, the state's step size (absolute; Accel's delta_i).
  state_norm    ||s_i||, the hidden-state norm.
  ce            -log p_i[next token] in nats; NaN where there is no next token.
  entropy       entropy of p_i in nats.
  argmax        the most likely next token id; top1_prob its probability.
  topk_ids / topk_probs   the k most likely tokens (the logit lens), descending.
  exit_lambda   for a model with a learned exit gate (Ouro), the gate's exit probability
                sigmoid(w . s_i + b) after loop i (GateExit's fast face reads it); absent otherwise.

Loop 1 convention: s_0 is the initial noise state and p_0 = head(coda(s_0)) (`exits.halting.read_start`), the readout of that
noise. Loop 1's kl_prev, kl_prev_reverse, state_change and cosine_change are measured against them, so every entry is finite and a
policy may halt at loop 1 (A1 with eps = inf does).

Inputs: `ids` of shape (N, T + 1) are windows, as saved in checkpoints: the model reads w[:, :-1]
and is scored against w[:, 1:]. A 1-D `ids` of length T is one text (e.g. pasted): the model reads
all T tokens and the last one has no target (ce NaN there).

Padding: positions that carried zero loss weight in training are excluded from every statistic.
A checkpoint trained on the hops task (recur_core/tasks/hops.py) pads each program window with EOS and
weighs padding-predicting-padding 0; `trace` marks those positions in `Trace.zero_weight`, and
`Trace.scored` (a target, nonzero weight) is what every loss, KL and class statistic counts.
Other checkpoints weighed every position alike: nothing is marked.

Noise: window n (its row index in `ids`) starts from noise drawn by a generator seeded with
seed_for(seed, n) (LoopedLM.seeded_state), so a window's trace does not depend on how windows are batched, and the exact
harness (recur_core.analysis.harness) can reproduce the same noise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .. import cancel
from ..exits.halting import start_loops
from ..exits.readout import readout_group
from ..exits.signals import loops_readout, state_signals
from ..exits.trace_type import GATE_FIELD, LOOP_FIELDS, NO_TARGET, TOPK_FIELDS, Trace
from ..model.checkpoint import Checkpoint, model_id, resolve_model
from ..model.hf_folder import available_bytes
from ..model.looped_lm import LoopedLM
from ..tasks import task_of
from .cache import TraceCache, trace_key
from .parallel import map_batches

TRACE_FORMAT_VERSION = 3  # 2: kl_prev_reverse and cosine_change; 3: state_step and state_norm


# -- inputs and noise ---------------------------------------------------------------------------
def split_inputs(ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (N, T) int64: windows (N, T + 1) or one text (T,) (see module doc)."""
    ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[1] < 2:
            raise ValueError("windows need at least 2 tokens (inputs plus a target)")
        return ids[:, :-1], ids[:, 1:]
    if ids.dim() == 1:
        if len(ids) < 1:
            raise ValueError("empty text")
        targets = torch.cat([ids[1:], torch.tensor([NO_TARGET])])
        return ids[None], targets[None]
    raise ValueError(f"ids must be (N, T + 1) windows or a (T,) text, got shape {tuple(ids.shape)}")


@dataclass(frozen=True)
class Recording:
    """What a trace records: loops 1 .. max_loops, the top-k tokens of each (0: none), and the chance
    of a change that each A2 probe predicts (for LinearRouter's fast path)."""

    max_loops: int
    topk: int = 0
    probes: Sequence = ()


def trace_batch(model: LoopedLM, inputs: torch.Tensor, targets: torch.Tensor, noise: torch.Tensor,
                recording: Recording, on_state: Callable[[int, torch.Tensor], None] | None = None,
                on_loop: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
    """Run one batch as `recording` says; returns {field: (B, T, L) or (B, T, L, k)} tensors on the CPU.

    The core runs loop after loop; the readout (coda, head, statistics) takes `readout_group` loops'
    states at once, after the group's last core step. on_state(loop, state) is called after every
    core step (the probe harvest records states with it); on_loop(loop) too, except for the last
    loop, which is reported once every readout is done.
    """
    max_loops, topk, probes = recording.max_loops, recording.topk, recording.probes
    targets = targets.to(inputs.device)
    e, state, h_prev = start_loops(model, inputs, noise, read_out=True)  # h_prev: p_0's hidden
    gated = model.exit_gate is not None
    names = (*LOOP_FIELDS, *TOPK_FIELDS, *((GATE_FIELD,) if gated else ()))
    per_loop: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    chances: dict[str, list[torch.Tensor]] = {p.probe_id: [] for p in probes}
    group = readout_group(inputs.numel())
    pending = []  # states awaiting their readout
    for loop in range(1, max_loops + 1):
        cancel.check()
        new = model.core_step(state, e)
        for name, value in state_signals(new, state).items():
            per_loop[name].append(value.cpu())
        if gated:
            per_loop[GATE_FIELD].append(model.gate_lambda(new).cpu())
        for p in probes:
            chances[p.probe_id].append(p.chance(new, loop).float().cpu())
        if on_state is not None:
            on_state(loop, new)
        pending.append(new)
        if len(pending) == group or loop == max_loops:
            h_prev, stats = loops_readout(model, pending, h_prev, targets, topk)
            _append_readout(per_loop, stats)
            pending = []
        if on_loop is not None and loop < max_loops:
            on_loop(loop)
        state = new
    if on_loop is not None:
        on_loop(max_loops)
    out = {name: torch.stack(vals, dim=2) for name, vals in per_loop.items()}
    out.update({f"router_chance/{k}": torch.stack(v, dim=2) for k, v in chances.items()})
    return out


def _append_readout(per_loop: dict[str, list[torch.Tensor]], stats) -> None:
    """Each loop's readout fields (stats of leading shape (G, B, T)) onto per_loop, on the CPU."""
    for j in range(stats.argmax.shape[0]):
        for name in ("kl_prev", "kl_prev_reverse", "ce", "entropy", "argmax", "top1_prob"):
            per_loop[name].append(getattr(stats, name)[j].cpu())
        per_loop["topk_ids"].append(_or_empty(stats.topk_ids, j, stats.argmax.shape[1:], torch.long))
        per_loop["topk_probs"].append(_or_empty(stats.topk_probs, j, stats.argmax.shape[1:], torch.float32))


def _or_empty(topk_field: torch.Tensor | None, j: int, lead: torch.Size, dtype) -> torch.Tensor:
    """Loop j's top-k field on the CPU, or a (B, T, 0) placeholder when topk == 0."""
    return topk_field[j].cpu() if topk_field is not None else torch.empty((*lead, 0), dtype=dtype)


# -- the trace ----------------------------------------------------------------------------------
def resolve_cache(cache) -> TraceCache | None:
    """cache: True (the default folder), False / None (no caching), a folder, or a TraceCache."""
    if cache is True:
        return TraceCache()
    if cache is False or cache is None:
        return None
    return cache if isinstance(cache, TraceCache) else TraceCache(cache)


def progress_bar(progress, total: int, desc: str):
    """A callable(n_done) over `total` steps from `progress`: True (a tqdm bar), a callable
    (done, total) -> None, or None / False (silent). Returns (update, close). A callable hears
    (0, total) at once, so a UI shows that the work has begun before its first step ends."""
    if progress is True:
        from tqdm import tqdm
        bar = tqdm(total=total, desc=desc, dynamic_ncols=True)
        return bar.update, bar.close
    if callable(progress):
        done = [0]
        progress(0, total)

        def update(n):
            done[0] += n
            progress(done[0], total)
        return update, lambda: None
    return (lambda n: None), (lambda: None)


def trace(ckpt_or_model: Checkpoint | LoopedLM, ids, max_loops: int, seed: int = 0, *, topk: int = 5,
          probes: Sequence = (), device: str | torch.device | None = None, batch_size: int = 16,
          progress=None, cache=True) -> Trace:
    """Trace windows (N, T + 1) or one text (T,) at uniform depth max_loops (see the module doc).

    probes: A2 router probes whose per-loop chances to record (for LinearRouter's fast path).
    device: where to run; the model is moved there if it is elsewhere (None: the model's device).
    cache: True (default folder), False/None, a folder or a TraceCache; the key covers the
    checkpoint id, ids, max_loops, seed, topk, probe ids and TRACE_FORMAT_VERSION.
    Same inputs give an identical trace.
    """
    model, ckpt_id = resolve_model(ckpt_or_model)[0], model_id(ckpt_or_model)
    if device is not None:
        model.to(device)
    ids_np = np.asarray(ids.cpu() if torch.is_tensor(ids) else ids, dtype=np.int64)
    inputs, targets = split_inputs(ids_np)
    store = resolve_cache(cache)
    probe_ids = tuple(p.probe_id for p in probes)
    key = trace_key(ckpt_id, ids_np, max_loops, seed, topk, TRACE_FORMAT_VERSION, probe_ids)
    shapes = expected_shapes(inputs.shape, max_loops, topk, probe_ids, model.exit_gate is not None)
    check_memory(shapes)
    pad = padding_token(ckpt_or_model)
    if store is not None:
        hit = store.load(store.trace_path(ckpt_id, key), key, shapes)
        if hit is not None:
            return _from_arrays(hit[0], max_loops, seed, ckpt_id, pad)
    arrays = _compute(model, inputs, targets, Recording(max_loops, topk, probes), seed, batch_size, progress)
    if store is not None:
        store.save(store.trace_path(ckpt_id, key), key, arrays,
                   {"max_loops": max_loops, "seed": seed, "topk": topk, "checkpoint_id": ckpt_id,
                    "format_version": TRACE_FORMAT_VERSION})
    return _from_arrays(arrays, max_loops, seed, ckpt_id, pad)


def padding_token(ckpt_or_model) -> int | None:
    """The token whose padding positions (padding predicting padding) had zero loss weight in
    training, as the checkpoint's task says (`Task.padding`: EOS for hops programs, recur_core/tasks/hops.py);
    None for anything else, a bare model included (every position counts)."""
    if not isinstance(ckpt_or_model, Checkpoint):
        return None
    padding = task_of(ckpt_or_model.meta).padding
    return None if padding is None else ckpt_or_model.tokenizer().token_to_id(padding)


def weighted_positions(ckpt_or_model, ids) -> np.ndarray:
    """(N, T) bool: the positions of windows (N, T + 1) or a text (T,) that are not padding
    (`Trace.weighted` without tracing; the exact harness scores the same positions)."""
    inputs, targets = (t.numpy() for t in split_inputs(np.asarray(ids.cpu() if torch.is_tensor(ids) else ids)))
    zero = zero_weight_mask(inputs, targets, padding_token(ckpt_or_model))
    return np.ones(inputs.shape, dtype=bool) if zero is None else ~zero


def zero_weight_mask(ids: np.ndarray, targets: np.ndarray, pad: int | None) -> np.ndarray | None:
    """(N, T) bool padding positions (input and target both `pad`), or None when nothing is padding."""
    return None if pad is None else (ids == pad) & (targets == pad)


def is_cached(ckpt_or_model: Checkpoint | LoopedLM, ids, max_loops: int, seed: int = 0, *, topk: int = 5,
              probes: Sequence = (), cache=True) -> bool:
    """Whether `trace` with these arguments would be read from the cache (a file under its key)."""
    store = resolve_cache(cache)
    if store is None:
        return False
    ckpt_id = model_id(ckpt_or_model)
    ids_np = np.asarray(ids.cpu() if torch.is_tensor(ids) else ids, dtype=np.int64)
    key = trace_key(ckpt_id, ids_np, max_loops, seed, topk, TRACE_FORMAT_VERSION, tuple(p.probe_id for p in probes))
    return store.trace_path(ckpt_id, key).is_file()


INT_FIELDS = ("ids", "targets", "argmax", "topk_ids")  # int64; every other array is float32


def trace_bytes(shapes: dict[str, tuple]) -> int:
    """Memory a trace of these array shapes needs while it is built: each array twice (the per-loop
    pieces and the stacked result)."""
    return 2 * sum(int(np.prod(shape)) * (8 if name in INT_FIELDS else 4) for name, shape in shapes.items())


def refuse_if_too_big(ckpt_or_model, ids, max_loops: int, topk: int = 5) -> None:
    """What `trace(ckpt_or_model, ids, max_loops, topk=topk)` refuses before any work, without tracing:
    a ValueError naming the memory it needs and the limit (for a caller that starts the trace later,
    e.g. in a background job)."""
    model = resolve_model(ckpt_or_model)[0]
    inputs, _ = split_inputs(np.asarray(ids.cpu() if torch.is_tensor(ids) else ids, dtype=np.int64))
    check_memory(expected_shapes(inputs.shape, max_loops, topk, (), model.exit_gate is not None))


def check_memory(shapes: dict[str, tuple]) -> None:
    """Refuse, before any work, a trace that would not fit in the memory available now (at most
    $RECUR_MEMORY_LIMIT bytes when that is set)."""
    need, free = trace_bytes(shapes), available_bytes(torch.device("cpu"))
    if need > free:
        N, T, L = shapes["kl_prev"]
        raise ValueError(f"a trace of {N} windows x {T} tokens x {L} loops needs {need / 2**30:.2f} GiB, more than "
                          f"the {free / 2**30:.2f} GiB available (the limit: free memory, or $RECUR_MEMORY_LIMIT): "
                          "trace fewer windows or loops")


def expected_shapes(input_shape, max_loops: int, topk: int, probe_ids: Sequence[str],
                    gated: bool = False) -> dict[str, tuple]:
    N, T = input_shape
    loop_fields = (*LOOP_FIELDS, GATE_FIELD) if gated else LOOP_FIELDS
    shapes = {"ids": (N, T), "targets": (N, T), **{name: (N, T, max_loops) for name in loop_fields},
              **{name: (N, T, max_loops, topk) for name in TOPK_FIELDS}}
    shapes.update({f"router_chance/{k}": (N, T, max_loops) for k in probe_ids})
    return shapes


@torch.inference_mode()
def _compute(model, inputs, targets, recording: Recording, seed, batch_size, progress) -> dict:
    device = next(model.parameters()).device
    N, T = inputs.shape
    max_loops = recording.max_loops
    update, close = progress_bar(progress, N * max_loops, "trace (window-loops)")

    batches = [range(first, min(first + batch_size, N)) for first in range(0, N, batch_size)]
    lone = len(batches) == 1  # runs in the calling thread (map_batches): progress after every loop

    def run(rows: range) -> dict:
        return trace_batch(model, inputs[rows.start:rows.stop].to(device), targets[rows.start:rows.stop],
                           model.seeded_state(rows, seed, T), recording,
                           on_loop=(lambda loop: update(len(rows))) if lone else None)
    try:
        parts = map_batches(run, batches, device,
                            on_done=None if lone else lambda rows, _: update(len(rows) * max_loops))
    finally:
        close()
    arrays = {name: torch.cat([p[name] for p in parts]).numpy() for name in parts[0]}
    arrays["ids"], arrays["targets"] = inputs.numpy(), targets.numpy()
    return arrays


def _from_arrays(arrays: dict[str, np.ndarray], max_loops: int, seed: int, ckpt_id: str,
                 pad: int | None = None) -> Trace:
    prefix = "router_chance/"
    chance = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
    plain = {k: v for k, v in arrays.items() if not k.startswith(prefix)}
    return Trace(**plain, max_loops=max_loops, seed=seed, checkpoint_id=ckpt_id, router_chance=chance,
                 zero_weight=zero_weight_mask(plain["ids"], plain["targets"], pad))
