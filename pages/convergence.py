"""Convergence: how the successive-output KL, the moving fraction and the state change decay over loops."""
import pandas as pd
import streamlit as st

from recur_core.analysis.dynamics import REGIMES
from ui import charts, download, state

m = state.require_model()
st.title("Convergence")
st.caption("Uniform run to the trace depth; per loop i the mean KL(p_i ‖ p_{i−1}) over tokens, the fraction of "
           "tokens still moving (KL above the threshold) and the relative state change ‖s_i − s_{i−1}‖ / ‖s_i‖, "
           "with 95% bootstrap bands over windows.")
ids = state.source_picker(m)
if ids is False:
    st.stop()
first_look = state.first_look(m, ids)
banner = st.container()
conv = m.convergence(ids, first_look)

c = st.columns(3)
c[0].metric("Median convergence loop", f"{conv['median_convergence_loop']:.0f}",
            help=f"Median over tokens of the loop from which KL stays ≤ {conv['moving_threshold']:g} to the end "
                 f"(95% CI [{conv['median_convergence_loop_ci_low']:.0f}, {conv['median_convergence_loop_ci_high']:.0f}]).")
c[1].metric("Never settled", f"{conv['frac_never_settled']:.1%}", help="Tokens still moving at the last loop.")
c[2].metric("Moving threshold", f"KL > {conv['moving_threshold']:g} nats")

left, right = st.columns(2)
with left:
    charts.show(charts.per_loop(conv, "mean_kl_prev", "Mean KL(p_i ‖ p_{i−1}) per loop", charts.KL_AXIS, True,
                                "#f58518"), "mean_kl", key="mean_kl")
    charts.show(charts.per_loop(conv, "mean_state_change", "State change per loop", "‖s_i − s_{i−1}‖ / ‖s_i‖",
                                True, "#4c78a8"), "state_change", key="state_change")
with right:
    charts.show(charts.per_loop(conv, "frac_moving", "Tokens still moving", "tokens with KL > threshold [%]",
                                False, "#e45756", scale=100.0), "frac_moving", key="frac_moving")
    eps = state.eps_slider("convergence")
    ex = m.exit_depths(ids, eps, first_look)
    charts.show(charts.depth_histogram(ex["depth"], ex["converged"], m.r_max, eps), "exit_depths", key="exit_depths")

dy = m.dynamics(ids, first_look)
st.subheader("How the states move")
low, high = dy["marginal_band"]
r = st.columns(3)
for col, name, what in zip(r, REGIMES, (f"ρ < {low:g}: the steps shrink", f"{low:g} ≤ ρ ≤ {high:g}: they neither "
                                        "shrink nor grow", f"ρ > {high:g}: they grow"), strict=True):
    share = dy[f"share_{name}"]
    col.metric(name.capitalize(), f"{share['value']:.1%}",
               help=f"Tokens whose step size ‖s_i − s_{{i−1}}‖ changes by a factor ρ per loop over the last "
                    f"{dy['rate_loops']} loops with {what} (95% CI [{share['ci_low']:.1%}, {share['ci_high']:.1%}]).")
charts.show(charts.state_norm_per_loop(dy), "state_norm", key="state_norm")

table = pd.DataFrame({k: conv[k] for k in conv if isinstance(conv[k], list)})
with st.expander("Per-loop table and the raw trace"):
    download.table(table, "convergence_per_loop")
    download.trace_buttons(m.trace(ids, with_probes=ids is None, first_look=first_look),
                           "eval_trace" if ids is None else "text_trace")
if first_look:
    state.refine(m, banner)
