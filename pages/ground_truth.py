"""Ground truth: on a checkpoint whose answers have a known depth (multi-hop programs, word problems),
do exit policies stop each answer token at the depth it needs? Exact (as real halting) by default, the
fast path one click away."""
import streamlit as st

from ui import charts, download, ground_truth, jobs, state, text, views

m = state.require_model()
st.title("Ground truth: exit depth against the depth each answer needs")
if not ground_truth.has_ground_truth(m):
    st.info("This checkpoint has no ground truth. Pick **checkpoints/specimen** in the sidebar (word problems, "
            "each answer word labelled with the facts it reads) or **checkpoints/stories-reasoning** (word "
            "problems in story form, each answer word labelled with the composition steps it needs) or "
            "**checkpoints/hops** (variable-binding programs, each answer labelled with its number of lookups).")
    st.stop()

unit = ground_truth.unit(m)
operating = ("A good exit policy spends more loops on deeper answers. Each policy is shown at its **operating "
             "point**: the cheapest threshold whose answer accuracy is within 1 point of uniform depth r̄.")
task = text.task(m)
st.caption(f"{task.about} {operating}")
if state.first_look(m):
    st.info("The eval windows are being traced (once per checkpoint, then cached on disk); the page fills in when "
            "they are done.")
    state.refine(m, st.container())
    st.stop()

path = st.segmented_control(
    "Path", ["exact", "fast"], required=True, **state.keep("gt_path", "exact"),
    format_func={"exact": "Exact (what real decoding gets: halted tokens stay in context)",
                 "fast": "Fast (every other token at full depth)"}.get)
fast = ground_truth.section(m, False)
exact_ready = ground_truth.exact_ready(m)
if path == "exact" and not exact_ready:
    job = jobs.get(ground_truth.exact_key(m))
    if job is None:  # minutes to hours on a CPU: started only when asked
        n_harness, n_decoded, n_windows = ground_truth.exact_size(m)
        decoded = (", then the readout rules (A1, Huginn's KL / entropy / argmax) likewise in decoding, and decode "
                   "the certified exit at the checkpoint's measured L" if n_decoded else
                   " (this model has no coda, so the masking harness is exact for the readout rules too)")
        st.warning(f"**The exact figures are not computed yet, and on a CPU they may take long**: about 2 minutes for "
                   f"the shipped default on 2 cores (docs/BENCHMARKS.md), hours on a larger model. "
                   f"They walk each of {n_harness} rules from its fast operating point to its exact one "
                   f"on {n_windows} eval windows in the masking harness{decoded}; "
                   "once started, the bar shows the time left at its own pace "
                   "and Stop acts within seconds. The result is cached on disk (`python -m recur_core.analyze` "
                   "fills the same cache). The **fast path** is shown below meanwhile.", icon=":material/schedule:")
        st.button("Compute the exact figures", key="gt_start_exact", on_click=ground_truth.start_exact,
                  args=(m,))
    else:
        jobs.watch(job, "The exact figures are computed once per checkpoint, then cached on disk: the state rules "
                        "walked to their operating points in the masking harness, then the readout rules (A1, Huginn's "
                        "KL / entropy / argmax) decoded near theirs. Meanwhile the **fast path** is shown below.")
gt = ground_truth.section(m, True) if path == "exact" and exact_ready else fast
if exact_ready:
    exact = gt if gt is not fast else ground_truth.section(m, True)
    st.markdown(ground_truth.gap_sentence(exact, fast))
st.caption(f"Showing the **{gt['path']} path**. " + (
    "Exact: what real decoding gets, a halted token staying in the context with its exit state. State rules come "
    "from the masking harness, which equals decoding for them; readout rules (A1, Huginn's KL / entropy / argmax, the certified exit) "
    "are decoded token by token (report.json's `ground_truth`)." if gt["path"] == "exact" else
    "Fast: each answer is read off the uniform trace at its exit loop, as if every other token had looped to full "
    "depth; it overstates the saving (report.json's `ground_truth_fast`)."))

a1 = gt["policies"]["A1"]
sp = a1["spearman_exit_vs_hops"]
best = gt["best_uniform_depth"]
c = st.columns(4)
c[0].metric(f"Accuracy at r̄ = {m.r_bar}", f"{gt['uniform']['answer_accuracy'][m.r_bar - 1]:.1%}",
            help=f"Answer accuracy over {gt['n_trained_answers']} answers needing the trained {unit}s "
                 f"{gt['target_hops']}, in {gt['n_programs']} held-out windows.")
c[1].metric(f"Spearman(A1 exit, {unit}s)", ground_truth.fmt_rho(sp).split(" ")[0],
            help=f"With its 95% bootstrap CI over programs: {ground_truth.fmt_rho(sp)}")
c[2].metric("Best uniform depth", f"{best}" if best else "none",
            help=f"The smallest uniform depth whose answer accuracy reaches the target, "
                 f"{gt['target_accuracy']:.1%} (A0 at r̄ minus 1 point).")
ratio = a1["vs_best_uniform_loops_ratio"]
c[3].metric("A1 mean loops", f"{a1['mean_loops']:.2f}",
            **(views.delta(ratio - 1, ".0%", f"more than depth {best}", f"fewer than depth {best}", "lower",
                           f"as many as depth {best}") if ratio else {}),
            help=f"Over all tokens (answers and the rest), at A1's operating point; the change is against "
                 f"the best uniform depth {best} ({ratio or 0:.2f}×).")

charts.show(ground_truth.exit_vs_hops(gt, unit), "exit_vs_hops", key="exit_vs_hops")
charts.show(ground_truth.accuracy_vs_loops(gt, unit), "accuracy_vs_loops", key="accuracy_vs_loops")
st.dataframe(download.readable(ground_truth.policy_table(gt, fast if gt is not fast else None, unit)), hide_index=True,
             column_config={f"Spearman(exit, {unit}s) [95% CI]": st.column_config.TextColumn(width="medium"),
                            "matches A0 at r̄": st.column_config.TextColumn(width="medium")})

noun = task.noun
st.subheader(f"One {noun}, token by token")
examples_key = f"gt_programs@{m.path}"
examples = st.session_state.setdefault(examples_key, ground_truth.eval_examples(m))
cols = st.columns([3, 1, 1])
max_hops = cols[1].number_input(f"Max {unit} count", 1, gt["max_train_hops"] + 4,
                                **state.keep("gt_max_hops", min(4, gt["max_train_hops"]), scope=m.path))
cols[2].button(f"New random {noun}", key="gt_new", on_click=ground_truth.add_random_example, args=(m, examples_key))
examples = st.session_state[examples_key]
pick = cols[0].selectbox(noun.capitalize(), list(range(len(examples))),
                         **state.keep("gt_pick", 0, scope=m.path, valid=lambda i: 0 <= i < len(examples)),
                         format_func=lambda i: ground_truth.example_label(m, examples[i], i))
enc, depths = ground_truth.encode_example(m, examples[pick])
tr = m.trace(enc.ids, with_probes=False)
eps = state.eps_slider("ground_truth")
out = m.text_outcome(enc.ids, tr, m.a1(eps), path == "exact")  # the page's path
table = views.token_table(m, tr, enc, out)
table["ground_truth"] = ground_truth.ground_truth_notes(depths, unit)
state.follow_decoding([out])
views.render_strip(m, table, state.path_label(f"A1 ε={eps:.1e}", out), colour_by=state.colour_by_control("ground_truth"))
st.dataframe(download.readable(ground_truth.answer_table(table, depths, unit)), hide_index=True)
