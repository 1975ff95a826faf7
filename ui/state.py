"""Session state and the controls shared between pages: the sidebar (checkpoint and device), the text
form, the ε slider and the data-source switch.

Streamlit forgets a widget's value once a run does not draw it (another page, a page stopped by an
error), so every value a researcher sets lives in a plain session key that no run deletes, and the
widget is (re)filled from it before it draws (`keep`). Values that only make sense for one
checkpoint (a depth up to its r_max, a probe kind) are kept per checkpoint; the pasted text is kept
per task and tokenizer (`checkpoints.data_key`: a hops program is not prose).

Session keys (one browser tab = one session):
  checkpoint_path  the selected checkpoint folder (absolute; `require_model` opens it for every page)
  device           "cpu", "cuda", ...
  text@<task>      the submitted text of that task, shared by every page that reads pasted text
  eps_log10        A1's ε (log10), shared by every page's ε slider
  kept:<key>@<scope>  a widget's value for one checkpoint (or task)
  typed_paths, typed_path_error  folders added in the sidebar, and why the last one was refused
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import streamlit as st

from recur_core import CheckpointError

from . import compute, jobs
from .checkpoints import data_key, default_path, describe, discover, expand
from .handle import Handle
from .text import Encoded, encode_for, examples_for
from .views import COLOUR_BY, plain_md

_MISSING = object()


# -- values that outlive their widgets --------------------------------------------------------------------
def keep(key: str, default: Any, scope: str = "", store: str | None = None,
         valid: Callable[[Any], bool] | None = None) -> dict:
    """Keyword arguments (key, on_change, args) for a widget whose value outlives it: the value lives
    in session key `store` (default kept:<key>@<scope>), which fills the widget before every draw;
    the widget's on_change writes it back. `valid` rejects a stored value that no longer fits (then
    `default`). Do not also pass the widget a default value.

    Filled on every draw, even when the widget's own state already holds the value: a run stopped
    early (`st.stop`, e.g. on an empty text) keeps the state of the widgets it did not draw while
    the browser forgets them, and a page switch draws the same key as a new widget; either way the
    browser would show the widget's empty default while the script reads the kept value, then send
    that default back on the next run. Only a value set through session state reaches the browser."""
    store = store or f"kept:{key}@{scope}"
    value = st.session_state.get(store, default)
    if valid is not None and not valid(value):
        value = default
    st.session_state[store] = st.session_state[key] = value
    return {"key": key, "on_change": _write_back, "args": (key, store)}


def set_kept(key: str, value: Any, scope: str = "") -> None:
    """Set a kept widget's value from a callback (before the widget draws again)."""
    st.session_state[f"kept:{key}@{scope}"] = st.session_state[key] = value


def _write_back(key: str, store: str) -> None:
    st.session_state[store] = st.session_state[key]


# -- sidebar ------------------------------------------------------------------------------------------
def devices() -> list[str]:
    import torch
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" if torch.cuda.device_count() > 1 else "cuda" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        out.append("mps")
    return out


def _add_typed_path() -> None:
    """Add a typed folder and select it; a folder that cannot be used is refused with its reason,
    and the selection and every setting stay as they were."""
    typed = st.session_state.get("typed_path_input", "").strip()
    st.session_state["typed_path_error"] = None
    if not typed:
        return
    found = expand(Path(typed), explicit=True)  # a checkpoint, or the first one in a folder of them
    entry = describe(found[0])
    if not entry.ok:
        st.session_state["typed_path_error"] = entry.error
        return
    paths = st.session_state.setdefault("typed_paths", [])
    if typed not in paths:
        paths.append(typed)
    st.session_state["checkpoint_path"] = entry.path
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
                st.error(plain_md(entry.error))
        st.text_input("Add a checkpoint folder", key="typed_path_input", on_change=_add_typed_path,
                      placeholder="/path/to/checkpoint", help="A checkpoint folder, or a folder of them.")
        if st.session_state.get("typed_path_error"):
            st.error("Not added: " + plain_md(st.session_state["typed_path_error"]) +
                     "  \nThe selection and settings are unchanged.")
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


def require_model() -> Handle:
    """The selected checkpoint, loaded; otherwise a clear message and the page stops here."""
    ensure_navigation()
    path = st.session_state.get("checkpoint_path")
    if not path:
        st.info("No checkpoint is selected: pick or add one in the sidebar.")
        st.stop()
    entry = describe(path)
    if not entry.ok:
        st.error(f"**This checkpoint cannot be used.** {plain_md(entry.error)}  \nPick another one in the sidebar.")
        st.stop()
    try:
        model = Handle.open(path, st.session_state.get("device", "cpu"))
    except (CheckpointError, OSError, ValueError, RuntimeError) as err:
        st.error(f"**This checkpoint cannot be used.** {plain_md(str(err))}  \nPick another one in the sidebar.")
        st.stop()
    if model.id_mismatch:
        st.warning(model.id_mismatch)
    return model


# -- pasted text ----------------------------------------------------------------------------------------
def task_scope(model: Handle) -> str:
    """The scope of values kept per task and tokenizer (texts, prompts)."""
    return data_key(model.meta, model.path)


def text_key(model: Handle) -> str:
    """The session key of the submitted text for this checkpoint's task and tokenizer."""
    return f"text@{task_scope(model)}"


def current_text(model: Handle) -> str:
    """The submitted text of this checkpoint's task (its first example until one is submitted)."""
    return st.session_state.setdefault(text_key(model), next(iter(examples_for(model).values())))


def _use_example(model: Handle, key: str) -> None:
    examples = examples_for(model)
    name = st.session_state.get(key)
    if name in examples:
        st.session_state[text_key(model)] = examples[name]


def _submit_text(area_key: str, store: str) -> None:
    st.session_state[store] = st.session_state.get(area_key, "")


def text_form(model: Handle, form_key: str) -> str:
    """Example picker + a text box in a form; returns the submitted text (shared by the pages, per
    task). The box always opens on the submitted text, the one the page analyses."""
    store, area = text_key(model), f"{form_key}_text"
    submitted = current_text(model)
    synced = st.session_state.setdefault("text_synced", {})
    if st.session_state.get(area, _MISSING) is _MISSING or synced.get(area) != (store, submitted):
        st.session_state[area] = submitted  # first show, dropped by Streamlit, or submitted elsewhere
    synced[area] = (store, submitted)
    example_key = f"example@{form_key}"
    st.selectbox("Example prompts", list(examples_for(model)), index=None, key=example_key, on_change=_use_example,
                 args=(model, example_key), placeholder="Pick an example (analysed at once)…")
    with st.form(form_key, border=False):
        st.text_area("Text", key=area, height=110, placeholder="Paste or type text, then press Analyse")
        # a callback, not the button's return value: it runs before the script, so a rerun cannot drop it
        st.form_submit_button("Analyse", type="primary", on_click=_submit_text, args=(area, store))
    return st.session_state[store]


def encoded_text(model: Handle, text: str | None = None) -> Encoded | None:
    """The shared text as token ids within the context, with the hint / truncation notice shown;
    None (after a hint) when there is no text."""
    text = current_text(model) if text is None else text
    if not text or not text.strip():
        st.info("The text is empty: type or paste some text (or pick an example) and press **Analyse**.")
        return None
    enc = encode_for(model, text)
    if not enc.ids:
        st.info("The text has no tokens: type some words and press **Analyse**.")
        return None
    if enc.notice():
        st.warning(enc.notice(), icon="✂️")
    return enc


def pasted_text(model: Handle, form_key: str) -> Encoded:
    """The text form and its encoding, for pages that analyse the pasted text; stops the page
    (after the hint) while there is no text to analyse."""
    enc = encoded_text(model, text_form(model, form_key))
    if enc is None:
        st.stop()
    return enc


# -- shared controls ------------------------------------------------------------------------------------
def eps_slider(page: str = "other", help_text: str | None = None) -> float:
    """A1's threshold ε on a log scale; returns ε. One value for the whole session: each page has
    its own slider (key eps_slider_<page>) that starts from and writes back to session key eps_log10."""
    kept = keep(f"eps_slider_{page}", math.log10(compute.S.default_eps), store="eps_log10",
                valid=lambda v: v in compute.S.eps_log10)
    log10 = st.select_slider(
        "A1 threshold ε: stop a token once KL(p_i ‖ p_{i−1}) < ε", options=compute.S.eps_log10, **kept,
        format_func=lambda v: f"{10.0 ** v:.1e}",
        help=help_text or "Log scale, 1e-7 … 10. Smaller ε: tokens loop longer. 1e-3 is the paper's threshold.")
    return 10.0 ** log10


def source_picker(model: Handle) -> tuple[int, ...] | None | bool:
    """Eval windows (returns None) or the pasted text (returns its ids); False when the text is unusable.
    A checkpoint that ships no eval windows (a Huginn folder) always uses the pasted text."""
    if not model.has_windows:
        st.info("This checkpoint ships no eval windows: the pasted text is analysed (change it on "
                "**Token exit depths**).")
        enc = encoded_text(model)
        return False if enc is None else enc.ids
    choice = st.segmented_control(
        "Data", ["eval", "text"], **keep("source", "eval"), required=True,
        format_func=lambda s: {"eval": f"Eval windows (first {compute.S.windows}, validation side)",
                               "text": "Pasted text"}[s])
    if choice != "text":
        return None
    enc = encoded_text(model)
    if enc is None:
        return False
    st.caption(f"Pasted text: {len(enc.ids)} tokens — change it on **Token exit depths**.")
    return enc.ids


# -- the eval set: a first look while the full trace runs ------------------------------------------------
def first_look(model: Handle, ids: tuple[int, ...] | None = None) -> bool:
    """Whether a page on the eval windows (ids None) shows its first look: the canonical trace is
    neither on disk nor done in the background yet."""
    return ids is None and model.has_windows and not model.eval_trace_ready()


def refine(model: Handle, where) -> None:
    """Start (or follow) the background job that computes the canonical trace, its progress bar in
    the container `where`; the page reruns with the full results when it ends."""
    job = model.start_eval_trace()
    with where:
        jobs.watch(job, f"**First look**: the first {compute.FIRST_LOOK_WINDOWS} of {compute.S.windows} eval windows, "
                        "A0 and A1 only. The full trace (with A2's probes) is computed in the background; the page "
                        "refines in place when it is done. Stop keeps this first look.")


def follow_decoding(outcomes, where=None) -> None:
    """While exact decoding of the pasted text runs in the background (compute.text_outcome gave
    outcomes with `pending` set), say that the page shows the fast path and follow the decoding's
    progress (one job at a time; the page reruns as each ends), in the container `where`."""
    pending = [o.pending for o in outcomes if o.pending is not None]
    if not pending:
        return
    job = next((j for j in pending if j.running), pending[0])
    with where if where is not None else st.container():
        jobs.watch(job, f"**Exact decoding** ({len(pending)} polic{'y' if len(pending) == 1 else 'ies'} left) runs "
                        "in the background, token by token. Until it ends, the strips and figures marked *fast* "
                        "are the **fast path** (one uniform trace: later tokens see context that kept moving, so "
                        "its saving is an upper bound); they are replaced by real decoding's when it is done.")


def path_label(label: str, out: compute.Outcome) -> str:
    """A strip's title with the path its numbers come from while exact decoding is pending."""
    return f"{label} · fast path (exact decoding running)" if out.pending is not None else label


TEXT_PATHS = {"exact": "Exact (real decoding: a halted token stays frozen in context)",
              "fast": "Fast (one uniform trace: each token read out at its exit loop)"}


def text_path(page: str) -> bool:
    """The pasted-text pages' Evaluation choice (one value for the session); True for exact."""
    path = st.segmented_control(
        "Evaluation", list(TEXT_PATHS), required=True, format_func=TEXT_PATHS.get,
        **keep(f"text_path_{page}", "exact", store="text_path", valid=lambda v: v in TEXT_PATHS),
        help="Exact decodes the text token by token as `generate` does (teacher-forced, the \"recompute\" KV "
             "rule): each token stops at its own loop and later tokens read its frozen state. Fast reads "
             "every token off one run in which all tokens loop to the end, so later tokens see context that "
             "kept moving: its exit depths and losses can differ from decoding's.")
    return path == "exact"


def colour_by_control(page: str, regime: bool = False) -> str:
    """How the page's token strip is coloured, kept across pages: "reading" or "produced"
    (views.COLOUR_BY), and with regime also "regime"."""
    options = [o for o in COLOUR_BY if regime or o != "regime"]
    return st.segmented_control("Colour each token by", options, required=True, format_func=COLOUR_BY.get,
                                **keep(f"{page}_colour_by", "reading", store="kept:colour_by",
                                       valid=lambda v: v in options))
