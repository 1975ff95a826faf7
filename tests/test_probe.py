import numpy as np
import pytest
import torch

from recur_core import load_checkpoint
from recur_core.analysis.cache import TraceCache
from recur_core.analysis.probe import (
    Harvest,
    Probe,
    ProbeSpec,
    auc,
    fit_logistic,
    harvest,
    load_or_train_probes,
    split_windows,
    train_probe,
)
from recur_core.exits.policies import LinearRouter
from recur_core.exits.signals import LoopSignals


def separable_harvest(n_windows=40, per_window=50, d=6, seed=0) -> Harvest:
    """States whose label is a known linear rule: changes iff 2 s_0 - s_3 + 0.3 * loop > 1."""
    rng = np.random.default_rng(seed)
    M = n_windows * per_window
    state = rng.normal(size=(M, d)).astype(np.float32)
    loop = rng.integers(1, 8, size=(M, 1)).astype(np.float32)
    rule = 2 * state[:, 0] - state[:, 3] + 0.3 * loop[:, 0] > 1
    kl = np.where(rule, 0.0, 1.0)  # KL labels (>= 1e-3) are the complement here
    return Harvest(np.hstack([state, loop]), np.repeat(np.arange(n_windows), per_window), rule, rule, kl, kl, 1e-3)


def test_probe_finds_a_separable_rule():
    data = separable_harvest()
    probe = train_probe(data, "argmax", l2=1e-4)
    held = probe.metrics["heldout"]
    assert held["accuracy"] > 0.97 and held["auc"] > 0.995
    assert probe.metrics["n_heldout_windows"] == 10 and probe.metrics["n_train_windows"] == 30
    w = (probe.weight / probe.std).numpy()  # the rule's direction in raw feature units
    true = np.array([2, 0, 0, -1, 0, 0, 0.3])
    assert np.dot(w, true) / np.linalg.norm(w) / np.linalg.norm(true) > 0.95
    flipped = train_probe(data, "kl", l2=1e-4)  # the other label kind is the complement here
    assert flipped.metrics["heldout"]["accuracy"] > 0.97
    assert np.dot((flipped.weight / flipped.std).numpy(), true) < 0


def test_router_halts_where_the_probe_predicts_no_change():
    probe = train_probe(separable_harvest(), "argmax", l2=1e-4)
    state = torch.zeros(1, 2, 6)
    state[0, 0, 0], state[0, 1, 0] = 3.0, -3.0  # token 0 will change, token 1 will not
    signals = LoopSignals(state=state, state_change=torch.zeros(1, 2))
    assert LinearRouter(probe, 0.5).halt(2, signals).tolist() == [[False, True]]
    chance = probe.chance(state, 2)
    assert chance[0, 0] > 0.99 and chance[0, 1] < 0.01


def test_fit_logistic_standardises_and_regularises():
    x = np.array([[0.0], [1.0], [2.0], [3.0]]) * 1000 + 5000
    y = np.array([0, 0, 1, 1])
    w, b, mean, std = fit_logistic(x, y, l2=1.0)
    assert mean.item() == pytest.approx(6500) and std.item() > 0
    assert 0 < w.item() < 5  # strong L2 keeps it finite on separable data


def test_auc():
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auc(np.array([0.5, 0.5]), np.array([0, 1])) == pytest.approx(0.5)
    assert np.isnan(auc(np.array([0.1, 0.2]), np.array([1, 1])))


def test_split_is_by_whole_windows():
    window = np.repeat(np.arange(8), 5)
    held = split_windows(window, 0.25, seed=0)
    assert set(window[held]).isdisjoint(window[~held])
    assert len(set(window[held])) == 2


def test_harvest_and_cached_probes(tiny_ckpt, tmp_path):
    ckpt = load_checkpoint(tiny_ckpt)
    data = harvest(ckpt, ckpt.windows("probe")[:3], max_loops=4, tokens_per_window=5, label_eps=1e-6)
    d = ckpt.config.d_model
    assert data.features.shape == (3 * 5 * 3, d + 1)
    assert sorted(set(data.features[:, -1])) == [1.0, 2.0, 3.0]
    assert len(data.window) == len(data.changed_argmax) == len(data.kl_next)
    assert data.trace.kl_prev.shape == (3, ckpt.windows("probe").shape[1] - 1, 4)

    store = TraceCache(tmp_path)
    kwargs = dict(cache=store)
    probes = load_or_train_probes(ckpt, 4, 0, ProbeSpec(n_windows=4, tokens_per_window=6), **kwargs)
    assert set(probes) == {"argmax", "kl", "argmax_any", "kl_any"}
    files = sorted((tmp_path / ckpt.checkpoint_id / "probes").glob("*.safetensors"))
    assert len(files) == 4
    again = load_or_train_probes(ckpt, 4, 0, ProbeSpec(n_windows=4, tokens_per_window=6), **kwargs)
    assert again["kl"].probe_id == probes["kl"].probe_id
    torch.testing.assert_close(again["kl"].weight, probes["kl"].weight)

    files[0].write_bytes(files[0].read_bytes()[:-10])  # truncate one probe: it is retrained, not returned
    with pytest.warns(UserWarning, match="corrupt probe file"):
        rebuilt = load_or_train_probes(ckpt, 4, 0, ProbeSpec(n_windows=4, tokens_per_window=6), **kwargs)
    assert {p.probe_id for p in rebuilt.values()} == {p.probe_id for p in probes.values()}


def test_probe_save_load_roundtrip(tmp_path):
    probe = train_probe(separable_harvest(), "kl")
    probe.save(tmp_path / "p.safetensors", key="k")
    loaded = Probe.load(tmp_path / "p.safetensors", key="k")
    assert loaded.probe_id == probe.probe_id and loaded.metrics == probe.metrics
    state = torch.randn(2, 3, 6)
    torch.testing.assert_close(loaded.chance(state, 4), probe.chance(state, 4))


def test_kl_labels_follow_label_eps_at_both_horizons():
    """One token over 5 loops with KL(p_i || p_(i-1)) = 9, .5, .001, .2, .0001: samples at loops 1..4."""
    kl_next = np.array([0.5, 0.001, 0.2, 0.0001])
    kl_later = np.array([0.5, 0.2, 0.2, 0.0001])
    data = Harvest(np.zeros((4, 2), np.float32), np.zeros(4, int), np.zeros(4, bool), np.zeros(4, bool),
                   kl_next, kl_later, 0.01)
    assert data.labels("kl").tolist() == [True, False, True, False]
    assert data.labels("kl_any").tolist() == [True, True, True, False]  # loop 2: KL 0.2 at loop 4 is later
    data.label_eps = 0.3
    assert data.labels("kl_any").tolist() == [True, False, False, False]
    with pytest.raises(ValueError):
        data.labels("entropy")


def test_harvested_any_later_labels_follow_the_trace(ckpt):
    data = harvest(ckpt, ckpt.windows("probe")[:2], max_loops=5, tokens_per_window=4, label_eps=1e-4)
    tr = data.trace
    positions = _positions_of(data, tr, ckpt)
    for m, (w, t, i) in enumerate(positions):
        seq = tr.argmax[w, t]
        assert data.changed_argmax[m] == (seq[i] != seq[i - 1])
        assert data.changed_argmax_any[m] == (seq[i:] != seq[i - 1]).any()
        assert data.kl_later_max[m] == pytest.approx(tr.kl_prev[w, t, i:].max())
    # the any-later label is a superset of the next-loop one
    assert (data.labels("argmax_any") >= data.labels("argmax")).all()
    assert (data.labels("kl_any") >= data.labels("kl")).all()


def _positions_of(data, tr, ckpt):
    """(window, position, loop) of every harvested sample, recovered from the sampling seed."""
    from recur_core.analysis.probe import _sample_positions
    pos = _sample_positions(tr.n_windows, tr.seq_len, 4, 0).numpy()
    return [(w, t, i) for w in range(tr.n_windows) for t in pos[w] for i in range(1, tr.max_loops)]


def test_kl_label_eps_is_tied_to_a1s_matched_eps(ckpt, tmp_path):
    from recur_core.analysis.curves import fast_sums
    from recur_core.analysis.probe import a1_matched_eps
    from recur_core.exits.policies import ConvergenceExit, Uniform
    probes = load_or_train_probes(ckpt, 4, 0, ProbeSpec(r_bar=2, n_windows=4, tokens_per_window=6), cache=TraceCache(tmp_path))
    data = harvest(ckpt, ckpt.windows("probe")[:4], max_loops=4, tokens_per_window=6)
    eps = a1_matched_eps(data.trace, 2, 4)
    target = fast_sums(data.trace, Uniform(2)).mean_loss
    expected = 1e-3 if eps is None else eps
    if eps is not None:
        assert fast_sums(data.trace, ConvergenceExit(eps, r_max=4)).mean_loss <= target
    for kind in ("kl", "kl_any"):  # a kind whose labels are then all of one class is refused, saying so
        if kind in probes.refused:
            assert f"label ε {expected:.3g} nats" in probes.refused[kind]
        else:
            assert probes[kind].label_eps == expected
            assert ("matched" if eps is not None else "fallback") in probes[kind].metrics["label_eps_rule"]
    fixed = load_or_train_probes(ckpt, 4, 0, ProbeSpec(label_eps=0.05, n_windows=4, tokens_per_window=6), cache=False)
    assert fixed["kl"].label_eps == 0.05 if "kl" in fixed else "label ε 0.05 nats" in fixed.refused["kl"]


def test_single_class_labels_are_refused_with_a_message(ckpt):
    from recur_core.analysis.probe import SingleClassLabels
    data = separable_harvest()
    data.label_eps = 5.0  # above every KL of the harvest: every KL label is negative
    with pytest.raises(SingleClassLabels, match=r"'kl': all \d+ training labels are negative \(label ε 5 nats "
                                                r"is above every KL\)"):
        train_probe(data, "kl")
    train_probe(data, "argmax")  # two classes: fitted
    with pytest.warns(UserWarning, match="a probe fit to one class is a constant"):
        probes = load_or_train_probes(ckpt, 4, 0, ProbeSpec(label_eps=1e9, n_windows=4, tokens_per_window=6), cache=False)
    assert set(probes) == {"argmax", "argmax_any"} and set(probes.refused) == {"kl", "kl_any"}
    assert "all" in probes.refused["kl"] and "negative" in probes.refused["kl"]


def test_label_eps_matched_on_answer_accuracy_where_there_is_ground_truth(ckpt):
    """With answer tokens given, A1's matched ε is the cheapest whose answer accuracy is within 1
    point of A0's at r_bar, not the one whose all-token loss reaches A0's."""
    from recur_core.analysis.curves import EPS_GRID
    from recur_core.analysis.ground_truth import TOLERANCE, correct_at
    from recur_core.analysis.probe import a1_matched_eps
    from recur_core.exits.policies import ConvergenceExit, Uniform
    tr = harvest(ckpt, ckpt.windows("probe")[:4], max_loops=4, tokens_per_window=6).trace
    answers = np.zeros(tr.targets.shape, dtype=bool)
    answers[:, ::3] = True
    accuracy = lambda p: correct_at(tr, p.exit_depth(tr))[answers].mean()  # noqa: E731
    target = accuracy(Uniform(2)) - TOLERANCE
    eps = a1_matched_eps(tr, 2, 4, answers)
    meets = [e for e in EPS_GRID if 0 < e < np.inf and accuracy(ConvergenceExit(e, r_max=4)) >= target]
    cost = lambda e: (ConvergenceExit(e, r_max=4).exit_depth(tr).mean(), e)  # noqa: E731
    assert eps == (min(meets, key=cost) if meets else None)
