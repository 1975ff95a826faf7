"""Cached calls into recur_core for the analysis pages: loading checkpoints, traces, curves, probes.
(Decoding for the Generate page is ui/decoding.py; neither holds any science of its own.)

Caching, per the app's contract:
  * models: `st.cache_resource` keyed by (folder, its stamp: meta.json, config.json and weights,
    device); a shared object that is never mutated (recur_core runs it under inference_mode);
  * traces: recur_core's own disk cache (`$RECUR_CACHE_DIR`), plus `st.cache_resource` for the big
    eval-window trace (shared, read-only) and `st.cache_data` for the small pasted-text traces;
  * derived results: `st.cache_data` keyed by checkpoint id and every input (no `_argument`).

Every cached function takes (path, ckpt_id, device, ...) as plain values, which Streamlit hashes;
pages call them through the checkpoint's handle (ui/handle.py), which carries that key. A progress
bar is drawn from inside the function that does the long work (Streamlit replays it, empty, on a hit).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from recur_core import CheckpointError, cancel, load_checkpoint
from recur_core.analysis import allocation as alloc
from recur_core.analysis import curves as analysis
from recur_core.analysis.cache import TraceCache
from recur_core.analysis.certify import measured_lipschitz
from recur_core.analysis.dynamics import answer_flips, overthinking, overthinking_loops
from recur_core.analysis.dynamics import dynamics as state_dynamics
from recur_core.analysis.exact import ExactPath, TextDecoding
from recur_core.analysis.ground_truth import answer_hops, load_ground_truth
from recur_core.analysis.stats import Bootstrap
from recur_core.analysis.study import Study, StudySettings
from recur_core.analysis.trace import is_cached, refuse_if_too_big, trace
from recur_core.exits import catalogue
from recur_core.exits.policies import ConvergenceExit, GateExit, LinearRouter, Uniform
from recur_core.exits.trace_type import Trace
from recur_core.model.checkpoint import METRICS, TOKENIZER
from recur_core.model.metrics_log import read_metrics
from recur_core.settings import SETTINGS

from . import jobs
from .checkpoints import describe
from .strip import plain_visible

S = SETTINGS  # seed, bootstrap, windows, loops, top-k and grids: the same as `python -m recur_core.analyze`


# -- checkpoints ------------------------------------------------------------------------------------
@st.cache_resource(max_entries=6, show_spinner="Loading checkpoint…")
def _load(path: str, stamp: tuple, device: str, _meta: dict | None):
    return load_checkpoint(path, device, meta=_meta)


def checkpoint(path: str, device: str):
    """The loaded Checkpoint, cached on the folder's stamp (ui.checkpoints.folder_stamp; meta.json as
    the picker read it); CheckpointError with a clear message if it is unusable."""
    entry = describe(path)
    return _load(entry.path, entry.stamp, device, entry.meta_json)


def _ckpt(path: str, ckpt_id: str, device: str):
    ckpt = checkpoint(path, device)
    if ckpt.checkpoint_id != ckpt_id:
        raise CheckpointError(f"{path} changed on disk while the app was running; pick it again")
    return ckpt


@st.cache_resource(max_entries=8, show_spinner=False)
def tokenizer(path: str, ckpt_id: str):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(Path(path) / TOKENIZER))


def decode_ids(path: str, ckpt_id: str, ids) -> list[str]:
    """Each token id's own text (for predictions; a partial UTF-8 byte shows as �)."""
    tok = tokenizer(path, ckpt_id)
    return [tok.decode([int(i)]) for i in ids]


# -- progress ---------------------------------------------------------------------------------------
class Progress:
    """A recur_core progress callback (done, total) drawn as st.progress, created on first use
    (recur_core calls it with done 0 as the work starts)."""

    def __init__(self, label: str, unit: str = ""):
        self.label, self.unit, self.bar = label, unit, None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = st.progress(0.0, text=self.label)
        unit = f" {self.unit}" if self.unit else ""
        self.bar.progress(min(done / max(total, 1), 1.0), text=f"{self.label}: {done:,} / {total:,}{unit}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.empty()


# -- traces -----------------------------------------------------------------------------------------
FIRST_LOOK_WINDOWS = 16  # a page's first look at the eval set, while the full trace runs in the background


def study(path: str, ckpt_id: str, device: str) -> Study:
    """The checkpoint's Study with the app's settings (SETTINGS, the defaults of `python -m
    recur_core.analyze`): the same steps and disk-cache keys as the report. One per checkpoint and
    cache folder, kept across reruns, so what it measures once (the certified exit's L, the
    bootstrap) is not measured again on every rerun."""
    return _study(path, ckpt_id, device, str(TraceCache().root))


@st.cache_resource(max_entries=6, show_spinner=False)
def _study(path: str, ckpt_id: str, device: str, cache_dir: str) -> Study:
    return Study(_ckpt(path, ckpt_id, device), _study_settings(), cache=TraceCache(cache_dir))


def _study_settings() -> StudySettings:
    """The app's settings (S) as a Study's: what `python -m recur_core.analyze` runs by default."""
    return StudySettings(windows=S.windows, seed=S.seed, n_boot=S.n_boot, topk=S.topk, probe_windows=S.probe_windows,
                         probe_tokens=S.probe_tokens)


def _train_probes(ckpt, progress=None, cache_only: bool = False):
    """A2's probes as `python -m recur_core.analyze` trains them (Study.probes); {} when r_max < 2 or no
    probe windows ship."""
    return Study(ckpt, _study_settings(), cache=TraceCache()).probes(progress, cache_only)


@st.cache_resource(max_entries=6, show_spinner=False)
def probes(path: str, ckpt_id: str, device: str) -> dict:
    """A2's router probes (argmax and KL labels), from recur_core's probe cache or trained now."""
    bar = Progress("Training the A2 router probes (once per checkpoint)", "probe windows")
    try:
        return _train_probes(_ckpt(path, ckpt_id, device), progress=bar)
    finally:
        bar.close()


def trace_loops(ckpt) -> int:
    return S.trace_loops(ckpt.recipe)


def _eval_windows(ckpt):
    return ckpt.windows("eval")[:S.windows]


@st.cache_resource(max_entries=4, show_spinner=False)
def eval_trace(path: str, ckpt_id: str, device: str) -> Trace:
    """The canonical trace (Study.trace): the first 128 eval windows to max(32, r_max) loops with A2's
    chances (the same key as `python -m recur_core.analyze`, so either one fills the disk cache)."""
    probes(path, ckpt_id, device)  # trained here with their own bar, then read from the disk cache
    the_study = study(path, ckpt_id, device)
    bar = Progress(f"Tracing {len(the_study.eval_windows)} eval windows × {the_study.max_loops} loops (cached on "
                   "disk after this)", "window-loops")
    try:
        return the_study.trace(bar)
    finally:
        bar.close()


def eval_trace_key(path: str, ckpt_id: str, device: str) -> tuple:
    return "eval_trace", path, ckpt_id, device


def eval_trace_ready(path: str, ckpt_id: str, device: str) -> bool:
    """Whether the canonical trace can be had without a long wait: its background job finished, or
    it and its probes are on disk (e.g. from `python -m recur_core.analyze`)."""
    job = jobs.get(eval_trace_key(path, ckpt_id, device))
    if job is not None:
        return job.finished and not (job.error or job.stopped)
    return study(path, ckpt_id, device).is_traced()


def start_eval_trace(path: str, ckpt_id: str, device: str) -> jobs.Job:
    """The background job that trains the probes and traces the eval windows into the disk cache."""
    the_study = study(path, ckpt_id, device)

    def work(job: jobs.Job) -> None:
        the_study.probes(job.progress("Training the A2 router probes", "probe windows"))
        the_study.trace(job.progress(f"Tracing {len(the_study.eval_windows)} eval windows × {the_study.max_loops} "
                                     "loops", "window-loops"))
    return jobs.start(eval_trace_key(path, ckpt_id, device), work)


@st.cache_resource(max_entries=4, show_spinner=False)
def first_look_trace(path: str, ckpt_id: str, device: str) -> Trace:
    """The first FIRST_LOOK_WINDOWS eval windows to r_max loops (every policy's cap), traced without
    A2's probes (A0 / A1 only): what a page shows within seconds while the canonical trace runs in
    the background."""
    ckpt = _ckpt(path, ckpt_id, device)
    windows = _eval_windows(ckpt)[:FIRST_LOOK_WINDOWS]
    loops = min(trace_loops(ckpt), max(ckpt.recipe.r_max, 2))
    bar = Progress(f"First look: tracing {len(windows)} eval windows × {loops} loops", "window-loops")
    try:
        return trace(ckpt, windows, loops, S.seed, topk=S.topk, cache=TraceCache(), progress=bar,
                     batch_size=max(1, len(windows) // 2))  # two batches: both cores busy
    finally:
        bar.close()


@st.cache_data(max_entries=64, show_spinner=False)
def text_trace(path: str, ckpt_id: str, device: str, ids: tuple[int, ...], with_probes: bool) -> Trace:
    """Trace of one pasted text (token ids); with A2's chances when with_probes."""
    ckpt = _ckpt(path, ckpt_id, device)
    prb = list(probes(path, ckpt_id, device).values()) if with_probes else []
    bar = Progress(f"Tracing {len(ids)} tokens × {trace_loops(ckpt)} loops", "token-loops")
    try:
        return trace(ckpt, np.asarray(ids, dtype=np.int64), trace_loops(ckpt), S.seed, topk=S.topk, probes=prb,
                     cache=TraceCache(), progress=lambda done, total: bar(done * len(ids), total * len(ids)))
    finally:
        bar.close()


def source_trace(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None,
                 with_probes: bool = True, first_look: bool = False) -> Trace:
    """The eval-window trace (ids None; its first look when first_look) or a pasted text's trace."""
    if ids is None:
        return first_look_trace(path, ckpt_id, device) if first_look else eval_trace(path, ckpt_id, device)
    return text_trace(path, ckpt_id, device, ids, with_probes)


# -- policies on a trace ----------------------------------------------------------------------------
def a0(r: int) -> Uniform:
    return catalogue.make("A0", r)


def a1(eps: float, r_max: int) -> ConvergenceExit:
    return catalogue.make("A1", eps, r_max=r_max)


def a2(path: str, ckpt_id: str, device: str, kind: str, tau: float, r_max: int) -> LinearRouter:
    return catalogue.make("A2", tau, r_max=r_max, probe=probes(path, ckpt_id, device)[kind])


def policy(name: str, threshold, r_max: int):
    """A catalogue family that needs neither a probe nor a gate (the Compare page's criteria)."""
    return catalogue.make(name, threshold, r_max=r_max)


@st.cache_data(max_entries=16, show_spinner="Measuring the readout's Lipschitz bound L…")
def lipschitz(path: str, ckpt_id: str, device: str, text: tuple[int, ...] | None) -> dict:
    """The certified exit's L for this checkpoint (recur_core.analysis.certify.measured_lipschitz: on
    its probe windows, or on `text` for a folder that ships none)."""
    ckpt = _ckpt(path, ckpt_id, device)
    return measured_lipschitz(ckpt, trace_loops(ckpt), S.seed, None if text is None else np.asarray(text))


def gate(path: str, ckpt_id: str, device: str) -> tuple | None:
    """(gate_lambda, trained steps) of a model with a learned exit gate (Ouro), else None."""
    return alloc.model_gate(_ckpt(path, ckpt_id, device))


def gate_exit(path: str, ckpt_id: str, device: str, q: float, r_max: int) -> GateExit:
    """Ouro's Q-exit at q, capped at the gate's trained steps (and r_max)."""
    return catalogue.make("Gate", q, r_max=r_max, gate=gate(path, ckpt_id, device))


@dataclass
class Outcome:
    """A policy applied to a trace (fast path) or in real decoding (exact, `decoded` set: each token's
    output at its exit comes from decoding, not from the trace): per-token exits and the policy's score.
    `pending`: exact decoding was asked for and is still running in the background; until it ends
    this outcome is the fast path's."""

    depth: np.ndarray  # (N, T) exit loop
    converged: np.ndarray  # (N, T) False where only r_max stopped the token
    mean_loops: float  # over scored tokens
    loss: float  # nats / scored token
    n_scored: int
    decoded: TextDecoding | None = None
    pending: jobs.Job | None = None


def outcome(tr: Trace, policy) -> Outcome:
    ex = policy.exits(tr)
    sums = analysis.fast_sums(tr, policy)
    return Outcome(ex.depth, ex.converged, sums.mean_loops, sums.mean_loss, sums.n_scored)


DECODE_WAIT_S = 3.0  # exact decoding of a text that takes longer runs on in the background (the fast path meanwhile)
_DECODING = threading.Lock()  # one exact decoding at a time: they share the CPU cores


def decoded_key(path: str, ckpt_id: str, device: str, ids: tuple[int, ...], policy) -> tuple:
    return "decoded_text", path, ckpt_id, device, ids, repr(policy)


def start_decoding(path: str, ckpt_id: str, device: str, ids: tuple[int, ...], policy,
                   guess: np.ndarray | None = None) -> jobs.Job:
    """The background job that decodes a text with real halting under `policy` into the disk cache
    (recur_core.analysis.exact.ExactPath.decoded_text, by the fixed point seeded with `guess`, the fast exits),
    its progress the tokens settled; the job holds the decoding too (job.result), so a page never
    depends on the disk cache to see it."""
    ckpt = _ckpt(path, ckpt_id, device)

    def work(job: jobs.Job) -> TextDecoding:
        job.progress("Waiting for another decoding to end", "tokens")(0, len(ids))
        while not _DECODING.acquire(timeout=0.5):
            cancel.check()  # Stop acts while it waits too
        try:
            progress = job.progress(f"Decoding {len(ids)} tokens with real halting ({policy!r})", "tokens")
            return ExactPath(ckpt, np.asarray(ids, dtype=np.int64), cache=TraceCache(), progress=progress
                             ).decoded_text(policy, trace_loops(ckpt), S.seed, guess=guess)
        finally:
            _DECODING.release()
    return jobs.start(decoded_key(path, ckpt_id, device, ids, policy), work)


def text_outcome(path: str, ckpt_id: str, device: str, ids: tuple[int, ...], tr: Trace, policy,
                 exact: bool) -> Outcome:
    """A policy on a pasted text: exact (real decoding, through the disk cache; a decoding that
    takes more than DECODE_WAIT_S goes on in the background, and the fast path stands in with
    `pending` set) or fast (its uniform trace `tr`)."""
    if not exact:
        return outcome(tr, policy)
    ckpt, ids_np = _ckpt(path, ckpt_id, device), np.asarray(ids, dtype=np.int64)
    d = ExactPath(ckpt, ids_np, cache=TraceCache(), cache_only=True).decoded_text(policy, trace_loops(ckpt), S.seed)
    if d is None:
        fast = outcome(tr, policy)
        job = start_decoding(path, ckpt_id, device, ids, policy, guess=fast.depth[0])
        job.wait(DECODE_WAIT_S)
        d = job.result  # not the disk cache: it may since point elsewhere, or be unwritable
        if d is None:
            fast.pending = job
            return fast
    return Outcome(d.exit_depth[None], d.converged[None], d.mean_loops, d.loss, len(ids) - 1, d)


# -- sweeps (page 2) --------------------------------------------------------------------------------
def differences(curves: dict, boot: Bootstrap) -> dict[str, dict]:
    """Every curve but A0 minus A0 at the same mean loops, with paired bands."""
    return {name: analysis.difference_from_a0(c, curves["A0"], boot) for name, c in curves.items() if name != "A0"}


@st.cache_data(max_entries=16, show_spinner="Sweeping ε and τ over the trace…")
def sweep_fast(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None, r_max: int, r_bar: int,
               first_look: bool = False) -> dict:
    """A0 / A1 / A2 allocation curves (fast path) with the matched-depth table, on the grids of
    report.json (A1's ε grid holds every stop of the ε slider, so moving it only looks a point up);
    first_look: A0 and A1 on the first look's windows (no probes yet)."""
    tr = source_trace(path, ckpt_id, device, ids, first_look=first_look)
    prb = {} if first_look else probes(path, ckpt_id, device)
    boot = Bootstrap(tr.n_windows, S.n_boot, S.seed)
    res = alloc.allocation(tr, boot, r_bar, alloc.allocation_families(r_max, probes=prb, gate=gate(path, ckpt_id, device)))
    return {"report": res["report"], "curves": res["curves"], "diffs": differences(res["curves"], boot),
            "n_windows": tr.n_windows, "seq_len": tr.seq_len, "probe_metrics": {k: p.metrics for k, p in prb.items()}}


def _exact_inputs(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None, n_windows: int):

    ckpt = _ckpt(path, ckpt_id, device)
    if ids is None:
        full = eval_trace(path, ckpt_id, device)
        n = min(n_windows, full.n_windows)
        return ckpt, full.subset(range(n)), ckpt.windows("eval")[:n]
    return ckpt, text_trace(path, ckpt_id, device, ids, True), np.asarray(ids, dtype=np.int64)


def exact_key(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None, n_windows: int) -> tuple:
    return "exact_sweep", path, ckpt_id, device, ids, n_windows


def start_exact_sweep(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None, r_max: int, r_bar: int,
                      n_windows: int) -> jobs.Job:
    """The background job that runs the exact plan into the harness's disk cache (read back by
    sweep_exact). Its inputs come from recur_core's disk caches (the page has traced them)."""
    ckpt = _ckpt(path, ckpt_id, device)

    def work(job: jobs.Job) -> None:
        prb = _train_probes(ckpt)
        inputs = _eval_windows(ckpt)[:n_windows] if ids is None else np.asarray(ids, dtype=np.int64)
        tr = trace(ckpt, _eval_windows(ckpt) if ids is None else inputs, trace_loops(ckpt), S.seed, topk=S.topk,
                   probes=list(prb.values()), cache=TraceCache())
        tr = tr.subset(range(min(n_windows, tr.n_windows))) if ids is None else tr
        bar = job.progress(f"Exact masking harness on {tr.n_windows} window(s), one pass per round", "window passes")
        alloc.allocation(tr, Bootstrap(tr.n_windows, S.n_boot, S.seed), r_bar,
                         alloc.allocation_families(r_max, probes=prb, gate=alloc.model_gate(ckpt)),
                         ExactPath(ckpt, inputs, TraceCache(), bar))
    return jobs.start(exact_key(path, ckpt_id, device, ids, n_windows), work)


def exact_cached(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None, r_max: int, r_bar: int,
                 n_windows: int) -> bool:
    """Whether the exact plan is already in the disk cache (e.g. written by `python -m recur_core.analyze`)."""
    ckpt, tr, inputs = _exact_inputs(path, ckpt_id, device, ids, n_windows)
    boot = Bootstrap(tr.n_windows, S.n_boot, S.seed)
    families = alloc.allocation_families(r_max, probes=probes(path, ckpt_id, device), gate=alloc.model_gate(ckpt))
    return alloc.exact_is_cached(tr, boot, r_bar, families, ExactPath(ckpt, inputs, TraceCache()))


@st.cache_data(max_entries=8, show_spinner=False)
def sweep_exact(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None, r_max: int, r_bar: int,
                n_windows: int) -> dict:
    """The report's families in the masking harness on the exact plan's points (alloc.allocation with
    exact=...; cached on disk, shared with the analyze CLI), with the fast − exact gap per policy at
    those points on the same windows (paired bootstrap)."""
    ckpt, tr, inputs = _exact_inputs(path, ckpt_id, device, ids, n_windows)
    prb = probes(path, ckpt_id, device)
    boot = Bootstrap(tr.n_windows, S.n_boot, S.seed)
    families = alloc.allocation_families(r_max, probes=prb, gate=alloc.model_gate(ckpt))
    fast = alloc.allocation(tr, boot, r_bar, families)
    bar = Progress(f"Exact masking harness on {tr.n_windows} window(s): the plan's ε / τ points, one pass per round")
    try:
        exact = alloc.allocation(tr, boot, r_bar, families, ExactPath(ckpt, inputs, TraceCache(), bar))
    finally:
        bar.close()
    return {"report": exact["report"], "curves": exact["curves"], "diffs": differences(exact["curves"], boot),
            "gaps": analysis.fast_minus_exact(fast["curves"], exact["curves"], boot), "n_windows": tr.n_windows,
            "seq_len": tr.seq_len}


# -- convergence, classes, elasticity --------------------------------------------------------------
@st.cache_data(max_entries=16, show_spinner="Measuring convergence…")
def convergence(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None, first_look: bool = False) -> dict:
    tr = source_trace(path, ckpt_id, device, ids, with_probes=ids is None, first_look=first_look)
    return analysis.convergence(tr, Bootstrap(tr.n_windows, S.n_boot, S.seed))


@st.cache_data(max_entries=16, show_spinner=False)
def dynamics(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None, first_look: bool = False) -> dict:
    """Hidden-state norms per loop and the tokens' regimes (recur_core.analysis.dynamics), off the same trace."""
    tr = source_trace(path, ckpt_id, device, ids, with_probes=ids is None, first_look=first_look)
    return state_dynamics(tr, Bootstrap(tr.n_windows, S.n_boot, S.seed))


@st.cache_data(max_entries=64, show_spinner=False)
def exit_depths(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None, eps: float,
                r_max: int, first_look: bool = False) -> dict:
    """A1's exit depth of every scored token at eps: depths and converged flags (flattened)."""
    tr = source_trace(path, ckpt_id, device, ids, with_probes=ids is None, first_look=first_look)
    out = outcome(tr, a1(eps, r_max))
    scored = tr.scored
    return {"depth": out.depth[scored], "converged": out.converged[scored], "mean_loops": out.mean_loops,
            "loss": out.loss}


@st.cache_data(max_entries=8, show_spinner="Classifying the vocabulary…")
def vocab_classes(path: str, ckpt_id: str, vocab_size: int) -> np.ndarray:
    return analysis.vocab_classes(tokenizer(path, ckpt_id), vocab_size)


@st.cache_data(max_entries=32, show_spinner="Exit depth by token class…")
def token_classes(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None, eps: float,
                  r_max: int, vocab_size: int, first_look: bool = False) -> dict:
    """analysis.token_classes at A1(eps), plus the tokens of each class: one row per token id with
    its count and mean exit depth over the scored positions where it occurs."""
    tr = source_trace(path, ckpt_id, device, ids, with_probes=ids is None, first_look=first_look)
    classes = vocab_classes(path, ckpt_id, vocab_size)
    policy = a1(eps, r_max)
    summary = analysis.token_classes(tr, classes, policy, Bootstrap(tr.n_windows, S.n_boot, S.seed))
    per_token = pd.DataFrame(analysis.token_exit_table(tr, classes, policy))
    per_token.insert(1, "token", [plain_visible(t) for t in decode_ids(path, ckpt_id, per_token["token_id"])])
    return {"summary": summary, "tokens": per_token}


@st.cache_data(max_entries=16, show_spinner="Loss at every depth…")
def elasticity(path: str, ckpt_id: str, device: str, first_look: bool = False) -> dict:
    tr = source_trace(path, ckpt_id, device, None, first_look=first_look)
    return analysis.elasticity(tr, Bootstrap(tr.n_windows, S.n_boot, S.seed))


@st.cache_data(max_entries=16, show_spinner="Paired differences…")
def elasticity_difference(path: str, ckpt_id: str, ref_path: str, ref_id: str, device: str,
                          first_look: bool = False) -> dict:
    """Loss at each depth minus the reference checkpoint's, paired over the same eval windows
    (ValueError when the two checkpoints do not share their eval windows); first_look: on both
    first looks."""
    tr, ref = (source_trace(p, i, device, None, first_look=first_look) for p, i in ((path, ckpt_id), (ref_path, ref_id)))
    return analysis.elasticity_difference(tr, ref, Bootstrap(ref.n_windows, S.n_boot, S.seed))


# -- overthinking: a trace far past r_max ------------------------------------------------------------
def _deep_inputs(ckpt, ids: tuple[int, ...] | None):
    return _eval_windows(ckpt) if ids is None else np.asarray(ids, dtype=np.int64)


def overthinking_size(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None) -> tuple[int, int]:
    """(windows, loops) of the overthinking sweep; a ValueError naming the memory limit, before any
    work, when its trace would not fit (recur_core.analysis.trace.refuse_if_too_big)."""
    ckpt = _ckpt(path, ckpt_id, device)
    inputs, loops = _deep_inputs(ckpt, ids), overthinking_loops(ckpt.recipe.r_max)
    refuse_if_too_big(ckpt, inputs, loops)
    return (1 if ids is not None else len(inputs)), loops


def overthinking_key(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None) -> tuple:
    return "overthinking", path, ckpt_id, device, ids


def _overthinking(ckpt, path: str, ids: tuple[int, ...] | None, progress=None) -> dict:
    """recur_core's overthinking figures off the deep trace (the same disk-cache key as `analyze
    --overthinking`), answer accuracy on a ground-truth checkpoint's eval windows, and for a pasted text
    each token's answer flips, its last flip loop and its argmax at r_max and at the last loop."""
    r_max, loops = ckpt.recipe.r_max, overthinking_loops(ckpt.recipe.r_max)
    tr = trace(ckpt, _deep_inputs(ckpt, ids), loops, S.seed, cache=TraceCache(), progress=progress)
    gt = load_ground_truth(path) if ids is None else None
    out = overthinking(tr, Bootstrap(tr.n_windows, S.n_boot, S.seed), r_max, None if gt is None else answer_hops(tr, gt[0]))
    if ids is not None:
        flips, last = answer_flips(tr)
        out["tokens"] = {"flips": flips[0], "last_flip": last[0], "argmax_at_r_max": tr.argmax[0, :, min(r_max, loops) - 1],
                         "argmax_at_last": tr.argmax[0, :, -1]}
    return out


def overthinking_ready(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None) -> bool:
    """Whether the deep trace can be had without a long wait: its job finished, or it is on disk."""
    job = jobs.get(overthinking_key(path, ckpt_id, device, ids))
    if job is not None and job.finished and not (job.error or job.stopped):
        return True
    ckpt = _ckpt(path, ckpt_id, device)
    return is_cached(ckpt, _deep_inputs(ckpt, ids), overthinking_loops(ckpt.recipe.r_max), S.seed, cache=TraceCache())


def start_overthinking(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None) -> jobs.Job:
    """The background job that traces the windows (or the text) far past r_max into the disk cache;
    it holds the figures too (job.result)."""
    ckpt = _ckpt(path, ckpt_id, device)
    windows, loops = overthinking_size(path, ckpt_id, device, ids)

    def work(job: jobs.Job) -> dict:
        return _overthinking(ckpt, path, ids, job.progress(f"Tracing {windows} window(s) × {loops} loops",
                                                           "window-loops"))
    return jobs.start(overthinking_key(path, ckpt_id, device, ids), work)


@st.cache_data(max_entries=8, show_spinner="Reading the overthinking sweep…")
def overthinking_figures(path: str, ckpt_id: str, device: str, ids: tuple[int, ...] | None) -> dict:
    """The figures of a finished sweep: its job's, else off the deep trace on disk (overthinking_ready)."""
    job = jobs.get(overthinking_key(path, ckpt_id, device, ids))
    if job is not None and job.result is not None:
        return job.result
    return _overthinking(_ckpt(path, ckpt_id, device), path, ids)


# -- training log -----------------------------------------------------------------------------------
@st.cache_data(max_entries=16, show_spinner=False)
def training_log(path: str, stamp: str) -> dict:
    """The checkpoint's metrics.jsonl, parsed by recur_core.model.metrics_log (beside its writer)."""
    log = read_metrics(Path(path) / METRICS)
    return {"train": log.train, "eval": log.evals, "bad_lines": log.bad_lines, "start": log.start}


def log_stamp(path: str) -> str:
    try:
        s = (Path(path) / METRICS).stat()
    except OSError:
        return "missing"
    return f"{s.st_mtime_ns}-{s.st_size}"
