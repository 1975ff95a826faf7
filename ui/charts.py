"""Plotly figures of the app: pure functions from numbers (computed by recur_core) to go.Figure.

Shown with `show(fig, name)`: theme=None keeps these colour scales, and the mode bar keeps Plotly's
PNG export (named after the chart, 2x scale).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from recur_core.exits import catalogue

KL_AXIS = "KL(p_i ‖ p_{i−1}) [nats]"
LOSS_AXIS = "loss [nats/token]"
LOOPS_AXIS = "mean loops per token"
DIFF_AXIS = "loss − A0's at the same mean loops [nats/token]"
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d")
KL_FLOOR = 1e-12  # log10 of a KL of exactly 0 is drawn at this floor
# Inferno, with its first stop "#000004" nudged: the app frontend turned exactly that colour into lavender
KL_SCALE = [[0.0, "#050310"]] + [[i / 9, c] for i, c in enumerate(
    ("#000004", "#1b0c41", "#4a0c6b", "#781c6d", "#a52c60", "#cf4446", "#ed6925", "#fb9b06", "#f7d13d", "#fcffa4"))][1:]


def show(fig: go.Figure, name: str, key: str | None = None, **kwargs):
    config = {"displaylogo": False, "toImageButtonOptions": {"format": "png", "filename": name, "scale": 2}}
    return st.plotly_chart(fig, theme=None, config=config, key=key, **kwargs)


def rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def base_layout(fig: go.Figure, title: str, height: int = 380) -> go.Figure:
    fig.update_layout(title=dict(text=title, x=0.0, xanchor="left", font=dict(size=15)), template="plotly_white",
                      height=height, margin=dict(l=60, r=20, t=50, b=60),
                      legend=dict(orientation="h", yanchor="top", y=-0.2, xanchor="left", x=0.0))
    return fig


def band(x, low, high, color: str, name: str, group: str | None = None, row=None, col=None) -> go.Scatter:
    """A filled confidence band (go.Scatter polygon; Scattergl cannot fill)."""
    x, low, high = (np.asarray(v, dtype=float) for v in (x, low, high))
    ok = np.isfinite(x) & np.isfinite(low) & np.isfinite(high)
    x, low, high = x[ok], low[ok], high[ok]
    return go.Scatter(x=np.concatenate([x, x[::-1]]), y=np.concatenate([high, low[::-1]]), fill="toself", mode="lines",
                      fillcolor=rgba(color, 0.10), line=dict(width=0), hoverinfo="skip", showlegend=False,
                      name=f"{name} 95% CI", legendgroup=group or name)


def positive(values, floor: float = KL_FLOOR) -> np.ndarray:
    """Values for a log axis: zeros and negatives raised to a floor."""
    return np.maximum(np.asarray(values, dtype=float), floor)


# -- page 1: one text ---------------------------------------------------------------------------------
def kl_heatmap(kl: np.ndarray, labels: Sequence[str], exit_depth: np.ndarray, converged: np.ndarray,
               r_max: int, policy: str) -> go.Figure:
    """Tokens x loops heatmap of log10 KL(p_i || p_{i-1}); each token's exit loop marked."""
    T, L = kl.shape
    pos = np.arange(T)
    z = np.log10(positive(kl)).T  # (L, T): loops up, tokens across
    hover_tok = np.tile(np.array([f"#{i} {lab!r}" for i, lab in enumerate(labels)], dtype=object), (L, 1))
    fig = go.Figure(go.Heatmap(
        x=pos, y=np.arange(1, L + 1), z=z, customdata=kl.T, text=hover_tok, colorscale=KL_SCALE,
        zmin=max(-8.0, float(np.floor(z.min()))), zmax=float(np.ceil(z.max())),
        colorbar=dict(title=dict(text="log10 " + KL_AXIS, side="right"), thickness=12),
        hovertemplate="%{text}<br>loop %{y}<br>KL %{customdata:.2e} nats<extra></extra>", name="log10 KL"))
    conv = converged.astype(bool)
    fig.add_trace(go.Scatter(x=pos[conv], y=exit_depth[conv], mode="markers", name=f"exit loop ({policy})",
                             marker=dict(symbol="circle-open", size=9, color="#00e5ff", line=dict(width=2)),
                             hovertemplate="exit at loop %{y}<extra></extra>"))
    if (~conv).any():
        fig.add_trace(go.Scatter(x=pos[~conv], y=exit_depth[~conv], mode="markers", name="not converged (r_max)",
                                 marker=dict(symbol="x", size=9, color="#e8467c", line=dict(width=1)),
                                 hovertemplate="stopped at r_max = %{y}<extra></extra>"))
    if r_max < L:
        fig.add_trace(go.Scatter(x=[-0.5, T - 0.5], y=[r_max + 0.5, r_max + 0.5], mode="lines",
                                 line=dict(color="#ffffff", dash="dash", width=1.5), name=f"r_max = {r_max}",
                                 hoverinfo="skip"))
    fig.update_xaxes(title="token", tickvals=pos, ticktext=list(labels), tickangle=-60 if T > 12 else 0,
                     range=[-0.5, T - 0.5], showgrid=False)
    fig.update_yaxes(title="loop i", range=[0.5, L + 0.5], showgrid=False)
    base_layout(fig, f"{KL_AXIS} per token and loop (log10 colour)", height=420)
    return fig


def token_curves(kl: np.ndarray, state_change: np.ndarray, ce: np.ndarray, exit_depth: int, converged: bool,
                 eps: float, r_max: int, label: str) -> go.Figure:
    """One token's KL, state change and next-token loss over loops, with its exit loop."""
    L = len(kl)
    loops = np.arange(1, L + 1)
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.09, subplot_titles=(
        "KL(p_i ‖ p_{i−1})", "state change ‖s_i − s_{i−1}‖ / ‖s_i‖", "next-token loss"))
    fig.add_trace(go.Scatter(x=loops, y=positive(kl), mode="lines+markers", name="KL", line=dict(color="#f58518"),
                             hovertemplate="loop %{x}<br>KL %{y:.2e} nats<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=[1, L], y=[eps, eps], mode="lines", name=f"ε = {eps:.1e}",
                             line=dict(color="#888", dash="dot")), row=1, col=1)
    fig.add_trace(go.Scatter(x=loops, y=positive(state_change), mode="lines+markers", name="state change",
                             line=dict(color="#4c78a8"), hovertemplate="loop %{x}<br>%{y:.2e}<extra></extra>"),
                  row=1, col=2)
    if np.isfinite(ce).any():
        fig.add_trace(go.Scatter(x=loops, y=ce, mode="lines+markers", name="loss", line=dict(color="#54a24b"),
                                 hovertemplate="loop %{x}<br>%{y:.3f} nats<extra></extra>"), row=1, col=3)
    else:
        fig.add_annotation(text="last token: no next token to score", xref="x3 domain", yref="y3 domain",
                           x=0.5, y=0.5, showarrow=False, font=dict(color="#888"))
    for col in (1, 2, 3):
        fig.add_vline(x=exit_depth, line=dict(color="#00a0b0" if converged else "#e8467c", width=2, dash="dash"),
                      row=1, col=col)
        fig.update_xaxes(title_text="loop i", row=1, col=col, range=[0.5, L + 0.5])
    if r_max < L:
        for col in (1, 2, 3):
            fig.add_vline(x=r_max + 0.5, line=dict(color="#bbb", width=1), row=1, col=col)
    fig.update_yaxes(type="log", title_text=KL_AXIS, exponentformat="power", row=1, col=1)
    fig.update_yaxes(type="log", title_text="relative change", exponentformat="power", row=1, col=2)
    fig.update_yaxes(title_text="loss [nats]", row=1, col=3)
    exit_text = f"exit at loop {exit_depth}" if converged else f"not converged, stopped at r_max = {exit_depth}"
    base_layout(fig, f"Token {label}: {exit_text} (dashed line)", height=340)
    fig.update_layout(showlegend=False)
    return fig


def token_state(norm: np.ndarray, step: np.ndarray, exit_depth: int, converged: bool, r_max: int,
                label: str) -> go.Figure:
    """One token's hidden-state norm ‖s_i‖ and step size ‖s_i − s_{i−1}‖ over loops, its exit marked."""
    loops = np.arange(1, len(norm) + 1)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, subplot_titles=(
        "hidden-state norm ‖s_i‖", "step size ‖s_i − s_{i−1}‖"))
    fig.add_trace(go.Scatter(x=loops, y=norm, mode="lines+markers", name="‖s_i‖", line=dict(color="#54a24b"),
                             hovertemplate="loop %{x}<br>‖s_i‖ %{y:.4g}<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=loops, y=positive(step), mode="lines+markers", name="step", line=dict(color="#393b79"),
                             hovertemplate="loop %{x}<br>step %{y:.2e}<extra></extra>"), row=1, col=2)
    for col in (1, 2):
        fig.add_vline(x=exit_depth, line=dict(color="#00a0b0" if converged else "#e8467c", width=2, dash="dash"),
                      row=1, col=col)
        if r_max < len(norm):
            fig.add_vline(x=r_max + 0.5, line=dict(color="#bbb", width=1), row=1, col=col)
        fig.update_xaxes(title_text="loop i", row=1, col=col, range=[0.5, len(norm) + 0.5])
    fig.update_yaxes(title_text="‖s_i‖", row=1, col=1)
    fig.update_yaxes(type="log", title_text="‖s_i − s_{i−1}‖", exponentformat="power", row=1, col=2)
    base_layout(fig, f"Token {label}: its state per loop (dashed: its exit)", height=300)
    fig.update_layout(showlegend=False)
    return fig


# -- page 2: depth / loss curves ----------------------------------------------------------------------
def depth_loss(curves: dict[str, list[dict]], highlight: dict | None, reference: tuple[int, float] | None,
               title: str, bands: bool = True) -> go.Figure:
    """(mean loops, loss) curve per policy family with 95% bootstrap bands of the loss; `highlight`
    is the point of the current ε, `reference` (r̄, A0 loss at r̄) a dotted level. Without bands the
    loss axis zooms onto the curves."""
    fig = go.Figure()
    for name, pts in curves.items():
        pts = sorted(pts, key=lambda p: p["mean_loops"])
        color = catalogue.colour(name)
        x = [p["mean_loops"] for p in pts]
        if bands:
            fig.add_trace(band(x, [p["ci_low"] for p in pts], [p["ci_high"] for p in pts], color, name, group=name))
        thr = [fmt_threshold(p["threshold_name"], p["threshold"]) for p in pts]
        fig.add_trace(go.Scatter(
            x=x, y=[p["loss"] for p in pts], mode="lines+markers", name=catalogue.display(name),
            legendgroup=name, line=dict(color=color, width=2), marker=dict(size=5),
            customdata=np.array([[t, p["ci_low"], p["ci_high"]] for t, p in zip(thr, pts, strict=True)], dtype=object),
            hovertemplate=("%{customdata[0]}<br>mean loops %{x:.2f}<br>loss %{y:.4f} "
                           "[%{customdata[1]:.4f}, %{customdata[2]:.4f}]<extra>" + name + "</extra>")))
    if reference is not None:
        r_bar, loss = reference
        xs = [p["mean_loops"] for pts in curves.values() for p in pts]
        fig.add_trace(go.Scatter(x=[min(xs), max(xs)], y=[loss, loss], mode="lines", name=f"A0 loss at r̄ = {r_bar}",
                                 line=dict(color="#999", dash="dot", width=1), hoverinfo="skip"))
    if highlight is not None:
        fig.add_trace(current_marker(highlight, highlight["loss"], "loss %{y:.4f}"))
    fig.update_xaxes(title=LOOPS_AXIS)
    fig.update_yaxes(title=LOSS_AXIS)
    if not bands:
        ys = [p["loss"] for pts in curves.values() for p in pts if math.isfinite(p["loss"])]
        pad = 0.08 * (max(ys) - min(ys) or 1e-3)
        fig.update_yaxes(range=[min(ys) - pad, max(ys) + pad])
    return base_layout(fig, title, height=470)


def current_marker(highlight: dict, y: float, hover_y: str) -> go.Scatter:
    """The open red circle at the current threshold's point (x: its mean loops)."""
    return go.Scatter(x=[highlight["mean_loops"]], y=[y], mode="markers",
                      name=f"current {fmt_threshold(highlight['threshold_name'], highlight['threshold'])}",
                      marker=dict(size=18, symbol="circle-open", color="#d62728", line=dict(width=3)),
                      hovertemplate=f"mean loops %{{x:.2f}}<br>{hover_y}<extra>current ε</extra>")


def difference_curves(diffs: dict[str, dict], highlight: dict | None, title: str) -> go.Figure:
    """Each policy's loss minus A0's at the same mean loops, with paired 95% bootstrap bands
    (analysis.difference_from_a0); A0 is the zero line. `highlight` is the current ε's point."""
    fig = go.Figure()
    xs = [x for d in diffs.values() for x in d["mean_loops"]]
    if xs:
        fig.add_trace(go.Scatter(x=[min(xs), max(xs)], y=[0, 0], mode="lines", name=catalogue.display("A0") + " (zero)",
                                 line=dict(color=catalogue.colour("A0"), width=2), hoverinfo="skip"))
    for name, d in diffs.items():
        order = np.argsort(d["mean_loops"], kind="stable")
        pick = lambda key, d=d, order=order: np.asarray(d[key], dtype=float)[order]
        x, y, lo, hi = pick("mean_loops"), pick("diff"), pick("ci_low"), pick("ci_high")
        color = catalogue.colour(name)
        fig.add_trace(band(x, lo, hi, color, name, group=name))
        thr = np.array([fmt_threshold(d["threshold_name"], t) for t in d["thresholds"]], dtype=object)[order]
        fig.add_trace(go.Scatter(
            x=x, y=y, mode="lines+markers", name=catalogue.display(name), legendgroup=name,
            line=dict(color=color, width=2), marker=dict(size=5), customdata=np.stack([thr, lo, hi], axis=1),
            hovertemplate=("%{customdata[0]}<br>mean loops %{x:.2f}<br>− A0: %{y:+.4f} "
                           "[%{customdata[1]:+.4f}, %{customdata[2]:+.4f}]<extra>" + name + "</extra>")))
    if highlight is not None:
        fig.add_trace(current_marker(highlight, highlight["diff"], "− A0: %{y:+.4f}"))
    fig.update_xaxes(title=LOOPS_AXIS)
    fig.update_yaxes(title=DIFF_AXIS, zeroline=True)
    return base_layout(fig, title, height=470)


def elasticity_differences(diffs: list[dict], reference: str) -> go.Figure:
    """diffs: {name, loops, diff, ci_low, ci_high} per checkpoint, each minus the reference
    checkpoint at the same depth with paired 95% bootstrap bands (same windows)."""
    fig = go.Figure()
    for i, d in enumerate(diffs):
        color = PALETTE[(i + 1) % len(PALETTE)]
        fig.add_trace(band(d["loops"], d["ci_low"], d["ci_high"], color, d["name"]))
        fig.add_trace(go.Scatter(x=d["loops"], y=d["diff"], mode="lines+markers", name=d["name"],
                                 legendgroup=d["name"], line=dict(color=color), marker=dict(size=5),
                                 hovertemplate="loops %{x}<br>− reference: %{y:+.4f}<extra>" + d["name"] + "</extra>"))
    if diffs:
        loops = diffs[0]["loops"]
        fig.add_trace(go.Scatter(x=[loops[0], loops[-1]], y=[0, 0], mode="lines", name=f"{reference} (zero)",
                                 line=dict(color=PALETTE[0], width=2), hoverinfo="skip"))
    fig.update_xaxes(title="loops (uniform depth r)", dtick=2)
    fig.update_yaxes(title=f"loss − {reference}'s at the same depth [nats/token]", zeroline=True)
    return base_layout(fig, f"Difference from {reference} at each depth (paired 95% bootstrap bands, same windows)",
                       height=470)


def fmt_threshold(name: str, value) -> str:
    sym = {"eps": "ε", "tau": "τ", "r": "r"}.get(name, name)
    if isinstance(value, str):
        return f"{sym} = {value}"
    if name == "r":
        return f"r = {int(value)}"
    if value == 0:
        return f"{sym} = 0"
    if math.isinf(value):
        return f"{sym} = ∞"
    return f"{sym} = {value:.2g}"


# -- page 4: convergence ------------------------------------------------------------------------------
def per_loop(conv: dict, key: str, title: str, y_title: str, log: bool, color: str, scale: float = 1.0,
             threshold: float | None = None) -> go.Figure:
    loops = np.asarray(conv["loops"])
    val, lo, hi = (np.asarray(conv[k], dtype=float) * scale for k in (key, f"{key}_ci_low", f"{key}_ci_high"))
    if log:
        val, lo, hi = positive(val), positive(lo), positive(hi)
    fig = go.Figure([band(loops, lo, hi, color, title),
                     go.Scatter(x=loops, y=val, mode="lines+markers", name=title, line=dict(color=color),
                                hovertemplate="loop %{x}<br>%{y:.3g}<extra></extra>")])
    if threshold is not None:
        fig.add_trace(go.Scatter(x=[loops[0], loops[-1]], y=[threshold, threshold], mode="lines",
                                 name=f"moving threshold {threshold:g}", line=dict(color="#999", dash="dot")))
    fig.update_xaxes(title="loop i")
    fig.update_yaxes(title=y_title, type="log" if log else "linear", exponentformat="power")
    base_layout(fig, title, height=330)
    fig.update_layout(showlegend=threshold is not None)
    return fig


def state_norm_per_loop(dy: dict) -> go.Figure:
    """Mean hidden-state norm per loop with its 95% band, over the 10th–90th percentile of tokens."""
    loops, color = np.asarray(dy["loops"]), "#54a24b"
    spread = go.Scatter(x=np.concatenate([loops, loops[::-1]]),
                        y=np.concatenate([dy["state_norm_p90"], dy["state_norm_p10"][::-1]]), fill="toself",
                        mode="lines", fillcolor=rgba(color, 0.08), line=dict(width=0, dash="dot"), hoverinfo="skip",
                        name="10th–90th percentile of tokens")
    fig = go.Figure([spread, band(loops, dy["mean_state_norm_ci_low"], dy["mean_state_norm_ci_high"], color, "mean"),
                     go.Scatter(x=loops, y=dy["mean_state_norm"], mode="lines+markers", name="mean ‖s_i‖",
                                line=dict(color=color), hovertemplate="loop %{x}<br>%{y:.4g}<extra></extra>")])
    fig.update_xaxes(title="loop i")
    fig.update_yaxes(title="‖s_i‖")
    return base_layout(fig, "Hidden-state norm per loop", height=330)


def depth_histogram(depth: np.ndarray, converged: np.ndarray, r_max: int, eps: float) -> go.Figure:
    counts = np.bincount(depth[converged.astype(bool)], minlength=r_max + 1)[1:r_max + 1]
    capped = int((~converged.astype(bool)).sum())
    total = max(len(depth), 1)
    fig = go.Figure([go.Bar(x=np.arange(1, r_max + 1), y=100 * counts / total, name="converged",
                            marker_color="#4c78a8", hovertemplate="exit at loop %{x}: %{y:.1f}%<extra></extra>"),
                     go.Bar(x=[r_max], y=[100 * capped / total], name=f"not converged by r_max = {r_max}",
                            marker_color="#e8467c", hovertemplate="stopped at r_max: %{y:.1f}%<extra></extra>")])
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title="exit depth [loops]", dtick=1 if r_max <= 16 else 2)
    fig.update_yaxes(title="tokens [%]")
    return base_layout(fig, f"A1 exit depths at ε = {eps:.1e}", height=330)


# -- page 5: token classes ------------------------------------------------------------------------------
def class_bars(summary: dict, classes: Sequence[str]) -> go.Figure:
    names = [c for c in classes if summary[c]["n_tokens"] > 0]
    val = [summary[c]["mean_exit_depth"] for c in names]
    lo = [summary[c]["mean_exit_depth"] - summary[c]["ci_low"] for c in names]
    hi = [summary[c]["ci_high"] - summary[c]["mean_exit_depth"] for c in names]
    fig = go.Figure(go.Bar(
        x=names, y=val, marker_color=[PALETTE[i % len(PALETTE)] for i in range(len(names))],
        error_y=dict(type="data", symmetric=False, array=hi, arrayminus=lo, color="#333"),
        customdata=[summary[c]["n_tokens"] for c in names], text=[f"n = {summary[c]['n_tokens']:,}" for c in names],
        textposition="inside", insidetextanchor="start",
        hovertemplate="%{x}: %{y:.2f} loops<br>%{customdata} tokens<extra></extra>", name="mean exit depth"))
    fig.update_xaxes(title="token class")
    fig.update_yaxes(title="mean exit depth [loops]")
    return base_layout(fig, "Mean A1 exit depth by token class (95% bootstrap CI)", height=380)


# -- page 6: elasticity -----------------------------------------------------------------------------------
def elasticity(runs: list[dict]) -> go.Figure:
    """runs: {name, loops, loss, loss_ci_low, loss_ci_high, r_bar}; r̄ marked on each curve."""
    fig = go.Figure()
    for i, run in enumerate(runs):
        color = PALETTE[i % len(PALETTE)]
        fig.add_trace(band(run["loops"], run["loss_ci_low"], run["loss_ci_high"], color, run["name"]))
        fig.add_trace(go.Scatter(x=run["loops"], y=run["loss"], mode="lines+markers", name=run["name"],
                                 legendgroup=run["name"], line=dict(color=color), marker=dict(size=5),
                                 hovertemplate="loops %{x}<br>loss %{y:.4f}<extra>" + run["name"] + "</extra>"))
        rb = run["r_bar"]
        if 1 <= rb <= len(run["loss"]):
            fig.add_trace(go.Scatter(x=[rb], y=[run["loss"][rb - 1]], mode="markers+text", text=[f"r̄ = {rb}"],
                                     textposition="top center", name=f"{run['name']}: r̄", showlegend=False,
                                     marker=dict(size=14, symbol="diamond", color=color, line=dict(color="#000", width=1)),
                                     hovertemplate="training mean depth r̄ = %{x}<br>loss %{y:.4f}<extra></extra>"))
            fig.add_vline(x=rb, line=dict(color=color, dash="dot", width=1))
    fig.update_xaxes(title="loops (uniform depth r)", dtick=2)
    fig.update_yaxes(title=LOSS_AXIS)
    return base_layout(fig, "Elasticity: loss at uniform depth r = 1 … 32 (95% bootstrap CI over windows)", height=470)


# -- page 7: training run -----------------------------------------------------------------------------------
def line(df, x: str, y: str, title: str, x_title: str, y_title: str, color: str = "#4c78a8", mode: str = "lines",
         group: str | None = None) -> go.Figure:
    fig = go.Figure()
    if group is None:
        fig.add_trace(go.Scatter(x=df[x], y=df[y], mode=mode, name=y, line=dict(color=color), marker=dict(size=4)))
    else:
        for i, (g, part) in enumerate(df.groupby(group)):
            fig.add_trace(go.Scatter(x=part[x], y=part[y], mode="lines+markers", name=f"{group} {g}",
                                     line=dict(color=PALETTE[i % len(PALETTE)]), marker=dict(size=5)))
    fig.update_xaxes(title=x_title)
    fig.update_yaxes(title=y_title)
    return base_layout(fig, title, height=320)


# -- overthinking -----------------------------------------------------------------------------------------
def past_r_max(ov: dict, key: str, title: str, y_title: str, r_bar: int, scale: float = 1.0,
               by_hops: dict | None = None) -> go.Figure:
    """A per-loop figure of the overthinking sweep (`key` with its CI band) from loop 1 to its last,
    r̄ and r_max marked; by_hops: one extra line per hop count ({h: values per loop})."""
    loops, color = np.asarray(ov["loops"]), "#4c78a8"
    y = scale * np.asarray(ov[key], dtype=float)
    fig = go.Figure([band(loops, scale * np.asarray(ov[f"{key}_ci_low"], dtype=float),
                          scale * np.asarray(ov[f"{key}_ci_high"], dtype=float), color, "all"),
                     go.Scatter(x=loops, y=y, mode="lines", name="all" if by_hops else key, line=dict(color=color),
                                hovertemplate="loop %{x}<br>%{y:.4g}<extra></extra>")])
    for i, (h, values) in enumerate(sorted((by_hops or {}).items(), key=lambda kv: int(kv[0]))):
        fig.add_trace(go.Scatter(x=loops, y=scale * np.asarray(values, dtype=float), mode="lines",
                                 name=f"{h} hop{'s' if int(h) != 1 else ''}",
                                 line=dict(color=PALETTE[(i + 1) % len(PALETTE)], width=1.3),
                                 hovertemplate=f"{h} hops · loop %{{x}}<br>%{{y:.4g}}<extra></extra>"))
    for x, label, dash in ((r_bar, "r̄", "dot"), (ov["r_max"], "r_max", "dash")):
        fig.add_vline(x=x, line=dict(color="#888", width=1, dash=dash), annotation_text=f"{label} = {x}",
                      annotation_position="top")
    fig.update_xaxes(title="loops (every token the same)")
    fig.update_yaxes(title=y_title)
    return base_layout(fig, title, height=360)
