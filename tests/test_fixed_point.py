"""The fixed-point engine (recur_core.decoding.fixed_point) is token-by-token decoding: identical exits
and logits within float tolerance for every policy family and KV rule, on the tiny checkpoint, the
shipped checkpoints and the Huginn / Ouro fixtures; it needs at most T computed passes (after a
guess's replay), and any first guess converges to the same result."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from recur_core import load_checkpoint
from recur_core.analysis.probe import Probe
from recur_core.analysis.trace import trace
from recur_core.decoding.fixed_point import fixed_point, needs_passes, settled_prefix
from recur_core.decoding.kv import KV_RULES
from recur_core.decoding.teacher_forced import exact_mode, teacher_forced
from recur_core.exits.halting import HaltSchedule
from recur_core.exits.policies import (
    Accel,
    ArgmaxStable,
    CertifiedExit,
    ConvergenceExit,
    CosineExit,
    EntropyDiff,
    GateExit,
    LatentDiff,
    LinearRouter,
    ReverseKLExit,
    Uniform,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
SEED = 5
TOL = 5e-5  # float32 reordering: a parallel pass against one position at a time


def gap_threshold(values: np.ndarray) -> float:
    """A threshold in the widest gap between neighbouring values of the middle half: part of the
    tokens meet it, part do not, and float reordering cannot move a value across it."""
    v = np.sort(values[np.isfinite(values)].ravel())
    lo, hi = len(v) // 4, 3 * len(v) // 4
    i = lo + int(np.argmax(v[lo + 1:hi + 1] - v[lo:hi]))
    return float((v[i] + v[i + 1]) / 2)


def families(ckpt, windows, loops: int) -> dict:
    """One policy per family, its threshold in a gap of this model's own signals (mixed exits)."""
    tr = trace(ckpt, windows, loops, SEED)
    g = torch.Generator().manual_seed(0)
    d = ckpt.config.d_model
    probe = Probe(torch.randn(d + 1, generator=g), 0.0, torch.zeros(d + 1), torch.ones(d + 1), "kl", 1e-3)
    return {
        "A0": Uniform(3),
        "A1": ConvergenceExit(gap_threshold(tr.kl_prev[..., 1:])),
        "A2": LinearRouter(probe, 0.5),
        "latent": LatentDiff(gap_threshold(tr.state_change)),
        "reverse_kl": ReverseKLExit(gap_threshold(tr.kl_prev_reverse[..., 1:])),
        "entropy": EntropyDiff(gap_threshold(np.abs(np.diff(tr.entropy, axis=-1)))),
        "argmax": ArgmaxStable(2),
        "cosine": CosineExit(gap_threshold(tr.cosine_change)),
        "accel": Accel(gap_threshold(np.abs(np.diff(tr.state_step, axis=-1)))),
        "certified": mixed_exits(CertifiedExit, tr, loops),
        "never": ConvergenceExit(0.0),
        "first_check": ConvergenceExit(math.inf),
    }


def mixed_exits(cls, tr, loops: int):
    """The family at the first threshold of a decade grid whose fast exits are mixed (some tokens halt
    before the cap, some run to it)."""
    for exponent in range(-4, 7):
        policy = cls(10.0 ** exponent)
        depth = policy.exit_depth(tr)
        if (depth < loops).any() and (depth == loops).any():
            return policy
    raise AssertionError(f"no {cls.__name__} threshold mixes exits on this trace")


def assert_same(ckpt, windows, policy, kv_rule, loops, **kw):
    """fixed_point against token-by-token decoding; returns the fixed point's result."""
    ref = teacher_forced(ckpt, windows, policy, kv_rule, seed=SEED, max_loops=loops, mode="decode",
                         keep_logits=True, **kw)
    got = teacher_forced(ckpt, windows, policy, kv_rule, seed=SEED, max_loops=loops, mode="fixed_point",
                         keep_logits=True, **kw)
    assert torch.equal(got.exit_loop, ref.exit_loop), f"{policy!r} under {kv_rule}: exits differ"
    torch.testing.assert_close(got.logits, ref.logits, atol=TOL, rtol=1e-4)
    torch.testing.assert_close(got.ce, ref.ce, atol=TOL, rtol=1e-4)
    assert all(1 <= p <= windows.shape[1] - 1 for p in got.passes)
    return got


@pytest.fixture(scope="module")
def windows(ckpt):
    w = ckpt.windows("eval")[:2]
    return w[:, :16]  # 15 positions: an odd length


@pytest.fixture(scope="module")
def tiny_families(ckpt, windows):
    return families(ckpt, windows, 8)


@pytest.mark.parametrize("kv_rule", KV_RULES)
@pytest.mark.parametrize("name", ["A0", "A1", "A2", "latent", "reverse_kl", "entropy", "argmax", "cosine",
                                  "never", "first_check"])
def test_every_family_and_rule_equals_token_by_token_decoding(ckpt, windows, tiny_families, name, kv_rule):
    got = assert_same(ckpt, windows, tiny_families[name], kv_rule, 8, batch_size=1)
    if not needs_passes(ckpt.model, tiny_families[name]):
        assert got.passes == [1, 1]  # a rule that reads only the state: one pass per batch


@pytest.fixture(scope="module")
def context_heavy(ckpt):
    """The tiny model with its coda attention's output scaled up, so that a token's readout leans on
    the earlier tokens' coda entries (the tiny model's own readout hardly does)."""
    model = copy.deepcopy(ckpt.model)
    with torch.no_grad():
        model.coda_blocks[0].attn.o_proj.weight.mul_(6.0)
    return model


def test_the_passes_matter_for_a_readout_rule(context_heavy, windows):
    """For some ε, A1's one parallel pass (the harness's readout context: earlier tokens at the current
    loop) halts differently from decoding; the fixed point still is decoding there, after passes."""
    tr = trace(context_heavy, windows, 8, SEED)
    kl = np.sort(tr.kl_prev[..., 1:].ravel())
    kl = kl[kl > 1e-5]  # far above float32 noise in a KL (~1e-7)
    wide = np.flatnonzero(kl[1:] > 1.1 * kl[:-1])  # gaps no float reordering can cross
    for i in wide[np.linspace(0, len(wide) - 1, 25).astype(int)]:
        a1 = ConvergenceExit(float(np.sqrt(kl[i] * kl[i + 1])))
        one = teacher_forced(context_heavy, windows, a1, "recompute", seed=SEED, max_loops=8, mode="prefill")
        fixed = teacher_forced(context_heavy, windows, a1, "recompute", seed=SEED, max_loops=8, mode="fixed_point")
        if not torch.equal(one.exit_loop, fixed.exit_loop):
            got = assert_same(context_heavy, windows, a1, "recompute", 8)
            assert got.passes[0] >= 2  # one pass was not enough
            return
    pytest.fail("no ε among the candidates where the readout context changes an exit")


def test_a_window_of_one_token(ckpt, windows, tiny_families):
    for name in ("A1", "entropy", "latent"):
        got = assert_same(ckpt, windows[:, :2], tiny_families[name], "latest", 8)
        assert got.passes == [1]


@pytest.mark.parametrize("guess", ["ones", "cap", "random"])
def test_any_first_guess_converges_to_the_same_result(context_heavy, windows, guess):
    model, a1 = context_heavy, ConvergenceExit(1e-3)
    ids = windows[:, :-1]
    B, T = ids.shape
    noise = model.seeded_state(range(B), SEED)
    start = {"ones": torch.ones(B, T, dtype=torch.long), "cap": torch.full((B, T), 8),
             "random": torch.randint(1, 9, (B, T), generator=torch.Generator().manual_seed(1))}[guess]
    plain = fixed_point(model, ids, HaltSchedule(a1, 8), noise=noise, kv_rule="recompute")
    seeded = fixed_point(model, ids, HaltSchedule(a1, 8), noise=noise, kv_rule="recompute", guess=start)
    assert torch.equal(plain.exits, seeded.exits)
    torch.testing.assert_close(plain.logits, seeded.logits, atol=TOL, rtol=1e-4)
    assert seeded.passes <= T + 1 and plain.passes <= T  # a guess's replay, then at most T computed passes
    assert seeded.settled == sorted(seeded.settled) and seeded.settled[-1] == B * T


@pytest.mark.parametrize("kv_rule", KV_RULES)
def test_a_guess_is_checked_by_replaying_its_core(context_heavy, windows, kv_rule, monkeypatch):
    """Seeded with decoding's own exits, the fixed point takes one pass and runs the core only in the
    guess's pass (the check replays it under the policy's readouts); a guess wrong at one position
    leaves the positions before it settled by that replay, and the result is the same."""
    model, a1 = context_heavy, ConvergenceExit(1e-3)
    ids = windows[:, :-1]
    B, T = ids.shape
    noise = model.seeded_state(range(B), SEED)
    plain = fixed_point(model, ids, HaltSchedule(a1, 8), noise=noise, kv_rule=kv_rule)
    steps, core_step = [], model.core_step
    monkeypatch.setattr(model, "core_step", lambda *a, **k: steps.append(1) or core_step(*a, **k))
    right = fixed_point(model, ids, HaltSchedule(a1, 8), noise=noise, kv_rule=kv_rule, guess=plain.exits)
    assert right.passes == 1 and torch.equal(right.exits, plain.exits)
    assert len(steps) == int(plain.exits.max())  # the guess's pass alone: one core step per loop
    torch.testing.assert_close(right.logits, plain.logits, atol=TOL, rtol=1e-4)
    wrong = plain.exits.clone()
    wrong[0, 5] = 1 if wrong[0, 5] > 1 else 8
    seeded = fixed_point(model, ids, HaltSchedule(a1, 8), noise=noise, kv_rule=kv_rule, guess=wrong)
    assert seeded.settled[0] == 5 + T and torch.equal(seeded.exits, plain.exits)
    torch.testing.assert_close(seeded.logits, plain.logits, atol=TOL, rtol=1e-4)


@pytest.mark.parametrize("kv_rule", ["latest", "recompute"])  # under "continue" these windows take 3 passes
def test_the_rest_is_decoded_token_by_token_once_that_is_cheaper(context_heavy, ckpt, kv_rule, monkeypatch):
    """From the third computed pass on, once the passes still needed times the windows still running
    exceed STEP_ROWS, the rest is decoded token by token (a threshold at the float noise of its signal
    settles a few positions a pass): with STEP_ROWS 0, a decoding that needs more than three passes
    gives decoding's exits and logits, and the steps cover what the third pass left unsettled. ε 1e-5 is
    near this model's KL noise (what makes passes slow), so an order of float arithmetic may move an
    exit (one of 128 on an AVX-512 CPU, as it moves one of the passes' own): the exits must agree with
    token-by-token decoding's but for at most 2%, the logits wherever a window's exits all agree."""
    from recur_core.decoding import fixed_point as fixed_point_module
    model, a1 = context_heavy, ConvergenceExit(1e-5)
    ids = ckpt.windows("eval")[:4]
    B, T = ids.shape[0], ids.shape[1] - 1
    noise = model.seeded_state(range(B), SEED)
    full = fixed_point(model, ids[:, :-1], HaltSchedule(a1, 8), noise=noise, kv_rule=kv_rule)
    assert full.passes >= 4 and full.stepped == 0
    monkeypatch.setattr(fixed_point_module, "STEP_ROWS", 0)
    stepped = fixed_point(model, ids[:, :-1], HaltSchedule(a1, 8), noise=noise, kv_rule=kv_rule)
    assert stepped.passes == 3 and stepped.settled[:3] == full.settled[:3]
    assert 0 < stepped.stepped < T and stepped.settled[-1] == B * T
    ref = teacher_forced(model, ids, a1, kv_rule, seed=SEED, max_loops=8, batch_size=B, mode="decode",
                         keep_logits=True)
    agree = stepped.exits == ref.exit_loop
    assert agree.float().mean() >= 0.98
    same = agree.all(1)
    assert same.any()
    torch.testing.assert_close(stepped.logits[same], ref.logits[same], atol=TOL, rtol=1e-4)


@pytest.mark.parametrize("rows, group", [(1, 1), (60, 2), (90, 3), (512, 4)])
def test_a_replay_reads_out_a_group_of_loops_per_coda_call(context_heavy, windows, rows, group, monkeypatch):
    """A guess's replay reads out several loops in one coda call (their states stacked on the batch):
    as many as READOUT_ROWS token readouts fill (here 30 tokens) and the replay holds (4 loops); every
    group size gives decoding's exits and logits, and counts every loop read."""
    import recur_core.exits.readout as readout_mod
    model, a1 = context_heavy, ConvergenceExit(1e-3)
    ids = windows[:, :-1]
    B, T = ids.shape
    noise = model.seeded_state(range(B), SEED)
    plain = fixed_point(model, ids, HaltSchedule(a1, 8), noise=noise, kv_rule="recompute")
    monkeypatch.setattr(readout_mod, "READOUT_ROWS", rows)
    batches, coda = [], model.coda
    monkeypatch.setattr(model, "coda", lambda state, *a, **k: batches.append(state.shape[0]) or coda(state, *a, **k))
    right = fixed_point(model, ids, HaltSchedule(a1, 8), noise=noise, kv_rule="recompute", guess=plain.exits)
    assert right.passes == 1 and torch.equal(right.exits, plain.exits)
    torch.testing.assert_close(right.logits, plain.logits, atol=TOL, rtol=1e-4)
    assert B * T == 30 and int(plain.exits.max()) == 4
    assert max(batches) == group * B
    assert right.readouts == int(plain.exits.max()) + 1  # every loop up to the last exit, and the exits'


def test_settled_windows_leave_the_batch(context_heavy, ckpt):
    """A window whose every position is settled leaves the batch (later passes run fewer windows),
    and each window's result is what it gets decoded alone."""
    model, a1 = context_heavy, ConvergenceExit(1e-3)
    ids = ckpt.windows("eval")[:6, :24]
    B, T = ids.shape
    noise = model.seeded_state(range(B), SEED)
    batch = fixed_point(model, ids, HaltSchedule(a1, 8), noise=noise, kv_rule="recompute")
    assert batch.rows[0] == B and batch.rows == sorted(batch.rows, reverse=True) and batch.rows[-1] < B
    for b in range(B):
        alone = fixed_point(model, ids[b:b + 1], HaltSchedule(a1, 8), noise=noise[b:b + 1], kv_rule="recompute")
        assert torch.equal(alone.exits[0], batch.exits[b])
        torch.testing.assert_close(alone.logits[0], batch.logits[b], atol=TOL, rtol=1e-4)


def test_decoded_leaves_out_what_follows_each_windows_length(context_heavy, ckpt, monkeypatch):
    """ExactPath.decoded(lengths=...) decodes each window's leading positions only, in batches by
    length: those equal token-by-token decoding of the whole windows, the rest read exit 0, argmax -1."""
    from recur_core.analysis import exact
    monkeypatch.setattr(exact, "DECODE_BATCH", 2)  # three batches, each cut to its longest window
    windows = ckpt.windows("eval")[:5, :20].numpy()
    lengths = np.array([19, 3, 11, 1, 7])
    a1 = ConvergenceExit(1e-3)
    ref = teacher_forced(context_heavy, windows, a1, "recompute", seed=SEED, max_loops=8, mode="decode")
    path = exact.ExactPath(context_heavy, windows)
    exit_loop, argmax = path.decoded(a1, 8, SEED, lengths=lengths)
    inside = np.arange(19)[None, :] < lengths[:, None]
    assert np.array_equal(exit_loop[inside], ref.exit_loop.numpy()[inside])
    assert np.array_equal(argmax[inside], ref.argmax.numpy()[inside])
    assert (exit_loop[~inside] == 0).all() and (argmax[~inside] == -1).all()
    whole, _ = path.decoded(a1, 8, SEED)
    assert np.array_equal(whole, ref.exit_loop.numpy())


def test_settled_prefix_counts_passes_and_the_first_change():
    exits = torch.tensor([[2, 3, 4, 5], [2, 3, 4, 5]])
    before = torch.tensor([[2, 3, 9, 5], [2, 3, 4, 5]])
    assert settled_prefix(exits, None, 1).tolist() == [1, 1]
    assert settled_prefix(exits, before, 2).tolist() == [3, 4]  # row 0 changed at 2: positions 0..2 settled
    assert settled_prefix(exits, before, 9).tolist() == [4, 4]


def test_progress_is_reported_per_pass(ckpt, windows, tiny_families):
    seen = []
    teacher_forced(ckpt, windows[:1], tiny_families["A1"], "latest", seed=SEED, max_loops=8, mode="fixed_point",
                   position_progress=lambda done, total: seen.append((done, total)))
    T = windows.shape[1] - 1
    assert seen and seen[-1] == (T, T) and [d for d, _ in seen] == sorted(d for d, _ in seen)


SHIPPED = sorted(p.name for p in (ROOT / "checkpoints").iterdir() if (p / "meta.json").is_file())


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "hops" else pytest.mark.slow) for n in SHIPPED])
def test_shipped_checkpoints(name):
    """A1 (and Accel and the certified exit, at thresholds that mix exits) on two short windows of every
    shipped checkpoint under its default KV rule: real thresholds (the app's first ε), the fixed point
    equals decoding (hops in the quick suite: there the readout context moves exits, so a pass that
    misjudged what settled fails it). The certified exit's tail δρ/(1 − ρ) turns float32 reordering
    into flipped exits where ρ is near 1 (on `demo`, 1 to 5 of 50 tokens differ between batch 1 and
    batch 2 of decoding itself; on `stories-reasoning` 2 of 50 between decoding and the fixed point on
    a CPU without AVX-512, none on one with it), so it is held to decoding in float64, except on hops,
    where float32 must do."""
    ck = load_checkpoint(ROOT / "checkpoints" / name)
    w = ck.windows("eval")[:2, :26]
    loops = min(ck.recipe.r_max, 16)
    tr = trace(ck, w, loops, SEED)
    for policy in (ConvergenceExit(1e-3), ConvergenceExit(1e-2), Accel(gap_threshold(np.abs(np.diff(tr.state_step, axis=-1))))):
        assert_same(ck, w, policy, None, loops)
    certified = mixed_exits(CertifiedExit, tr, loops)
    if name != "hops":
        ck.model.double()
    assert_same(ck, w, certified, None, loops)


def random_windows(ck, n: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ck.config.vocab_size, (n, length), generator=g)


def test_huginn_fixture_every_rule():
    """Huginn's format: two coda blocks, so a readout rule's context spans layers."""
    ck = load_checkpoint(FIXTURES / "huginn_tiny", dtype="float32")
    w = random_windows(ck, 2, 10, 0)
    fam = families(ck, w, 6)
    for kv_rule in KV_RULES:
        assert_same(ck, w, fam["A1"], kv_rule, 6)
    for name in ("entropy", "argmax", "latent"):
        assert_same(ck, w, fam[name], "latest", 6)


@pytest.mark.parametrize("folder", ["ouro_tiny", "ouro_heldout"])
def test_ouro_fixtures(folder):
    """Ouro's format has no coda: every rule, the gate included, needs one pass."""
    ck = load_checkpoint(FIXTURES / folder, dtype="float32")
    w = random_windows(ck, 2, 12, 1)
    steps = ck.recipe.depth
    tr = trace(ck, w, steps, SEED)
    for policy in (GateExit.of_checkpoint(ck, 0.5), ConvergenceExit(gap_threshold(tr.kl_prev[..., 1:])),
                   LatentDiff(gap_threshold(tr.state_change))):
        for kv_rule in KV_RULES:
            got = assert_same(ck, w, policy, kv_rule, steps)
            assert got.passes == [1]
        assert exact_mode(ck.model, policy, 64) == "fixed_point"  # one pass is exact: no lockstep


def test_bad_windows_are_refused_before_any_work(ckpt):
    a1 = ConvergenceExit(1e-3)
    too_long = torch.zeros(1, ckpt.config.max_seq_len + 2, dtype=torch.long)
    with pytest.raises(ValueError, match="exceed the context"):
        teacher_forced(ckpt, too_long, a1, mode="fixed_point")
    for bad in (torch.zeros(2, 1, dtype=torch.long), torch.zeros(5, dtype=torch.long)):
        with pytest.raises(ValueError, match="at least 2 tokens"):
            teacher_forced(ckpt, bad, a1, mode="fixed_point")
    with pytest.raises(ValueError, match="mode must be one of"):
        teacher_forced(ckpt, torch.zeros(1, 4, dtype=torch.long), a1, mode="parallel")


def test_bench_fixed_point_compares_the_engines_on_the_specimen(capsys):
    from bench.bench_fixed_point import main
    out = main(["--targets", "specimen", "--windows", "2", "--tokens", "9", "--passes-only"])
    row = out["rows"][0]
    assert (row["windows"], row["tokens"]) == (2, 9) and row["exits_identical"] and row["seeded_exits_identical"]
    assert row["passes_only_passes"] == row["passes"] and all(1 <= p <= 9 for p in row["passes"])
    assert "passes only" in capsys.readouterr().out


def test_decoded_picks_the_cheaper_exact_mode_and_keys_results_by_it(context_heavy, ckpt, tmp_path, monkeypatch):
    """ExactPath.decoded runs LOCKSTEP_MIN_BATCH windows or more of a small model on a CPU token by token in
    lockstep (the reference itself), fewer by the fixed point; both equal token-by-token decoding, and
    the disk cache keeps them apart (at float-noise thresholds their order of arithmetic can differ)."""
    from recur_core.analysis import exact
    from recur_core.analysis.cache import TraceCache
    from recur_core.decoding import teacher_forced as tf
    a1 = ConvergenceExit(1e-3)
    assert tf.exact_mode(context_heavy, a1, tf.LOCKSTEP_MIN_BATCH) == "decode"
    assert tf.exact_mode(context_heavy, a1, tf.LOCKSTEP_MIN_BATCH - 1) == "fixed_point"
    assert tf.exact_mode(context_heavy, LatentDiff(0.1), 64) == "fixed_point"  # one pass is exact
    monkeypatch.setattr(tf, "LOCKSTEP_MAX_PARAMS", 1000)  # a model over the limit: passes, whatever the batch
    assert tf.exact_mode(context_heavy, a1, 64) == "fixed_point"
    monkeypatch.undo()

    eval_windows = ckpt.windows("eval")[:, :13].numpy()
    windows = np.resize(eval_windows, (tf.LOCKSTEP_MIN_BATCH, 13))  # enough rows for lockstep
    ref = teacher_forced(context_heavy, windows, a1, "recompute", seed=SEED, max_loops=8, mode="decode")
    modes = []
    real = exact.teacher_forced
    monkeypatch.setattr(exact, "teacher_forced", lambda *a, **kw: modes.append(kw["mode"]) or real(*a, **kw))
    cache = TraceCache(tmp_path)
    lockstep, _ = exact.ExactPath(context_heavy, windows, cache=cache).decoded(a1, 8, SEED)
    assert set(modes) == {"decode"} and np.array_equal(lockstep, ref.exit_loop.numpy())
    monkeypatch.setattr(tf, "LOCKSTEP_MIN_BATCH", tf.LOCKSTEP_MIN_BATCH + 1)  # now the fixed point's turn
    modes.clear()
    passes, _ = exact.ExactPath(context_heavy, windows, cache=cache).decoded(a1, 8, SEED)
    assert set(modes) == {"fixed_point"}, "a lockstep result in the cache must not answer for the fixed point"
    assert np.array_equal(passes, ref.exit_loop.numpy())
