"""Overthinking: loss (and answer accuracy on ground-truth checkpoints) at uniform depths far past r_max,
and each token's answer flips across loops."""
import pandas as pd
import streamlit as st

from ui import charts, compute, download, jobs, state
from ui.strip import plain_visible
from ui.text import encode_for

m = state.require_model()
st.title("Overthinking")
st.caption("Every token loops the same number of times, from 1 to 4 × r_max (at most 128, never fewer than the "
           "analysis' own trace): does quality peak near the trained depth and then fall? Loss per loop with 95% "
           "bootstrap bands over windows; on a checkpoint with ground truth (hops) the answer accuracy per loop, "
           "per hop count too. An **answer flip** is a change of a token's top prediction (argmax) from one loop to "
           "the next. The same figures as `python -m recur_core.analyze --overthinking`, from the same cached trace.")
ids = state.source_picker(m)
if ids is False:
    st.stop()
try:
    windows, loops = m.overthinking_size(ids)
except ValueError as err:  # past the memory available: refused before any work
    st.error(f"The overthinking sweep is refused: {err}")
    st.stop()

what = f"{windows} eval window(s)" if ids is None else f"the pasted text ({len(ids)} tokens)"
if not m.overthinking_ready(ids):
    if m.overthinking_job(ids) is None and ids is None:  # the eval set's sweep starts when asked
        st.info(f"The sweep traces {what} to {loops} loops: minutes on a large checkpoint, so it starts when asked "
                "and runs in the background (cached on disk after this).")
        st.button(f"Run the sweep: {what} × {loops} loops", key="ot_start", on_click=m.start_overthinking,
                  args=(ids,))
        st.stop()
    job = m.start_overthinking(ids)
    if ids is not None:
        job.wait(compute.DECODE_WAIT_S)  # a short text is done within seconds
    if not job.finished or job.error or job.stopped:
        jobs.watch(job, f"**Overthinking sweep**: tracing {what} to {loops} loops in the background; the page "
                        "shows the figures when it is done.")
        st.stop()

ov = m.overthinking(ids)
c = st.columns(4)
c[0].metric("Best depth", f"{ov['best_loop']} loops", help="The uniform depth with the lowest loss.")
c[1].metric(f"Loss at r_max = {ov['r_max']}", f"{ov['loss_at_r_max']:.4f}")
c[2].metric(f"Loss at {ov['loops'][-1]} loops", f"{ov['loss_at_last']:.4f}",
            delta=f"{ov['loss_at_last'] - ov['loss_at_r_max']:+.4f} vs r_max", delta_color="inverse")
flips, late = ov["mean_flips"], ov["share_flipping_past_r_max"]
c[3].metric("Answer flips per token", f"{flips['value']:.2f}",
            help=f"Mean number of argmax changes between consecutive loops 1..{ov['loops'][-1]} (95% CI "
                 f"[{flips['ci_low']:.2f}, {flips['ci_high']:.2f}]); {late['value']:.1%} of tokens flip for the last "
                 f"time after r_max (CI [{late['ci_low']:.1%}, {late['ci_high']:.1%}]).")
charts.show(charts.past_r_max(ov, "loss", "Loss at every uniform depth, past r_max", charts.LOSS_AXIS, m.r_bar),
            "overthinking_loss", key="overthinking_loss")
if "answer_accuracy" in ov:
    charts.show(charts.past_r_max(ov, "answer_accuracy", "Answer accuracy at every uniform depth, by hop count",
                                  "answers right [%]", m.r_bar, scale=100.0, by_hops=ov["answer_accuracy_by_hops"]),
                "overthinking_accuracy", key="overthinking_accuracy")

if "tokens" in ov:
    enc = encode_for(m, state.current_text(m))
    tok = ov["tokens"]
    table = pd.DataFrame({
        "position": range(len(tok["flips"])), "token": [plain_visible(p) for p in enc.pieces],
        "answer flips": tok["flips"], "last flip at loop": tok["last_flip"],
        f"top prediction at r_max = {ov['r_max']}": [plain_visible(t) for t in
                                                     m.decode_ids(tok["argmax_at_r_max"])],
        f"top prediction at {ov['loops'][-1]} loops": [plain_visible(t) for t in
                                                       m.decode_ids(tok["argmax_at_last"])]})
    st.subheader("Each token's answer flips")
    download.table(table, "answer_flips", caption="Per token: how often its top prediction changes between "
                   "consecutive loops, and the last loop at which it did (0: never).")
with st.expander("Loss (and answer accuracy) per loop (table)"):
    cols = [k for k in ("loss", "loss_ci_low", "loss_ci_high", "answer_accuracy", "answer_accuracy_ci_low",
                        "answer_accuracy_ci_high") if k in ov]
    download.table(pd.DataFrame({"loops": ov["loops"], **{k: ov[k] for k in cols}}), "overthinking_per_loop")
