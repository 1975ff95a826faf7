"""Session state and the controls shared between pages: the sidebar (checkpoint and device), the text
form, the ε slider and the data-source switch.

Session keys (one browser tab = one session):
  checkpoint_path  the selected checkpoint folder (absolute; `require_model` opens it for every page)
  device           "cpu", "cuda", ...
  text             the submitted text, shared by every page that reads pasted text
  text_area        the text box's draft; eps_log10, source: shared widget values
"""
from __future__ import annotations

import math
from pathlib import Path

import streamlit as st

from recur_core import CheckpointError

from . import compute
from .checkpoints import default_path, describe, discover, expand
from .text import EXAMPLES, Encoded, encode


def devices() -> list[str]:
    import torch
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" if torch.cuda.device_count() > 1 else "cuda" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        out.append("mps")
    return out


# -- sidebar ------------------------------------------------------------------------------------------
def _add_typed_path() -> None:
    typed = st.session_state.get("typed_path_input", "").strip()
    if not typed:
        return
    found = expand(Path(typed), explicit=True)  # a checkpoint, or the first one in a folder of them
    paths = st.session_state.setdefault("typed_paths", [])
    if typed not in paths:
        paths.append(typed)
    st.session_state["checkpoint_path"] = describe(found[0]).path
    st.session_state["typed_path_input"] = ""


def sidebar() -> None:
    """Checkpoint picker (shipped, $RECUR_CHECKPOINTS, $RECUR_CHECKPOINT, typed) and device choice."""
    entries = discover(st.session_state.get("typed_paths", []))
    by_path = {e.path: e for e in entries}
    with st.sidebar:
        st.markdown("### :material/all_inclusive: recur")
        if not entries:
            st.warning("No checkpoints found. Ship one in `checkpoints/`, set `RECUR_CHECKPOINT` / "
                       "`RECUR_CHECKPOINTS`, or type a folder below.")
        else:
            if st.session_state.get("checkpoint_path") not in by_path:
                st.session_state["checkpoint_path"] = default_path(entries)
            st.selectbox("Checkpoint", list(by_path), key="checkpoint_path",
                         format_func=lambda p: by_path[p].label(),
                         help="name · preset · training mean depth r̄ · tokens trained · checkpoint id")
            entry = by_path[st.session_state["checkpoint_path"]]
            if entry.ok:
                r = entry.recipe
                st.caption(f"`{entry.path}`  \n" + (r.describe() if r else "recipe unreadable")
                           + f" · step {entry.meta.get('step', '?')}")
                if entry.meta.get("memory_estimate"):
                    st.caption(entry.size_line(st.session_state.get("device", "cpu")))
            else:
                st.error(entry.error)
        st.text_input("Add a checkpoint folder", key="typed_path_input", on_change=_add_typed_path,
                      placeholder="/path/to/checkpoint", help="A checkpoint folder, or a folder of them.")
        options = devices()
        if st.session_state.get("device") not in options:
            st.session_state["device"] = options[0]
        st.selectbox("Device", options, key="device", help="Where the model runs; results are cached per device.")


def ensure_navigation() -> None:
    """Run the page inside app.py's frame. Streamlit starts a server whose script folder has a
    pages/ directory in the legacy "pages folder" mode until app.py first calls st.navigation; a
    first visit straight to a page URL would then run the page alone (no sidebar). Leave that mode
    and rerun, so app.py runs and routes to the same URL."""
    from streamlit.runtime.pages_manager import PagesManager  # Streamlit internals: guarded
    if getattr(PagesManager, "uses_pages_directory", False):
        PagesManager.uses_pages_directory = False
        st.rerun()


def require_model() -> compute.SelectedCheckpoint:
    """The selected checkpoint, loaded; otherwise a clear message and the page stops here."""
    ensure_navigation()
    path = st.session_state.get("checkpoint_path")
    if not path:
        st.info("No checkpoint is selected: pick or add one in the sidebar.")
        st.stop()
    entry = describe(path)
    if not entry.ok:
        st.error(f"**This checkpoint cannot be used.** {entry.error}  \nPick another one in the sidebar.")
        st.stop()
    try:
        model = compute.open_model(path, st.session_state.get("device", "cpu"))
    except (CheckpointError, OSError, ValueError, RuntimeError) as err:
        st.error(f"**This checkpoint cannot be used.** {err}  \nPick another one in the sidebar.")
        st.stop()
    if model.id_mismatch:
        st.warning(model.id_mismatch)
    return model


# -- pasted text ----------------------------------------------------------------------------------------
def _use_example() -> None:
    name = st.session_state.get("example")
    if name in EXAMPLES:
        st.session_state["text_area"] = st.session_state["text"] = EXAMPLES[name]


def _submit_text() -> None:
    st.session_state["text"] = st.session_state.get("text_area", "")


def text_form(form_key: str) -> str:
    """Example picker + a text box in a form; returns the submitted (shared) text."""
    st.session_state.setdefault("text", next(iter(EXAMPLES.values())))
    st.session_state.setdefault("text_area", st.session_state["text"])
    st.selectbox("Example prompts", list(EXAMPLES), index=None, key="example", on_change=_use_example,
                 placeholder="Pick an example (analysed at once)…")
    with st.form(form_key, border=False):
        st.text_area("Text", key="text_area", height=110, placeholder="Paste or type text, then press Analyse")
        # a callback, not the button's return value: it runs before the script, so a rerun cannot drop it
        st.form_submit_button("Analyse", type="primary", on_click=_submit_text)
    return st.session_state["text"]


def encoded_text(model: compute.SelectedCheckpoint, text: str | None = None) -> Encoded | None:
    """The shared text as token ids within the context, with the hint / truncation notice shown;
    None (after a hint) when there is no text."""
    text = st.session_state.get("text", "") if text is None else text
    if not text or not text.strip():
        st.info("The text is empty: type or paste some text (or pick an example) and press **Analyse**.")
        return None
    enc = encode(model.path, model.checkpoint_id, text, model.max_seq_len)
    if not enc.ids:
        st.info("The text has no tokens: type some words and press **Analyse**.")
        return None
    if enc.notice():
        st.warning(enc.notice(), icon="✂️")
    return enc


def pasted_text(model: compute.SelectedCheckpoint, form_key: str) -> Encoded:
    """The text form and its encoding, for pages that analyse the pasted text; stops the page
    (after the hint) while there is no text to analyse."""
    enc = encoded_text(model, text_form(form_key))
    if enc is None:
        st.stop()
    return enc


# -- shared controls ------------------------------------------------------------------------------------
def _share_eps(widget_key: str) -> None:
    st.session_state["eps_log10"] = st.session_state[widget_key]


def eps_slider(page: str = "other", help_text: str | None = None) -> float:
    """A1's threshold ε on a log scale; returns ε. One value for the whole session: each page has
    its own slider (key eps_slider_<page>) that starts from and writes back to session key eps_log10."""
    key = f"eps_slider_{page}"
    shared = st.session_state.setdefault("eps_log10", math.log10(compute.S.default_eps))
    if st.session_state.get(key) != shared:  # first show on this page, or moved on another page since
        st.session_state[key] = shared
    log10 = st.select_slider(
        "A1 threshold ε: stop a token once KL(p_i ‖ p_{i−1}) < ε", options=compute.S.eps_log10, key=key,
        on_change=_share_eps, args=(key,), format_func=lambda v: f"{10.0 ** v:.1e}",
        help=help_text or "Log scale, 1e-7 … 10. Smaller ε: tokens loop longer. 1e-3 is the paper's threshold.")
    return 10.0 ** log10


def source_picker(model: compute.SelectedCheckpoint) -> tuple[int, ...] | None | bool:
    """Eval windows (returns None) or the pasted text (returns its ids); False when the text is unusable.
    A checkpoint that ships no eval windows (a Huginn folder) always uses the pasted text."""
    if not model.has_windows:
        st.info("This checkpoint ships no eval windows: the pasted text is analysed (change it on "
                "**Token exit depths**).")
        enc = encoded_text(model)
        return False if enc is None else enc.ids
    choice = st.segmented_control(
        "Data", ["eval", "text"], default="eval", key="source", persist_state="session", required=True,
        format_func=lambda s: {"eval": f"Eval windows (first {compute.S.windows}, validation side)",
                               "text": "Pasted text"}[s])
    if choice != "text":
        return None
    enc = encoded_text(model)
    if enc is None:
        return False
    st.caption(f"Pasted text: {len(enc.ids)} tokens — change it on **Token exit depths**.")
    return enc.ids
