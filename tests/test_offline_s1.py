"""The s1 / s0 presets offline: without the hub, a fast clear error naming --data; with local
FineWeb-Edu jsonl (tests/fixtures/fineweb-edu, ODC-By) and the shipped SmolLM2 tokenizer, a real
s1 run of a few steps at shrunken sizes."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recur_core import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
FINEWEB = ROOT / "tests" / "fixtures" / "fineweb-edu"
CLOSED_PORT = "http://127.0.0.1:9"  # nothing listens: the hub "cannot be reached", at once
SMALL_S1 = {"d_model": "32", "n_heads": "2", "n_kv_heads": "1", "ffn_dim": "64", "seq_len": "16",
            "batch_size": "4", "warmup_steps": "1", "eval_every": "2", "ckpt_every": "2", "eval_windows": "4",
            "log_every": "1"}


def run_cli(args, env, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"PYTHONPATH": str(ROOT),
                                                                             "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-m", "training.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_s1_without_the_hub_fails_fast_with_one_message(tmp_path):
    t0 = time.perf_counter()
    out = run_cli(["s1", "--out", str(tmp_path / "run"), "--no-progress"], {"HF_ENDPOINT": CLOSED_PORT})
    elapsed = time.perf_counter() - t0
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and "ConnectionError" in out.stderr  # one message, not a traceback
    for words in ("HuggingFaceFW/fineweb-edu", "cannot reach", "--data", ".txt", ".jsonl", ".parquet", '"text"'):
        assert words in out.stderr, out.stderr
    assert elapsed < 30, elapsed  # the hub clients' own retries took about 30 s before the import time


def test_hub_check_answers_within_its_timeout(monkeypatch):
    from training import data

    monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT)
    data.hub_reachable.cache_clear()
    t0 = time.perf_counter()
    with pytest.raises(data.HubUnreachable, match="--data"):
        data.require_hub("the dataset 'x/y'")
    assert time.perf_counter() - t0 < data.HUB_CHECK_TIMEOUT_S + 2
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data.hub_reachable.cache_clear()
    assert "HF_HUB_OFFLINE" in data.hub_reachable()
    data.hub_reachable.cache_clear()


def test_a_missing_local_file_is_not_mistaken_for_a_hub_id(tmp_path):
    out = run_cli(["s1", "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "run")],
                  {"HF_HUB_OFFLINE": "1"})
    assert out.returncode != 0 and "nope.jsonl: no such file" in out.stderr and "Traceback" not in out.stderr


def test_s1_preset_trains_offline_on_local_fineweb_edu_with_the_shipped_tokenizer(tmp_path):
    sets = [a for k, v in SMALL_S1.items() for a in ("--set", f"{k}={v}")]
    out = run_cli(["s1", *sets, "--data", str(FINEWEB / "train.jsonl"), "--val-data", str(FINEWEB / "validation.jsonl"),
                   "--max-tokens", str(4 * 4 * 16), "--out", str(tmp_path / "run"), "--threads", "1", "--no-progress"],
                  {"HF_HUB_OFFLINE": "1"})  # any hub access would now fail
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = load_checkpoint(tmp_path / "run" / "best")
    assert ckpt.config.vocab_size == 49_152 and ckpt.tokenizer().token_to_id("<|endoftext|>") == 0
    assert (ckpt.config.n_prelude, ckpt.config.n_core, ckpt.config.n_coda) == (2, 4, 2)  # the s1 split
    assert ckpt.meta["recipe"] == {"r_bar": 8.0, "r_max": 32, "k": 8, "sigma": 0.5, "sampler_mean": "r_bar",
                                   "depth_mode": "per_step", "token_share": 0.0}
    assert ckpt.meta["train_config"]["tokenizer"] == "smollm2" and ckpt.meta["step"] in (2, 4)
    assert ckpt.windows("eval").shape == (128, 17)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["event"] == "train"]
    assert len(train) == 4 and all(r["loss"] == r["loss"] and 1 <= r["r"] <= 32 for r in train)
    assert {r["split"] for r in rows if r["event"] == "eval"} == {"select", "eval"}
