"""Token exit depths: a token strip coloured by A1 exit depth (or by regime), the KL heatmap and a
per-token drill-in (its curves, regime and state norm per loop)."""
import streamlit as st

from recur_core.analysis import curves as analysis
from recur_core.analysis.dynamics import MARGINAL, PRECISION, RATE_LOOPS
from ui import charts, compute, download, state, views
from ui.strip import plain_visible

m = state.require_model()
st.title("Token exit depths")
st.caption("Every token is coloured by its **A1 exit depth**: the first loop i at which KL(p_i ‖ p_{i−1}) "
           "drops below ε, after which the token is frozen. A1 first checks at loop 2 (the paper's convention: "
           "loop 1's KL compares with the readout of the noise state). Hover a token for its depth and top "
           "prediction; pick one below to drill in. The heatmap and the drill-in show the uniform run (every "
           "token to the last loop), with the exit marked. **Colour each token by the loops that produced it** shifts "
           "the colours by one: each token shows the exit of the token before it, the position that predicted it "
           "(a word problem's answer word then carries the depth its answer took). **Its regime** colours it by how its "
           "state moves over the uniform run's last loops: settling (the steps shrink), marginal or drifting (they grow).")

enc = state.pasted_text(m, "exits_form")
decoding_note = st.container()
tr = m.trace(enc.ids, with_probes=False)

exact = state.text_path("exits")
eps = state.eps_slider("exits")
out = m.text_outcome(enc.ids, tr, m.a1(eps), exact)
uniform = compute.outcome(tr, compute.a0(m.r_bar))  # A0 freezes no token early: its trace is its decoding
table = views.token_table(m, tr, enc, out)
state.follow_decoding([out], decoding_note)

c = st.columns(4)
c[0].metric("Mean loops (A1)", f"{out.mean_loops:.2f}", help="Mean exit depth over the tokens that have a next "
            "token to score (all but the last).")
best = analysis.smallest_uniform_depth(tr, out.loss, m.r_max)
saving = views.saving_vs_uniform(out.mean_loops, best, m.r_max, m.r_bar)
c[1].metric(saving.label, saving.value, **saving.vs_r_bar,
            help=f"Core loops against the best uniform depth: the smallest uniform depth r whose loss on this text is "
                 f"at most A1's (\"beats all\": none up to r_max = {m.r_max} reaches it, A1's loss is below every "
                 f"uniform depth's). Beneath, against uniform r̄ = {m.r_bar}: {out.mean_loops:.2f} against {m.r_bar} "
                 "loops. The paper's FLOP proxy; the cost of the KL check itself is not counted.")
c[2].metric("Loss (A1)", f"{out.loss:.3f} nats",
            **views.delta(out.loss - uniform.loss, ".3f", "nats worse than A0 at r̄", "nats better than A0 at r̄",
                          "lower", "as good as A0 at r̄"), help="Mean next-token cross-entropy with each token read out at its exit loop.")
c[3].metric("Converged before r_max", f"{table.converged.mean():.0%}", help=f"Tokens whose KL fell below ε by "
            f"r_max = {m.r_max}; the others (pink, dashed) were stopped by the cap.")

if saving.warning:
    st.warning(saving.warning)

pick_key = f"token_pos_{hash(enc.ids) & 0xFFFFFFFF:x}"  # a fresh picker for every text
selected = st.session_state.get(pick_key, views.deepest_token(table))
colour_by = state.colour_by_control("exits", regime=True)
views.render_strip(m, table, state.path_label(f"A1 ε={eps:.1e}", out), selected=selected, colour_by=colour_by)

charts.show(charts.kl_heatmap(tr.kl_prev[0], [plain_visible(p) for p in enc.pieces], out.depth[0],
                              out.converged[0], m.r_max, "A1, decoding" if out.decoded is not None else "A1"), "kl_heatmap",
            key="kl_heatmap")

st.subheader("Drill into a token")
pos = st.selectbox("Token", list(range(len(table))), index=selected, key=pick_key,
                   format_func=lambda p: views.token_label(table, p))
row = table.iloc[pos]
charts.show(charts.token_curves(tr.kl_prev[0, pos], tr.state_change[0, pos], tr.ce[0, pos], int(row.exit_depth),
                                bool(row.converged), eps, m.r_max, views.token_label(table, pos)),
            "token_curves", key="token_curves")
low, high = MARGINAL
r = st.columns(2)
r[0].metric("Regime", str(row.regime).capitalize(), help=f"From the contraction rate ρ of the token's step sizes over "
            f"the uniform run's last {RATE_LOOPS} loops: settling ρ < {low:g} (or its last relative step at most "
            f"{PRECISION:g}: converged to float32 resolution), marginal {low:g} ≤ ρ ≤ {high:g}, drifting ρ > {high:g}.")
r[1].metric("Contraction rate ρ", f"{row.contraction_rate:.3g}", help=f"(δ_L / δ_(L−{RATE_LOOPS}))^(1/{RATE_LOOPS}), "
            "δ_i = ‖s_i − s_{i−1}‖ the state's step size, L the trace's last loop: below 1 the steps shrink.")
charts.show(charts.token_state(tr.state_norm[0, pos], tr.state_step[0, pos], int(row.exit_depth), bool(row.converged),
                               m.r_max, views.token_label(table, pos)), "token_state", key="token_state")
st.markdown(f"**Logit lens over loops** — top-{tr.topk} next-token predictions of token #{pos} after each loop")
download.table(views.logit_lens(m, tr, pos, int(row.exit_depth)), f"logit_lens_token{pos}", height=280)

with st.expander("All tokens and the raw trace"):
    download.table(table, "token_exits", caption="One row per token at the current ε.")
    download.trace_buttons(tr, "text_trace")
