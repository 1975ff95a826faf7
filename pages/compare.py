"""Compare policies: A0 / A1 / A2 token strips of the pasted text side by side."""
import streamlit as st

from recur_core.exits import catalogue
from ui import compute, download, state, views
from ui.strip import legend_html

m = state.require_model()
st.title("Compare policies")
st.caption("The same text under the three depth-allocation policies. Set each policy's knob; the strips show "
           "where each one stops every token.")

enc = state.pasted_text(m, "compare_form")
tr = m.trace(enc.ids)
exact = state.text_path("compare")
decoding_note = st.container()


def policy_outcome(policy) -> compute.Outcome:
    return m.text_outcome(enc.ids, tr, policy, exact)


prb = m.probes()
legend = st.empty()  # one scale for the three strips, drawn once their depths are known

cols = st.columns(3, gap="medium")
with cols[0]:
    st.subheader("A0 · uniform depth")
    r = st.slider("r: loops for every token", 1, m.r_max,
                  **state.keep("cmp_r", m.r_bar, scope=m.path, valid=lambda v: 1 <= v <= m.r_max))
    policies = [("A0", f"A0 r={r}", compute.a0(r))]
with cols[1]:
    st.subheader("A1 · convergence exit")
    eps = state.eps_slider("compare")
    policies.append(("A1", f"A1 ε={eps:.1e}", m.a1(eps)))
with cols[2]:
    st.subheader("A2 · learned router")
    if prb:
        kind = st.radio("Probe labels", list(prb),
                        **state.keep("cmp_kind", "kl" if "kl" in prb else next(iter(prb)), scope=m.path,
                                     valid=lambda v: v in prb),
                        format_func={"kl": "KL ≥ ε at the next loop", "argmax": "argmax change at the next loop",
                                     "kl_any": "KL ≥ ε at any later loop",
                                     "argmax_any": "argmax change at any later loop"}.get)
        tau = st.slider("τ: halt once the predicted chance of change < τ", 0.0, 1.0, step=0.01,
                        **state.keep("cmp_tau", 0.5, scope=m.path))
        policies.append(("A2", f"A2 {kind} τ={tau:.2f}", m.a2(kind, tau)))
    else:
        st.info(f"A2 needs r_max ≥ 2 to train its probe (this checkpoint has r_max = {m.r_max})." if m.has_windows
                else "A2's probe is trained on the checkpoint's training-side windows, and this folder ships none.")

outcomes = [policy_outcome(policy) for _family, _label, policy in policies]
tables = [views.token_table(m, tr, enc, out) for out in outcomes]
scale = views.strip_scale(m, *tables)
legend.html(legend_html(scale))
for col, (_family, label, _policy), out, table in zip(cols, policies, outcomes, tables, strict=False):
    with col:  # 3 columns, 2 policies without A2
        a, b = st.columns(2)
        a.metric("Mean loops", f"{out.mean_loops:.2f}")
        b.metric("Loss [nats]", f"{out.loss:.3f}")
        views.render_strip(m, table, state.path_label(label, out), legend=False, scale=scale)
st.subheader("More exit criteria (Huginn's, Accel, the certified exit) · on the same tokens")
h_cols = st.columns(2, gap="medium")
with h_cols[0]:
    criteria = [f.name for f in catalogue.shown_in(catalogue.COMPARE)]
    crit = st.selectbox("Criterion (seal-rg/recurrent-pretraining's exit evaluators, Accel, the certified exit)", criteria,
                        format_func=catalogue.display, **state.keep("cmp_huginn", criteria[0],
                                                                   valid=lambda v: v in criteria))
    fam = catalogue.family(crit)
    if fam.integer:
        thr = st.number_input(fam.rule, 1, m.r_max, **state.keep(f"cmp_huginn_{crit}", min(fam.default, m.r_max),
                                                                  scope=m.path, valid=lambda v: 1 <= v <= m.r_max))
    elif fam.default is None:  # the certified exit: its knob is the checkpoint's measured L
        lip = m.lipschitz(None if m.has_windows else enc.ids)
        thr = st.number_input(fam.rule, fam.low, None, format="%.4g", help=f"Measured: L = {lip['lipschitz']:.4g}, "
                              f"the largest ‖z_i − z_{{i−1}}‖_∞ / ‖s_i − s_{{i−1}}‖ over {lip['n_pairs']:,} token-loop "
                              f"steps of a uniform run on {lip['measured_on']} (99th percentile {lip['p99']:.4g}). "
                              "The guarantee holds as far as L bounds the readout along the rest of the path.",
                              **state.keep(f"cmp_huginn_{crit}", lip["lipschitz"], scope=m.path))
    else:
        thr = st.number_input(fam.rule, fam.low, None, format="%.1e", **state.keep(f"cmp_huginn_{crit}", fam.default))
    h_policy = m.policy(crit, thr)
    h_out = policy_outcome(h_policy)
    shown = [*outcomes, h_out]
    a, b = st.columns(2)
    a.metric("Mean loops", f"{h_out.mean_loops:.2f}")
    b.metric("Loss [nats]", f"{h_out.loss:.3f}")
with h_cols[1]:
    views.render_strip(m, views.token_table(m, tr, enc, h_out), state.path_label(f"{fam.display} {fam.knob} = {thr:g}", h_out))

if m.gate() is not None:
    st.subheader("The model's learned exit gate · on the same tokens")
    g_cols = st.columns(2, gap="medium")
    with g_cols[0]:
        q = st.slider("q: halt at the first loop whose exit CDF ≥ q (Ouro's Q-exit)", 0.0, 1.0, 0.5, 0.01,
                      key="cmp_gate_q")
        g_out = policy_outcome(m.gate_exit(q))
        shown.append(g_out)
        a, b = st.columns(2)
        a.metric("Mean loops", f"{g_out.mean_loops:.2f}")
        b.metric("Loss [nats]", f"{g_out.loss:.3f}")
    with g_cols[1]:
        views.render_strip(m, views.token_table(m, tr, enc, g_out), state.path_label(f"gate q={q:.2f}", g_out),
                           legend=False)

state.follow_decoding(shown, decoding_note)
leaner = views.leaner_and_better([label for _f, label, _p in policies], outcomes)
if leaner:
    st.caption(f"**Fewer loops and a lower loss than A0 r={r}** on this text: {', '.join(leaner)}. Depth does not "
               "lower every token's loss: a token whose loss rises past some loop scores better when it stops early, "
               "and a short text has few tokens to average over. The eval-set pages (Depth / loss curve) say whether "
               "it holds on average.")

with st.expander("A2 probe quality (held-out windows) and the raw trace"):
    if prb:
        download.table(views.probe_table(prb), "a2_probe_quality")
    download.trace_buttons(tr, "text_trace_with_router")
st.caption(f"Loss: mean next-token cross-entropy over the {max(len(enc.ids) - 1, 0)} tokens that have a next token, "
           f"each read out at its exit loop ({'in real decoding' if exact else 'of the uniform run'}). "
           f"{catalogue.display('A2_kl')} uses A1's own signal as labels.")
