"""The Ground truth page's cached calls and figures: exit policies against known hop counts.

Only for checkpoints that carry ground truth (training/hops.py; recur_core.analysis.ground_truth). The
eval-set numbers are `recur_core.analysis.ground_truth.ground_truth_section` on the same trace and grids as
`python -m recur_core.analyze`, so the page and report.json agree.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from recur_core.analysis.ground_truth import eos_id, ground_truth_section, load_ground_truth
from recur_core.analysis.stats import Bootstrap
from recur_core.settings import SETTINGS
from training.hops import HopsTask, is_hops, random_program

from . import compute
from .charts import FAMILY_COLORS, PALETTE, base_layout

POLICY_NAMES = {"A1": "A1 convergence exit", "A2_argmax": "A2 router (argmax labels)",
                "A2_kl": "A2 router (KL labels)", "latent": "latent rule (Huginn)"}
POLICY_COLORS = {**FAMILY_COLORS, "latent": "#e45756"}


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


@st.cache_data(max_entries=8, show_spinner="Scoring exits against the hop counts…")
def section(path: str, ckpt_id: str, device: str, r_max: int, r_bar: int) -> dict:
    """The report's ground_truth section on the canonical eval trace."""
    tr = compute.eval_trace(path, ckpt_id, device)
    hops, max_train = load_ground_truth(path)
    eos = eos_id(compute.tokenizer(path, ckpt_id))
    return ground_truth_section(tr, hops, max_train, eos, r_max, r_bar, Bootstrap(tr.n_windows, SETTINGS.n_boot, SETTINGS.seed),
                                compute.probes(path, ckpt_id, device), SETTINGS.eps_grid, SETTINGS.tau_grid)


def add_random_program(model: compute.SelectedCheckpoint) -> None:
    """Button callback: a new seeded program with the chosen max hop count, appended and picked."""
    seed = st.session_state.get("gt_seed", 0) + 1
    text = random_program(task_of(model), seed, int(st.session_state["gt_max_hops"])).text
    st.session_state["gt_seed"] = seed
    st.session_state["gt_programs"] = [*st.session_state["gt_programs"], text]
    st.session_state["gt_pick"] = len(st.session_state["gt_programs"]) - 1


def ground_truth_notes(hops: list[int]) -> list[str]:
    """Per token of EOS + program: the tooltip line about its ground truth ("" for most tokens).
    Position t predicts token t + 1, so the query `v?` before an answer carries the answer's hop count."""
    notes = [""] * len(hops)
    for t in range(len(hops)):
        if t + 1 < len(hops) and hops[t + 1]:
            notes[t] = f"ground truth: predicts an answer {hops[t + 1]} hops deep"
        elif hops[t]:
            notes[t] = f"ground truth: answer token, {hops[t]} hops deep (predicted at the query before it)"
    return notes


# -- figures ----------------------------------------------------------------------------------------
def exit_vs_hops(gt: dict) -> go.Figure:
    """Exit depth of every answer token against its hop count, one box (with points) per policy."""
    fig = go.Figure()
    hops = np.asarray(gt["answers"]["hops"])
    for name, depths in gt["answers"]["exit_depth"].items():
        pol = gt["policies"][name]
        label = f"{POLICY_NAMES.get(name, name)} · ρ = {fmt_rho(pol['spearman_exit_vs_hops'])}"
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
                                 name=f"{h} hop{'s' if h > 1 else ''}" + (" (unseen)" if past else ""),
                                 line=dict(color=PALETTE[i % len(PALETTE)], dash="dash" if past else "solid"),
                                 marker=dict(size=4)))
    fig.add_vline(x=gt["r_bar"], line_dash="dot", line_color="#999", annotation_text=f"r̄ = {gt['r_bar']}")
    fig.update_layout(xaxis_title="uniform loops (A0)", yaxis_title="answer accuracy", yaxis=dict(range=[0, 1.02]))
    return base_layout(fig, "Answer accuracy against loops, one line per hop count", height=460)


# -- tables -----------------------------------------------------------------------------------------
def policy_table(gt: dict):
    """One row per policy at its operating point, with both baselines."""
    import pandas as pd
    rows = []
    for name, pol in gt["policies"].items():
        sp = pol["spearman_exit_vs_hops"]
        rows.append({"policy": POLICY_NAMES.get(name, name), "threshold": pol["threshold"],
                     "answer accuracy": pol["answer_accuracy"], "mean loops (all tokens)": pol["mean_loops"],
                     "mean loops (answers)": pol["answer_mean_loops"],
                     "vs A0 at r̄": pol["vs_a0_rbar_loops_ratio"],
                     f"vs best uniform ({gt['best_uniform_depth']})": pol["vs_best_uniform_loops_ratio"],
                     "Spearman(exit, hops)": sp["value"], "CI low": sp["ci_low"], "CI high": sp["ci_high"],
                     "matches A0 at r̄": pol["matches_a0_rbar"]})
    return pd.DataFrame(rows)


def answer_table(table):
    """The query tokens of a program's token table: what each predicts, at which exit depth."""
    rows = table[table.ground_truth.str.startswith("ground truth: predicts")]
    return rows[["position", "ground_truth", "exit_depth", "top_prediction", "top_prob"]]
