"""Decoding with real per-token halting (recur_core.decoding.decode) on the tiny checkpoint."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recur_core.analysis.probe import Probe
from recur_core.decoding.decode import (
    Decoder,
    full_depth_logits,
    generate,
    generation_drift,
    sample_next,
)
from recur_core.decoding.kv import KV_RULES
from recur_core.decoding.teacher_forced import teacher_forced
from recur_core.exits.halting import HaltSchedule
from recur_core.exits.policies import ConvergenceExit, LatentDiff, LinearRouter, Uniform
from recur_core.exits.signals import LoopSignals
from recur_core.settings import seed_for

ROOT = Path(__file__).resolve().parents[1]
TOL = 2e-5  # float32 reordering (cached attention over a slab, masks)
SEED = 3


@pytest.fixture(scope="module")
def windows(ckpt):
    return ckpt.windows("eval")[:4]


def window_noise(model, n_rows, seq_len, seed=SEED):
    return torch.cat([model.init_state(1, seq_len, torch.Generator().manual_seed(seed_for(seed, n)))
                      for n in range(n_rows)])


def forward_ce(model, windows, loops, seed=SEED):
    logits = torch.stack([full_depth_logits(model, w[:-1], loops, seed, row=n) for n, w in enumerate(windows)])
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none"), logits


def relative_change(new, old):
    return (new - old).norm(dim=-1) / new.norm(dim=-1)


@torch.inference_mode()
def mixed_delta(model, windows, loop=1, seed=SEED):
    """A LatentDiff threshold among the middle half of the state changes at `loop`: part of the
    tokens halt there, the rest later (so exits are mixed whatever the tiny model learned). It sits
    in the widest gap between neighbouring values, so float reordering cannot flip an exit."""
    ids = windows[:, :-1]
    e, s = model.prelude(ids), window_noise(model, len(ids), ids.shape[1], seed)
    for _ in range(loop):
        s, old = model.core_step(s, e), s
    v = relative_change(s, old).flatten().sort().values
    lo, hi = len(v) // 4, 3 * len(v) // 4
    i = lo + int((v[lo + 1:hi + 1] - v[lo:hi]).argmax())
    return float((v[i] + v[i + 1]) / 2)


@torch.inference_mode()
def masking_harness(model, windows, policy, max_loops, seed=SEED):
    """The masking harness, straight from the model: every token steps every loop, halted tokens
    are frozen with core_step(freeze=...); logits are read out from the final (exit) states."""
    ids = windows[:, :-1]
    e, s = model.prelude(ids), window_noise(model, len(ids), ids.shape[1], seed)
    halted = torch.zeros(ids.shape, dtype=torch.bool)
    exits = torch.zeros(ids.shape, dtype=torch.long)
    for loop in range(1, max_loops + 1):
        new = model.core_step(s, e, freeze=halted)
        stop = policy.halt(loop, LoopSignals(new, relative_change(new, s))) & ~halted
        if loop == max_loops:
            stop = ~halted
        exits[stop] = loop
        halted |= stop
        s = new
        if halted.all():
            break
    return model.readout(s), exits


@torch.inference_mode()
def latest_rule_reference(model, windows, policy, max_loops, seed=SEED):
    """Huginn's rule built from the model's own attention pieces: at every loop and core layer a
    halted token's keys/values are the ones it wrote at its exit loop (its latest)."""
    ids = windows[:, :-1]
    T = ids.shape[1]
    cos, sin = model.rope(T)
    e, s = model.prelude(ids), window_noise(model, len(ids), T, seed)
    halted = torch.zeros(ids.shape, dtype=torch.bool)
    exits = torch.zeros(ids.shape, dtype=torch.long)
    latest = [None] * len(model.core_blocks)
    for loop in range(1, max_loops + 1):
        x = model.adapter(torch.cat((s, e), dim=-1))
        for l, block in enumerate(model.core_blocks):
            q, k, v = block.attn.project_qkv(block.attn_norm(x), cos, sin)
            if latest[l] is not None:
                m = halted[:, None, :, None]
                k, v = torch.where(m, latest[l][0], k), torch.where(m, latest[l][1], v)
            latest[l] = (k, v)
            x = block.attn_out_norm(block.attn.attend(q, k, v, is_causal=True) + x)
            x = block.mlp_out_norm(block.mlp(block.mlp_norm(x)) + x)
        new = torch.where(halted[..., None], s, x)
        stop = policy.halt(loop, LoopSignals(new, relative_change(new, s))) & ~halted
        if loop == max_loops:
            stop = ~halted
        exits[stop] = loop
        halted |= stop
        s = new
        if halted.all():
            break
    return model.readout(s), exits


# -- exits disabled ------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_rule", KV_RULES)
def test_exits_disabled_generate_equals_forward(ckpt, windows, kv_rule):
    loops = 5
    gen = generate(ckpt, windows[0, :10], 12, None, max_loops=loops, kv_rule=kv_rule, greedy=True, seed=SEED)
    assert gen.exit_loops == [loops] * 12 and gen.mean_loops == loops
    seq = gen.prompt_ids + gen.ids[:-1]
    ref = full_depth_logits(ckpt, seq, loops, seed=SEED)[len(gen.prompt_ids) - 1:]
    torch.testing.assert_close(gen.logits, ref, atol=TOL, rtol=0)
    assert gen.ids == [int(r.argmax()) for r in ref]  # greedy followed the forward's argmax


@pytest.mark.parametrize("loops", [1, 3])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_a0_decode_equals_forward(ckpt, windows, loops, mode):
    ce_ref, logits_ref = forward_ce(ckpt.model, windows, loops)
    for kv_rule in KV_RULES:
        tf = teacher_forced(ckpt, windows, Uniform(loops), kv_rule, seed=SEED, mode=mode, batch_size=3,
                            keep_logits=True)
        assert (tf.exit_loop == loops).all()
        torch.testing.assert_close(tf.logits, logits_ref, atol=TOL, rtol=0)
        torch.testing.assert_close(tf.ce, ce_ref, atol=TOL, rtol=0)


def test_a0_generate_equals_forward_with_readout_policy_never_halting(ckpt, windows):
    """A1 with eps 0 never halts: every token runs the cap, its logits are the forward's."""
    gen = generate(ckpt, windows[1, :8], 6, ConvergenceExit(0.0, min_loops=1), max_loops=4, greedy=True, seed=SEED)
    assert gen.exit_loops == [4] * 6
    ref = full_depth_logits(ckpt, gen.prompt_ids + gen.ids[:-1], 4, seed=SEED)[len(gen.prompt_ids) - 1:]
    torch.testing.assert_close(gen.logits, ref, atol=TOL, rtol=0)
    assert gen.step_readouts == [5] * 5  # loop 0 (the noise state) and loops 1..4


# -- the KV rules with exits ----------------------------------------------------------------------
@pytest.mark.parametrize("loop", [1, 2])
def test_recompute_rule_is_the_masking_harness(ckpt, windows, loop):
    policy = LatentDiff(mixed_delta(ckpt.model, windows, loop))
    ref_logits, ref_exits = masking_harness(ckpt.model, windows, policy, max_loops=6)
    assert 0 < (ref_exits == loop).float().mean() < 1  # the exits are mixed
    for mode in ("decode", "prefill"):
        tf = teacher_forced(ckpt, windows, policy, "recompute", seed=SEED, max_loops=6, mode=mode,
                            batch_size=3, keep_logits=True)
        assert torch.equal(tf.exit_loop, ref_exits)
        torch.testing.assert_close(tf.logits, ref_logits, atol=TOL, rtol=0)


def test_latest_rule_is_huginns_rule_and_differs_from_the_harness(ckpt, windows):
    policy = LatentDiff(mixed_delta(ckpt.model, windows, 1))
    ref_logits, ref_exits = latest_rule_reference(ckpt.model, windows, policy, max_loops=6)
    harness_logits, _ = masking_harness(ckpt.model, windows, policy, max_loops=6)
    for mode in ("decode", "prefill"):
        tf = teacher_forced(ckpt, windows, policy, "latest", seed=SEED, max_loops=6, mode=mode,
                            batch_size=3, keep_logits=True)
        assert torch.equal(tf.exit_loop, ref_exits)
        torch.testing.assert_close(tf.logits, ref_logits, atol=TOL, rtol=0)
    assert not torch.allclose(tf.logits, harness_logits, atol=1e-6, rtol=0)  # "latest" is not the harness


@torch.inference_mode()
def loop_on_reference(model, windows, policy, max_loops, seed=SEED):
    """Ouro's semantics from the model alone: every token steps every loop, never frozen (the
    uniform forward); each exits where the policy first holds on those states, and its logits are
    the readout of the sequence of exit states (the coda reads each past token at its exit)."""
    ids = windows[:, :-1]
    e, s = model.prelude(ids), window_noise(model, len(ids), ids.shape[1], seed)
    halted = torch.zeros(ids.shape, dtype=torch.bool)
    exits = torch.zeros(ids.shape, dtype=torch.long)
    exit_state = torch.zeros_like(s)
    for loop in range(1, max_loops + 1):
        new = model.core_step(s, e)
        stop = (policy.halt(loop, LoopSignals(new, relative_change(new, s))) | (loop == max_loops)) & ~halted
        exits[stop], exit_state[stop] = loop, new[stop]
        halted |= stop
        s = new
    return model.readout(exit_state), exits


def test_continue_rule_is_the_uniform_forward_read_at_each_exit(ckpt, windows):
    """Under "continue" a halted token's later entries are those of its state looping on: decoding
    (token by token and in parallel) gives the uniform forward's states, read out at each token's
    exit, unlike the masking harness; and every cache entry it computed is the uniform run's."""
    d = ckpt.config.d_model
    g = torch.Generator().manual_seed(1)  # a probe that halts some tokens at loop 1 and the rest at the cap
    probe = Probe(torch.randn(d + 1, generator=g), 0.0, torch.zeros(d + 1), torch.ones(d + 1), "kl", 1e-3)
    policy = LinearRouter(probe, 0.5, r_max=6)
    ref_logits, ref_exits = loop_on_reference(ckpt.model, windows, policy, max_loops=6)
    assert 0 < (ref_exits == 1).float().mean() < 1 and (ref_exits == 6).any()
    for mode in ("decode", "prefill"):
        tf = teacher_forced(ckpt, windows, policy, "continue", seed=SEED, max_loops=6, mode=mode,
                            batch_size=3, keep_logits=True)
        assert torch.equal(tf.exit_loop, ref_exits)
        torch.testing.assert_close(tf.logits, ref_logits, atol=TOL, rtol=0)
    harness_logits, _ = masking_harness(ckpt.model, windows, policy, max_loops=6)
    assert not torch.allclose(tf.logits, harness_logits, atol=1e-3, rtol=0)
    ids, model = windows[:, :-1], ckpt.model
    sessions = {}
    for name, p in (("continue", policy), ("uniform", Uniform(6))):
        dec = Decoder(model, HaltSchedule(p, 6), batch=len(ids), kv_rule="continue",
                      noise=window_noise(model, len(ids), model.cfg.max_seq_len))
        for t in range(ids.shape[1]):
            dec.step(ids[:, t], t)
        sessions[name] = dec.cache
    T = ids.shape[1]
    filled = torch.from_numpy(sessions["continue"].filled[0, :T])  # lockstep rows are filled alike
    have = (torch.arange(1, 7)[:, None] <= filled[None, :])[None, None, None, :, None, :, None]
    got, want = (sessions[n].core[..., :T, :] for n in ("continue", "uniform"))
    torch.testing.assert_close(got[have.expand_as(got)], want[have.expand_as(want)], atol=TOL, rtol=0)


def test_router_prefill_equals_decoding_under_both_rules(ckpt, windows):
    """A2 (a state probe) under either rule: the parallel prefill that benchmarks use to score it is
    token-by-token decoding, so neither rule's loss can come from positions seeing later ones."""
    g = torch.Generator().manual_seed(0)
    d = ckpt.config.d_model
    probe = Probe(torch.randn(d + 1, generator=g), 0.0, torch.zeros(d + 1), torch.ones(d + 1), "kl", 1e-3)
    policy = LinearRouter(probe, 0.5, r_max=6)
    for kv_rule in KV_RULES:
        par = teacher_forced(ckpt, windows, policy, kv_rule, seed=SEED, mode="prefill", keep_logits=True)
        seq = teacher_forced(ckpt, windows, policy, kv_rule, seed=SEED, mode="decode", keep_logits=True)
        assert 1 < len(par.exit_loop.unique()) and torch.equal(par.exit_loop, seq.exit_loop)
        torch.testing.assert_close(par.logits, seq.logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("kv_rule", KV_RULES)
def test_chunked_prefill_equals_the_one_piece_prefill_for_state_policies(ckpt, windows, kv_rule):
    """A prompt run in chunks (each reading the earlier chunks from the cache under the KV rule)
    gives the same exits and logits as all at once when the policy reads only the state; chunk 1 is
    token-by-token decoding of the prompt."""
    g = torch.Generator().manual_seed(0)
    d = ckpt.config.d_model
    probe = Probe(torch.randn(d + 1, generator=g), 0.0, torch.zeros(d + 1), torch.ones(d + 1), "kl", 1e-3)
    prompt = windows[1, :13]
    for policy in (LatentDiff(0.2, r_max=6), LinearRouter(probe, 0.5, r_max=6)):
        whole = generate(ckpt, prompt, 6, policy, kv_rule=kv_rule, seed=SEED, greedy=True)
        assert len(set(whole.prompt_exit_loops)) > 1  # the prompt's exits are mixed
        for chunk in (1, 4, 5):
            part = generate(ckpt, prompt, 6, policy, kv_rule=kv_rule, seed=SEED, greedy=True, prefill_chunk=chunk)
            assert part.prompt_exit_loops == whole.prompt_exit_loops and part.ids == whole.ids
            torch.testing.assert_close(part.logits, whole.logits, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        generate(ckpt, prompt, 2, prefill_chunk=0)


@pytest.mark.parametrize("kv_rule", KV_RULES)
def test_cache_entries_of_halted_tokens(ckpt, windows, kv_rule):
    """What a later loop reads for a halted token: under "latest" its exit loop's entry, copied; under
    "recompute" ("continue") the entry its frozen (running) state writes at that loop (not the exit
    loop's)."""
    model, cap = ckpt.model, 6
    policy = LatentDiff(mixed_delta(model, windows, 1))
    ids = windows[:, :-1]
    dec = Decoder(model, HaltSchedule(policy, cap), batch=len(ids), kv_rule=kv_rule,
                  noise=window_noise(model, len(ids), model.cfg.max_seq_len))
    for t in range(ids.shape[1]):
        dec.step(ids[:, t], t)
    T = ids.shape[1]
    core = dec.cache.core[..., :T, :]  # (2, n_core, B, loops, Hkv, T, hd)
    exits = dec.cache.exit_loop[:, :T]
    at_exit, later = core[:, :, :, 0], core[:, :, :, 1]  # loop 1 entries and loop 2 entries
    halted_at_1 = (exits == 1)[None, None, :, None, :, None].expand_as(at_exit)
    assert halted_at_1.any()
    if kv_rule == "latest":  # copied lazily: to every loop that a later token read
        read_at_2 = torch.from_numpy(dec.cache.filled[:, :T] >= 2)[None, None, :, None, :, None].expand_as(at_exit)
        assert (halted_at_1 & read_at_2).any()
        assert (later == at_exit)[halted_at_1 & read_at_2].all()
    else:
        assert not (later == at_exit)[halted_at_1].all()
        assert (dec.cache.filled[:, :T] >= 2).all()  # loop 2 was filled for every position a later token needed


def mixed_eps(ckpt, windows, check_every, cap):
    """The largest A1 threshold under which some tokens halt before the cap and some at it. KL values
    below ~1e-6 nats are float32 rounding noise (the batch shape changes them), so none is used."""
    for eps in torch.logspace(0, -6, 25).tolist():
        exits = teacher_forced(ckpt, windows, ConvergenceExit(eps, r_max=cap), "latest", seed=SEED,
                               check_every=check_every).exit_loop
        if (exits == cap).any() and (exits < cap).any():
            return eps
    pytest.skip("no threshold mixes exits on this checkpoint")


@pytest.mark.slow
@pytest.mark.parametrize("check_every, cap", [(1, 3), (3, 6)])
def test_lockstep_rows_equal_decoding_each_window_alone(ckpt, windows, check_every, cap):
    """Rows decoded together give what each gives alone, with some rows halting at the cap (where,
    with check_every 3, nothing was read out) while others halt earlier."""
    policy = ConvergenceExit(mixed_eps(ckpt, windows, check_every, cap), r_max=cap)
    for kv_rule in KV_RULES:
        together = teacher_forced(ckpt, windows, policy, kv_rule, seed=SEED, batch_size=4, keep_logits=True,
                                  check_every=check_every)
        for n in range(len(windows)):
            alone = teacher_forced(ckpt, windows[n:n + 1], policy, kv_rule, seed=SEED, first_window=n,
                                   keep_logits=True, check_every=check_every)
            assert torch.equal(alone.exit_loop[0], together.exit_loop[n])
            torch.testing.assert_close(alone.logits[0], together.logits[n], atol=TOL, rtol=0)


HUGINN_FIXTURE = ROOT / "tests" / "fixtures" / "huginn_tiny"  # a core of several blocks


@pytest.mark.parametrize("kv_rule", ["recompute", "latest"])
@pytest.mark.parametrize("family, threshold", [("A1", 3e-3), ("latent", 0.1), ("Accel", 0.1), ("huginn", 1e-3)])
def test_a_step_computing_only_its_looping_rows_changes_no_bit(ckpt, kv_rule, family, threshold, monkeypatch):
    """Once at most half of a lockstep batch still loops, a step computes only those rows (padded to
    COMPACT_MIN_ROWS); its exits and kept logits are bit for bit those of the step that computes every
    row (one torch thread: the products keep their kernels), for a readout rule, a state rule and a
    remembering one on the tiny model's one-block core (exits 2-3, 2-4, 4-6), under both rules that freeze
    a halted token; on a core of several blocks (the Huginn fixture, A1) only under "latest", whose fill
    copies: "recompute" fills there by a call over several positions, which rounds otherwise."""
    from recur_core import load_checkpoint
    from recur_core.decoding import decode
    from recur_core.exits import catalogue
    model = load_checkpoint(HUGINN_FIXTURE) if family == "huginn" else ckpt
    batch = (torch.randint(0, model.config.vocab_size, (12, 25), generator=torch.Generator().manual_seed(0))
             if family == "huginn" else torch.cat([ckpt.windows("eval")] * 2)[:12])  # 12 distinct noise rows
    policy = catalogue.make("A1" if family == "huginn" else family, threshold, r_max=8)
    compacted = []
    run_loop = Decoder._run_loop
    monkeypatch.setattr(Decoder, "_run_loop", lambda self, *a: compacted.append(a[-1] is not None) or run_loop(self, *a))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fewer = teacher_forced(model, batch, policy, kv_rule, seed=SEED, batch_size=12, keep_logits=True)
        assert fewer.exit_loop.min() < fewer.exit_loop.max()
        if family == "huginn" and kv_rule == "recompute":
            assert not any(compacted)
            return
        assert any(compacted), "no step left its halted rows out: the test checks nothing"
        monkeypatch.setattr(decode, "COMPACT_SHARE", 0.0)  # every step computes every row
        compacted.clear()
        every = teacher_forced(model, batch, policy, kv_rule, seed=SEED, batch_size=12, keep_logits=True)
        assert not any(compacted)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(fewer.exit_loop, every.exit_loop)
    assert torch.equal(fewer.logits, every.logits)


def test_generate_matches_teacher_forced_decoding(ckpt, windows):
    """generate's kept logits and exits are what teacher_forced decoding gives the same text."""
    policy = LatentDiff(mixed_delta(ckpt.model, windows, 2), r_max=6)
    gen = generate(ckpt, windows[0, :12], 10, policy, greedy=True, seed=SEED)
    seq = torch.tensor([gen.prompt_ids + gen.ids])
    tf = teacher_forced(ckpt, seq, policy, "latest", seed=SEED, keep_logits=True, first_window=0)
    # noise: generate uses row 0's generator, like window 0
    P = len(gen.prompt_ids)
    assert tf.exit_loop[0, P - 1:].tolist() == gen.exit_loops
    torch.testing.assert_close(tf.logits[0, P - 1:], gen.logits, atol=TOL, rtol=0)


def test_decoded_text_is_what_generate_gets_for_every_token(ckpt, windows):
    """The app's exact path on a pasted text: every token's exit and output at exit are generate's
    (token by token, "recompute"); A0 equals the uniform trace at r; a token run to the cap is
    marked unconverged, and the last token (no next token) is not scored."""
    import numpy as np

    from recur_core.analysis.exact import ExactPath
    from recur_core.analysis.trace import trace
    ids = windows[1, :13].numpy()
    a1 = ConvergenceExit(3e-3, r_max=6)
    got = ExactPath(ckpt, ids).decoded_text(a1, 8, SEED)
    gen = generate(ckpt, ids, 1, a1, kv_rule="recompute", greedy=True, seed=SEED, max_loops=8, prefill_chunk=1)
    assert got.exit_depth.tolist() == gen.prompt_exit_loops and 1 < len(set(gen.prompt_exit_loops))
    assert got.argmax[-1] == gen.ids[0]  # the last token's prediction is the first new token
    assert got.converged.tolist() == [d < 6 for d in got.exit_depth]
    assert np.isnan(got.ce[-1]) and not np.isnan(got.ce[:-1]).any()
    assert got.mean_loops == pytest.approx(got.exit_depth[:-1].mean())
    tr = trace(ckpt, ids, 8, SEED, cache=False)
    a0 = ExactPath(ckpt, ids).decoded_text(Uniform(3), 8, SEED)
    assert a0.exit_depth.tolist() == [3] * len(ids) and a0.converged.all()
    np.testing.assert_allclose(a0.ce[:-1], tr.ce[0, :-1, 2], atol=TOL)
    assert a0.argmax.tolist() == tr.argmax[0, :, 2].tolist()
    assert (a0.top_prob > 0).all() and (a0.top_prob <= 1).all()
    with pytest.raises(ValueError, match="non-empty text"):
        ExactPath(ckpt, ids[:0]).decoded_text(a1, 8, SEED)
    for guess in (a1.exits(tr).depth[0], np.ones(len(ids), dtype=np.int64)):  # the fast exits (the app's), a bad one
        seeded = ExactPath(ckpt, ids).decoded_text(a1, 8, SEED, guess=guess)
        assert seeded.exit_depth.tolist() == got.exit_depth.tolist()
        np.testing.assert_allclose(seeded.ce[:-1], got.ce[:-1], atol=TOL)


def test_decoded_text_reports_each_token_and_replays_from_the_disk_cache(ckpt, windows, tmp_path):
    """The app's background decoding: progress after every fixed-point pass (tokens settled of T,
    rising to T of T), the result saved in the disk cache and read back equal, keyed by the policy
    (another threshold misses); cache_only misses without decoding."""
    import numpy as np

    from recur_core.analysis.cache import TraceCache
    from recur_core.analysis.exact import ExactPath
    ids, store = windows[2, :11].numpy(), TraceCache(tmp_path)
    a1 = ConvergenceExit(3e-3, r_max=6)
    assert ExactPath(ckpt, ids, cache=store, cache_only=True).decoded_text(a1, 8, SEED) is None
    calls = []
    first = ExactPath(ckpt, ids, cache=store, progress=lambda done, total: calls.append((done, total))).decoded_text(
        a1, 8, SEED)
    done = [d for d, total in calls if total == len(ids)]
    assert len(done) == len(calls) <= len(ids) and done == sorted(done) and done[-1] == len(ids)
    again = ExactPath(ckpt, ids, cache=store, cache_only=True).decoded_text(a1, 8, SEED)
    for field in ("exit_depth", "converged", "argmax", "top_prob", "ce"):
        np.testing.assert_array_equal(getattr(again, field), getattr(first, field))
    assert again.loss == pytest.approx(first.loss, nan_ok=True) and again.mean_loops == first.mean_loops
    assert ExactPath(ckpt, ids, cache=store, cache_only=True).decoded_text(ConvergenceExit(1e-2, r_max=6), 8, SEED) is None
    assert ExactPath(ckpt, ids, cache=store, cache_only=True).decoded_text(a1, 8, SEED + 1) is None


def test_halting_skips_compute_and_counts_readouts(ckpt, windows):
    a1 = generate(ckpt, windows[2, :8], 10, ConvergenceExit(1e-2, min_loops=2), max_loops=8, greedy=True)
    for loops, readouts in zip(a1.decode_exit_loops, a1.step_readouts, strict=True):
        assert 2 <= loops <= 8 and readouts == loops  # loops 1 .. exit (min_loops 2 reads out from loop 1)
    lat = generate(ckpt, windows[2, :8], 10, LatentDiff(1.0), max_loops=8, greedy=True)
    assert lat.step_readouts == [1] * 9  # one readout of the exit state per token


def test_check_every_n_loops(ckpt, windows):
    """check_every 3 with min_loops 2: A1 is consulted at loops 2, 5, 8 (and halts at the cap), reading
    out at loops 0, 2, 5, 8; check_every 1 is the default."""
    policy = ConvergenceExit(1e9, min_loops=2)  # halts at its first check
    gen = generate(ckpt, windows[0, :8], 5, policy, max_loops=8, greedy=True, check_every=3)
    assert set(gen.decode_exit_loops) == {2} and set(gen.step_readouts) == {2}
    never = generate(ckpt, windows[0, :8], 5, ConvergenceExit(0.0, min_loops=2), max_loops=7, greedy=True,
                     check_every=3)
    assert set(never.decode_exit_loops) == {7}
    assert set(never.step_readouts) == {4}  # loops 0, 2, 5 and the exit state's readout at the cap
    a = teacher_forced(ckpt, windows, ConvergenceExit(1e-3), "latest", seed=SEED, max_loops=8)
    b = teacher_forced(ckpt, windows, ConvergenceExit(1e-3), "latest", seed=SEED, max_loops=8, check_every=1)
    assert torch.equal(a.exit_loop, b.exit_loop)


def test_drift_is_zero_without_exits(ckpt, windows):
    gen = generate(ckpt, windows[3, :8], 8, Uniform(4), greedy=True, seed=SEED)
    d = generation_drift(ckpt, gen, 4, seed=SEED, halted_only=False)
    assert d.kl_mean < 1e-6 and d.argmax_agree == 1.0


# -- sampling -------------------------------------------------------------------------------------
def test_seeded_sampling_repeats(ckpt, windows):
    kw = dict(temperature=0.9, top_k=50, top_p=0.95, max_loops=4)
    a = generate(ckpt, windows[0, :8], 16, LatentDiff(0.05), seed=11, **kw)
    b = generate(ckpt, windows[0, :8], 16, LatentDiff(0.05), seed=11, **kw)
    assert a.ids == b.ids and a.exit_loops == b.exit_loops
    torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)
    others = [generate(ckpt, windows[0, :8], 16, LatentDiff(0.05), seed=s, **kw).ids for s in (12, 13, 14)]
    assert any(o != a.ids for o in others)


def test_sampling_filters():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, g, greedy=True) == 1
    assert sample_next(logits, g, temperature=0) == 1
    assert all(sample_next(logits, g, top_k=1) == 1 for _ in range(20))
    assert all(sample_next(logits, g, top_p=1e-3) == 1 for _ in range(20))
    assert {sample_next(logits, g, top_k=2) for _ in range(200)} == {1, 2}
    # p = (.089, .657, .242, .012): the smallest set reaching 0.85 is {1, 2}, reaching 0.9 adds 0
    assert {sample_next(logits, g, top_p=0.85) for _ in range(300)} == {1, 2}
    assert {sample_next(logits, g, top_p=0.9) for _ in range(500)} == {0, 1, 2}


def test_text_prompt_and_pieces(ckpt):
    gen = generate(ckpt, "Lily saw", 6, Uniform(2), greedy=True)
    assert gen.text == "".join(gen.pieces) and len(gen.pieces) == len(gen.ids) == 6
    tok = ckpt.tokenizer()
    assert tok.decode(gen.prompt_ids + gen.ids).endswith(gen.text)


def test_too_long_raises(ckpt):
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(ckpt, [1] * 20, ckpt.config.max_seq_len, Uniform(2))


# -- the benchmark --------------------------------------------------------------------------------
def test_bench_decode_runs_on_tiny(tiny_ckpt, tmp_path):
    env = {**os.environ, "RECUR_CACHE_DIR": str(tmp_path / "cache")}  # the A2 probe is cached there
    out = subprocess.run([sys.executable, "-m", "bench.bench_decode", "--ckpt", str(tiny_ckpt),
                          "--prompts", "2", "--new-tokens", "8", "--windows", "4", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    for key in ("realized_speedup", "flop_proxy_speedup", "mean_loops_a1", "loss_a0", "loss_a1",
                "realized_speedup_latent", "flop_proxy_speedup_latent", "mean_loops_latent", "loss_latent",
                "loss_a0_at_mean_loops_a1", "tokens_per_s", "wall_s", "drift", "realized_speedup_a2",
                "realized_speedup_a1_every", "loss_harness_a1", "tokens_per_s_latent_recompute",
                "mean_loops_a2_recompute", "tau_a2_recompute"):
        assert key in result, key
    text = out.stdout
    for figure in ("tok/s", "FLOP-proxy", "realized", "mean loops", "harness", "drift", "KV rules"):
        assert figure in text, figure


# -- the app page ---------------------------------------------------------------------------------
def test_generate_page_colours_tokens_and_times_them(tiny_ckpt):
    from streamlit.testing.v1 import AppTest
    at = AppTest.from_file(str(ROOT / "pages" / "generate.py"), default_timeout=120)
    at.session_state["checkpoint_path"] = str(tiny_ckpt)
    at.run()
    at.text_area[0].input("Lily saw a")
    next(s for s in at.slider if s.label == "Loop cap").set_value(2)
    next(s for s in at.slider if s.label == "New tokens").set_value(6)
    at.button[0].click().run()
    assert not at.exception
    strip = str(at.get("html")[-1].proto)
    depths = [int(d) for d in re.findall(r'data-depth=\\"(\d+)\\"', strip)]
    assert len(depths) == 6 and all(1 <= d <= 2 for d in depths)
    labels = [m.label for m in at.metric]
    assert any(label.startswith("A1") and "tokens/s" in label for label in labels)
    assert any(label.startswith("Uniform") for label in labels)
