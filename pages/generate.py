"""Generate: decoding with real per-token halting; each new token is coloured by its exit depth.

A thin view over recur_core.decoding.decode.generate (one prompt) and recur_core.decoding.serve (several prompts at
once: a pool whose tokens sit at different loops share one core step). The chosen policy decodes,
then uniform depth r̄ runs the same prompts with the same sampling, for tokens/s side by side.
"""
import streamlit as st

from recur_core.decoding.decode import generate, token_pieces
from recur_core.decoding.kv import KV_RULES
from recur_core.decoding.serve import Request, serve
from recur_core.exits import catalogue
from recur_core.exits.policies import Uniform
from ui import decoding, state, text
from ui.strip import DepthScale

m = state.require_model()
st.title("Generate")
st.caption("Autoregressive decoding where every new token loops only until its policy halts it: the skipped "
           "loops are really not computed. Colour = the exit loop of the step that produced the token.")
ckpt = decoding.warm_checkpoint(m)
tok = m.tokenizer()

pool_mode = st.toggle("Several prompts at once", **state.keep("gen_pool", False), help="Decode a pool of sequences together: every step, each "
                      "in-flight token runs one core loop in one batched step, whatever its loop index.")
if pool_mode:
    prompts_text = st.text_area("Prompts, one per line", height=120, **state.keep(
        "gen_prompts", decoding.default_prompts(m), scope=state.task_scope(m)))
else:
    prompt = st.text_area("Prompt", height=90, **state.keep("gen_prompt", decoding.default_prompts(m).split("\n")[0],
                                                          scope=state.task_scope(m)))
left, right = st.columns(2)
with left:
    kind = st.radio("Policy", decoding.POLICIES, format_func=decoding.policy_title,
                    **state.keep("gen_policy", "A1", valid=lambda v: v in decoding.POLICIES))
    fam = catalogue.family(kind)
    if kind == "A1":
        threshold = state.eps_slider()
    elif fam.integer:
        threshold = st.slider(fam.rule, 1, m.r_max, **state.keep("gen_r", m.r_bar, scope=m.path,
                                                                 valid=lambda v: 1 <= v <= m.r_max))
    else:
        threshold = st.select_slider(fam.rule, fam.calibration, format_func=lambda x: f"{x:g}",
                                     **state.keep(f"gen_{kind}", fam.default, valid=lambda v: v in fam.calibration))
    cap = st.slider("Loop cap", 1, m.r_max, disabled=kind == "A0",
                    **state.keep("gen_cap", m.r_max, scope=m.path, valid=lambda v: 1 <= v <= m.r_max))
    kv_rule = st.radio("Keys and values of halted tokens at later loops", list(KV_RULES), horizontal=True,
                       **state.keep("gen_kv", next(iter(KV_RULES)), valid=lambda v: v in KV_RULES),
                       help="latest: reuse the halted token's last entry (Huginn's rule, free); recompute: "
                            "compute them from its frozen state at every later loop (the masking harness).")
with right:
    max_new = st.slider("New tokens", 1, 256, **state.keep("gen_new", 64))
    if pool_mode:
        slots = st.slider("Pool size (sequences decoded together)", 1, 16, **state.keep("gen_slots", 4))
    greedy = st.checkbox("Greedy", **state.keep("gen_greedy", False))
    temperature = st.slider("Temperature", 0.05, 2.0, disabled=greedy, **state.keep("gen_temperature", 0.8))
    top_k = st.number_input("Top-k (0 = off)", 0, m.vocab_size, disabled=greedy,
                            **state.keep("gen_top_k", min(50, m.vocab_size), scope=m.path,
                                         valid=lambda v: 0 <= v <= m.vocab_size))
    top_p = st.slider("Top-p", 0.05, 1.0, disabled=greedy, **state.keep("gen_top_p", 0.95))
    seed = st.number_input("Seed", 0, 2 ** 31 - 1, **state.keep("gen_seed", 0))

policy = decoding.make_policy(kind, threshold, cap)
label = decoding.policy_label(kind, threshold)
sampling = dict(greedy=greedy, temperature=temperature, top_k=int(top_k), top_p=top_p)


def fit(prompt_ids: list[int]) -> int | None:
    """How many new tokens this prompt can have (None: it cannot run), with a message."""
    room = m.max_seq_len - len(prompt_ids) + 1
    if not prompt_ids or room < 1:
        st.error(f"A prompt must have 1 to {m.max_seq_len} tokens (this one has {len(prompt_ids)}).")
        return None
    if max_new > room:
        st.info(f"Generating {room} tokens after a {len(prompt_ids)}-token prompt: the context holds {m.max_seq_len}.")
    return min(max_new, room)


if not pool_mode and st.button("Generate", type="primary"):
    prompt_ids = text.prompt_ids(m, prompt)
    n_new = fit(prompt_ids)
    if n_new is None:
        st.stop()
    run = dict(tokenizer=tok, keep_logits=False, seed=int(seed), **sampling)
    st.markdown(f"**Prompt** ({len(prompt_ids)} tokens):")
    st.text(prompt)  # as typed: never Markdown or HTML
    legend, live = st.empty(), st.empty()
    ids, depths = [], []
    cap = policy.cap(m.r_max)
    live_scale = DepthScale(1, cap, cap)  # while decoding: the whole range; then fitted to the depths drawn
    legend.html(decoding.legend(live_scale))

    def show(index, token_id, exit_loop):
        ids.append(token_id)
        depths.append(exit_loop)
        live.html(decoding.strip(token_pieces(tok, prompt_ids, ids), depths, live_scale, repr(policy)))

    with decoding.one_thread():
        generate(ckpt, prompt_ids, n_new, policy, kv_rule=kv_rule, on_token=show, **run)
    fitted = DepthScale.of(depths, cap)
    legend.html(decoding.legend(fitted))
    live.html(decoding.strip(token_pieces(tok, prompt_ids, ids), depths, fitted, repr(policy)))
    # tokens/s from clean runs (nothing drawn inside the loop), the policy and uniform depth back to back
    with st.spinner(f"Timing it against uniform depth r̄ = {m.r_bar} …"), decoding.one_thread():
        gen = generate(ckpt, prompt_ids, n_new, policy, kv_rule=kv_rule, **run)
        base = generate(ckpt, prompt_ids, n_new, Uniform(m.r_bar), **run)
    decoding.speed_metrics(label, f"Uniform r̄ = {m.r_bar}", gen, base, m.r_bar)
    readout = "coda + LM head" if ckpt.model.coda_blocks else "LM head"  # without a coda the head reads the state
    if gen.readouts > base.readouts:
        st.caption(f"Why fewer loops need not mean more tokens/s: {label} reads the output out to check its rule "
                   f"({gen.readouts} {readout} passes, against {base.readouts} for uniform depth, which reads "
                   "out once per token). Those readouts cost time that the loop count does not show; tokens/s "
                   "counts both.")
    st.caption(f"Decode {gen.decode_s:.2f} s for {gen.decode_steps} steps (prompt prefill {1e3 * gen.prefill_s:.0f} ms, "
               f"{gen.readouts} {readout} passes); uniform {base.decode_s:.2f} s. One short run each on a "
               f"shared machine: `bench/bench_decode.py` measures this properly.")

if pool_mode and st.button("Run the pool", type="primary"):
    prompts = [p for p in prompts_text.splitlines() if p.strip()]
    encoded = [text.prompt_ids(m, p) for p in prompts]
    lengths = [fit(ids) for ids in encoded]
    if not prompts or any(n is None for n in lengths):
        st.stop()
    requests = [Request(ids, n, policy, kv_rule=kv_rule, seed=int(seed) + i, **sampling)
                for i, (ids, n) in enumerate(zip(encoded, lengths, strict=True))]
    uniform = [Request(ids, n, Uniform(m.r_bar), kv_rule=kv_rule, seed=int(seed) + i, **sampling)
               for i, (ids, n) in enumerate(zip(encoded, lengths, strict=True))]
    with st.spinner(f"Decoding {len(prompts)} prompts in a pool of {slots}, then uniform depth r̄ = {m.r_bar} …"), \
            decoding.one_thread():
        run = serve(ckpt, requests, slots, max_loops=m.r_max, keep_logits=False)
        base = serve(ckpt, uniform, slots, max_loops=m.r_max, keep_logits=False)
    scale = DepthScale.of((d for c in run for d in c.exit_loops), policy.cap(m.r_max))
    st.html(decoding.legend(scale))
    for typed, c in zip(prompts, run, strict=True):
        st.text(typed)  # the prompt as typed: never Markdown or HTML
        st.html(decoding.strip(token_pieces(tok, c.prompt_ids, c.ids), c.exit_loops, scale, repr(policy)))
    decoding.speed_metrics(f"{label}, pool of {slots}:", f"Uniform r̄ = {m.r_bar}, same pool:", run, base, m.r_bar)
    st.caption(f"{run.steps} pool steps, {run.mixed_steps} of them batched tokens at different loops; "
               f"{run.wall_s:.2f} s against {base.wall_s:.2f} s for uniform depth (prefills included). One run each "
               "on a shared machine: `bench/bench_serve.py` measures this properly.")
