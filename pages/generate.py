"""Generate: decoding with real per-token halting; each new token is coloured by its exit depth.

A thin view over recur_core.decode.generate. The chosen policy decodes live (tokens appear as they
are sampled), then the policy and uniform depth at r_bar are timed back to back on the same prompt
with the same sampling, for tokens/s side by side.
"""
from contextlib import contextmanager

import streamlit as st
import torch

from recur_core.decode import KV_RULES, DecodeWeights, generate
from recur_core.policies import ConvergenceExit, LatentDiff, Uniform
from ui import compute, state
from ui.strip import TokenView, depth_color, strip_html, text_color, tooltip

st.session_state.setdefault("checkpoint_path", "checkpoints/demo")  # the sidebar replaces it when it can
POLICIES = {"a1": "A1 convergence exit: KL(p_i ‖ p_i−1) < ε",
            "latent": "Latent difference: ‖s_i − s_i−1‖ / ‖s_i‖ < δ (no coda or head per loop)",
            "a0": "A0 uniform depth"}
DELTAS = (0.3, 0.2, 0.1, 0.05, 0.03, 0.02, 0.01, 5e-3, 2e-3, 1e-3)


@st.cache_resource(max_entries=4, show_spinner=False)
def decode_weights(path: str, ckpt_id: str, device: str) -> DecodeWeights:
    ckpt = compute.checkpoint(path, device)
    weights = DecodeWeights(ckpt.model)
    with one_thread():  # warm-up: the first calls of a process are slow
        generate(ckpt, [0], 3, Uniform(1), weights=weights, greedy=True, keep_logits=False)
    return weights


@contextmanager
def one_thread():
    """Batch-1 decoding on a CPU is latency-bound: more intra-op threads only add synchronisation."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_policy(kind: str, threshold, cap: int):
    if kind == "a1":
        return ConvergenceExit(threshold, r_max=cap)
    if kind == "latent":
        return LatentDiff(threshold, r_max=cap)
    return Uniform(int(threshold))


def legend(cap: int) -> str:
    cells = "".join(f'<span style="display:inline-block;min-width:1.35em;text-align:center;font-size:0.72rem;'
                    f'background:{depth_color(d, cap)};color:{text_color(depth_color(d, cap))}">{d}</span>'
                    for d in range(1, cap + 1))
    return f'<div style="font-size:0.8rem">exit loop of each new token: {cells}</div>'


def strip(pieces, depths, cap: int, policy: str) -> str:
    tokens = [TokenView(p, d, True, tooltip(i, p, d, True, cap, policy=policy))
              for i, (p, d) in enumerate(zip(pieces, depths))]
    return strip_html(tokens, cap, policy=policy)


m = state.require_model()
st.title("Generate")
st.caption("Autoregressive decoding at batch 1 where every new token loops only until its policy halts it: "
           "the skipped loops are really not computed. Colour = the exit loop of the step that produced "
           "the token.")
ckpt = compute.checkpoint(m.path, m.device)
weights = decode_weights(*m.key)
tok = compute.tokenizer(m.path, m.checkpoint_id)

prompt = st.text_area("Prompt", "Once upon a time, there was a little girl named Lily.", height=90)
left, right = st.columns(2)
with left:
    kind = st.radio("Policy", list(POLICIES), format_func=POLICIES.get)
    if kind == "a1":
        threshold = state.eps_slider()
    elif kind == "latent":
        threshold = st.select_slider("δ", DELTAS, value=0.02, format_func=lambda x: f"{x:g}")
    else:
        threshold = st.slider("Loops r", 1, m.r_max, m.r_bar)
    cap = st.slider("Loop cap", 1, m.r_max, m.r_max, disabled=kind == "a0")
    kv_rule = st.radio("Keys and values of halted tokens at later loops", KV_RULES, horizontal=True,
                       help="latest: reuse the halted token's last entry (Huginn's rule, free); recompute: "
                            "compute them from its frozen state at every later loop (the masking harness).")
with right:
    max_new = st.slider("New tokens", 1, 256, 64)
    greedy = st.checkbox("Greedy", value=False)
    temperature = st.slider("Temperature", 0.05, 2.0, 0.8, disabled=greedy)
    top_k = st.number_input("Top-k (0 = off)", 0, m.vocab_size, 50, disabled=greedy)
    top_p = st.slider("Top-p", 0.05, 1.0, 0.95, disabled=greedy)
    seed = st.number_input("Seed", 0, 2 ** 31 - 1, 0)

if st.button("Generate", type="primary"):
    prompt_ids = tok.encode(prompt).ids
    room = m.max_seq_len - len(prompt_ids) + 1
    if not prompt_ids or room < 1:
        st.error(f"The prompt must have 1 to {m.max_seq_len} tokens (it has {len(prompt_ids)}).")
        st.stop()
    if max_new > room:
        st.info(f"Generating {room} tokens: the context holds {m.max_seq_len}.")
        max_new = room
    policy = make_policy(kind, threshold, cap)
    run = dict(weights=weights, tokenizer=tok, keep_logits=False, greedy=greedy, temperature=temperature,
               top_k=int(top_k), top_p=top_p, seed=int(seed))
    st.markdown(f"**Prompt** ({len(prompt_ids)} tokens): {prompt}")
    st.html(legend(policy.cap(m.r_max)))
    live = st.empty()
    ids, depths, pieces, text = [], [], [], [tok.decode(prompt_ids)]

    def show(index, token_id, exit_loop):
        ids.append(token_id)
        depths.append(exit_loop)
        full = tok.decode(prompt_ids + ids)
        pieces.append(full[len(text[0]):] if full.startswith(text[0]) else full)
        text[0] = full
        live.html(strip(pieces, depths, policy.cap(m.r_max), repr(policy)))

    with one_thread():
        generate(ckpt, prompt_ids, max_new, policy, kv_rule=kv_rule, on_token=show, **run)
    # tokens/s from clean runs (nothing drawn inside the loop), the policy and uniform depth back to back
    with st.spinner(f"Timing it against uniform depth r̄ = {m.r_bar} …"), one_thread():
        gen = generate(ckpt, prompt_ids, max_new, policy, kv_rule=kv_rule, **run)
        base = generate(ckpt, prompt_ids, max_new, Uniform(m.r_bar), **run)
    c = st.columns(3)
    label = {"a1": f"A1 ε = {threshold:.0e}", "latent": f"Latent δ = {threshold:g}", "a0": f"A0 r = {threshold}"}[kind]
    c[0].metric(f"{label} tokens/s", f"{gen.tokens_per_s:.1f}",
                f"{gen.tokens_per_s / base.tokens_per_s:.2f}× uniform", delta_color="off")
    c[1].metric(f"Uniform r̄ = {m.r_bar} tokens/s", f"{base.tokens_per_s:.1f}")
    c[2].metric("Mean loops per new token", f"{gen.mean_loops:.2f}", f"{gen.mean_loops - m.r_bar:+.2f} vs r̄",
                delta_color="inverse")
    st.caption(f"Decode {gen.decode_s:.2f} s for {gen.decode_steps} steps (prompt prefill {1e3 * gen.prefill_s:.0f} ms, "
               f"{gen.readouts} coda + head passes); uniform {base.decode_s:.2f} s. One short run each on a "
               f"shared machine: `bench/bench_decode.py` measures this properly.")
