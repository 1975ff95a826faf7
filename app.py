"""`streamlit run app.py`: the front door of recur, a workbench for depth-recurrent transformers.

This file sets up the page, the shared sidebar (checkpoint, device) and the navigation over
pages/; every page is a thin view over recur_core through the ui package.
"""

import sys

import streamlit as st

st.set_page_config(page_title="recur · looped transformers", page_icon="🔁", layout="wide")
starting = None
if "ui.state" not in sys.modules:  # the server's first run: torch and recur_core take seconds to import
    starting = st.progress(0.0, text="Starting: loading torch and the analysis libraries (once per server)…")
from ui import state  # noqa: E402

if starting is not None:
    starting.empty()


def page(file: str, title: str, icon: str, **kwargs) -> st.Page:
    return st.Page(f"pages/{file}", title=title, icon=f":material/{icon}:", **kwargs)


home = page("exits.py", "Token exit depths", "palette", default=True, url_path="token_exit_depths")


def open_home() -> None:
    """/exits: the home page is served at / (a default page's own url_path is not served), so its
    deep link is this hidden page, which opens it."""
    st.switch_page(home)


navigation = st.navigation({
    "Text": [home, st.Page(open_home, title="Token exit depths", url_path="exits", visibility="hidden"),
             page("compare.py", "Compare policies", "compare", url_path="compare"),
             page("generate.py", "Generate", "bolt", url_path="generate")],
    "Eval set": [page("curve.py", "Depth / loss curve", "show_chart", url_path="curve"),
                 page("convergence.py", "Convergence", "trending_down", url_path="convergence"),
                 page("classes.py", "Token classes", "category", url_path="classes"),
                 page("elasticity.py", "Elasticity & saturation", "stacked_line_chart", url_path="elasticity"),
                 page("overthinking.py", "Overthinking", "history", url_path="overthinking"),
                 page("ground_truth.py", "Ground truth", "rule", url_path="ground_truth")],
    "Training": [page("training.py", "Training run", "monitoring", url_path="training")],
})
state.sidebar()
navigation.run()
