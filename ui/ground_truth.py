"""The Ground truth page's cached calls and figures: exit policies against known hop counts.

Only for checkpoints that carry ground truth (training/hops.py; recur_core.analysis.ground_truth). The
eval-set numbers are `recur_core.analysis.ground_truth.ground_truth_section` on the same trace and grids as
`python -m recur_core.analyze`, so the page and report.json agree: exact (the masking harness, as
real halting) by default, computed in the background into the harness's disk cache the first time,
and the fast path one click away.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from recur_core.analysis.cache import TraceCache
from recur_core.analysis.ground_truth import (
    eos_id,
    ground_truth_section,
    load_ground_truth,
)
from recur_core.analysis.stats import Bootstrap
from recur_core.analysis.trace import trace
from recur_core.settings import SETTINGS
from training.hops import HopsTask, is_hops, random_program

from . import compute, jobs, state
from .charts import FAMILY_COLORS, FAMILY_NAMES, PALETTE, base_layout

POLICY_NAMES = {**FAMILY_NAMES, "A1": "A1 convergence exit", "latent": "latent rule (Huginn)",
                "huginn_kl": "KL, Huginn's direction", "huginn_entropy": "entropy difference (Huginn)",
                "huginn_cosine": "cosine change (Huginn)", "huginn_argmax": "argmax stability (Huginn)"}
POLICY_COLORS = {**FAMILY_COLORS, "latent": "#9d755d", "huginn_kl": "#ff9da6", "huginn_entropy": "#bab0ac",
                 "huginn_cosine": "#eeca3b", "huginn_argmax": "#17becf"}  # one colour per policy, none shared


def policy_name(key: str) -> str:
    """A policy's name for people (report.json's key never shows)."""
    return POLICY_NAMES.get(key, key.replace("_", " "))


def fmt_rho(estimate: dict) -> str:
    """A Spearman estimate as text; n/a where it is undefined (NaN / None: constant exit depths)."""
    v = estimate["value"]
    if v is None or v != v:
        return "n/a (exit depth constant)"
    return f"{v:.2f} [{estimate['ci_low']:.2f}, {estimate['ci_high']:.2f}]"


def has_ground_truth(path: str) -> bool:
    return load_ground_truth(path) is not None


def task_of(model: compute.SelectedCheckpoint) -> HopsTask:
    dataset = model.meta.get("train_config", {}).get("dataset", "hops")
    return HopsTask.parse(dataset if is_hops(dataset) else "hops")


def _inputs(path: str, ckpt_id: str, device: str):
    """(trace, hops, max_train_hops, eos, probes, windows) of the canonical eval trace, read through
    recur_core and its disk cache (no Streamlit: the background job calls it too)."""
    ckpt = compute._ckpt(path, ckpt_id, device)
    prb = compute._train_probes(ckpt, path)
    windows = ckpt.windows("eval")[:SETTINGS.windows]
    tr = trace(ckpt, windows, compute.trace_loops(ckpt), SETTINGS.seed, topk=SETTINGS.topk, probes=list(prb.values()),
               cache=TraceCache())
    hops, max_train = load_ground_truth(path)
    return ckpt, tr, hops, max_train, eos_id(compute.tokenizer(path, ckpt_id)), prb, windows


def _section(path: str, ckpt_id: str, device: str, r_max: int, r_bar: int, exact: bool, progress=None,
             cache_only: bool = False) -> dict | None:
    ckpt, tr, hops, max_train, eos, prb, windows = _inputs(path, ckpt_id, device)
    return ground_truth_section(tr, hops, max_train, eos, r_max, r_bar, Bootstrap(tr.n_windows, SETTINGS.n_boot, SETTINGS.seed),
                                prb, SETTINGS.eps_grid, SETTINGS.tau_grid, exact=(ckpt, windows) if exact else None,
                                cache=TraceCache() if exact else False, progress=progress, cache_only=cache_only)


@st.cache_data(max_entries=8, show_spinner="Scoring exits against the hop counts…")
def section(path: str, ckpt_id: str, device: str, r_max: int, r_bar: int, exact: bool) -> dict:
    """The report's ground_truth section on the canonical eval trace: exact (report.json's
    `ground_truth`) or fast (`ground_truth_fast`)."""
    return _section(path, ckpt_id, device, r_max, r_bar, exact)


_EXACT_READY: set[tuple] = set()


def exact_key(path: str, ckpt_id: str, device: str) -> tuple:
    return "exact_ground_truth", path, ckpt_id, device


def exact_ready(path: str, ckpt_id: str, device: str, r_max: int, r_bar: int) -> bool:
    """Whether the exact section is in the disk cache (the harness's sweep and the readout rules'
    decoding, e.g. from `python -m recur_core.analyze`)."""
    key = exact_key(path, ckpt_id, device)
    job = jobs.get(key)
    if key in _EXACT_READY or (job is not None and job.finished and not (job.error or job.stopped)):
        return True
    if _section(path, ckpt_id, device, r_max, r_bar, True, cache_only=True) is None:
        return False
    _EXACT_READY.add(key)  # on disk now: no need to read it all again on every rerun
    return True


def start_exact(path: str, ckpt_id: str, device: str, r_max: int, r_bar: int) -> jobs.Job:
    """The background job that runs every policy's thresholds in the masking harness, then decodes the
    readout rules near their operating points (all cached on disk)."""
    def work(job: jobs.Job) -> None:
        _section(path, ckpt_id, device, r_max, r_bar, True,
                 progress=job.progress("Exact: every policy in the masking harness, then readout rules decoded",
                                       "windows"))
    return jobs.start(exact_key(path, ckpt_id, device), work)


def gap_sentence(exact: dict, fast: dict, policy: str = "A1") -> str:
    """The fast path's overstatement in words, for one policy at its operating points."""
    e, f = exact["policies"][policy], fast["policies"][policy]
    return (f"Under real halting (exact), {policy_name(policy)} needs **{e['mean_loops']:.2f}** mean loops to come within "
            f"{100 * exact['tolerance']:.0f} point of A0's answer accuracy at r̄ = {exact['r_bar']}; if every other "
            f"token stayed at full depth (the fast path) it would need **{f['mean_loops']:.2f}**.")


def add_random_program(model: compute.SelectedCheckpoint, programs_key: str) -> None:
    """Button callback: a new seeded program with the chosen max hop count, appended and picked."""
    seed = st.session_state.get("gt_seed", 0) + 1
    text = random_program(task_of(model), seed, int(st.session_state["gt_max_hops"])).text
    st.session_state["gt_seed"] = seed
    st.session_state[programs_key] = [*st.session_state[programs_key], text]
    state.set_kept("gt_pick", len(st.session_state[programs_key]) - 1, scope=model.path)


def hop_words(n: int) -> str:
    return f"{n} hop" + ("" if n == 1 else "s")


def ground_truth_notes(hops: list[int]) -> list[str]:
    """Per token of EOS + program: the tooltip line about its ground truth ("" for most tokens).
    Position t predicts token t + 1, so the query `v?` before an answer carries the answer's hop count."""
    notes = [""] * len(hops)
    for t in range(len(hops)):
        if t + 1 < len(hops) and hops[t + 1]:
            notes[t] = f"ground truth: predicts an answer {hop_words(hops[t + 1])} deep"
        elif hops[t]:
            notes[t] = f"ground truth: answer token, {hop_words(hops[t])} deep (predicted at the query before it)"
    return notes


# -- figures ----------------------------------------------------------------------------------------
def exit_vs_hops(gt: dict) -> go.Figure:
    """Exit depth of every answer token against its hop count, one box (with points) per policy."""
    fig = go.Figure()
    hops = np.asarray(gt["answers"]["hops"])
    for name, depths in gt["answers"]["exit_depth"].items():
        pol = gt["policies"][name]
        label = f"{policy_name(name)} · ρ = {fmt_rho(pol['spearman_exit_vs_hops'])}"
        fig.add_trace(go.Box(x=hops, y=depths, name=label, boxpoints="all", jitter=0.4, pointpos=0,
                             marker=dict(size=3, color=POLICY_COLORS.get(name, "#888")),
                             line=dict(color=POLICY_COLORS.get(name, "#888"))))
    fig.add_vline(x=gt["max_train_hops"] + 0.5, line_dash="dot", line_color="#999",
                  annotation_text="trained up to here", annotation_position="top left")
    fig.update_layout(boxmode="group", xaxis_title="hop count of the answer (ground truth)",
                      yaxis_title="exit depth (loops)", xaxis=dict(dtick=1))
    return base_layout(fig, "Exit depth of each answer token against its hop count (each policy at its operating "
                            "point)", height=460)


def accuracy_vs_loops(gt: dict) -> go.Figure:
    """Answer accuracy against uniform loops, one line per hop count (dashed: past training)."""
    fig = go.Figure()
    loops = gt["uniform"]["loops"]
    for i, h in enumerate(gt["hop_counts"]):
        past = h > gt["max_train_hops"]
        fig.add_trace(go.Scatter(x=loops, y=gt["uniform"]["accuracy_by_hops"][str(h)], mode="lines+markers",
                                 name=hop_words(h) + (" (unseen)" if past else ""),
                                 line=dict(color=PALETTE[i % len(PALETTE)], dash="dash" if past else "solid"),
                                 marker=dict(size=4)))
    fig.add_vline(x=gt["r_bar"], line_dash="dot", line_color="#999", annotation_text=f"r̄ = {gt['r_bar']}")
    fig.update_layout(xaxis_title="uniform loops (A0)", yaxis_title="answer accuracy", yaxis=dict(range=[0, 1.02]))
    return base_layout(fig, "Answer accuracy against loops, one line per hop count", height=460)


# -- tables -----------------------------------------------------------------------------------------
def policy_table(gt: dict, fast: dict | None = None):
    """One row per policy at its operating point, with both baselines (and, beside an exact section,
    the fast path's mean loops at its own operating point)."""
    import pandas as pd
    rows = []
    for name, pol in gt["policies"].items():
        row = {"policy": policy_name(name), "threshold": pol["threshold"], "answer accuracy": pol["answer_accuracy"],
               "mean loops": pol["mean_loops"]}
        if fast is not None:
            row["mean loops, fast path"] = fast["policies"][name]["mean_loops"]
        row.update({"loops on answers": pol["answer_mean_loops"], "× A0 at r̄": pol["vs_a0_rbar_loops_ratio"],
                    "× best uniform": pol["vs_best_uniform_loops_ratio"],
                    "Spearman(exit, hops) [95% CI]": fmt_rho(pol["spearman_exit_vs_hops"]),
                    "matches A0 at r̄": pol["matches_a0_rbar"]})
        rows.append(row)
    return pd.DataFrame(rows)


def answer_table(table, hops: list[int]):
    """The query tokens of a program's token table (position t predicts t + 1): its answer's hop
    count, its exit depth, what it predicts there, the answer, and whether the prediction is right."""
    import pandas as pd
    at = [t for t in range(min(len(hops), len(table)) - 1) if hops[t + 1]]
    rows = table.iloc[at]
    answers = [table.token.iloc[t + 1] for t in at]
    predicted = rows.top_prediction.tolist()
    return pd.DataFrame({"position": at, "hops": [hop_words(hops[t + 1]) for t in at],
                         "exit depth": rows.exit_depth.tolist(), "prediction": predicted, "answer": answers,
                         "right": ["✓ right" if p.strip() == a.strip() else "✗ wrong"
                                   for p, a in zip(predicted, answers, strict=True)],
                         "p(prediction)": rows.top_prob.tolist()})
