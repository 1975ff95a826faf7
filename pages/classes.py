"""Token classes: mean A1 exit depth by class (whitespace, numeral, punctuation, word) and their tokens."""
import pandas as pd
import streamlit as st

from recur_core.analysis.curves import TOKEN_CLASSES
from ui import charts, download, state

m = state.require_model()
st.title("Token classes")
st.caption("Mean A1 exit depth of the tokens of each class (the token whose state loops), over scored tokens, "
           "with 95% bootstrap CIs over windows. The paper finds whitespace < numeral < punctuation < word.")
ids = state.source_picker(m)
if ids is False:
    st.stop()
first_look = state.first_look(m, ids)
banner = st.container()
eps = state.eps_slider("classes")
res = m.token_classes(ids, eps, first_look)
summary, tokens = res["summary"], res["tokens"]

charts.show(charts.class_bars(summary, TOKEN_CLASSES), "token_classes", key="token_classes")
rows = [{"class": c, "mean_exit_depth": summary[c]["mean_exit_depth"], "ci_low": summary[c]["ci_low"],
         "ci_high": summary[c]["ci_high"], "n_tokens": summary[c]["n_tokens"]} for c in TOKEN_CLASSES]
download.table(pd.DataFrame(rows), "token_classes")

st.subheader("Tokens of each class")
present = [c for c in TOKEN_CLASSES if (tokens["class"] == c).any()]
for tab, name in zip(st.tabs([f"{c} ({int((tokens['class'] == c).sum())})" for c in present]), present, strict=True):
    with tab:
        part = tokens[tokens["class"] == name].reset_index(drop=True)
        download.table(part, f"tokens_{name}", height=min(320, 35 * (len(part) + 1) + 3),
                       caption="Each distinct token: occurrences and mean exit depth at the current ε.")
if first_look:
    state.refine(m, banner)
