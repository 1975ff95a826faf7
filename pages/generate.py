"""Generate: decode with real per-token halting; each new token is coloured by its exit depth.

A thin view over recur_core.decode.generate: the chosen policy runs live, then uniform depth A0 at
the recipe's r_bar runs on the same prompt with the same sampling, for the tokens/s comparison.
"""
from __future__ import annotations

import html
from pathlib import Path

import streamlit as st

from recur_core import load_checkpoint
from recur_core.decode import KV_RULES, DecodeWeights, generate
from recur_core.policies import ConvergenceExit, LatentDiff, Uniform

DEFAULT_CHECKPOINT = "checkpoints/demo"
POLICIES = ("A1 convergence exit (KL < eps)", "Latent difference (||s_i - s_i-1|| / ||s_i|| < delta)",
            "A0 uniform depth")
EPS_OPTIONS = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 1e-6)
DELTA_OPTIONS = (0.2, 0.1, 0.05, 0.03, 0.02, 0.01, 5e-3, 2e-3, 1e-3)


@st.cache_resource(show_spinner="Loading checkpoint ...")
def load(path: str):
    ckpt = load_checkpoint(path)
    return ckpt, DecodeWeights(ckpt.model), ckpt.tokenizer()


def depth_colour(depth: int, cap: int) -> str:
    """Shallow tokens green, deep ones red."""
    frac = 0.0 if cap <= 1 else (depth - 1) / (cap - 1)
    return f"hsl({120 * (1 - frac):.0f}, 70%, 82%)"


def render(prompt: str, pieces: list[str], depths: list[int], cap: int) -> str:
    spans = "".join(
        f'<span class="tok" data-depth="{d}" title="exit loop {d}" '
        f'style="background:{depth_colour(d, cap)};border-radius:3px">{html.escape(p)}</span>'
        for p, d in zip(pieces, depths))
    return (f'<div data-testid="generated-text" style="white-space:pre-wrap;font-family:monospace;'
            f'line-height:1.7">{html.escape(prompt)}{spans}</div>')


def legend(cap: int) -> str:
    cells = "".join(f'<span style="background:{depth_colour(d, cap)};padding:0 6px">{d}</span>'
                    for d in range(1, cap + 1))
    return f'<div style="font-size:0.8em">exit loop: {cells}</div>'


def make_policy(kind: str, threshold, cap: int):
    if kind == POLICIES[0]:
        return ConvergenceExit(threshold, r_max=cap)
    if kind == POLICIES[1]:
        return LatentDiff(threshold, r_max=cap)
    return Uniform(int(threshold))


st.title("Generate")
path = st.session_state.get("checkpoint_path") or DEFAULT_CHECKPOINT
if not Path(path).is_dir():
    st.warning(f"No checkpoint at `{path}`: choose one in the sidebar.")
    st.stop()
ckpt, weights, tokenizer = load(path)
recipe = ckpt.meta.get("recipe", {})
r_bar = int(round(recipe.get("r_bar", 4)))
r_max = int(recipe.get("r_max", 4 * r_bar))
st.caption(f"`{path}` (r_bar {r_bar}, r_max {r_max}); batch 1 on {weights.embed.device}.")

prompt = st.text_area("Prompt", "Once upon a time, there was a little girl named Lily.", height=90)
col1, col2 = st.columns(2)
with col1:
    kind = st.selectbox("Policy", POLICIES)
    if kind == POLICIES[0]:
        threshold = st.select_slider("eps (nats)", EPS_OPTIONS, value=1e-3, format_func=lambda x: f"{x:g}")
    elif kind == POLICIES[1]:
        threshold = st.select_slider("delta", DELTA_OPTIONS, value=0.02, format_func=lambda x: f"{x:g}")
    else:
        threshold = st.slider("loops r", 1, r_max, r_bar)
    cap = st.slider("Loop cap", 1, r_max, r_max)
    kv_rule = st.radio("KV rule for halted tokens", KV_RULES, horizontal=True,
                       help="latest: reuse a halted token's last keys/values (Huginn); "
                            "recompute: compute them from its frozen state at every later loop")
with col2:
    max_new = st.slider("New tokens", 1, 256, 64)
    greedy = st.checkbox("Greedy", value=False)
    temperature = st.slider("Temperature", 0.05, 2.0, 0.8, disabled=greedy)
    top_k = st.number_input("Top-k (0 = off)", 0, ckpt.config.vocab_size, 50, disabled=greedy)
    top_p = st.slider("Top-p", 0.05, 1.0, 0.95, disabled=greedy)
    seed = st.number_input("Seed", 0, 2 ** 31 - 1, 0)

if st.button("Generate", type="primary"):
    prompt_ids = tokenizer.encode(prompt).ids
    if not prompt_ids:
        st.error("The prompt is empty.")
        st.stop()
    room = ckpt.config.max_seq_len - len(prompt_ids) + 1
    if room < 1:
        st.error(f"The prompt has {len(prompt_ids)} tokens; the model's context is {ckpt.config.max_seq_len}.")
        st.stop()
    if max_new > room:
        st.info(f"Generating {room} tokens: the context holds {ckpt.config.max_seq_len}.")
        max_new = room
    policy = make_policy(kind, threshold, cap)
    sampling = dict(greedy=greedy, temperature=temperature, top_k=int(top_k), top_p=top_p, seed=int(seed))
    st.html(legend(cap))
    live = st.empty()
    ids, depths, pieces, text = [], [], [], [tokenizer.decode(prompt_ids)]

    def show(index, token_id, exit_loop):
        ids.append(token_id)
        depths.append(exit_loop)
        full = tokenizer.decode(prompt_ids + ids)
        pieces.append(full[len(text[0]):] if full.startswith(text[0]) else full)
        text[0] = full
        live.html(render(prompt, pieces, depths, cap))

    gen = generate(ckpt, prompt_ids, max_new, policy, kv_rule=kv_rule, max_loops=cap, weights=weights,
                   tokenizer=tokenizer, on_token=show, keep_logits=False, **sampling)
    live.html(render(prompt, gen.pieces, gen.exit_loops, cap))
    with st.spinner(f"Uniform depth {r_bar} on the same prompt ..."):
        base = generate(ckpt, prompt_ids, max_new, Uniform(r_bar), weights=weights, tokenizer=tokenizer,
                        keep_logits=False, **sampling)
    m1, m2, m3 = st.columns(3)
    m1.metric(f"{type(policy).__name__} tokens/s", f"{gen.tokens_per_s:.1f}",
              f"{gen.tokens_per_s / base.tokens_per_s:.2f}x uniform" if base.tokens_per_s else None)
    m2.metric(f"Uniform({r_bar}) tokens/s", f"{base.tokens_per_s:.1f}")
    m3.metric("Mean loops", f"{gen.mean_loops:.2f}", f"{gen.mean_loops - r_bar:+.2f} vs uniform",
              delta_color="inverse")
    st.caption(f"Decode {gen.decode_s:.2f}s for {gen.decode_steps} steps (prefill {1e3 * gen.prefill_s:.0f} ms); "
               f"uniform {base.decode_s:.2f}s. {gen.readouts} coda + head passes.")
