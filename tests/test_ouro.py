"""Ouro's on-disk format (recur_core.model.ouro) and its exit gate (GateExit) against the reference
implementation's outputs, on two fixtures: tests/fixtures/ouro_tiny (the shared oracle's) and
tests/fixtures/ouro_heldout (other shapes: grouped-query heads, 3 layers, 3 steps). No transformers
and no ../shared needed.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from recur_core import CheckpointError, load_checkpoint
from recur_core.analysis.harness import run_exact
from recur_core.analysis.trace import trace
from recur_core.decoding.decode import Decoder, full_depth_logits, generate
from recur_core.decoding.serve import Request, serve
from recur_core.decoding.teacher_forced import teacher_forced
from recur_core.exits.halting import HaltSchedule
from recur_core.exits.policies import GateExit, Uniform, exit_cdf
from recur_core.exits.signals import LoopSignals
from recur_core.model.formats import describe_folder
from recur_core.model.hf_folder import INDEX

FIXTURES = Path(__file__).parent / "fixtures"
TINY, HELDOUT = FIXTURES / "ouro_tiny", FIXTURES / "ouro_heldout"
# measured max |diff| of our float32 logits against the reference's: 3.6e-6 (tiny) and 4.8e-6
# (held-out), on logits of magnitude ~3 (same math, another op order)
ATOL, RTOL = 1e-5, 1e-4


def reference(folder: Path) -> dict:
    return load_file(str(folder / "reference_outputs.safetensors"))


def steps_of(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["total_ut_steps"]


@pytest.fixture(scope="module", params=[TINY, HELDOUT], ids=["tiny", "heldout"])
def ouro(request):
    return request.param, load_checkpoint(request.param), reference(request.param)


# -- exactness ------------------------------------------------------------------------------------
def test_per_step_logits_equal_the_reference(ouro):
    folder, ck, ref = ouro
    T = steps_of(folder)
    assert ref["logits_per_step"].shape[0] == T
    with torch.no_grad():
        for t in range(1, T + 1):
            torch.testing.assert_close(ck.model(ref["input_ids"], loops=t), ref["logits_per_step"][t - 1],
                                       atol=ATOL, rtol=RTOL, msg=lambda m, t=t: f"loops {t}: {m}")


def test_six_loops_equal_the_reference(ouro):
    """logits_steps6 is the reference's default call with 6 steps: per token, the step whose exit
    CDF first reaches 1.0 (the last step, unless the CDF rounds to 1.0 earlier)."""
    _, ck, ref = ouro
    cdf = ref["exit_pdf_steps6"].cumsum(0)
    step = torch.where((cdf >= 1.0).any(0), (cdf >= 1.0).int().argmax(0), 5)
    with torch.no_grad():
        per_step = torch.stack([ck.model(ref["input_ids"], loops=t) for t in range(1, 7)])
    picked = per_step.gather(0, step[None, ..., None].expand(1, *per_step.shape[1:]))[0]
    torch.testing.assert_close(picked, ref["logits_steps6"], atol=ATOL, rtol=RTOL)
    if (step == 5).all():  # the shared fixture: all six loops
        torch.testing.assert_close(per_step[5], ref["logits_steps6"], atol=ATOL, rtol=RTOL)


def test_the_state_is_the_normed_output_and_the_gate_reads_it(ouro):
    _, ck, ref = ouro
    model = ck.model
    with torch.no_grad():
        state = model.start_state(model.seeded_state(range(len(ref["input_ids"])), 0, ref["input_ids"].shape[1]),
                                  model.prelude(ref["input_ids"]))
        for t in range(ref["hidden_per_step"].shape[0]):
            state = model.core_step(state, None)
            torch.testing.assert_close(state, ref["hidden_per_step"][t], atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(model.gate_lambda(state), ref["exit_lambda"][t], atol=1e-6, rtol=1e-5)


def test_config_translation():
    ck = load_checkpoint(HELDOUT)
    cfg = ck.config
    assert (cfg.n_prelude, cfg.n_core, cfg.n_coda, cfg.n_heads, cfg.n_kv_heads, cfg.d_model) == (0, 3, 0, 6, 2, 48)
    assert (cfg.loop_input, cfg.loop_final_norm, cfg.sandwich, cfg.rope_layout) == ("state", True, "branch", "half")
    assert cfg.rope_base == 1e4 and cfg.norm_eps == 1e-5 and not cfg.tie_embeddings and cfg.exit_gate
    assert ck.model.adapter is None and ck.model.lm_head is not None
    assert ck.meta["recipe"]["r_bar"] == 3 and ck.meta["exit_steps"] == 3 and ck.meta["config_dtype"] == "float32"
    info = describe_folder(HELDOUT)
    assert info["format"] == "ouro" and info["n_params"] == ck.model.num_params()


def test_reads_torch_dtype_as_older_configs_write_it(tmp_path):
    folder = copy_fixture(tmp_path / "old")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["torch_dtype"] = cfg.pop("dtype")
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(folder).meta["config_dtype"] == "float32"
    assert describe_folder(folder)["config_dtype"] == "float32"


def test_no_noise_is_drawn():
    """Ouro's loop starts from the embedded tokens: the 'noise' is a broadcast zero, however long the context."""
    ck = load_checkpoint(TINY)
    noise = ck.model.seeded_state([0, 1], seed=3)
    assert noise.shape == (2, 256, 64) and noise.stride() == (0, 0, 0) and not noise.any()


# -- the exit gate --------------------------------------------------------------------------------
def _exit_steps(ref: dict) -> dict[float, np.ndarray]:
    return {int(k[-3:]) / 100: v.numpy() for k, v in ref.items() if k.startswith("exit_step_q")}


def test_gate_exit_equals_the_reference_q_exit(ouro):
    """GateExit(q)'s exit loop (1-based) is the reference's Q-exit step (0-based) + 1, on a trace of
    T loops and on a longer one (the policy's cap is total_ut_steps: the last step takes what is left)."""
    folder, ck, ref = ouro
    T = steps_of(folder)
    ids = ref["input_ids"].numpy()
    traces = {loops: [trace(ck, row, loops, cache=False) for row in ids] for loops in (T, 2 * T)}
    lam = np.stack([tr.exit_lambda[0] for tr in traces[T]])
    np.testing.assert_allclose(lam, ref["exit_lambda"].numpy().transpose(1, 2, 0), atol=1e-6)
    # before the last step (which takes what is left: CDF 1) the CDFs agree
    np.testing.assert_allclose(exit_cdf(lam)[..., :-1], ref["exit_cdf"].numpy().transpose(1, 2, 0)[..., :-1], atol=1e-6)
    steps = _exit_steps(ref)
    assert len(steps) == 4
    for q, expected in steps.items():
        for loops, rows in traces.items():
            ours = np.stack([GateExit(q, r_max=T).exit_depth(tr)[0] for tr in rows])
            np.testing.assert_array_equal(ours, expected + 1, err_msg=f"q {q}, {loops} loops")
    # the reference's steps spread over the loops, loop 1 included (a test that could fail)
    assert len(np.unique(np.concatenate([v.ravel() for v in steps.values()]))) >= 3
    assert min(v.min() for v in steps.values()) == 0


def test_online_face_equals_the_fast_face(ouro):
    """Fed a uniform run's states loop by loop, the online face halts exactly where the fast one exits."""
    folder, ck, ref = ouro
    T = steps_of(folder)
    model, ids = ck.model, ref["input_ids"]
    for q in _exit_steps(ref):
        policy = GateExit(q, gate=model.gate_lambda, r_max=T).private()
        halted = torch.zeros(ids.shape, dtype=torch.bool)
        depth = torch.zeros(ids.shape, dtype=torch.long)
        with torch.no_grad():
            state = model.start_state(model.seeded_state(range(len(ids)), 0, ids.shape[1]), model.prelude(ids))
            for loop in range(1, T + 1):
                new = model.core_step(state, None)
                stop = policy.halt(loop, LoopSignals.of_states(new, state)) & ~halted
                depth[stop], halted, state = loop, halted | stop, new
        assert halted.all()
        np.testing.assert_array_equal(depth.numpy(), _exit_steps(ref)[q] + 1)


def test_gate_exit_needs_a_gate_online_and_lambdas_in_the_trace():
    ck = load_checkpoint(TINY)
    with pytest.raises(ValueError, match="needs the model's gate"):
        GateExit(0.5).halt(1, LoopSignals.of_states(torch.ones(1, 2, 64), torch.zeros(1, 2, 64)))
    tr = trace(ck, np.arange(5), 2, cache=False)
    tr.exit_lambda = None
    with pytest.raises(KeyError, match="no exit-gate lambdas"):
        GateExit(0.5).exits(tr)
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        GateExit(1.5)


def test_decoding_halts_on_the_gate():
    """generate, teacher_forced, the exact harness and the pool halt on GateExit for real: exits in
    1..T, spread, and the same per-token exits whichever runs them alone."""
    ck = load_checkpoint(TINY)
    ref = reference(TINY)
    policy = GateExit(0.5, gate=ck.model.gate_lambda, r_max=4)
    tf = teacher_forced(ck, ref["input_ids"], policy, mode="decode")
    assert ((1 <= tf.exit_loop) & (tf.exit_loop <= 4)).all() and len(tf.exit_loop.unique()) >= 2
    gen = generate(ck, ref["input_ids"][0, :6].tolist(), 5, policy, greedy=True)
    pooled = serve(ck, [Request(ref["input_ids"][0, :6].tolist(), 5, policy, greedy=True)], slots=2).completions[0]
    assert pooled.ids == gen.ids and pooled.exit_loops == gen.exit_loops
    assert all(1 <= e <= 4 for e in gen.exit_loops)
    exact = run_exact(ck, ref["input_ids"].numpy(), policy, 8)
    assert ((1 <= exact.exit_depth) & (exact.exit_depth <= 4)).all()


# -- KV-cached decoding ---------------------------------------------------------------------------
def test_cached_decoding_reproduces_the_reference_logits(ouro):
    """Prefill then one token at a time (Decoder), teacher_forced (both modes), generate and the
    serving pool reproduce the reference's default-call logits position by position."""
    folder, ck, ref = ouro
    T, ids, logits = steps_of(folder), ref["input_ids"], ref["logits"]
    B, S = ids.shape
    model = ck.model
    with torch.no_grad():
        dec = Decoder(model, HaltSchedule(Uniform(T), T), batch=B, noise=model.seeded_state(range(B), 0), max_len=S)
        first, _ = dec.prefill(ids[:, :5])
        rest = [dec.step(ids[:, p], p)[0] for p in range(5, S)]
    torch.testing.assert_close(torch.cat([first, torch.stack(rest, 1)], 1), logits, atol=ATOL, rtol=RTOL)
    for mode in ("prefill", "decode"):
        tf = teacher_forced(ck, ids, Uniform(T), mode=mode, keep_logits=True)
        torch.testing.assert_close(tf.logits, logits[:, :-1], atol=ATOL, rtol=RTOL)
    prompts = [ids[b, :k].tolist() for b in range(B) for k in range(1, S + 1)]
    expected = torch.stack([logits[b, k - 1] for b in range(B) for k in range(1, S + 1)])
    run = serve(ck, [Request(p, 1, Uniform(T), greedy=True) for p in prompts], slots=4)
    torch.testing.assert_close(torch.stack([c.logits[0] for c in run.completions]), expected, atol=ATOL, rtol=RTOL)
    for b in range(B):
        gen = generate(ck, ids[b].tolist(), 1, Uniform(T), greedy=True)
        torch.testing.assert_close(gen.logits[0], logits[b, -1], atol=ATOL, rtol=RTOL)


def test_generate_continues_as_the_full_forward():
    ck = load_checkpoint(TINY)
    prompt = reference(TINY)["input_ids"][0, :8].tolist()
    gen = generate(ck, prompt, 6, Uniform(4), greedy=True)
    full = full_depth_logits(ck, gen.prompt_ids + gen.ids[:-1], 4, seed=0)[len(prompt) - 1:]
    torch.testing.assert_close(gen.logits, full, atol=1e-4, rtol=0)


# -- decoding on the gate, against the reference's full recompute -----------------------------------
def _thresholds(ref: dict) -> dict[float, str]:
    return {int(k[-3:]) / 100: k[-3:] for k in ref if k.startswith("exit_step_q")}


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_gate_decoding_is_the_references_full_recompute(ouro, mode):
    """Token by token (each token's later steps not run, the earlier tokens' steps it reads run
    when it needs them) and all at once, at every recorded threshold: each position exits where
    the reference's Q-exit does and returns its logits (`model(ids, exit_threshold=q)`, which runs
    every token through every step)."""
    folder, ck, ref = ouro
    ids = ref["input_ids"]
    for q, tag in _thresholds(ref).items():
        tf = teacher_forced(ck, ids, GateExit.of_checkpoint(ck, q), mode=mode, keep_logits=True)
        np.testing.assert_array_equal(tf.exit_loop.numpy(), ref[f"exit_step_q{tag}"][:, :-1].numpy() + 1)
        torch.testing.assert_close(tf.logits, ref[f"logits_exit_q{tag}"][:, :-1], atol=ATOL, rtol=RTOL,
                                   msg=lambda m, q=q: f"q {q}: {m}")


def every_threshold(cdf: torch.Tensor, gap: float = 1e-4) -> list[float]:
    """One q inside each interval between consecutive distinct exit-CDF values of the steps before
    the last (the last one's CDF is 1): as q sweeps (0, 1) the reference's exits change only at those
    values, so these q give every exit assignment there is. Intervals narrower than gap are left out
    (float32 CDFs that close could round either way in another op order)."""
    v = torch.unique(cdf[:-1].double().flatten())
    edges = torch.cat([torch.zeros(1, dtype=v.dtype), v, torch.ones(1, dtype=v.dtype)])
    lo, hi = edges[:-1], edges[1:]
    keep = (hi - lo) >= gap
    return ((lo + hi) / 2)[keep].tolist()


def test_gate_decoding_is_the_reference_at_every_threshold(ouro):
    """Not only at the recorded thresholds: at a q in every interval of the reference's exit CDFs
    (every assignment of exit steps the gate can make), decoding exits where the reference's Q-exit
    would (its first step with CDF >= q, `exit_cdf`) and returns the reference's full-recompute
    logits at that step (`logits_per_step`, every token through every step), token by token and
    all positions at once."""
    _, ck, ref = ouro
    cdf, per_step, ids = ref["exit_cdf"], ref["logits_per_step"], ref["input_ids"]
    qs = every_threshold(cdf)
    assert len(qs) > 60
    seen = set()
    for q in qs:
        want = (cdf >= q).int().argmax(0)  # 0-based step; the last step's CDF is 1
        picked = per_step.gather(0, want[None, ..., None].expand(1, *per_step.shape[1:]))[0]
        for mode in ("decode", "prefill"):
            tf = teacher_forced(ck, ids, GateExit.of_checkpoint(ck, q), keep_logits=True, mode=mode)
            assert torch.equal(tf.exit_loop, want[:, :-1] + 1), (q, mode)
            torch.testing.assert_close(tf.logits, picked[:, :-1], atol=ATOL, rtol=RTOL,
                                       msg=lambda m, q=q, mode=mode: f"q {q} ({mode}): {m}")
        seen.add(tuple(want[:, :-1].flatten().tolist()))
    assert len(seen) > 30  # the sweep really moves the exits


def test_the_frozen_rules_are_not_the_reference():
    """What the test above rules out: with a halted token's keys frozen ("latest") or its state
    frozen ("recompute"), later tokens read another context than the reference's."""
    ck, ref = load_checkpoint(TINY), reference(TINY)
    for rule in ("latest", "recompute"):
        tf = teacher_forced(ck, ref["input_ids"], GateExit.of_checkpoint(ck, 0.5), rule, keep_logits=True)
        assert (tf.logits - ref["logits_exit_q050"][:, :-1]).abs().max() > 0.1


def test_generate_is_the_references_greedy_generation(ouro):
    """A 5-token prompt, 20 greedy tokens, every threshold, each prompt row: the ids, each token's exit
    step and its logits are what Ouro's own code gives with full recompute per token
    (tests/fixtures/make_ouro_generations.py; every CDF and argmax there is at least 1e-4 from a
    tie). The serving pool, all of them at once, gives the same."""
    folder, ck, ref = ouro
    gens = load_file(str(folder / "reference_generations.safetensors"))
    ids = ref["input_ids"]
    runs = [(b, q, tag) for b in range(len(ids)) for q, tag in _thresholds(ref).items()]
    requests = []
    for b, q, tag in runs:
        policy = GateExit.of_checkpoint(ck, q)
        gen = generate(ck, ids[b, :5].tolist(), 20, policy, greedy=True)
        key = f"b{b}_q{tag}"
        assert gen.ids == gens[f"ids_{key}"].tolist(), key
        assert gen.exit_loops == (gens[f"exit_{key}"] + 1).tolist(), key
        torch.testing.assert_close(gen.logits, gens[f"logits_{key}"], atol=ATOL, rtol=RTOL)
        requests.append(Request(ids[b, :5].tolist(), 20, policy, greedy=True))
    assert len({e for b, _, tag in runs for e in gens[f"exit_b{b}_q{tag}"].tolist()}) >= 3  # exits spread
    pooled = serve(ck, requests, slots=3)
    for (b, _, tag), c in zip(runs, pooled, strict=True):
        assert c.ids == gens[f"ids_b{b}_q{tag}"].tolist() and c.exit_loops == (gens[f"exit_b{b}_q{tag}"] + 1).tolist()


def _core_rows(model) -> tuple[list[int], object]:
    """A hook counting the token positions each core call runs (the first core block's input rows)."""
    rows = []
    handle = model.core_blocks[0].register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[1]))
    return rows, handle


def test_a_halted_tokens_later_steps_run_only_when_a_later_token_reads_them():
    """Decoding on the gate runs position j's steps up to the deepest exit at or after it, each once:
    a token's steps after its exit run only when a later token reaches them (inside that token's own
    core calls: a decoded token makes one core call per step it runs), and never when none does.
    So a decoded token makes exit-loop core calls against Uniform's 4, while the positions run
    fall below Uniform's only after the last deep token (here at two thresholds of three)."""
    ck, ref = load_checkpoint(TINY), reference(TINY)
    ids, P = ref["input_ids"][0], 5
    saved_rows = []
    for q in (0.3, 0.5, 0.7):
        dec = Decoder(ck.model, HaltSchedule(GateExit.of_checkpoint(ck, q), 4), noise=ck.model.seeded_state([0], 0),
                      max_len=len(ids))
        rows, handle = _core_rows(ck.model)
        try:
            with torch.no_grad():
                _, prompt_exits = dec.prefill(ids[None, :P])
                calls_before = len(rows)
                exits = [int(dec.step(ids[p:p + 1], p)[1]) for p in range(P, len(ids))]
        finally:
            handle.remove()
        deepest = [max([int(prompt_exits.max())] + exits)] * P + [max(exits[k:]) for k in range(len(exits))]
        assert dec.cache.filled[0, :len(ids)].tolist() == deepest
        assert sum(rows) == sum(deepest)  # every (position, step) run once, no more
        assert len(rows) - calls_before == sum(exits) < 4 * len(exits)  # one core call per step it runs
        assert len(set(exits)) > 1
        saved_rows.append(sum(deepest) < 4 * len(ids))
    assert any(saved_rows)


def test_bad_thresholds_and_models_are_refused():
    ck = load_checkpoint(TINY)
    for q in (0, 1, 0.0, 1.0, -0.1, 1.5, float("nan"), "half", None):
        with pytest.raises(ValueError, match=r"gate threshold q must"):
            GateExit.of_checkpoint(ck, q)
    assert GateExit.of_checkpoint(ck, "0.25").q == 0.25 and GateExit.of_checkpoint(ck, 0.5, max_loops=2).r_max == 2
    from types import SimpleNamespace
    with pytest.raises(ValueError, match="no learned exit gate"):
        GateExit.of_checkpoint(SimpleNamespace(model=SimpleNamespace(exit_gate=None), path="demo"), 0.5)


def test_a_prompt_longer_than_the_cache_is_refused_and_nothing_is_lost():
    """generate and teacher_forced refuse a sequence past the context; a decoding session refuses
    positions past its cache before writing anything, and then goes on as if it had not been asked."""
    ck, ref = load_checkpoint(TINY), reference(TINY)
    policy = GateExit.of_checkpoint(ck, 0.5)
    with pytest.raises(ValueError, match="exceed the context"):
        generate(ck, [5] * 256, 2, policy)
    with pytest.raises(ValueError, match="exceed the context"):
        teacher_forced(ck, torch.full((1, 258), 5), policy)
    ids = ref["input_ids"][:1]
    model = ck.model

    def session():
        return Decoder(model, HaltSchedule(policy, 4), noise=model.seeded_state([0], 0), max_len=8)

    with torch.no_grad():
        dec, clean = session(), session()
        torch.testing.assert_close(dec.prefill(ids[:, :6])[0], clean.prefill(ids[:, :6])[0])
        with pytest.raises(ValueError, match="do not fit the cache's context of 8"):
            dec.prefill(ids[:, 6:10], 6)
        with pytest.raises(ValueError, match="do not fit the cache's context of 8"):
            dec.step(ids[:, 8], 8)
        for p in (6, 7):
            torch.testing.assert_close(dec.step(ids[:, p], p)[0], clean.step(ids[:, p], p)[0], atol=0, rtol=0)


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 1}, "unexpected tensor model.layers.1"),
    ({"num_hidden_layers": 3}, "missing tensors model.layers.2"),
    ({"num_key_value_heads": 2}, r"k_proj.weight has shape \(64, 64\) in the weights, \(32, 64\) expected"),
    ({"vocab_size": 300}, r"has shape \(320, 64\) in the weights, \(300, 64\) expected"),
    ({"total_ut_steps": 0}, "total_ut_steps must be >= 1"),
])
def test_refuses_a_config_that_does_not_match_its_weights(tmp_path, change, message):
    folder = copy_fixture(tmp_path / "cfg")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(folder)


# -- files and refusals ---------------------------------------------------------------------------
def copy_fixture(dest: Path, folder: Path = TINY, weights: bool = True) -> Path:
    shutil.copytree(folder, dest, ignore=None if weights else shutil.ignore_patterns("model.safetensors"))
    return dest


def make_sharded(dest: Path) -> Path:
    """The fixture in two shards plus model.safetensors.index.json; k_proj and v_proj of layer 0 in
    different shards (the loader pairs them across files)."""
    copy_fixture(dest, weights=False)
    tensors = load_file(str(TINY / "model.safetensors"))
    first = {n for n in tensors if n < "model.layers.0.self_attn.q"}
    assert "model.layers.0.self_attn.k_proj.weight" in first and "model.layers.0.self_attn.v_proj.weight" not in first
    shards = {"model-00001-of-00002.safetensors": sorted(first),
              "model-00002-of-00002.safetensors": sorted(set(tensors) - first)}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(dest / shard), metadata={"format": "pt"})
    weight_map = {n: shard for shard, part in shards.items() for n in part}
    (dest / INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return dest


def test_sharded_loads_the_same_as_single_file(tmp_path):
    one, two = load_checkpoint(TINY), load_checkpoint(make_sharded(tmp_path / "sharded"))
    assert one.checkpoint_id == two.checkpoint_id
    a, b = one.model.state_dict(), two.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_refuses_pickles_and_a_missing_shard(tmp_path):
    only_bin = copy_fixture(tmp_path / "bin", weights=False)
    torch.save({"x": torch.zeros(2)}, only_bin / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle files .*pytorch_model.bin.*never unpickled"):
        load_checkpoint(only_bin)
    folder = make_sharded(tmp_path / "sharded")
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors is missing"):
        load_checkpoint(folder)


def test_refuses_a_tensor_of_the_wrong_shape_or_a_missing_one(tmp_path):
    tensors = load_file(str(TINY / "model.safetensors"))
    folder = copy_fixture(tmp_path / "shape", weights=False)
    save_file({**tensors, "model.layers.1.mlp.up_proj.weight": torch.zeros(127, 64)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers.1.mlp.up_proj.weight has shape \(127, 64\) in the weights, "
                                              r"\(128, 64\) expected"):
        load_checkpoint(folder)
    save_file({k: v for k, v in tensors.items() if "early_exit_gate" not in k}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors model.early_exit_gate.bias, model.early_exit_gate.weight"):
        load_checkpoint(folder)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "model_type 'llama' is not supported.*'huginn_raven', 'ouro'"),
    ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window = True is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling = .* is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
    ({"head_dim": 32}, "head_dim 32 x 4 heads is not hidden_size 64"),
])
def test_refuses_configs_it_does_not_compute(tmp_path, change, message):
    folder = copy_fixture(tmp_path / "cfg")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(folder)
    with pytest.raises(CheckpointError, match=message):
        describe_folder(folder)


def test_refuses_a_model_too_large_before_loading():
    with pytest.raises(CheckpointError, match="too large for this machine.*need about .* free"):
        load_checkpoint(TINY, max_bytes=100_000)


def test_bfloat16_on_request():
    bf = load_checkpoint(TINY, dtype="bfloat16")
    assert {p.dtype for p in bf.model.parameters()} == {torch.bfloat16}
    ref = reference(TINY)
    with torch.no_grad():
        logits = bf.model(ref["input_ids"], loops=4).float()
    assert (logits - ref["logits_per_step"][3]).abs().max() < 0.2


# -- the comparison it is for ---------------------------------------------------------------------
def test_analyze_puts_the_gate_beside_a1(tmp_path):
    """report.json: GateExit's curve (exact and fast) and its matched point next to A1's, the latent
    rule's, Accel's and the certified exit's on the same curves (issue 48), on the fixture (random
    weights: a check of the mechanism, not of the science)."""
    from recur_core.analyze import main
    text = tmp_path / "text.txt"
    text.write_text("The baker sold 14 loaves before seven, and the river rose by 3 metres on Tuesday. " * 12)
    report = main([str(TINY), "--text", str(text), "--seq-len", "24", "--windows", "4", "--max-loops", "8",
                   "--n-boot", "20", "--probe-windows", "4", "--probe-tokens", "16",
                   "--out", str(tmp_path / "report"), "--cache-dir", str(tmp_path / "cache")])
    for section in ("allocation", "allocation_fast"):
        al = report[section]
        assert [p["threshold_name"] for p in al["Gate"]] == ["q"] * len(al["Gate"])
        assert "a1_loops_to_match_a0_rbar" in al and al["gate_loops_to_match_a0_rbar"]["value"] is not None
        beside = ("A1", "latent", "Accel", "Certified", "Gate")
        assert all(f"{name}_minus_A0" in row for row in al["matched_depth"] for name in beside)
        for name in beside:
            assert al[name] and al[f"{name.lower()}_loops_to_match_a0_rbar"] is not None
            assert all(1.0 <= p["mean_loops"] <= 8.0 for p in al[name])
        loops = [p["mean_loops"] for p in al["Gate"]]
        assert loops[0] == 1.0 and max(loops) <= 4.0 and loops == sorted(loops)  # q = 0: loop 1; cap: 4 steps
    assert 0 in report["allocation"]["exact_points"]["Gate"] and report["settings"]["q_grid"][0] == 0.0
    assert {"Accel", "Certified"} <= set(report["fast_minus_exact"])
    assert any(r["threshold_name"] == "q" for r in report["fast_minus_exact"]["Gate"])


# -- the app --------------------------------------------------------------------------------------
def _app(monkeypatch, tmp_path):
    import streamlit as st
    from streamlit.testing.v1 import AppTest
    st.cache_resource.clear()  # a model another test loaded stays cached in this process
    monkeypatch.delenv("RECUR_CHECKPOINT", raising=False)
    monkeypatch.delenv("RECUR_CHECKPOINTS", raising=False)
    monkeypatch.setenv("RECUR_SHIPPED", str(tmp_path / "none"))
    monkeypatch.setenv("RECUR_CACHE_DIR", str(tmp_path / "cache"))
    at = AppTest.from_file("../app.py", default_timeout=300)
    at.run()
    at.text_input(key="typed_path_input").input(str(TINY)).run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def test_app_shows_the_gate_beside_a1(monkeypatch, tmp_path):
    """The Ouro folder opens (token strip drawn); Compare draws the gate's strip next to A0 / A1 and the
    depth / loss curve has the Gate family beside A1's, with its matched point."""
    at = _app(monkeypatch, tmp_path)
    assert any('data-testid="token-strip"' in el.proto.body for el in at.html)
    at.switch_page("pages/compare.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert any("learned exit gate" in h.value for h in at.subheader)
    assert any("gate q=0.50" in el.proto.body for el in at.html)
    at.switch_page("pages/curve.py").run()
    at.segmented_control(key="eval_mode").set_value("fast").run()
    assert not at.exception, [e.message for e in at.exception]
    text = " ".join(c.value for c in at.caption)
    for name in ("Learned exit gate", "A1 convergence exit", "latent rule", "Accel", "Certified exit"):
        assert name in text


def test_a_lone_text_reports_progress_after_every_loop():
    """The app's progress bar moves during a pasted text's trace (one batch: every loop reports)."""
    seen = []
    trace(load_checkpoint(TINY), np.arange(7), 5, cache=False, progress=lambda done, total: seen.append((done, total)))
    assert [s for s in seen if s[0] > 0] == [(loop, 5) for loop in range(1, 6)]
