"""The trainer end to end at tiny size: loss falls, resume equivalence, NaN stop, DDP, CLI."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import TINY_SETTINGS, make_tiny_checkpoint, write_corpus

from recur_core import LoopedLM, load_checkpoint
from recur_core.model.checkpoint import read_safetensors
from training.data import pack_windows
from training.presets import PRESETS
from training.trainer import lr_at

ROOT = Path(__file__).resolve().parents[1]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_short_run_loss_falls_and_checkpoint_is_complete(tiny_ckpt):
    rows = metrics(tiny_ckpt.parent)
    train = [r for r in rows if r["event"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert {"step", "tokens", "loss", "r", "lr", "grad_norm", "tokens_per_s"} <= set(train[0])
    evals = [r for r in rows if r["event"] == "eval"]
    assert set(evals[-1]["loss_by_depth"]) == {"1", "2", "3", "4", "6", "8"}
    ckpt = load_checkpoint(tiny_ckpt)
    assert ckpt.meta["recipe"] == {"r_bar": 3.0, "r_max": 8, "k": 2, "sigma": 0.5, "sampler_mean": "r_bar",
                                   "depth_mode": "per_step", "token_share": 0.0}
    assert ckpt.meta["checkpoint_id"] == ckpt.checkpoint_id
    assert {"preset", "overrides", "step", "tokens_seen", "data", "code_revision", "last_eval"} <= set(ckpt.meta)
    assert ckpt.windows("eval").shape == (128, 33) and ckpt.windows("probe").shape == (128, 33)
    assert (tiny_ckpt / "metrics.jsonl").read_text() == (tiny_ckpt.parent / "metrics.jsonl").read_text()
    assert load_checkpoint(tiny_ckpt.parent / "best").meta["best_eval_r_bar"] <= ckpt.meta["best_eval_r_bar"]


def test_final_weights_compete_for_best(tmp_path):
    """30 steps with an eval every 20: the final step gets the periodic eval too, best/ holds the
    step with the lowest of those losses at r_bar, and the last eval uses all 128 windows."""
    run = make_tiny_checkpoint(tmp_path, steps=30).parent
    evals = [r for r in metrics(run) if r["event"] == "eval"]
    periodic = {r["step"]: r["loss_by_depth"]["3"] for r in evals if r["split"] == "select"}
    assert sorted(periodic) == [20, 30] and all(r["windows"] == 8 for r in evals if r["split"] == "select")
    assert load_checkpoint(run / "best").meta["step"] == min(periodic, key=periodic.get)
    assert evals[-1]["step"] == 30 and evals[-1]["windows"] == 128 and evals[-1]["split"] == "eval"


def test_best_is_chosen_on_windows_disjoint_from_the_analysed_ones(tmp_path):
    """The selection windows are the next cfg.eval_windows of the validation stream after the 128
    saved eval windows; the periodic eval's loss is measured on them and best/ says so."""
    from training.data import DataSpec
    from training.trainer import Trainer, evaluate

    train, val = write_corpus(tmp_path / "data")
    cfg = PRESETS["demo"].with_overrides(TINY_SETTINGS)
    trainer = Trainer("demo", cfg, {}, DataSpec(str(train), str(val)), tmp_path / "run", progress=False)
    trainer.setup()
    (tmp_path / "run").mkdir()
    stream = torch.tensor(list(pack_windows(DataSpec(str(train), str(val)).val_docs(), trainer.tokenizer,
                                            cfg.seq_len + 1, 0)))
    assert torch.equal(trainer.eval_windows, stream[:128])
    assert torch.equal(trainer.select_windows, stream[128:136])
    assert not any(torch.equal(s, e) for s in trainer.select_windows for e in trainer.eval_windows)
    losses = trainer.run_eval("select")
    expected = evaluate(trainer.model, stream[128:136], cfg.eval_depths(), trainer.device, cfg.autocast)
    assert losses == pytest.approx(expected)
    assert "disjoint" in trainer.meta()["best_selected_on"]


def test_short_validation_source_gives_fewer_windows_then_a_clear_error(tmp_path):
    """A separate validation source too short for 128 + 8 windows gives fewer (the selection keeps
    its share), recorded in meta.json; too short for the minimum, it is refused."""
    from training.data import DataError, DataSpec
    from training.trainer import Trainer

    train, val = write_corpus(tmp_path / "data", n_val=40)  # about 130 windows: 128 saved + too few to select on
    cfg = PRESETS["demo"].with_overrides(TINY_SETTINGS)
    trainer = Trainer("demo", cfg, {}, DataSpec(str(train), str(val)), tmp_path / "run", progress=False)
    trainer.setup()
    stream = torch.tensor(list(pack_windows(DataSpec(str(train), str(val)).val_docs(), trainer.tokenizer, 33, 0)))
    n_eval, n_select = len(trainer.eval_windows), len(trainer.select_windows)
    assert n_eval < 128 and 4 <= n_select < 8 and n_eval + n_select == len(stream)
    assert torch.equal(trainer.eval_windows, stream[:n_eval]) and torch.equal(trainer.select_windows, stream[n_eval:])
    v = trainer.meta()["validation"]
    assert (v["eval_windows"], v["selection_windows"], v["shrunk"], v["enlarged"]) == (n_eval, n_select, True, False)
    assert "hold_out_rank_below" not in v and v["made_by"] == f"a separate validation source ({val})"

    _, tiny_val = write_corpus(tmp_path / "tiny", n_val=2)
    trainer = Trainer("demo", cfg, {}, DataSpec(str(train), str(tiny_val)), tmp_path / "run2", progress=False)
    with pytest.raises(DataError, match=r"needs at least 12 \(8 saved eval windows plus 4 disjoint ones to choose "
                                        r"best/ on; usually 128 \+ 8\), that is 396 tokens of validation text\. "
                                        r"Give more validation text \(--val-data\)"):
        trainer.setup()


def test_sampler_mean_is_a_recorded_recipe_field(tmp_path):
    """--set sampler_mean=huginn changes the drawn depths and is written to meta.json, the log's start
    event and the stderr line; a checkpoint without the field reads as "r_bar"."""
    from recur_core.model.recipe import Recipe
    from training.depth_sampler import sample_depth

    run = make_tiny_checkpoint(tmp_path, steps=10, sampler_mean="huginn", log_every="1").parent
    meta = load_checkpoint(run / "latest").meta
    assert meta["recipe"]["sampler_mean"] == "huginn" and meta["train_config"]["sampler_mean"] == "huginn"
    start = metrics(run)[0]
    assert start["event"] == "start" and start["recipe"]["sampler_mean"] == "huginn"
    drawn = [r["r"] for r in metrics(run) if r["event"] == "train"]
    assert drawn == [sample_depth(s, 3, 8, 0.5, 0, "huginn") for s in range(10)]
    assert Recipe.from_meta({"recipe": {"r_bar": 4, "r_max": 16, "k": 4, "sigma": 0.5}}).sampler_mean == "r_bar"
    with pytest.raises(ValueError, match="sampler_mean"):
        PRESETS["demo"].with_overrides({"sampler_mean": "paper"})


def test_warmup_then_cosine_schedule():
    cfg = PRESETS["demo"].with_overrides({"warmup_steps": "10", "lr": "1.0", "min_lr_ratio": "0.1"})
    assert lr_at(0, cfg, 100) == pytest.approx(0.1)
    assert lr_at(9, cfg, 100) == pytest.approx(1.0)
    assert lr_at(100, cfg, 100) == pytest.approx(0.1)
    assert lr_at(55, cfg, 100) == pytest.approx(0.55)


def test_stopped_and_resumed_run_equals_uninterrupted_run(tmp_path):
    straight = make_tiny_checkpoint(tmp_path / "a", steps=30)
    stopped_root = tmp_path / "b"
    make_tiny_checkpoint(stopped_root, steps=30, trainer_kwargs={"stop_at_step": 13})
    assert load_checkpoint(stopped_root / "run" / "latest").meta["step"] == 13
    make_tiny_checkpoint(stopped_root, steps=30, trainer_kwargs={"resume": True})
    a = read_safetensors(straight / "model.safetensors")
    b = read_safetensors(stopped_root / "run" / "latest" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    opt_a = read_safetensors(straight / "optimizer.safetensors")
    opt_b = read_safetensors(stopped_root / "run" / "latest" / "optimizer.safetensors")
    assert all(torch.equal(opt_a[k], opt_b[k]) for k in opt_a)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "data")} for r in rows]  # data: the run's folder
    assert strip(metrics(straight.parent)) == strip(metrics(stopped_root / "run"))


def test_nonfinite_loss_stops_with_a_message_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    real_forward = LoopedLM.forward
    calls = {"n": 0}

    def poisoned(self, *args, **kwargs):
        calls["n"] += 1
        out = real_forward(self, *args, **kwargs)
        return out * float("nan") if calls["n"] > 25 else out

    monkeypatch.setattr(LoopedLM, "forward", poisoned)
    with pytest.raises(SystemExit, match="loss became nan at step 25"):
        make_tiny_checkpoint(tmp_path, steps=40)
    latest = load_checkpoint(tmp_path / "run" / "latest")
    assert latest.meta["step"] == 20
    assert metrics(tmp_path / "run")[-1]["event"] == "nonfinite"


def run_cli(args, cwd, timeout=240, env=None):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_cli_help_and_bad_override(tmp_path):
    out = run_cli(["-m", "training.run", "--help"], ROOT)
    assert out.returncode == 0 and "--resume" in out.stdout and "--set" in out.stdout
    out = run_cli(["-m", "training.run", "demo", "--set", "bogus=1", "--out", str(tmp_path)], ROOT)
    assert out.returncode != 0 and "unknown setting 'bogus'" in out.stderr


def test_two_process_ddp_gloo_run(tmp_path):
    train, val = write_corpus(tmp_path / "data")
    sets = [a for k, v in TINY_SETTINGS.items() for a in ("--set", f"{k}={v}")]
    out = run_cli(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29731",
                   "-m", "training.run", "demo", *sets, "--set", "batch_size=4", "--data", str(train),
                   "--val-data", str(val), "--out", str(tmp_path / "run"), "--max-tokens", str(20 * 8 * 32),
                   "--threads", "1", "--no-progress"], ROOT, env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = load_checkpoint(tmp_path / "run" / "latest")
    assert ckpt.meta["world_size"] == 2 and ckpt.meta["step"] == 20
    assert ckpt.meta["tokens_seen"] == 20 * 2 * 4 * 32
    train_rows = [r for r in metrics(tmp_path / "run") if r["event"] == "train"]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
