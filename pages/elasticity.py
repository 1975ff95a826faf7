"""Elasticity & saturation: loss at uniform depth 1..32 for one or several checkpoints, r̄ marked."""
import pandas as pd
import streamlit as st

from recur_core import CheckpointError
from ui import charts, download, state
from ui.checkpoints import discover, eval_set
from ui.handle import Handle

m = state.require_model()
st.title("Elasticity & saturation")
st.caption("Loss on each checkpoint's eval windows when every token gets the same r loops. The saturation "
           "hypothesis: useful depth stops growing near the training mean depth r̄ (diamond). Checkpoints "
           "evaluated on the same eval windows are offered (others on request); each is traced once, then cached "
           "on disk.")

usable = {e.path: e for e in discover(st.session_state.get("typed_paths", [])) if e.ok}
same_windows = {p for p in usable if eval_set(p) is not None and eval_set(p) == eval_set(m.path)} | {m.path}
others = st.toggle("Offer checkpoints evaluated on other data", **state.keep("elastic_other_tasks", False),
                   help="Off: only checkpoints whose eval windows and tokenizer are identical to the selected one's "
                        "(the same tokens scored: their losses compare, and pair window by window). On: every "
                        "checkpoint found.")
offered = {p: e for p, e in usable.items() if others or p in same_windows}
default = ([m.path] if m.path in offered else []) + [p for p in offered if p != m.path]
chosen = st.multiselect("Checkpoints", list(offered), format_func=lambda p: offered[p].label(),
                        **state.keep("elastic_ckpts", default[:3], scope=f"{m.path}|{others}",
                                     valid=lambda v: all(p in offered for p in v)))
banner = st.container()
runs, pending = [], []
for path in chosen:
    try:
        other = Handle.open(path, m.device)
    except (CheckpointError, OSError, ValueError, RuntimeError) as err:
        st.warning(f"Skipped {usable[path].name}: {err}")
        continue
    if not other.has_windows:
        st.info(f"Skipped {usable[path].name}: it ships no eval windows (elasticity is measured on them).")
        continue
    look = state.first_look(other)
    if look:
        pending.append(other)
    el = other.elasticity(look)
    runs.append({"name": f"{usable[path].name} ({other.checkpoint_id[:8]})" + (" · first look" if look else ""),
                 "r_bar": other.r_bar, "handle": other, "first_look": look, **el})
if not runs:
    st.info("Pick at least one checkpoint.")
    st.stop()
if any(p not in same_windows for p in chosen):
    st.warning("The checkpoints picked are evaluated on different eval windows or tokenizers: their losses are "
               "measured on different tokens, so they are not the same task's numbers, and no paired difference "
               "is drawn.", icon="⚠️")
diffs, note = [], None
if len(runs) > 1 and pending:
    note = "The paired difference is drawn once every checkpoint's full trace is done."
elif len(runs) > 1:  # checkpoints compared: default to their paired difference from the first one
    ref = runs[0]
    try:
        diffs = [{"name": r["name"], **r["handle"].elasticity_difference(ref["handle"])}
                 for r in runs[1:]]
    except ValueError as err:
        note = f"No paired difference: {err}."
view = st.segmented_control("View", ["diff", "absolute"], **state.keep("elastic_view", "diff"),
                            required=True, disabled=not diffs,
                            format_func={"diff": f"Difference from {runs[0]['name']} (paired)",
                                         "absolute": "Loss"}.get,
                            help="Difference: each checkpoint's loss minus the first one's at the same depth, with "
                                 "paired bootstrap bands (both on the same resampled eval windows), so the "
                                 "window-to-window spread cancels. Needs two or more checkpoints on the same windows.")
if note:
    st.info(note)
if view == "diff" and diffs:
    charts.show(charts.elasticity_differences(diffs, runs[0]["name"]), "elasticity_difference", key="elasticity")
else:
    charts.show(charts.elasticity(runs), "elasticity", key="elasticity")
parts = [pd.DataFrame({"loops": r["loops"], f"{r['name']} loss": r["loss"], f"{r['name']} low": r["loss_ci_low"],
                       f"{r['name']} high": r["loss_ci_high"]}).set_index("loops") for r in runs]
table = pd.concat(parts, axis=1).reset_index()  # checkpoints traced to different depths line up by loop
with st.expander("Loss by depth (table)"):
    download.table(table, "elasticity", caption="Loss [nats/token] with its 95% bootstrap interval per checkpoint.")
if pending:  # one trace at a time (they share two cores); the page reruns after each
    state.refine(pending[0], banner)
