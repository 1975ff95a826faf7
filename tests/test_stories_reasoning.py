"""The stories-reasoning preset's smallest run, end to end: the real trainer on tiny stories mixed
with word problems writes a checkpoint whose eval windows alternate text and problems with labelled
answers, which the runtime, the Ground truth page's loader and `bench.bench_specimen` all read."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from tiny import make_tiny_reasoning_checkpoint

from recur_core import load_checkpoint
from recur_core.analysis.ground_truth import load_ground_truth
from recur_core.tasks import WordProblems


@pytest.fixture(scope="module")
def reasoning(tmp_path_factory):
    return make_tiny_reasoning_checkpoint(tmp_path_factory.mktemp("reasoning"))


def test_checkpoint_carries_the_mixture_and_aligned_answers(reasoning):
    ckpt = load_checkpoint(reasoning)
    meta = json.loads((reasoning / "meta.json").read_text())
    task = WordProblems.parse(meta["train_config"]["mixture"])
    steps, max_train = load_ground_truth(reasoning)
    windows = ckpt.windows("eval")
    assert steps.shape == tuple(windows.shape) and max_train == task.max_steps
    labelled = (steps > 0).any(1)
    n_text = int((~labelled).sum())  # text rows and problem rows alternate, then the longer set's rest
    assert n_text > 0 and labelled[1:2 * n_text:2].all() and not labelled[0:2 * n_text:2].any()
    assert steps.max() == task.max_steps + task.extra_eval_steps  # held-out problems go past training
    tok = ckpt.tokenizer()
    first = int(np.nonzero(steps[1])[0][0])
    answer = tok.decode([int(windows[1, first])]).strip()
    problem = tok.decode(windows[1, :first].tolist())
    assert answer and "?" in problem  # an answer follows its question


def test_answers_are_grouped_by_their_problems_length():
    from bench.bench_specimen import LENGTH_BINS, by_problem_length, problem_length
    eos = 0
    targets = np.array([[5, 7, 0, 5, 8, 9, 0, 6], [5, 5, 5, 0, 7, 7, 0, 5]])
    steps = np.array([[1, 0, 0, 2, 0, 1, 0, 3], [0, 0, 0, 0, 2, 1, 0, 0]])
    length = problem_length(targets, eos)
    # problems: [5 7 0] [5 8 9 0] [6] in row 0, [5 5 5 0] [7 7 0] [5] in row 1 (an EOS ends its problem)
    assert length.tolist() == [[3, 3, 3, 4, 4, 4, 4, 1], [4, 4, 4, 4, 3, 3, 3, 1]]
    length[1, 4:7] = LENGTH_BINS[-1] + 1  # one long problem
    correct = np.array([[1, 0, 0, 0, 0, 1, 0, 1], [0, 0, 0, 0, 1, 0, 0, 0]], dtype=bool)
    got = by_problem_length(correct, steps > 0, steps, length)
    short, long = f"1-{LENGTH_BINS[0]}", f">{LENGTH_BINS[-1]}"
    assert got == {1: {short: {"accuracy": 1.0, "answers": 2}, long: {"accuracy": 0.0, "answers": 1}},
                   2: {short: {"accuracy": 0.0, "answers": 1}, long: {"accuracy": 1.0, "answers": 1}},
                   3: {short: {"accuracy": 1.0, "answers": 1}}}


def test_answers_are_grouped_by_their_form():
    from bench.bench_specimen import by_form
    question_mark = 9
    # a trace's position holds the input token and predicts the next: "?" at 2 and 5 is read before a terse answer
    ids = np.array([[4, 4, 9, 4, 4, 9, 4, 4]])
    answers = np.array([[0, 0, 1, 0, 0, 1, 0, 1]], dtype=bool)
    steps = np.array([[0, 0, 2, 0, 0, 2, 0, 2]])
    correct = np.array([[0, 0, 1, 0, 0, 0, 0, 1]], dtype=bool)
    assert by_form(correct, answers, steps, ids, question_mark) == {
        2: {"sentences": {"accuracy": 1.0, "answers": 1}, "terse": {"accuracy": 0.5, "answers": 2}}}


def test_answer_flips_count_the_answers_whose_argmax_changes_at_each_loop():
    from types import SimpleNamespace

    from bench.bench_specimen import answer_flips
    argmax = np.array([[[3, 4, 4, 5], [1, 1, 1, 1], [2, 7, 7, 7]]])  # (N, T, L): three tokens over 4 loops
    kl = np.array([[[9.0, 0.5, 0.0, 1e-6], [9.0, 0.0, 0.0, 0.0], [9.0, 0.25, 0.0, 0.0]]])
    top1 = np.array([[[0.3, 0.6, 0.7, 0.45], [0.9, 0.9, 0.9, 0.9], [0.2, 0.4, 0.8, 0.8]]])
    tr = SimpleNamespace(argmax=argmax, kl_prev=kl, top1_prob=top1)
    answers = np.array([[True, True, False]])  # the third token is no answer: its change is not counted
    assert answer_flips(tr, answers) == {
        2: {"answers": 1, "kl_median": 0.5, "kl_min": 0.5, "top1_median": 0.6},
        4: {"answers": 1, "kl_median": 1e-6, "kl_min": 1e-6, "top1_median": 0.45}}


def test_first_agreeing_loop_is_the_first_loop_with_the_r_bar_prediction():
    from bench.bench_specimen import first_agreeing_loop
    argmax = np.array([[3, 4, 4, 4, 9], [1, 1, 1, 1, 1], [2, 7, 2, 2, 2], [5, 6, 6, 4, 6]])  # r_bar 4: loop 5 unread
    assert first_agreeing_loop(argmax, 4).tolist() == [2, 1, 1, 4]


def test_bench_specimen_prints_its_six_figures(reasoning, capsys):
    from bench.bench_specimen import main
    out = main([str(reasoning), "--windows", "8"])
    printed = capsys.readouterr().out
    for figure in ("1. loss", "2. answer-token accuracy", "3. answer accuracy rise", "4. exact A1", "5. exact A1",
                   "Spearman(A1 exit, steps)", "6. answers whose argmax changes"):
        assert figure in printed
    r_bar = out["r_bar"]
    drop = out["loss_drop_1_to_rbar"]
    assert drop["ci_low"] <= drop["value"] <= drop["ci_high"]
    assert math.isclose(drop["value"], out["loss_by_depth"][1] - out["loss_by_depth"][r_bar], abs_tol=1e-9)
    acc = out["answer_accuracy_by_depth"]
    rise = out["answer_accuracy_rise_points_1_to_rbar"]
    assert math.isclose(rise["value"], 100 * (acc[r_bar] - acc[1]), abs_tol=1e-9)
    assert out["n_answers"] > 0 and all(0 <= a <= 1 for a in acc.values())
    assert 1 <= out["r_bar_prediction_first_reached_mean_loops"]["all"] <= r_bar
    assert "the fewest loops that give A0@r_bar's prediction" in printed
    flips = out["answer_argmax_changes_by_loop"]
    assert all(2 <= i <= out["trace_loops"] and 0 < f["answers"] <= out["n_answers"] for i, f in flips.items())
    sizes = out["answer_accuracy_at_rbar_by_problem_length"]  # every answer in one group
    assert sum(v["answers"] for row in sizes.values() for v in row.values()) == out["n_answers"]
    counts = {k: sum(v["answers"] for v in row.values()) for k, row in sizes.items() if k >= 2}
    multi = out["multi_step"]  # the goal's answers (>= 2 steps), pooled from the per-step rows
    pooled = {r: sum(out["answer_accuracy_by_steps"][k][r] * n for k, n in counts.items()) / sum(counts.values())
              for r in (1, r_bar)}
    assert multi["answers"] == sum(counts.values())
    assert math.isclose(multi["rise_points"]["value"], 100 * (pooled[r_bar] - pooled[1]), abs_tol=1e-9)
    assert multi["rise_points"]["ci_low"] <= multi["rise_points"]["value"] <= multi["rise_points"]["ci_high"]
    assert "multi-step answers (>= 2 steps" in printed
    a1 = out["exact_a1"]
    best = a1["best_uniform_depth"]
    assert best is None or 1 <= best <= r_bar
    if best:
        assert math.isclose(a1["vs_best_uniform"], a1["value"] / best)
    at_acc = out["exact_a1_at_answer_accuracy"]  # figure 5: the ground truth's exact A1 operating point
    assert math.isclose(at_acc["target_accuracy"], acc[r_bar] - 0.01, abs_tol=1e-9)
    assert at_acc["matches_a0_rbar"] == (at_acc["answer_accuracy"] >= at_acc["target_accuracy"])
    uniform = at_acc["best_uniform_depth"]
    assert uniform is None or (acc[uniform] >= at_acc["target_accuracy"] and uniform <= r_bar)
    if uniform:
        assert math.isclose(at_acc["vs_best_uniform_loops_ratio"], at_acc["mean_loops"] / uniform)
    assert at_acc["threshold"] in [p["threshold"] for p in at_acc["decoded"]]  # the walk decoded its point
    assert "epsilons decoded (answer accuracy, mean loops)" in printed
    rho = at_acc["spearman_exit_vs_steps"]
    if rho["value"] != rho["value"]:  # every answer exits at one loop (e.g. A1 at epsilon inf)
        assert "undefined: every answer exits at the same loop" in printed
    else:
        assert -1 <= rho["ci_low"] <= rho["value"] <= rho["ci_high"] <= 1


@pytest.fixture(scope="module")
def reasoning_env(reasoning, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECUR_CHECKPOINT", str(reasoning))
        mp.setenv("RECUR_CACHE_DIR", str(tmp_path_factory.mktemp("reasoning_cache")))
        mp.setenv("RECUR_SHIPPED", str(tmp_path_factory.mktemp("no_shipped_checkpoints")))
        yield Path(reasoning).resolve()


def test_ground_truth_page_scores_word_problem_answers_in_steps(reasoning_env):
    from streamlit.testing.v1 import AppTest
    from test_app import settle, tooltips
    at = AppTest.from_file("../app.py", default_timeout=300)
    at.run()
    at.switch_page("pages/ground_truth.py").run()
    settle(at)
    assert not at.error and any(m.label == "Spearman(A1 exit, steps)" for m in at.metric)
    examples = at.session_state[f"gt_programs@{reasoning_env}"]
    ex = examples[at.selectbox(key="gt_pick").value]
    answers = at.dataframe[-1].value
    labelled = [(pos, s) for pos, s in enumerate(ex.char_depths) if s]
    # every answer the model reads (within its context) is a row, with the steps the generator gave it
    assert 0 < len(answers) <= len(labelled)
    assert answers["steps"].tolist() == [f"{s} step" + ("s" if s > 1 else "") for _, s in labelled[:len(answers)]]
    for (pos, _), answer in zip(labelled, answers["answer"], strict=False):
        assert ex.text[pos:].startswith(answer.strip()) and answer.strip()  # the answer word's first token
    notes = [int(m) for t in tooltips(at) for m in re.findall(r"predicts an answer (\d+) steps? deep", t)]
    assert notes == [s for _, s in labelled[:len(answers)]]
    at.number_input(key="gt_max_hops").set_value(2).run()
    at.button(key="gt_new").click().run()
    assert not at.exception
    new = at.session_state[f"gt_programs@{reasoning_env}"][-1]
    assert new.deepest == 2 and at.selectbox(key="gt_pick").value == len(examples)


def test_export_ships_the_ground_truth_and_a_word_problem_section(reasoning, tmp_path):
    from recur_core.report.export import export
    dst = tmp_path / "stories-reasoning"
    export(reasoning, dst, "python -m training.run stories-reasoning", "test machine")
    src_steps, src_max = load_ground_truth(reasoning)
    steps, max_train = load_ground_truth(dst)
    assert np.array_equal(steps, src_steps) and max_train == src_max
    card = (dst / "README.md").read_text()
    assert "## Word problems" in card and "| all trained steps |" in card and "points**" in card
    assert not (dst / "optimizer.safetensors").exists()  # the trainer's state stays behind
