"""Display tables and strips built from a text trace and a policy outcome (formatting only)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import streamlit as st

from recur_core.analysis.dynamics import MARGINAL, RATE_LOOPS, REGIMES, contraction_rate, token_regimes
from recur_core.exits import catalogue
from recur_core.exits.trace_type import Trace

from . import compute
from .handle import Handle
from .strip import DepthScale, TokenView, legend_html, plain_visible, regime_legend_html, strip_html, tooltip
from .text import Encoded

# -- user text shown safely ----------------------------------------------------------------------------
_MD_SPECIAL = set("\\`*_{}[]()<>#+-.!|~$:=&\"'")


def plain_md(text: str) -> str:
    """Text to place inside Markdown (st.markdown, st.error, a caption) so that it shows as typed:
    every Markdown / HTML character backslash-escaped, so a pasted `![x](url)` is not an image and
    `<b>` is not a tag; newlines kept as line breaks."""
    escaped = "".join(f"\\{c}" if c in _MD_SPECIAL else c for c in text)
    return escaped.replace("\n", "  \n")


# -- metric deltas ------------------------------------------------------------------------------------
def delta(change: float, fmt: str, rise: str, fall: str, better: str, same: str) -> dict:
    """st.metric keyword arguments for a change, honest at a glance: the arrow points up and the
    colour is green when the change is an improvement, down and red when it is worse; no arrow and
    grey when it rounds to nothing. The words say which way it went, so the arrow never contradicts
    them: e.g. "3.36 more loops than r̄ = 4" (worse: red, down) or "24% slower than uniform r̄".
    fmt: the magnitude's format ("0.2f", ".0%"); rise / fall: the words after it for a positive /
    negative change; better: "higher" (accuracy, tokens/s) or "lower" (loss, loops); same: the words
    for no change."""
    if better not in ("higher", "lower"):
        raise ValueError(f"better must be 'higher' or 'lower', got {better!r}")
    size = f"{abs(change):{fmt}}"
    if not math.isfinite(change) or not any(c in "123456789" for c in size):  # nothing, as shown
        return {"delta": same, "delta_color": "off", "delta_arrow": "off"}
    good = (change > 0) == (better == "higher")
    # the string has no leading "-": Streamlit paints it green under "normal" and red under "inverse"
    return {"delta": f"{size} {rise if change > 0 else fall}", "delta_arrow": "up" if good else "down",
            "delta_color": "normal" if good else "inverse"}


@dataclass(frozen=True)
class Saving:
    """A per-token policy's loops against the best uniform depth (the smallest uniform depth whose loss
    reaches the policy's), in words that never call a loss a saving: `label` / `value` for st.metric
    (short: a metric's value is cut off, not wrapped), `vs_r_bar` the metric's delta against uniform
    r̄ beside it, and `warning`, a sentence when the policy costs more than the best uniform depth."""
    label: str
    value: str
    vs_r_bar: dict
    warning: str | None


def saving_vs_uniform(mean_loops: float, best: int | None, r_max: int, r_bar: int, policy: str = "A1") -> Saving:
    """best: the smallest uniform depth whose loss reaches the policy's (None: none up to r_max, so the
    policy's loss is below every uniform depth's)."""
    vs_r_bar = delta(mean_loops / r_bar - 1, ".0%", f"more loops than r̄ = {r_bar}", f"fewer loops than r̄ = {r_bar}",
                     "lower", f"as many loops as r̄ = {r_bar}")
    if best is None:
        return Saving("Loops vs uniform depth", f"beats all r ≤ {r_max}", vs_r_bar, None)
    change = mean_loops / best - 1
    label = f"Loops vs best uniform r = {best}"
    if f"{abs(change):.0%}" == "0%":
        return Saving(label, "as many", vs_r_bar, None)
    if change < 0:
        return Saving(label, f"{-change:.0%} fewer", vs_r_bar, None)
    return Saving(label, f"{change:.0%} more", vs_r_bar,
                  f"On this text {policy} is **not** a saving: it spends {mean_loops:.2f} loops per token on average, "
                  f"more than simply running every token {best} loop{'s' if best != 1 else ''}, which reaches the "
                  f"same loss (or lower). A smaller ε (the slider) or another text may change that.")


def smallest_depth_reaching(a0: dict[int, dict], loss: float, tolerance: float = 1e-4) -> int | None:
    """The smallest uniform depth r among the curve's A0 points {r: point} whose loss is within
    `tolerance` of `loss` or below, else None (as analysis.smallest_uniform_depth does on a trace)."""
    return next((r for r in sorted(a0) if a0[r]["loss"] <= loss + tolerance), None)


def against_best_uniform(mean_loops: float, best: int | None, r_max: int) -> dict:
    """st.metric delta keywords: a policy's mean loops against the best uniform depth (None: its loss
    is below every uniform depth's up to r_max)."""
    if best is None:
        return {"delta": f"loss below every uniform r ≤ {r_max}", "delta_color": "off", "delta_arrow": "off"}
    return delta(mean_loops - best, ".2f", f"more loops than best uniform r = {best}",
                 f"fewer loops than best uniform r = {best}", "lower", f"as many loops as best uniform r = {best}")


def leaner_and_better(labels: list[str], outcomes: list) -> list[str]:
    """The labels of the policies (after the first, uniform depth) that spend fewer mean loops than it
    and still reach a lower loss: a result that needs a word of explanation where it is shown."""
    uniform = outcomes[0]
    return [label for label, out in zip(labels[1:], outcomes[1:], strict=True)
            if out.mean_loops < uniform.mean_loops and out.loss < uniform.loss]


def _at_exit(values: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """(T, L) per-loop values -> (T,) the value at each token's exit loop."""
    return np.take_along_axis(values, depth[:, None] - 1, axis=1)[:, 0]


def token_table(model: Handle, tr: Trace, enc: Encoded, out: compute.Outcome) -> pd.DataFrame:
    """One row per token of the text: its exit depth under the policy and its output there, and its
    state's regime and contraction rate over the uniform run's last loops (recur_core.analysis.dynamics)."""
    depth, d = out.depth[0], out.decoded
    if d is None:  # fast path: the uniform trace at each token's exit loop
        pred_ids, top_prob, ce = _at_exit(tr.argmax[0], depth), _at_exit(tr.top1_prob[0], depth), _at_exit(tr.ce[0], depth)
        kl, change = _at_exit(tr.kl_prev[0], depth), _at_exit(tr.state_change[0], depth)
    else:  # real decoding's output at exit; its per-loop signals are not kept (NaN)
        pred_ids, top_prob, ce = d.argmax, d.top_prob, d.ce
        kl = change = np.full(len(depth), np.nan, dtype=np.float32)
    return pd.DataFrame({
        "position": np.arange(len(depth)), "token": list(enc.pieces), "token_id": tr.ids[0],
        "exit_depth": depth, "converged": out.converged[0], "kl_at_exit": kl, "state_change_at_exit": change,
        "top_prediction": model.decode_ids(pred_ids),
        "top_prob": top_prob, "next_token_loss": ce, "regime": [REGIMES[c] for c in token_regimes(tr)[0]],
        "contraction_rate": contraction_rate(tr.state_step[0])})


COLOUR_BY = {"reading": "the loops at it (predicting the next token)",
             "produced": "the loops that produced it (at the token before)",
             "regime": "its regime (settling / marginal / drifting)"}


def strip_views(model: Handle, table: pd.DataFrame, policy: str,
                colour_by: str = "reading") -> list[TokenView]:
    """One view per token. colour_by "reading": its own position's exit (it predicts the next token);
    "produced": the exit of the position before, which predicted it (a word problem's answer word
    then carries the depth its answer took; the first token has none); "regime": its own position's
    regime (its exit in the tooltip)."""
    views, rows = [], list(table.itertuples(index=False))
    notes = [getattr(row, "ground_truth", None) for row in rows]
    for i, row in enumerate(rows):
        at = row if colour_by != "produced" else rows[i - 1] if i else None
        if at is None:
            views.append(TokenView(row.token, 0, True, f"#0  {plain_visible(row.token)!r}\nthe first token: no "
                                   "position before it predicts it", coloured=False))
            continue
        loss = None if math.isnan(at.next_token_loss) else float(at.next_token_loss)
        kl = None if math.isnan(at.kl_at_exit) else float(at.kl_at_exit)
        regime = f"regime: {row.regime} (contraction rate ρ = {row.contraction_rate:.3g})"
        note = "\n".join(n for n in (notes[i], regime if colour_by == "regime" else None) if n)
        views.append(TokenView(row.token, int(at.exit_depth), bool(at.converged), tooltip(
            int(row.position), row.token, int(at.exit_depth), bool(at.converged), model.r_max,
            kl=kl, prediction=at.top_prediction, prob=float(at.top_prob), loss=loss,
            policy=policy, note=note or None, producer=None if at is row else at.token),
            regime=row.regime if colour_by == "regime" else ""))
    return views


def scored(table: pd.DataFrame) -> pd.Series:
    """The tokens that have a next token to score (all but the last): the ones a policy's numbers count."""
    return table.position < len(table) - 1 if len(table) > 1 else table.position >= 0


def strip_scale(model: Handle, *tables: pd.DataFrame) -> DepthScale:
    """One colour scale for strips shown together: the exit depths of the converged, scored tokens of
    all tables (the last token, with no next token to score, does not stretch it)."""
    return DepthScale.of((d for t in tables for d in t.exit_depth[t.converged & scored(t)]), model.r_max)


def deepest_token(table: pd.DataFrame) -> int:
    """The position the drill-in opens on: the deepest exit among the scored tokens."""
    return int(table.exit_depth[scored(table)].idxmax())


def render_strip(model: Handle, table: pd.DataFrame, policy: str, selected: int | None = None,
                 legend: bool = True, scale: DepthScale | None = None, colour_by: str = "reading") -> None:
    """A strip with its legend (legend=False: the caller drew a shared one, and passes its scale)."""
    scale = scale or strip_scale(model, table)
    if legend and colour_by == "regime":
        st.html(regime_legend_html(MARGINAL, RATE_LOOPS))
    elif legend:
        st.html(legend_html(scale))
    st.html(strip_html(strip_views(model, table, policy, colour_by), scale, policy=policy, selected=selected,
                       ids=table.token_id.tolist()))


def logit_lens(model: Handle, tr: Trace, pos: int, exit_depth: int) -> pd.DataFrame:
    """Top-k next-token predictions of one token after every loop (the logit lens over loops)."""
    ids, probs = tr.topk_ids[0, pos], tr.topk_probs[0, pos]  # (L, k)
    words = np.array(model.decode_ids(ids.ravel()), dtype=object).reshape(ids.shape)
    df = pd.DataFrame({"loop": np.arange(1, tr.max_loops + 1),
                       "": ["◀ exit" if i + 1 == exit_depth else "" for i in range(tr.max_loops)],
                       "KL [nats]": tr.kl_prev[0, pos], "loss [nats]": tr.ce[0, pos]})
    for j in range(ids.shape[1]):
        df[f"top-{j + 1}"] = [f"{plain_visible(w)}  {probability(p)}" for w, p in zip(words[:, j], probs[:, j],
                                                                                        strict=True)]
    return df


def probability(p: float) -> str:
    """A probability to three significant digits, as a percentage: a near-uniform prediction over
    thousands of tokens (0.00232) reads 0.232%, not 0.00."""
    return f"{100 * float(p):.3g}%"


def token_label(table: pd.DataFrame, pos: int) -> str:
    row = table.iloc[pos]
    state = f"exit {row.exit_depth}" if row.converged else f"not converged ({row.exit_depth})"
    return f"#{pos} {plain_visible(row.token)!r} · {state}"


# -- depth / loss curves --------------------------------------------------------------------------------
# The curves' report keys in catalogue order (A2: one per probe label kind; Gate: models with a gate)
FAMILIES = tuple(key for fam in catalogue.shown_in(catalogue.CURVES)
                 for key in ([f"{fam.name}_{kind}" for kind in fam.variants] or [fam.name]))


def point_at(points: list[dict], eps: float) -> dict:
    """The swept point whose finite threshold is nearest eps on a log scale (a lookup, no compute)."""
    finite = [p for p in points if isinstance(p["threshold"], (int, float)) and 0 < p["threshold"] < math.inf]
    return min(finite, key=lambda p: abs(math.log10(p["threshold"]) - math.log10(eps)))


def estimate_columns(rows: list[dict], keep: tuple[str, ...] = ()) -> pd.DataFrame:
    """Rows whose values are {value, ci_low, ci_high} dicts -> flat numeric columns
    `name`, `name low`, `name high` (other values kept as they are)."""
    flat = []
    for row in rows:
        out = {}
        for key, val in row.items():
            if isinstance(val, dict) and "value" in val:
                out[key.replace("_minus_", " − ")] = val["value"]
                out[f"{key.replace('_minus_', ' − ')} low"] = val["ci_low"]
                out[f"{key.replace('_minus_', ' − ')} high"] = val["ci_high"]
            elif not isinstance(val, dict) or key in keep:
                out[key] = val
        flat.append(out)
    return pd.DataFrame(flat)


def curve_table(points: dict[str, list[dict]]) -> pd.DataFrame:
    rows = [{"policy": name, **{k: v for k, v in p.items()}} for name, pts in points.items() for p in pts]
    df = pd.DataFrame(rows)
    df["threshold"] = df["threshold"].astype(str)
    return df


def gap_table(gaps: dict[str, list[dict]]) -> pd.DataFrame:
    """analysis.fast_minus_exact as one row per policy: both paths and the paired gap fast − exact."""
    flat = []
    for family, rows in gaps.items():
        for r in rows:
            flat.append({"policy": family, "threshold": str(r["threshold"]),
                         "exact mean loops": r["exact_mean_loops"]["value"], "exact loss": r["exact_loss"]["value"],
                         "fast mean loops": r["fast_mean_loops"]["value"], "fast loss": r["fast_loss"]["value"],
                         "gap loss (fast − exact)": r["gap_loss"]["value"], "gap low": r["gap_loss"]["ci_low"],
                         "gap high": r["gap_loss"]["ci_high"], "gap mean loops": r["gap_mean_loops"]["value"]})
    return pd.DataFrame(flat)


def diff_point_at(diff: dict, eps: float) -> dict:
    """The difference-view point of the swept ε nearest eps (as point_at)."""
    pts = [{"threshold_name": diff["threshold_name"], "threshold": t, "mean_loops": x, "diff": d}
           for t, x, d in zip(diff["thresholds"], diff["mean_loops"], diff["diff"], strict=True)]
    return point_at(pts, eps)


def is_number(x) -> bool:
    """A finite number (NaN, None, inf and "inf" are not)."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def fmt_est(d: dict, digits: int = 2) -> str:
    """value [ci_low, ci_high]; an infinite end (a level some replicates never reach) reads "> cap"."""
    v, lo, hi = d.get("value"), d.get("ci_low"), d.get("ci_high")
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "not reached"
    cap = d.get("cap")
    if not is_number(v) or not is_number(hi):
        end = lambda x: f"{x:.{digits}f}" if is_number(x) else f"> {cap}" if cap is not None else "not reached"
        return f"{end(v)} [{end(lo)}, {end(hi)}]"
    if lo is None or hi is None or (isinstance(lo, float) and math.isnan(lo)) or lo == hi:
        return f"{v:.{digits}f}"
    return f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def match_sentence(name: str, match: dict, r_bar: int) -> str:
    never = match.get("n_boot_not_reached")
    note = f" ({never} of {match['n_boot']} bootstrap replicates never reach it)" if never else ""
    if not is_number(match.get("value")):
        return f"{name} never reaches A0's loss at r̄ = {r_bar}{note}"
    return f"{name} reaches A0's loss at r̄ = {r_bar} with {fmt_est(match)} mean loops{note}"


def number_formats(df: pd.DataFrame) -> dict:
    """st.dataframe column formats: differences signed, losses to 4 decimals."""
    config = {}
    for col in df.columns:
        if not pd.api.types.is_float_dtype(df[col]):
            continue
        if "−" in col or "gap" in col:
            config[col] = st.column_config.NumberColumn(format="%+.5f")
        else:
            config[col] = st.column_config.NumberColumn(format="%.4f")
    return config


def label_kinds_table(probes: dict, report: dict) -> pd.DataFrame:
    """A2's label kinds side by side: probe quality (held-out windows), label ε, and the allocation
    report's mean loops to match A0 at r̄ with its interval and unreached replicates."""
    df = probe_table(probes)
    if df.empty:
        return df
    match = [report.get(f"a2_{kind}_loops_to_match_a0_rbar", {}) for kind in df["labels"]]
    df["loops to match A0 at r̄"] = [fmt_est(m) if m else "n/a" for m in match]
    df["replicates never reaching it"] = [m.get("n_boot_not_reached") for m in match]
    return df


def probe_table(probes: dict) -> pd.DataFrame:
    """A2 probes' quality on their held-out windows (recur_core.analysis.probe metrics)."""
    rows = []
    for kind, p in probes.items():
        held = p.metrics.get("heldout", {})
        rows.append({"labels": kind, "label_eps": p.label_eps, "accuracy": held.get("accuracy"),
                     "auc": held.get("auc"), "positive_rate": held.get("positive_rate"), "n": held.get("n")})
    return pd.DataFrame(rows)
