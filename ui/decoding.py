"""What the Generate page needs besides widgets: a warmed-up model, the policy the controls describe,
one-thread timing and the token strips of generated text."""
from __future__ import annotations

from contextlib import contextmanager

import streamlit as st
import torch

from recur_core.decoding.decode import generate
from recur_core.exits import catalogue
from recur_core.exits.policies import Uniform

from . import compute, text
from .handle import Handle
from .strip import DepthScale, TokenView, legend_html, strip_html, tooltip
from .views import delta

POLICIES = [f.name for f in catalogue.shown_in(catalogue.GENERATE)]


@contextmanager
def one_thread():
    """Decoding on a CPU is latency-bound at these widths: more intra-op threads only add
    synchronisation, and one thread makes the timings comparable."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def warm_checkpoint(model: Handle):
    """The loaded checkpoint after one short generation (the first calls of a process are slow)."""
    return _warm(*model.key)


@st.cache_resource(max_entries=4, show_spinner=False)
def _warm(path: str, ckpt_id: str, device: str):
    ckpt = compute.checkpoint(path, device)
    with one_thread():
        generate(ckpt, [0], 3, Uniform(1), greedy=True, keep_logits=False)
    return ckpt


def policy_title(name: str) -> str:
    """A policy's radio option: its name and rule (and that it skips the readout, where it does)."""
    fam = catalogue.family(name)
    saves = "" if fam.needs_readout or fam.name == "A0" else " (no coda or head per loop)"
    return f"{fam.display}: {fam.rule}{saves}"


def make_policy(name: str, threshold, cap: int):
    return catalogue.make(name, threshold, r_max=cap)


def policy_label(name: str, threshold) -> str:
    fam = catalogue.family(name)
    return f"{fam.name} {fam.knob} = {threshold:g}"


def legend(scale: DepthScale) -> str:
    return legend_html(scale, "exit loop of each new token", not_converged=False)


def strip(pieces, depths, scale: DepthScale, policy: str) -> str:
    """New tokens coloured by the exit loop of the step that produced them."""
    tokens = [TokenView(p, d, True, tooltip(i, p, d, True, scale.r_max, policy=policy))
              for i, (p, d) in enumerate(zip(pieces, depths, strict=True))]
    return strip_html(tokens, scale, policy=policy)


N_PROMPTS = 4


def default_prompts(model: Handle) -> str:
    """Prompts, one per line: for a hops checkpoint, held-out programs up to their first query (the
    model writes the answer); prose otherwise (recur_core.tasks)."""
    windows = text.eval_windows(model)
    tok = model.tokenizer() if windows is not None else None
    return "\n".join(text.task(model).prompts(tok, windows, N_PROMPTS))


def speed_metrics(label: str, uniform_label: str, run, base, r_bar: int) -> None:
    """Three metrics side by side: the policy's tokens/s (and its ratio to uniform depth), uniform
    depth r_bar's tokens/s, and the policy's mean loops per new token against r_bar."""
    c = st.columns(3)
    ratio = run.tokens_per_s / base.tokens_per_s
    c[0].metric(f"{label} tokens/s", f"{run.tokens_per_s:.1f}",
                **delta(ratio - 1, ".0%", f"faster than uniform r̄ ({ratio:.2f}×)",
                        f"slower than uniform r̄ ({ratio:.2f}×)", "higher", "as fast as uniform r̄"))
    c[1].metric(f"{uniform_label} tokens/s", f"{base.tokens_per_s:.1f}")
    c[2].metric("Mean loops per new token", f"{run.mean_loops:.2f}",
                **delta(run.mean_loops - r_bar, ".2f", "more loops than r̄", "fewer loops than r̄", "lower",
                        "as many loops as r̄"))
