"""The specimen preset (issue 50): the hops lessons in its settings, and its answer-weighted,
curriculum-driven mixture run through the real trainer, stopped and resumed exactly."""
from __future__ import annotations

import json

import torch
from tiny import make_tiny_reasoning_checkpoint

from recur_core.model.checkpoint import read_safetensors
from recur_core.tasks import WordProblems
from training.presets import PRESETS


def test_the_preset_applies_what_made_hops_learn():
    cfg = PRESETS["specimen"]
    task = WordProblems.parse(cfg.mixture)
    assert not cfg.model.tie_embeddings and cfg.model.n_core == 1
    assert cfg.model.n_coda == 0  # the loop is the only place past the prelude where a token reads another
    assert cfg.backprop_depth >= cfg.r_bar
    assert task.start_steps >= 1 and task.start_steps < task.max_steps  # a curriculum over steps
    assert task.answer_weight > task.other_weight and task.answer_weight > task.text_weight
    assert set(task.kind_list) == {"where"} and task.terse_share == 1  # lookups in hops' density, no arithmetic
    assert 0 < task.share < 1  # TinyStories stays in the mixture


# A block of answers that 16 steps never fill: a stop leaves a partial block (its answers seen and right) that
# the resumed run must carry on counting; whether a tiny model's answers advance a stage depends on the CPU's
# rounding (advancing is tested on the Curriculum itself, tests/test_word_problems.py).
TINY_CURRICULUM = ("word_problems:share=0.5,kinds=where+inside+swap,max_steps=3,extra_eval_steps=1,start_steps=1,"
                   "advance_at=0.05,advance_answers=10000,answer_weight=1,other_weight=0.1,text_weight=0.1")
TINY_SPECIMEN = {"mixture": TINY_CURRICULUM, "r_bar": "3", "backprop_depth": "3", "eval_every": "6",
                 "ckpt_every": "6"}


def test_a_stopped_and_resumed_run_continues_its_curriculum_exactly(tmp_path):
    straight = make_tiny_reasoning_checkpoint(tmp_path / "a", steps=16, preset="specimen", **TINY_SPECIMEN)
    stopped = tmp_path / "b"
    make_tiny_reasoning_checkpoint(stopped, steps=16, preset="specimen", trainer_kwargs={"stop_at_step": 7},
                                   **TINY_SPECIMEN)
    halfway = json.loads((stopped / "run" / "latest" / "trainer_state.json").read_text())["data"]["problems"]
    assert halfway["curriculum"]["seen"] > 0  # mid-block state to carry
    make_tiny_reasoning_checkpoint(stopped, steps=16, preset="specimen", trainer_kwargs={"resume": True},
                                   **TINY_SPECIMEN)
    resumed = stopped / "run" / "latest"
    a, b = read_safetensors(straight / "model.safetensors"), read_safetensors(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = lambda ckpt: json.loads((ckpt / "trainer_state.json").read_text())["data"]
    assert state(straight) == state(resumed)
    log = [json.loads(line) for line in (straight.parent / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in log if r["event"] == "train"]
    assert all(1 <= r["curriculum_top"] <= 3 and r["top_right"] <= r["top_answers"] for r in trained)
    gt = read_safetensors(straight / "ground_truth.safetensors")
    assert gt["max_train_hops"].item() == state(straight)["problems"]["curriculum"]["top"]  # trained so far
