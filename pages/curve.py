"""Depth / loss curve: A0, A1 and A2 as (mean loops, loss) curves, the current ε highlighted."""
import math

import streamlit as st

from ui import charts, compute, download, state, views

m = state.require_model()
st.title("Depth / loss curve")
st.caption("Each policy traced as (mean loops per token, loss) with 95% bootstrap bands over windows. "
           "**A0** gives every token r loops; **A1** stops a token once KL(p_i ‖ p_{i−1}) < ε; **A2** stops it "
           "once a linear probe on the core state predicts no further change (τ). The sweep is computed once; "
           "the ε slider only looks a point up.")

ids = state.source_picker(m)
if ids is False:
    st.stop()
mode = st.segmented_control("Evaluation", ["fast", "exact"], default="fast", key="eval_mode", required=True,
                            format_func={"fast": "Fast (trace: score each token at its exit loop)",
                                         "exact": "Exact (masking harness: frozen tokens stay in context)"}.get)
eps = state.eps_slider("curve")
bands = st.toggle("95% bootstrap bands", value=True, key="bands",
                  help="Off: the loss axis zooms onto the curves. The bands include between-window variance; "
                       "the paired differences in the matched-depth table are tighter.")

if mode == "fast":
    res = compute.sweep_fast(*m.key, ids, m.r_max, m.r_bar)
    rep = res["report"]
    points = {k: rep[k] for k in views.FAMILIES if k in rep}
    where = f"{res['n_windows']} window(s) × {res['seq_len']} tokens, fast path"
else:
    n = 1 if ids is not None else st.select_slider("Windows for the exact harness", [4, 8, 16, 32, 64, 128],
                                                   value=compute.S.exact_windows, key="exact_windows")
    res = compute.sweep_exact(*m.key, ids, m.r_max, n)
    points = views.exact_points(res["rows"])
    where = (f"{res['n_windows']} window(s), exact masking harness; ε at one value per decade, τ at "
             f"{len(compute.S.exact_tau_grid)} values")
cur = views.point_at(points["A1"], eps)
a0 = {int(p["threshold"]): p for p in points["A0"]}
ref = (m.r_bar, a0[m.r_bar]["loss"]) if m.r_bar in a0 else None

c = st.columns(4)
c[0].metric("ε (current point)", f"{cur['threshold']:.1e}",
            help=None if math.isclose(cur["threshold"], eps) else "The exact harness ran the nearest decade.")
c[1].metric("Mean loops (A1)", f"{cur['mean_loops']:.2f}",
            delta=f"{cur['mean_loops'] - m.r_bar:+.2f} vs r̄ = {m.r_bar}", delta_color="inverse")
c[2].metric("Loss (A1)", f"{cur['loss']:.4f}", delta=None if ref is None else f"{cur['loss'] - ref[1]:+.4f} vs A0 at r̄",
            delta_color="inverse", help=f"95% CI [{cur['ci_low']:.4f}, {cur['ci_high']:.4f}] nats/token")
if mode == "fast":
    match = rep.get("a1_loops_to_match_a0_rbar", {})
    reached = views.is_number(match.get("value"))
    c[3].metric(f"A1 loops to match A0 at r̄ = {m.r_bar}", f"{match['value']:.2f}" if reached else "not reached",
                delta=f"{match['value'] / m.r_bar - 1:+.0%} depth" if reached else None, delta_color="inverse",
                help=f"Mean loops at which the A1 curve first reaches uniform depth r̄'s loss; 95% CI "
                     f"{views.fmt_est(match)}.")

charts.show(charts.depth_loss(points, cur, ref, f"Loss vs mean loops ({where})", bands), "depth_loss", key="depth_loss")

if mode == "fast":
    st.subheader("Matched depth")
    st.caption("At each uniform depth r: every policy's loss at the same mean loops (interpolated on its curve) "
               "and its paired difference from A0, with 95% bootstrap CIs. Negative = better than uniform.")
    matched = views.estimate_columns(rep["matched_depth"])
    download.table(matched, "matched_depth", column_config=views.number_formats(matched))
    st.caption(" · ".join(views.match_sentence(charts.FAMILY_NAMES[k], rep[f"{k.lower()}_loops_to_match_a0_rbar"], m.r_bar)
                          for k in views.FAMILIES[1:] if f"{k.lower()}_loops_to_match_a0_rbar" in rep))
    with st.expander("All curve points"):
        download.table(views.curve_table(points), "curve_points")
else:
    st.subheader("Fast vs exact")
    st.caption("The same policies scored both ways on the same windows; the gap is exact − fast (paired CI).")
    exact = views.exact_table(res["rows"])
    download.table(exact, "fast_vs_exact", column_config=views.number_formats(exact))
