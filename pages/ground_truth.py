"""Ground truth: on a checkpoint trained on multi-hop programs, do exit policies stop each answer
token at the depth its hop count needs?"""
import streamlit as st

from ui import charts, compute, ground_truth, state, views

m = state.require_model()
st.title("Ground truth: exit depth against hop count")
if not ground_truth.has_ground_truth(m.path):
    st.info("This checkpoint has no ground truth. Pick **checkpoints/hops** in the sidebar: a model trained on "
            "variable-binding programs, where each answer token's required number of lookups (its hop count) is "
            "known.")
    st.stop()

st.caption("Programs bind variables in chains (`k=7;b=k;x=b;` … `x?7;`). The answer after `v?` needs one lookup per "
           "hop, so its **hop count** is the depth it should need. A good exit policy spends more loops on deeper "
           "answers. Each policy is shown at its **operating point**: the cheapest threshold whose answer accuracy "
           "is within 1 point of uniform depth r̄.")

gt = ground_truth.section(*m.key, m.r_max, m.r_bar)
st.caption("Fast path: each answer read off the uniform trace at its exit loop, as if every other token had "
           "looped to full depth; it overstates the saving. `python -m recur_core.analyze` reports the exact "
           "figures (masking harness) in report.json's `ground_truth`.")
a1 = gt["policies"]["A1"]
sp = a1["spearman_exit_vs_hops"]
best = gt["best_uniform_depth"]
c = st.columns(4)
c[0].metric(f"Answer accuracy at r̄ = {m.r_bar}", f"{gt['uniform']['answer_accuracy'][m.r_bar - 1]:.1%}",
            help=f"Over {gt['n_answers']} answers of {gt['n_programs']} held-out programs.")
c[1].metric("Spearman(A1 exit, hops)", ground_truth.fmt_rho(sp).split(" [")[0],
            help=f"With its 95% bootstrap CI over programs: {ground_truth.fmt_rho(sp)}")
c[2].metric("Smallest uniform depth reaching the target", f"{best}" if best else "none",
            help=f"Target: answer accuracy ≥ {gt['target_accuracy']:.1%} (A0 at r̄ minus 1 point).")
c[3].metric("A1 mean loops", f"{a1['mean_loops']:.2f}",
            delta=None if not a1["vs_best_uniform_loops_ratio"] else f"{a1['vs_best_uniform_loops_ratio']:.2f}× best uniform",
            delta_color="off", help="Over all program tokens (answers and the rest), at A1's operating point.")

charts.show(ground_truth.exit_vs_hops(gt), "exit_vs_hops", key="exit_vs_hops")
charts.show(ground_truth.accuracy_vs_loops(gt), "accuracy_vs_loops", key="accuracy_vs_loops")
st.dataframe(ground_truth.policy_table(gt), hide_index=True)

st.subheader("One program, token by token")
programs = st.session_state.setdefault("gt_programs", ground_truth.eval_programs(m))
cols = st.columns([3, 1, 1])
max_hops = cols[1].number_input("Max hop count", 1, gt["max_train_hops"] + 4, min(4, gt["max_train_hops"]),
                                key="gt_max_hops")
cols[2].button("New random program", key="gt_new", on_click=ground_truth.add_random_program, args=(m,))
programs = st.session_state["gt_programs"]
pick = cols[0].selectbox("Program", list(range(len(programs))), key="gt_pick",
                         format_func=lambda i: ground_truth.program_label(programs, i))
text = programs[pick]
enc, hops = ground_truth.encode_program(m, text)
tr = compute.text_trace(*m.key, enc.ids, False)
eps = state.eps_slider("ground_truth")
out = compute.outcome(tr, compute.a1(eps, m.r_max))
table = views.token_table(m, tr, enc, out)
table["ground_truth"] = ground_truth.ground_truth_notes(hops)
views.render_strip(m, table, f"A1 ε={eps:.1e}")
st.dataframe(ground_truth.answer_table(table), hide_index=True)
