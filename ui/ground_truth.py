"""The Ground truth page's cached calls and figures: exit policies against the known depth of each answer.

Only for checkpoints that carry ground truth (recur_core.analysis.ground_truth): multi-hop programs
or the stories-reasoning mixture's word problems, an answer's depth in hops or composition steps; the
examples, their labels and the unit are the checkpoint's task's (recur_core.tasks). The
eval-set numbers are the checkpoint's `recur_core.analysis.study.Study` ground truth, the same as
`python -m recur_core.analyze`'s, so the page and report.json agree: exact (the masking harness, as
real halting) by default, computed in the background into the harness's disk cache the first time,
and the fast path one click away.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from recur_core.analysis.ground_truth import load_ground_truth, needs_decoding, operating_point_families
from recur_core.exits import catalogue
from recur_core.tasks import Example

from . import compute, jobs, state, text
from .charts import PALETTE, base_layout
from .handle import Handle


def fmt_rho(estimate: dict) -> str:
    """A Spearman estimate as text; n/a where it is undefined (NaN / None: constant exit depths)."""
    v = estimate["value"]
    if v is None or v != v:
        return "n/a (exit depth constant)"
    return f"{v:.2f} [{estimate['ci_low']:.2f}, {estimate['ci_high']:.2f}]"


def has_ground_truth(model: Handle) -> bool:
    return load_ground_truth(model.path) is not None


# -- the labelled examples of the token-by-token section ---------------------------------------------
def unit(model: Handle) -> str:
    """What an answer's depth is counted in ("hop", "step")."""
    return text.task(model).unit


def eval_examples(model: Handle, n: int = 32) -> list[Example]:
    """n held-out labelled examples: the first eval programs, or word problems drawn with the held-out
    seeds, told plain, cycling through every step count the eval set has."""
    seed = int((model.meta.get("train_config") or {}).get("seed", 0))
    return text.task(model).eval_examples(model.tokenizer(), text.eval_windows(model), seed, n)


def random_example(model: Handle, seed: int, deepest: int) -> Example:
    """A new seeded program or word problem whose deepest answer needs `deepest` hops / steps."""
    return text.task(model).random_example(seed, deepest)


def encode_example(model: Handle, ex: Example) -> tuple[text.Encoded, list[int]]:
    """(what the model reads, each token's ground truth: its answer's hops / steps, else 0)."""
    return text.within_context(text.task(model).labelled(model.tokenizer(), ex), model.max_seq_len)


def example_label(model: Handle, ex: Example, i: int) -> str:
    return f"#{i} · deepest answer {unit_words(ex.deepest, unit(model))} · {ex.text[:40]}…"


def _section(path: str, ckpt_id: str, device: str, exact: bool, progress=None, cache_only: bool = False) -> dict | None:
    """The section through the checkpoint's Study and its disk cache (no Streamlit: the background
    job calls it too)."""
    study = compute.study(path, ckpt_id, device)
    return study.ground_truth(study.exact_path(progress, cache_only=cache_only) if exact else None)


def section(model: Handle, exact: bool) -> dict:
    """The report's ground_truth section on the canonical eval trace: exact (report.json's
    `ground_truth`) or fast (`ground_truth_fast`)."""
    return _cached_section(*model.key, exact)


@st.cache_data(max_entries=8, show_spinner="Scoring exits against the hop counts…")
def _cached_section(path: str, ckpt_id: str, device: str, exact: bool) -> dict:
    return _section(path, ckpt_id, device, exact)


_EXACT_READY: set[tuple] = set()


def exact_key(model: Handle) -> tuple:
    return "exact_ground_truth", *model.key


def exact_ready(model: Handle) -> bool:
    """Whether the exact section is in the disk cache (the harness's sweep and the readout rules'
    decoding, e.g. from `python -m recur_core.analyze`)."""
    key = exact_key(model)
    job = jobs.get(key)
    if key in _EXACT_READY or (job is not None and job.finished and not (job.error or job.stopped)):
        return True
    if _section(*model.key, True, cache_only=True) is None:
        return False
    _EXACT_READY.add(key)  # on disk now: no need to read it all again on every rerun
    return True


def exact_size(model: Handle) -> tuple[int, int, int]:
    """(harness families, decoded families, eval windows): the families whose operating points the exact
    section walks to in the masking harness (the state rules; every rule on a model without a coda), and
    those it decodes (the readout rules read through a coda, walking from the fast path's points too)."""
    study = compute.study(*model.key)
    families = operating_point_families(study.r_max, study.probes())
    decoded = sum(needs_decoding(f, study.ckpt.model) for f in families.values())
    return len(families) - decoded, decoded, len(study.eval_windows)


def start_exact(model: Handle) -> jobs.Job:
    """The background job that walks the state rules to their operating points in the masking harness
    (one pass over the windows per round), then decodes the readout rules near theirs (all cached on
    disk). Each harness pass counts windows, each decoding counts windows decoded."""
    def work(job: jobs.Job) -> None:
        _section(*model.key, True,
                 progress=job.progress("Exact: the state rules walked to their operating points in the masking "
                                       "harness (window passes), then each readout rule decoded near its own (windows)"))
    return jobs.start(exact_key(model), work)


def gap_sentence(exact: dict, fast: dict, policy: str = "A1") -> str:
    """The fast path's overstatement in words, for one policy at its operating points."""
    e, f = exact["policies"][policy], fast["policies"][policy]
    return (f"Under real halting (exact), {catalogue.display(policy)} needs **{e['mean_loops']:.2f}** mean loops to come within "
            f"{100 * exact['tolerance']:.0f} point of A0's answer accuracy at r̄ = {exact['r_bar']}; if every other "
            f"token stayed at full depth (the fast path) it would need **{f['mean_loops']:.2f}**.")


def add_random_example(model: Handle, examples_key: str) -> None:
    """Button callback: a new seeded example with the chosen deepest answer, appended and picked."""
    seed = st.session_state.get("gt_seed", 0) + 1
    ex = random_example(model, seed, int(st.session_state["gt_max_hops"]))
    st.session_state["gt_seed"] = seed
    st.session_state[examples_key] = [*st.session_state[examples_key], ex]
    state.set_kept("gt_pick", len(st.session_state[examples_key]) - 1, scope=model.path)


def unit_words(n: int, unit: str = "hop") -> str:
    return f"{n} {unit}" + ("" if n == 1 else "s")


def ground_truth_notes(depths: list[int], unit: str = "hop") -> list[str]:
    """Per token of EOS + example: the tooltip line about its ground truth ("" for most tokens).
    Position t predicts token t + 1, so the token before an answer (a program's query `v?`, a word
    problem's "had" / "the") carries the answer's hops / steps."""
    notes = [""] * len(depths)
    for t in range(len(depths)):
        if t + 1 < len(depths) and depths[t + 1]:
            notes[t] = f"ground truth: predicts an answer {unit_words(depths[t + 1], unit)} deep"
        elif depths[t]:
            notes[t] = (f"ground truth: answer token, {unit_words(depths[t], unit)} deep (predicted at the token "
                        "before it)")
    return notes


# -- figures ----------------------------------------------------------------------------------------
def exit_vs_hops(gt: dict, unit: str = "hop") -> go.Figure:
    """Exit depth of every answer token against its hops / steps, one box (with points) per policy."""
    fig = go.Figure()
    hops = np.asarray(gt["answers"]["hops"])
    for name, depths in gt["answers"]["exit_depth"].items():
        pol = gt["policies"][name]
        label = f"{catalogue.display(name)} · ρ = {fmt_rho(pol['spearman_exit_vs_hops'])}"
        fig.add_trace(go.Box(x=hops, y=depths, name=label, boxpoints="all", jitter=0.4, pointpos=0,
                             marker=dict(size=3, color=catalogue.colour(name)),
                             line=dict(color=catalogue.colour(name))))
    fig.add_vline(x=gt["max_train_hops"] + 0.5, line_dash="dot", line_color="#999",
                  annotation_text="trained up to here", annotation_position="top left")
    fig.update_layout(boxmode="group", xaxis_title=f"{unit}s the answer needs (ground truth)",
                      yaxis_title="exit depth (loops)", xaxis=dict(dtick=1))
    return base_layout(fig, f"Exit depth of each answer token against its {unit}s (each policy at its operating "
                            "point)", height=460)


def accuracy_vs_loops(gt: dict, unit: str = "hop") -> go.Figure:
    """Answer accuracy against uniform loops, one line per hops / steps count (dashed: past training)."""
    fig = go.Figure()
    loops = gt["uniform"]["loops"]
    for i, h in enumerate(gt["hop_counts"]):
        past = h > gt["max_train_hops"]
        fig.add_trace(go.Scatter(x=loops, y=gt["uniform"]["accuracy_by_hops"][str(h)], mode="lines+markers",
                                 name=unit_words(h, unit) + (" (unseen)" if past else ""),
                                 line=dict(color=PALETTE[i % len(PALETTE)], dash="dash" if past else "solid"),
                                 marker=dict(size=4)))
    fig.add_vline(x=gt["r_bar"], line_dash="dot", line_color="#999", annotation_text=f"r̄ = {gt['r_bar']}")
    fig.update_layout(xaxis_title="uniform loops (A0)", yaxis_title="answer accuracy", yaxis=dict(range=[0, 1.02]))
    return base_layout(fig, f"Answer accuracy against loops, one line per {unit} count", height=460)


# -- tables -----------------------------------------------------------------------------------------
def policy_table(gt: dict, fast: dict | None = None, unit: str = "hop"):
    """One row per policy at its operating point, with both baselines (and, beside an exact section,
    the fast path's mean loops at its own operating point)."""
    import pandas as pd
    rows = []
    for name, pol in gt["policies"].items():
        row = {"policy": catalogue.display(name), "threshold": pol["threshold"], "answer accuracy": pol["answer_accuracy"],
               "mean loops": pol["mean_loops"]}
        if fast is not None:
            row["mean loops, fast path"] = fast["policies"][name]["mean_loops"]
        row.update({"loops on answers": pol["answer_mean_loops"], "× A0 at r̄": pol["vs_a0_rbar_loops_ratio"],
                    "× best uniform": pol["vs_best_uniform_loops_ratio"],
                    f"Spearman(exit, {unit}s) [95% CI]": fmt_rho(pol["spearman_exit_vs_hops"]),
                    "matches A0 at r̄": "yes" if pol["matches_a0_rbar"] else "no"})
        rows.append(row)
    return pd.DataFrame(rows)


def answer_table(table, depths: list[int], unit: str = "hop"):
    """The tokens before the answers in an example's token table (position t predicts t + 1): the
    answer's hops / steps, its exit depth, what it predicts there, the answer, and whether it is right."""
    import pandas as pd
    at = [t for t in range(min(len(depths), len(table)) - 1) if depths[t + 1]]
    rows = table.iloc[at]
    answers = [table.token.iloc[t + 1] for t in at]
    predicted = rows.top_prediction.tolist()
    return pd.DataFrame({"position": at, f"{unit}s": [unit_words(depths[t + 1], unit) for t in at],
                         "exit depth": rows.exit_depth.tolist(), "prediction": predicted, "answer": answers,
                         "right": ["✓ right" if p.strip() == a.strip() else "✗ wrong"
                                   for p, a in zip(predicted, answers, strict=True)],
                         "p(prediction)": rows.top_prob.tolist()})
