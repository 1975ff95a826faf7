"""Training run: the checkpoint's metrics.jsonl (loss, sampled depth r, throughput, eval loss by depth)."""
import streamlit as st

from ui import charts, download, state

m = state.require_model()
st.title("Training run")
log = m.training_log()
if log is None or log["train"].empty:
    st.info("This checkpoint has no training log (metrics.jsonl is missing or empty).")
    st.stop()
train, evals = log["train"], log["eval"]
if log["bad_lines"]:
    st.warning(f"{log['bad_lines']} unreadable line(s) in metrics.jsonl were skipped.")
meta = m.meta
c = st.columns(4)
c[0].metric("Steps", f"{int(meta.get('step', train['step'].max())):,}")
c[1].metric("Tokens trained", f"{int(meta.get('tokens_seen', train['tokens'].max())):,}")
c[2].metric("Last train loss", f"{train['loss'].iloc[-1]:.3f} nats")
c[3].metric("Wall time", f"{meta.get('wall_seconds', float('nan')) / 60:.1f} min")
st.caption(f"Recipe: {m.recipe.describe()}. `best/` chosen on "
           + (meta["best_selected_on"] if meta.get("best_selected_on") else
              "the first periodic-eval windows of the saved eval windows (a run older than disjoint selection)") + ".")

left, right = st.columns(2)
with left:
    charts.show(charts.line(train, "tokens", "loss", "Training loss", "tokens", "loss [nats/token]"), "train_loss",
                key="train_loss")
    charts.show(charts.line(train, "step", "tokens_per_s", "Throughput", "step", "tokens / s", color="#54a24b"),
                "throughput", key="throughput")
with right:
    charts.show(charts.line(train, "step", "r", "Sampled recursion depth r per logged step", "step", "r [loops]",
                            color="#f58518", mode="markers"), "sampled_r", key="sampled_r")
    if not evals.empty:
        periodic, final = evals[evals["periodic"]], evals[~evals["periodic"]]
        charts.show(charts.line(periodic, "tokens", "loss", "Eval loss by depth over training", "tokens",
                                "loss [nats/token]", group="depth"), "eval_by_depth", key="eval_by_depth")
        if not periodic.empty:
            n_periodic = int(periodic["windows"].iloc[0])
            st.caption(f"Periodic evals on {n_periodic} validation windows; they choose `best/`. " + (
                "These selection windows are disjoint from the saved eval windows that every analysis uses."
                if (periodic["split"] == "select").all() else
                f"(An older run: they were the first {n_periodic} of the saved eval windows, which are also analysed.)"))
        if not final.empty:
            last = final[final["step"] == final["step"].max()]
            st.caption(f"Final eval on all {int(last['windows'].iloc[0])} saved windows (step {int(last['step'].iloc[0])}): "
                       + ", ".join(f"{d} loops {v:.3f}" for d, v in zip(last["depth"], last["loss"], strict=True))
                       + " nats.")
    else:
        st.info("No eval events in the log yet.")
with st.expander("Log tables"):
    download.table(train, "train_log")
    if not evals.empty:
        download.table(evals, "eval_log")
