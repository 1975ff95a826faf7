"""Depth / loss curve: A0, A1 and A2 as (mean loops, loss) curves, the current ε highlighted."""
import math

import streamlit as st

from recur_core.exits import catalogue
from ui import charts, compute, download, jobs, state, views

m = state.require_model()
st.title("Depth / loss curve")
st.caption("Each policy traced as (mean loops per token, loss). **A0** gives every token r loops; **A1** stops a "
           "token once KL(p_i ‖ p_{i−1}) < ε (first check at loop 2, the paper's convention: loop 1's KL compares "
           "with the readout of the noise state); **A2** stops it once a linear probe on the core state predicts no "
           "further change (τ), with four label kinds (argmax or KL ≥ label ε; at the next loop or any later one); "
           "on a model trained with an exit gate (Ouro), **Gate** stops it at the first loop whose exit CDF "
           "reaches q (Ouro's Q-exit, capped at the gate's trained steps). "
           "**Exact** (the masking harness, on the points that decide the headline numbers) gives them, as in "
           "report.json; **fast** (each token scored at its exit loop of one uniform trace) is what the ε slider "
           "looks up instantly.")

ids = state.source_picker(m)
if ids is False:
    st.stop()
first_look = state.first_look(m, ids)
banner = st.container()
n_exact = 1 if ids is not None else compute.S.windows
cached = not first_look and m.exact_cached(ids, n_exact)
mode = st.segmented_control("Evaluation", ["exact", "fast"], required=True, disabled=first_look,
                            **state.keep("eval_mode", "exact" if cached else "fast", scope=f"{m.path}|{ids is None}"),
                            format_func={"fast": "Fast (trace: score each token at its exit loop)",
                                         "exact": "Exact (masking harness: frozen tokens stay in context)"}.get)
mode = "fast" if first_look else mode
if mode == "fast" and not cached and not first_look:
    st.info("The exact sweep of these windows is not computed yet: choose **Exact** to run it (minutes on a CPU; "
            "then cached on disk), or run `python -m recur_core.analyze`, which fills the same cache.")
view = st.segmented_control("View", ["diff", "absolute"], **state.keep("curve_view", "diff"), required=True,
                            format_func={"diff": "Difference from A0 (paired)", "absolute": "Loss"}.get,
                            help="Difference: each curve minus A0 at the same mean loops, with paired bootstrap "
                                 "bands (both terms on the same resampled windows), so the window-to-window spread "
                                 "cancels. Loss: each curve with its own band over windows.")
eps = state.eps_slider("curve")
bands = view == "absolute" and st.toggle("95% bootstrap bands", **state.keep("bands", True),
                                         help="Off: the loss axis zooms onto the curves. These bands include "
                                              "between-window variance; the difference view pairs them.")

if mode == "exact" and ids is None:
    n_exact = st.select_slider("Windows for the exact harness", [4, 8, 16, 32, 64, 128],
                               **state.keep("exact_windows", n_exact))
exact_ready = mode == "exact" and m.exact_cached(ids, n_exact)
if mode == "exact" and not exact_ready:  # minutes on a CPU: in the background, the fast path meanwhile
    with banner:
        jobs.watch(m.start_exact_sweep(ids, n_exact),
                   "The exact sweep runs in the masking harness (then it is cached on disk); the **fast path** is "
                   "shown until it is done.")
if exact_ready:
    res = m.sweep_exact(ids, n_exact)
    where = f"{res['n_windows']} window(s), exact masking harness"
else:
    mode = "fast"
    res = m.sweep_fast(ids, first_look)
    where = f"{res['n_windows']} window(s) × {res['seq_len']} tokens, fast path" + (", first look" if first_look else "")
rep = res["report"]
points = {k: rep[k] for k in views.FAMILIES if k in rep}

cur = views.point_at(points["A1"], eps)
a0 = {int(p["threshold"]): p for p in points["A0"]}
ref = (m.r_bar, a0[m.r_bar]["loss"]) if m.r_bar in a0 else None

c = st.columns(4)
c[0].metric("ε (current point)", f"{cur['threshold']:.1e}",
            help=None if math.isclose(cur["threshold"], eps) else "The nearest ε of the swept grid.")
best = views.smallest_depth_reaching(a0, cur["loss"])
c[1].metric("Mean loops (A1)", f"{cur['mean_loops']:.2f}", **views.against_best_uniform(cur["mean_loops"], best, m.r_max),
            help=f"Against the best uniform depth: the smallest r whose A0 loss on these windows is at most A1's "
                 f"here ({'none up to r_max = ' + str(m.r_max) if best is None else f'r = {best}'}). Against uniform "
                 f"r̄ = {m.r_bar}: {cur['mean_loops'] / m.r_bar - 1:+.0%} loops (the last metric matches r̄'s loss).")
c[2].metric("Loss (A1)", f"{cur['loss']:.4f}",
            **({} if ref is None else views.delta(cur["loss"] - ref[1], ".4f", "nats worse than A0 at r̄",
                                                  "nats better than A0 at r̄", "lower", "as good as A0 at r̄")),
            help=f"95% CI [{cur['ci_low']:.4f}, {cur['ci_high']:.4f}] nats/token")
match = rep.get("a1_loops_to_match_a0_rbar", {})
reached = views.is_number(match.get("value"))
match_best = views.smallest_depth_reaching(a0, a0[m.r_bar]["loss"]) if m.r_bar in a0 else None
c[3].metric(f"A1 loops to match A0 at r̄ = {m.r_bar} ({mode})", f"{match['value']:.2f}" if reached else "not reached",
            **(views.against_best_uniform(match["value"], match_best, m.r_max) if reached and match_best else {}),
            help=f"Mean loops at which the A1 curve first reaches uniform depth r̄'s loss; 95% CI "
                 f"{views.fmt_est(match)} ({match.get('n_boot_not_reached', 0)} bootstrap replicates never reach it). "
                 f"Against the best uniform depth that reaches the same loss (r = {match_best}), not r̄ itself"
                 + (f"; against r̄ = {m.r_bar}: {match['value'] / m.r_bar - 1:+.0%} loops." if reached else "."))

if view == "diff":
    diffs = {k: res["diffs"][k] for k in views.FAMILIES if k in res["diffs"]}
    highlight = {**views.diff_point_at(diffs["A1"], eps)}
    fig = charts.difference_curves(diffs, highlight, f"Loss − A0 at the same mean loops ({where}; paired 95% bands)")
else:
    fig = charts.depth_loss(points, cur, ref, f"Loss vs mean loops ({where})", bands)
charts.show(fig, "depth_loss", key="depth_loss")

st.subheader(f"Matched depth ({mode} path)")
st.caption("At each uniform depth r: every policy's loss at the same mean loops (interpolated on its curve) "
           "and its paired difference from A0, with 95% bootstrap CIs. Negative = better than uniform.")
matched = views.estimate_columns(rep["matched_depth"])
download.table(matched, "matched_depth", column_config=views.number_formats(matched))
st.caption(" · ".join(views.match_sentence(catalogue.display(k), rep[f"{k.lower()}_loops_to_match_a0_rbar"], m.r_bar)
                      for k in views.FAMILIES[1:] if f"{k.lower()}_loops_to_match_a0_rbar" in rep))
with st.expander("A2 label kinds side by side"):
    if first_look:
        st.caption("After the first look: A2's probes are being trained.")
    st.caption("The router's labels: argmax or KL ≥ label ε (A1's matched ε on the probe's training windows), at the "
               "next loop or at any later loop up to r_max. Probe quality on held-out probe windows.")
    if not first_look:
        download.table(views.label_kinds_table(m.probes(), rep), "a2_label_kinds")
if mode == "exact":
    st.subheader("Fast − exact")
    st.caption("Every policy of the sweep scored both ways on the same windows; the gap is fast − exact (paired CI).")
    gaps = views.gap_table(res["gaps"])
    download.table(gaps, "fast_minus_exact", column_config=views.number_formats(gaps))
with st.expander("All curve points"):
    download.table(views.curve_table(points), "curve_points")
if first_look:
    state.refine(m, banner)
