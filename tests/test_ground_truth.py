"""recur_core.analysis.ground_truth: rank correlation, and the report's ground_truth section on a tiny model
trained for seconds on multi-hop programs (present only for checkpoints with ground truth)."""
import json

import numpy as np
import pytest
import torch

from recur_core import load_checkpoint
from recur_core.analysis.ground_truth import load_ground_truth, spearman, spearman_ci
from recur_core.analysis.stats import Bootstrap
from recur_core.model.checkpoint import read_safetensors
from recur_core.report.hops_card import beside_section, goals, learned_line

ANALYZE_ARGS = ["--windows", "12", "--max-loops", "6", "--n-boot", "40", "--probe-windows", "8",
                "--probe-tokens", "16", "--no-cache", "--batch-size", "12"]


def test_spearman_matches_pearson_of_ranks_with_ties():
    x = np.array([1, 2, 2, 3, 5, 4])
    y = np.array([1, 1, 2, 3, 3, 6])
    rx = np.array([1, 2.5, 2.5, 4, 6, 5])
    ry = np.array([1.5, 1.5, 3, 4.5, 4.5, 6])
    assert spearman(x, y) == pytest.approx(np.corrcoef(rx, ry)[0, 1])
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert np.isnan(spearman(x, np.ones_like(x)))


def test_spearman_ci_is_spearman_of_every_resampled_set_of_programs():
    """The bootstrap of Spearman(exit, hops) from count tables equals resampling the programs' answer
    tokens and ranking them (ties, programs without answers and constant replicates included)."""
    rng = np.random.default_rng(0)
    depth = rng.integers(1, 9, size=(7, 12))
    ah = np.where(rng.random((7, 12)) < 0.4, rng.integers(1, 5, size=(7, 12)), 0)
    ah[3] = 0  # a program without answers
    ah[5] = np.where(ah[5] > 0, 2, 0)
    boot = Bootstrap(7, n_boot=60, seed=1)
    got = spearman_ci(depth, ah, boot)
    reps = []
    for counts in boot.weights.astype(int):
        rows = np.repeat(np.arange(7), counts)
        x = np.concatenate([depth[w][ah[w] > 0] for w in rows])
        y = np.concatenate([ah[w][ah[w] > 0] for w in rows])
        reps.append(spearman(x, y))
    reps = np.array(reps)
    assert got["value"] == pytest.approx(reps[0], abs=1e-12)
    finite = reps[1:][~np.isnan(reps[1:])]
    assert np.quantile(finite, 0.025) == pytest.approx(got["ci_low"], abs=1e-12)
    assert np.quantile(finite, 0.975) == pytest.approx(got["ci_high"], abs=1e-12)
    only_five = spearman_ci(depth, np.where(np.arange(7)[:, None] == 5, ah, 0), boot)  # one hop count
    assert np.isnan(only_five["value"]) and np.isnan(only_five["ci_low"])


@pytest.mark.slow
def test_analyze_adds_the_ground_truth_section(hops_ckpt, tmp_path):
    from recur_core.analyze import main
    report = main([str(hops_ckpt), "--out", str(tmp_path), *ANALYZE_ARGS])
    gt = json.loads((tmp_path / "report.json").read_text())["ground_truth"]
    assert gt == report["ground_truth"]
    hops, max_train = load_ground_truth(hops_ckpt)
    answer_hops = hops[:12, 1:]
    assert gt["max_train_hops"] == max_train == 3
    assert gt["hop_counts"] == sorted(set(answer_hops[answer_hops > 0].tolist()))
    assert gt["n_answers"] == int((answer_hops > 0).sum())
    assert gt["uniform"]["loops"] == list(range(1, 7))
    for h in gt["hop_counts"]:
        accs = gt["uniform"]["accuracy_by_hops"][str(h)]
        assert len(accs) == 6 and all(0 <= a <= 1 for a in accs)
    assert gt["path"] == "exact" and report["ground_truth_fast"]["path"] == "fast"
    kinds = {k for k in gt["policies"] if k.startswith("A2_")} | {f"A2_{k}" for k in report["allocation"]["probes_refused"]}
    assert kinds == {"A2_argmax", "A2_kl", "A2_argmax_any", "A2_kl_any"}
    assert {"A1", "latent", "huginn_kl", "huginn_entropy", "huginn_cosine", "huginn_argmax", "Accel"} <= set(gt["policies"])
    assert gt["policies"]["Accel"]["evaluated_by"] == "harness"  # a state rule: its walk runs in the harness
    certified = gt["policies"]["Certified"]  # at the measured L alone, decoded once (a readout rule)
    assert certified["threshold"] == report["certified_lipschitz"]["lipschitz"] and len(certified["curve"]) == 1
    assert certified["evaluated_by"] == "decoding" and "fast_point" in certified
    fast = report["ground_truth_fast"]
    assert set(fast["policies"]) == set(gt["policies"]) == set(fast["fast_minus_exact"])
    for name, gap in fast["fast_minus_exact"].items():
        assert gap["mean_loops"] == pytest.approx(fast["policies"][name]["mean_loops"] - gt["policies"][name]["mean_loops"])
    assert fast["uniform"] == gt["uniform"]  # uniform depth: the same on both paths
    for pol in gt["policies"].values():
        assert {"threshold", "answer_accuracy", "mean_loops", "exit_depth_by_hops", "spearman_exit_vs_hops",
                "vs_a0_rbar_loops_ratio", "vs_best_uniform_loops_ratio", "accuracy_by_hops", "curve"} <= set(pol)
        sp = pol["spearman_exit_vs_hops"]
        assert set(sp) == {"value", "ci_low", "ci_high"}
        assert 1 <= pol["mean_loops"] <= 6
        if pol["matches_a0_rbar"]:
            assert pol["answer_accuracy"] >= gt["target_accuracy"]
    assert set(gt["extrapolation"]) == {"4"}  # the eval programs' one hop count past training
    # every documented ground_truth key is in the report (docs/REPORT_KEYS.md)
    import test_analysis_cli as cli
    keys = [k for k in cli.documented_keys() if k.startswith("ground_truth")]
    assert len(keys) > 25
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "PLACEHOLDERS", {"<policy>": ["A1", "latent", "huginn_argmax"],
                                         "<h>": [str(h) for h in gt["hop_counts"]],
                                         "<unseen>": [str(h) for h in gt["hop_counts"] if h > max_train]})
        for key in keys:
            cli.check_path(report, key.split("."), "")
    # and the converse: every key the sections hold is documented (ground_truth_fast: "the same keys" plus
    # fast_minus_exact.<policy>'s five, as docs/REPORT_KEYS.md says in words)
    fast = {k: v for k, v in report["ground_truth_fast"].items() if k != "fast_minus_exact"}
    for section in (report["ground_truth"], fast):
        missing = cli.undocumented({"ground_truth": section})
        assert not missing, sorted(missing)
    assert {k for gap in report["ground_truth_fast"]["fast_minus_exact"].values() for k in gap} == {
        "mean_loops", "answer_accuracy", "spearman", "threshold_fast", "threshold_exact"}
    best = gt["best_uniform_depth"]
    assert gt["uniform"]["answer_accuracy"][best - 1] >= gt["target_accuracy"]
    assert all(a < gt["target_accuracy"] for a in gt["uniform"]["answer_accuracy"][:best - 1])
    # the target is on the trained hop counts only: extrapolation answers do not move it
    trained = (answer_hops > 0) & (answer_hops <= max_train)
    assert gt["n_trained_answers"] == int(trained.sum()) < gt["n_answers"]


EXACT_EPS, EXACT_LOOPS, EXACT_SEED = (0.0, 1e-3, 0.05, float("inf")), 5, 3


@pytest.fixture(scope="module")
def exact_gt(hops_ckpt):
    """(ckpt, windows, trace, exact ground_truth section) of 6 programs, 5 loops."""
    from recur_core import load_checkpoint
    from recur_core.analysis.exact import ExactPath
    from recur_core.analysis.ground_truth import Labels, ground_truth_section, operating_point_families
    from recur_core.analysis.stats import Bootstrap
    from recur_core.analysis.trace import trace
    ckpt = load_checkpoint(hops_ckpt)
    windows = ckpt.windows("eval")[:6].numpy()
    tr = trace(ckpt, windows, EXACT_LOOPS, seed=EXACT_SEED, cache=False)
    families = operating_point_families(EXACT_LOOPS, None, EXACT_EPS, ())
    gt = ground_truth_section(tr, Labels.of(ckpt), EXACT_LOOPS, 3, Bootstrap(6, 20), families, ExactPath(ckpt, windows))
    return ckpt, windows, tr, gt


def _masks(ckpt, tr, hops_ckpt):
    from recur_core.analysis.ground_truth import answer_hops, eos_id, program_mask
    hops, max_train = load_ground_truth(hops_ckpt)
    ah = answer_hops(tr, hops)
    return (ah > 0) & (ah <= max_train), program_mask(tr, eos_id(ckpt.tokenizer()))


@pytest.mark.slow
def test_exact_ground_truth_walks_find_the_full_grids_operating_point(exact_gt, hops_ckpt):
    """Every state rule's threshold, run alone in a full-width masking harness (test_harness.naive_exact):
    each point of the family's curve (the thresholds its walk evaluated) equals that run, and the walk's
    operating point is the cheapest threshold of the whole grid that meets the target."""
    from test_harness import naive_exact

    from recur_core.analysis.ground_truth import _cheapest_meeting, operating_point_families
    ckpt, windows, tr, gt = exact_gt
    assert gt["path"] == "exact"
    trained, program = _masks(ckpt, tr, hops_ckpt)
    for name, family in operating_point_families(EXACT_LOOPS, None, EXACT_EPS, ()).items():
        if family[0].needs_readout:  # a readout rule's curve is what decoding got (the next test)
            continue
        grid = []
        for policy in family:
            _, depth, _, argmax = naive_exact(ckpt.model, windows, policy.private(), EXACT_LOOPS, seed=EXACT_SEED)
            grid.append({"threshold": policy.threshold, "mean_loops": float(depth[program].mean()),
                         "answer_accuracy": float((argmax == tr.targets)[trained].mean())})
        pol = gt["policies"][name]
        for point in pol["curve"]:
            naive = next(g for g in grid if g["threshold"] == point["threshold"])
            assert point["mean_loops"] == pytest.approx(naive["mean_loops"]), name
            assert point["answer_accuracy"] == pytest.approx(naive["answer_accuracy"]), name
        at, matched = _cheapest_meeting(grid, gt["target_accuracy"])
        assert (pol["threshold"], pol["matches_a0_rbar"]) == (grid[at]["threshold"], matched), name


def test_exact_operating_points_are_what_decoding_gets(exact_gt, hops_ckpt):
    """Every family's operating point comes from a walk from the fast path's point, and every point of its
    curve is what teacher-forced decoding ("recompute") gets: readout rules' points are decoded, state
    rules' run in the harness, whose exits equal decoding's for them."""
    _assert_points_are_decodings(*exact_gt, hops_ckpt, readout_by="decoding")


def test_without_a_coda_every_rule_walks_in_the_harness_and_gets_what_decoding_gets(tmp_path):
    """On a model without a coda a readout reads the token's own state alone, so the masking harness is
    exact for the readout rules too: every family walks there, and every point is what decoding gets."""
    from tiny import make_tiny_hops_checkpoint

    from recur_core.analysis.exact import ExactPath
    from recur_core.analysis.ground_truth import Labels, ground_truth_section, operating_point_families
    from recur_core.analysis.trace import trace
    path = make_tiny_hops_checkpoint(tmp_path, steps=20, n_coda="0")
    ckpt = load_checkpoint(path)
    assert len(ckpt.model.coda_blocks) == 0
    windows = ckpt.windows("eval")[:6].numpy()
    tr = trace(ckpt, windows, EXACT_LOOPS, seed=EXACT_SEED, cache=False)
    families = operating_point_families(EXACT_LOOPS, None, EXACT_EPS, ())
    gt = ground_truth_section(tr, Labels.of(ckpt), EXACT_LOOPS, 3, Bootstrap(6, 20), families, ExactPath(ckpt, windows))
    _assert_points_are_decodings(ckpt, windows, tr, gt, path, readout_by="harness")


def _assert_points_are_decodings(ckpt, windows, tr, gt, path, readout_by: str):
    from recur_core.analysis.ground_truth import Labels, ground_truth_section, operating_point_families
    from recur_core.analysis.stats import Bootstrap
    from recur_core.decoding.teacher_forced import teacher_forced
    gt_fast = ground_truth_section(tr, Labels.of(ckpt), EXACT_LOOPS, 3, Bootstrap(6, 20),
                                   operating_point_families(EXACT_LOOPS, None, EXACT_EPS, ()))
    trained, program = _masks(ckpt, tr, path)
    decode = lambda policy: teacher_forced(ckpt, windows, policy.private(), "recompute", seed=EXACT_SEED,  # noqa: E731
                                           max_loops=EXACT_LOOPS)
    for name, family in operating_point_families(EXACT_LOOPS, None, EXACT_EPS, ()).items():
        pol = gt["policies"][name]
        policy = next(p for p in family if p.threshold == pol["threshold"])
        out = decode(policy)
        assert pol["evaluated_by"] == (readout_by if policy.needs_readout else "harness"), name
        assert pol["mean_loops"] == pytest.approx(float(out.exit_loop.numpy()[program].mean())), name
        correct = out.argmax.numpy() == tr.targets
        assert pol["answer_accuracy"] == pytest.approx(float(correct[trained].mean())), name
        decoded = pol["curve"]  # the thresholds the walk evaluated, each what decoding gets
        fast_op = gt_fast["policies"][name]
        assert pol["fast_point"] == {k: fast_op[k] for k in ("threshold", "mean_loops", "answer_accuracy")}
        assert pol["fast_point"]["threshold"] in [p["threshold"] for p in decoded]  # the walk's start
        assert any(p["threshold"] == pol["threshold"] for p in decoded)
        for point in decoded:
            got = decode(next(p for p in family if p.threshold == point["threshold"]))
            assert point["mean_loops"] == pytest.approx(float(got.exit_loop.numpy()[program].mean())), name
            assert point["answer_accuracy"] == pytest.approx(float((got.argmax.numpy() == tr.targets)[trained].mean()))
        if pol["matches_a0_rbar"]:  # no decoded point that meets the target is cheaper
            assert pol["answer_accuracy"] >= gt["target_accuracy"]
            assert all(p["mean_loops"] >= pol["mean_loops"] for p in decoded
                       if p["answer_accuracy"] >= gt["target_accuracy"])


def test_checkpoints_without_ground_truth_have_no_section(tiny_ckpt, tmp_path):
    from recur_core.analyze import main
    assert load_ground_truth(tiny_ckpt) is None
    report = main([str(tiny_ckpt), "--out", str(tmp_path), *ANALYZE_ARGS])
    assert "ground_truth" not in report


@pytest.mark.slow
def test_export_writes_the_hops_card(hops_ckpt, tmp_path):
    from recur_core.report.export import export
    dst = tmp_path / "shipped"
    out = export(hops_ckpt, dst, command="python -m training.run hops", machine="a test")
    readme = (dst / "README.md").read_text()
    card = json.loads((dst / "card.json").read_text())
    strict = lambda text: json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert strict((dst / "meta.json").read_text())["epochs"] is None  # an infinite stream has no epochs
    assert (dst / "ground_truth.safetensors").is_file() and load_ground_truth(dst) is not None
    assert "Answer accuracy (%) per hop count × uniform loops" in readme and "(unseen)" in readme
    assert "python -m training.run hops" in readme
    assert [g["met"] for g in out["goals"]] == [g["met"] for g in card["goals"]] and len(card["goals"]) == 4
    gt = card["ground_truth"]
    assert gt["max_train_hops"] == 3 and gt["n_programs"] == 128 and gt["uniform"]["loops"][-1] == 32
    # the verdicts are judged on the exact section; the fast one stands beside it in the table
    assert gt["path"] == "exact" and gt["fast"]["path"] == "fast"
    assert [g["met"] for g in card["goals"]] == [ok for _, _, ok in goals(gt)]
    assert "Exit policies against the hop counts (exact" in readme and "fast path: loops, acc., Spearman" in readme
    assert load_ground_truth(dst) is not None and "probe_hops" in read_safetensors(dst / "ground_truth.safetensors")
    for h in gt["hop_counts"]:  # every row of the table is printed from card.json's numbers
        row = "| " + str(h) + (" (unseen)" if h > 3 else "") + f" | {gt['n_answers_by_hops'][str(h)]} | "
        assert row in readme
    # a goal's verdict follows from the measured numbers
    rb = gt["r_bar"]
    lowest = min(gt["uniform"]["accuracy_by_hops"][str(h)][rb - 1] for h in gt["hop_counts"] if h <= 3)
    assert card["goals"][0]["met"] == (lowest >= 0.95)
    # a per-token-depth checkpoint is also judged on issue 27's bound (0.4x), from the same best policy
    assert gt["depth_mode"] == "per_step"
    per_token = goals({**gt, "depth_mode": "per_token"})
    assert len(per_token) == 5 and per_token[4][1] == per_token[3][1] and "0.4×" in per_token[4][0]
    assert per_token[4][2] <= per_token[3][2]  # within 0.4x implies within 0.5x
    # the side-by-side section prints both checkpoints' numbers from their card.json
    other = json.loads(json.dumps(gt))
    other["policies"]["A1"]["mean_loops"] = 9.87
    other["uniform"]["accuracy_by_hops"]["1"][0] = 0.125
    text = beside_section("mine", gt, "theirs", other, same_programs=True)
    assert "## Beside `theirs`" in text and "the same 128 eval programs" in text
    assert f"| A1 | {gt['policies']['A1']['mean_loops']:.2f} / 9.87 |" in text
    assert f"| 1 | {100 * gt['uniform']['accuracy_by_hops']['1'][0]:.0f} / 12 |" in text
    assert "**different** eval programs" in beside_section("mine", gt, "theirs", other, same_programs=False)


def test_card_status_names_the_hop_counts_learned():
    acc = {"1": [0.99, 1.0], "2": [0.2, 0.3], "3": [0.1, None], "4": [0.5, 0.5]}
    gt = {"hop_counts": [1, 2, 3, 4], "max_train_hops": 3, "uniform": {"accuracy_by_hops": acc}}
    assert learned_line(gt) == ("**Hop counts learned (>= 90% at some uniform depth): 1**; the others, with "
                                "their best accuracy at any depth: 2: 30%, 3: 10%.")  # 4 is past training
    acc.update({"2": [0.95, 0.9], "3": [0.2, 0.91]})
    assert learned_line(gt).startswith("Every trained hop count reaches 90%")


def test_bench_decode_on_a_hops_checkpoint_matches_on_answer_accuracy(hops_ckpt, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "RECUR_CACHE_DIR": str(tmp_path / "cache")}  # the A2 probe is cached there
    out = subprocess.run([sys.executable, "-m", "bench.bench_decode", "--ckpt", str(hops_ckpt),
                          "--windows", "8", "--prompts", "2", "--repeats", "1", "--max-loops", "3"],
                         capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "answer accuracy" in out.stdout and "best uniform" in out.stdout
    # with the loop cap at r_bar (3), A1's smallest eps runs every loop: A0@r_bar itself, so it matches
    assert result["matched"]["A1"] and set(result["accuracy_uniform"]) == {"1", "2", "3"}
    best, depth = result["best_policy"], result["best_uniform_depth"]
    # the baseline is the smallest uniform depth within 1 point of the best policy's accuracy
    reach = [int(r) for r, a in result["accuracy_uniform"].items() if a >= result["accuracy"][best] - 0.01]
    assert depth == min(reach)
    for key in ("realized_speedup_vs_best_uniform", "realized_speedup_vs_a0_rbar",
                "flop_proxy_speedup_vs_best_uniform", "flop_proxy_speedup_vs_a0_rbar"):
        assert result[key] > 0, key


def test_bench_serve_on_a_hops_checkpoint_matches_on_answer_accuracy(hops_ckpt, tmp_path):
    """The pool benchmark calibrates on answer accuracy where a checkpoint has ground truth, and its
    default lengths fit the short context (prompt + new tokens - 1 <= max_seq_len)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from recur_core import load_checkpoint
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "RECUR_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "bench.bench_serve", "--ckpt", str(hops_ckpt),
                          "--requests", "3", "--pools", "1,2", "--windows", "6", "--bisect", "1", "--max-loops", "3",
                          "--no-a2"], capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["calibration_metric"] == "answer_accuracy" and "answer acc" in out.stdout
    rows = result["pools"]["1"]
    a0 = next(v for k, v in rows.items() if k.startswith(f"A0@{result['r_bar']}") and "best" not in k)
    assert result["target"] == a0["tf_score"] - 0.01
    best = next(v for k, v in rows.items() if "best uniform" in k)
    assert best["tf_score"] >= result["target"]
    max_len = load_checkpoint(hops_ckpt).config.max_seq_len
    assert result["prompt_len"] + result["new_tokens"] - 1 == max_len


def test_exact_ground_truth_predicts_teacher_forced_decoding(hops_ckpt):
    """bench.exact_vs_decoding: decoding token by token under the "recompute" KV rule at each family's
    exact operating point gives the exact ground truth's mean loops and answer accuracy; the latent
    rule's harness exits equal decoding's token for token (a state-based rule)."""
    from bench.exact_vs_decoding import main
    result = main([str(hops_ckpt), "--windows", "8", "--max-loops", "5"])
    assert result["policies"]["latent"]["recompute_exits_equal_harness"] == 1.0
    assert result["policies"]["A1"]["evaluated_by"] == "decoding"
    for row in result["policies"].values():
        assert row["recompute"]["mean_loops"] == pytest.approx(row["exact"]["mean_loops"])
        assert row["recompute"]["answer_accuracy"] == pytest.approx(row["exact"]["answer_accuracy"])
        assert set(row["latest_minus_exact"]) == {"mean_loops", "answer_accuracy"}
        assert 0 <= row["recompute_exits_equal_harness"] <= 1


def walk_on(accuracy: list[float], target: float, kind=None):
    """A decoding walk (`kind`: _DecodingWalk or a subclass) over thresholds whose answer accuracy is
    given, in that order, with no model: evaluating one records it as decoded."""
    from recur_core.analysis.ground_truth import Outcome, _DecodingWalk

    class Given(kind or _DecodingWalk):
        def __init__(self):
            self.order, self.done, self.target = list(range(len(accuracy))), {}, target

        def evaluate(self, i):
            self.done.setdefault(i, (Outcome(np.zeros(1), np.zeros(1, bool)), {"answer_accuracy": accuracy[i]}))
            return self.done[i]
    return Given()


@pytest.mark.parametrize("last_meeting", [-1, 0, 3, 7, 10])
def test_decoding_walk_finds_the_cheapest_threshold_that_meets_the_target(last_meeting):
    """Galloping then bisection from every start: the walk returns the last position (in the order of
    falling mean loops) whose accuracy meets the target, or the most accurate one when none does."""
    n, target = 11, 0.9
    accuracy = [0.99 - 0.001 * i if i <= last_meeting else 0.5 - 0.01 * i for i in range(n)]
    for start in range(n):
        walk = walk_on(accuracy, target)
        at, matched, _ = walk.operating_point(start)
        assert matched == (last_meeting >= 0)
        assert at == (last_meeting if matched else min(walk.done)), start
        assert len(walk.done) <= 2 + 2 * int(np.ceil(np.log2(n)))


def test_decoding_walk_probes_first_where_smoothly_falling_accuracy_crosses_the_target():
    """Accuracy that falls linearly with the order: from every start and for every boundary the walk
    finds the same threshold as midpoints alone would, and the regula falsi first probe of its bisection
    decodes fewer thresholds over all of them."""
    from recur_core.analysis.ground_truth import _DecodingWalk
    n = 24
    accuracy = [0.99 - 0.01 * i for i in range(n)]

    class Midpoints(_DecodingWalk):
        _crossing = staticmethod(_DecodingWalk._midpoint)

    decoded = {_DecodingWalk: 0, Midpoints: 0}
    for last in range(n - 1):
        target = accuracy[last] - 0.004
        for start in range(n):
            for kind in decoded:
                walk = walk_on(accuracy, target, kind)
                assert walk.operating_point(start)[:2] == (last, True)
                decoded[kind] += len(walk.done)
    assert decoded[_DecodingWalk] < decoded[Midpoints]


def test_state_rule_walks_share_one_harness_pass_per_round():
    """`_walk_in_harness` drives several walks together: each harness call holds the next threshold of every
    walk still searching (one each), the calls are as many as the longest walk's evaluations, and every
    walk ends where it ends alone."""
    from types import SimpleNamespace

    from recur_core.analysis.ground_truth import _Walk, _walk_in_harness
    accuracy = {"a": [0.99 - 0.01 * i for i in range(12)], "b": [0.95 - 0.05 * i for i in range(6)],
                "c": [0.5] * 5}  # c never meets the target

    class Given(_Walk):
        def __init__(self, name: str):
            self.family = [(name, i) for i in range(len(accuracy[name]))]
            self.order, self.done, self.target = list(range(len(self.family))), {}, 0.905

        def record(self, i, outcome):
            self.done[i] = outcome, {"answer_accuracy": accuracy[self.family[i][0]][i]}

    calls = []

    class Harness:
        def results(self, policies, max_loops, seed, uniform):
            calls.append(policies)
            return [SimpleNamespace(exit_depth=np.ones(1), argmax=np.zeros(1), targets=np.zeros(1)) for _ in policies]
    walks = {name: (Given(name), 2) for name in accuracy}
    found = _walk_in_harness(Harness(), walks, SimpleNamespace(max_loops=8, seed=0))
    evaluated = {name: len(walk.done) for name, (walk, _) in walks.items()}
    assert len(calls) == max(evaluated.values())
    assert all(len({name for name, _ in call}) == len(call) for call in calls)  # one threshold per walk
    assert sum(len(call) for call in calls) == sum(evaluated.values())  # none asked twice
    for name in accuracy:
        alone = walk_on(accuracy[name], 0.905)
        assert found[name][:2] == alone.operating_point(2)[:2], name
        assert evaluated[name] == len(alone.done)
    assert found["a"][:2] == (8, True) and found["b"][:2] == (0, True) and not found["c"][1]


def test_decoding_walk_seeds_each_decoding_with_the_nearest_decoded_exits():
    """The first threshold decoded starts from its fast exits; each later one from the exact exits of
    the decoded threshold nearest to it in the walk's order."""
    from recur_core.analysis.ground_truth import Outcome, _DecodingWalk
    n = 6

    class Fake(_DecodingWalk):
        def __init__(self):
            self.order, self.done = [5, 4, 3, 2, 1, 0], {}
            self.fast = [Outcome(np.full(1, 100 + i), np.zeros(1, bool)) for i in range(n)]
    walk = Fake()
    assert walk.guess(3)[0] == 103
    for i in (4, 0):
        walk.done[i] = Outcome(np.full(1, i), np.zeros(1, bool)), {}
    assert walk.guess(3)[0] == 4 and walk.guess(5)[0] == 4 and walk.guess(1)[0] == 0


def test_decoding_bench_scores_the_trained_hop_counts(hops_ckpt):
    """bench.bench_decode on hops matches policies on the answers the ground truth judges: the trained
    hop counts (the extrapolation answers are left out of the target and the best uniform depth)."""
    from bench.calibrate import AccuracyCalibrator
    ckpt = load_checkpoint(hops_ckpt)
    hops, max_train = load_ground_truth(hops_ckpt)
    windows = ckpt.windows("eval")[:16]
    every = AccuracyCalibrator(ckpt, windows, hops, 4, 0, 8)
    trained = AccuracyCalibrator(ckpt, windows, hops, 4, 0, 8, max_train)
    h = torch.as_tensor(hops[:16, 1:])
    assert torch.equal(trained.answers, (h > 0) & (h <= max_train))
    assert torch.equal(every.answers, h > 0) and trained.answers.sum() < every.answers.sum()


def test_bench_ground_truth_page_times_the_pages_stages(hops_ckpt, capsys):
    from bench.bench_ground_truth_page import main
    out = main([str(hops_ckpt), "--windows", "4"])
    assert list(out["seconds"]) == ["probes", "trace", "certified L", "fast ground truth", "exact ground truth"]
    assert all(s >= 0 for s in out["seconds"].values()) and out["within_goal"] == (out["seconds"]["exact ground truth"] < 300)
    assert out["decoded_thresholds"]["A1"] >= 1  # A1 reads the readout: its operating point was decoded
    assert out["harness_thresholds"]["latent"] >= 1 and "latent" not in out["decoded_thresholds"]
    assert out["harness_work"]["lane_loops"] > 0  # the state rules' walks ran in the harness
    assert "A1" in capsys.readouterr().out



def test_a_threshold_whose_rule_never_holds_is_read_off_the_trace(hops_ckpt):
    """A1 / Huginn's KL at ε 0 and the entropy rule at δ 0 never halt (their signals are >= 0): decoding
    runs every token to the cap, which is the uniform trace there, and the walk reads it off the trace
    instead of decoding (its ExactPath here is None: any decoding would fail)."""
    from recur_core import load_checkpoint
    from recur_core.analysis.ground_truth import Labels, Outcome, _Answers, _DecodingWalk, eos_id, program_mask
    from recur_core.analysis.stats import Bootstrap
    from recur_core.analysis.trace import trace
    from recur_core.decoding.teacher_forced import teacher_forced
    from recur_core.exits.policies import ConvergenceExit, EntropyDiff, LatentDiff, ReverseKLExit
    assert ConvergenceExit(0.0).never_halts and ReverseKLExit(0.0).never_halts and EntropyDiff(0.0).never_halts
    assert not ConvergenceExit(1e-9).never_halts and not EntropyDiff(1e-9).never_halts
    assert not LatentDiff(0.0).never_halts  # no floor declared: decoded like any other threshold
    ckpt = load_checkpoint(hops_ckpt)
    windows = ckpt.windows("eval")[:3].numpy()
    tr = trace(ckpt, windows, EXACT_LOOPS, seed=EXACT_SEED, cache=False)
    never = ConvergenceExit(0.0)
    decoded = teacher_forced(ckpt, windows, never, "recompute", seed=EXACT_SEED, max_loops=EXACT_LOOPS)
    assert (decoded.exit_loop == EXACT_LOOPS).all()
    labels = Labels.of(ckpt)
    scored = (tr, _Answers(tr, labels.hops, labels.max_train_hops, Bootstrap(3, 10)), program_mask(tr, eos_id(ckpt.tokenizer())))
    walk = _DecodingWalk(None, [never], [Outcome.fast(tr, never)], [{"mean_loops": EXACT_LOOPS}], scored, 0.5)
    outcome, point = walk.evaluate(0)
    assert (outcome.depth == EXACT_LOOPS).all()
    assert np.array_equal(outcome.correct, decoded.argmax.numpy() == tr.targets)
    assert point["mean_loops"] == EXACT_LOOPS
