"""metrics.jsonl, a checkpoint folder's live training log: one JSON object a line. The trainer writes it (`append`),
the app's Training page reads it (`read_metrics`).

Events:
  start      once, when a fresh run starts: preset, overrides, recipe (r_bar, r_max, k, sigma,
             sampler_mean), train_config, data
  train      step, tokens, loss, r (sampled loops), lr, grad_norm, tokens_per_s
  eval       step, tokens, windows, split, loss_by_depth {depth: nats/token}; split "select" is a
             periodic eval on the selection windows that pick best/ (disjoint from the saved eval
             windows), split "eval" the final eval on the saved eval windows. Logs written before
             the split was recorded have no "split": all their evals ran on the saved eval windows,
             periodically on the first few.
  nonfinite  step, message: the run stopped on a NaN / inf loss
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd


def append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


@dataclass
class MetricsLog:
    start: dict | None  # the run's start event (None in logs written before it existed)
    train: pd.DataFrame  # one row per train event
    evals: pd.DataFrame  # long: step, tokens, depth, loss, windows, split, periodic
    bad_lines: int  # unreadable lines, skipped


def read_metrics(path: Path) -> MetricsLog:
    """Parse a metrics.jsonl; unreadable lines are counted and skipped, unknown events ignored."""
    start, train, evals, bad = None, [], [], 0
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if not isinstance(rec, dict):
            bad += 1
        elif rec.get("event") == "start" and start is None:
            start = rec
        elif rec.get("event") == "train":
            train.append(rec)
        elif rec.get("event") == "eval":
            evals.append(rec)
    return MetricsLog(start, pd.DataFrame(train), eval_rows(evals), bad)


def eval_rows(records: list[dict]) -> pd.DataFrame:
    """Eval events as long rows (one per depth) with `periodic`: True for the evals a run makes
    every eval_every steps, False for its final eval on all saved windows."""
    first_windows = records[0].get("windows", 0) if records else 0
    rows = []
    for rec in records:
        split = rec.get("split")
        periodic = split == "select" if split else rec.get("windows", 0) == first_windows
        for depth, loss in (rec.get("loss_by_depth") or {}).items():
            rows.append({"step": rec.get("step"), "tokens": rec.get("tokens"), "depth": int(depth), "loss": loss,
                         "windows": rec.get("windows", 0), "split": split or "eval", "periodic": periodic})
    return pd.DataFrame(rows, columns=["step", "tokens", "depth", "loss", "windows", "split", "periodic"])
