"""`python -m bench.lm_eval_sweep --ckpt checkpoints/hops --task hops_qa`: one lm-eval task scored by the
model `recur` (recur_eval: real per-token halting) under A0 at 1 .. r̄ loops, A1 over an ε grid and the
latent rule over a δ grid: accuracy against mean loops, the paper's depth / quality curve measured by
a third-party harness.

Per row: acc (lm-eval's), mean_loops (the scored tokens: for hops_qa the answer positions) and
mean_loops_run (every position the model ran, context included: the compute). With --ckpt a
checkpoint with ground truth and a task whose documents carry `hops`, it adds accuracy per hop count
and, beside each uniform depth, the project's own answer accuracy (recur_core.analysis.ground_truth on
the fast path: the argmax over the whole vocabulary at that loop of the trace of the eval windows,
SETTINGS.seed, each window its own noise row), so the harness's figure is checked against the
project's. Defaults: A1's ε and the latent δ from their catalogue calibration grids. The
last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field

import numpy as np

from recur_core import load_checkpoint
from recur_core.exits import catalogue
from recur_core.settings import SETTINGS


@dataclass
class Row:
    policy: str
    threshold: float
    acc: float
    mean_loops: float
    mean_loops_run: float
    acc_by_hops: dict[int, float] = field(default_factory=dict)
    project_acc: float | None = None  # the project's own ground-truth accuracy (uniform depths)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.lm_eval_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default="checkpoints/hops")
    p.add_argument("--task", default="hops_qa")
    p.add_argument("--include-path", default=None, help="task folder (default: recur_eval/tasks)")
    p.add_argument("--limit", type=int, default=None, help="documents (default: all)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--kv-rule", default=SETTINGS.kv_rule)
    p.add_argument("--mode", default="decode", choices=("decode", "prefill"))
    p.add_argument("--max-depth", type=int, default=None, help="A0 at 1 .. this (default: the recipe's r̄)")
    p.add_argument("--eps", default=",".join(f"{e:g}" for e in catalogue.FAMILIES["A1"].calibration), help="A1's ε grid")
    p.add_argument("--delta", default=",".join(f"{d:g}" for d in catalogue.FAMILIES["latent"].calibration),
                   help="the latent rule's δ grid")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    return p.parse_args(argv)


def grid(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def evaluate(args, task_manager, policy: str, threshold: float) -> Row:
    """One lm-eval run of the task under one policy (threshold: A0's depth, A1's ε or the latent δ)."""
    from lm_eval import simple_evaluate

    model_args = {"pretrained": args.ckpt, "policy": policy, "kv_rule": args.kv_rule, "mode": args.mode}
    model_args.update({"loops": int(threshold)} if policy == "uniform" else {"threshold": threshold})
    out = simple_evaluate(model="recur", model_args=model_args, tasks=[args.task], task_manager=task_manager,
                          batch_size=args.batch_size, limit=args.limit, log_samples=True, verbosity="ERROR")
    res, info = out["results"][args.task], out["config"]["recur"]
    by_hops: dict[int, list[float]] = {}
    for s in out["samples"][args.task]:
        if "hops" in s["doc"]:
            by_hops.setdefault(int(s["doc"]["hops"]), []).append(float(s["acc"]))
    return Row(policy, threshold, res["acc,none"], info["mean_loops"][args.task], info["mean_loops_run"][args.task],
               {h: float(np.mean(v)) for h, v in sorted(by_hops.items())})


def project_accuracy(ckpt_path: str, depths: int) -> dict[int, float] | None:
    """The project's own answer accuracy at uniform depths 1 .. depths (None without ground truth)."""
    from recur_core.analysis.ground_truth import answer_hops, correct_at, load_ground_truth
    from recur_core.analysis.trace import trace

    truth = load_ground_truth(ckpt_path)
    if truth is None:
        return None
    ckpt = load_checkpoint(ckpt_path)
    tr = trace(ckpt, ckpt.windows("eval")[:SETTINGS.windows].numpy(), max_loops=depths, seed=SETTINGS.seed)
    answers = answer_hops(tr, truth[0]) > 0
    return {r: float(correct_at(tr, np.full(answers.shape, r))[answers].mean()) for r in range(1, depths + 1)}


def main(argv=None) -> list[Row]:
    args = parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    import recur_eval  # noqa: F401  (registers the model "recur")
    from recur_eval.task_data import TASKS_DIR

    task_manager = TaskManager(include_path=args.include_path or str(TASKS_DIR))
    depth = args.max_depth or round(load_checkpoint(args.ckpt).recipe.r_bar)
    points = ([("uniform", r) for r in range(1, depth + 1)] + [("a1", e) for e in grid(args.eps)]
              + [("latent", d) for d in grid(args.delta)])
    own = project_accuracy(args.ckpt, depth) if args.task == "hops_qa" else None
    print(f"{args.task} on {args.ckpt}: lm-eval, model recur (kv_rule {args.kv_rule}, mode {args.mode}, "
          f"batch {args.batch_size}{'' if args.limit is None else f', limit {args.limit}'})", flush=True)
    print(f"{'policy':>8} {'threshold':>9} {'acc':>7} {'loops':>7} {'loops_run':>9} {'project acc':>11}", flush=True)
    rows = []
    for policy, threshold in points:
        row = evaluate(args, task_manager, policy, threshold)
        if policy == "uniform" and own is not None:
            row.project_acc = own[int(threshold)]
        rows.append(row)
        proj = "" if row.project_acc is None else f"{row.project_acc:.4f}"
        print(f"{policy:>8} {threshold:>9g} {row.acc:7.4f} {row.mean_loops:7.3f} {row.mean_loops_run:9.3f} "
              f"{proj:>11}", flush=True)
        if row.acc_by_hops:
            print("         per hop count: " + "  ".join(f"{h}: {a:.3f}" for h, a in row.acc_by_hops.items()),
                  flush=True)
    payload = [asdict(r) for r in rows]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
    print(json.dumps({"task": args.task, "ckpt": args.ckpt, "rows": payload}))
    return rows


if __name__ == "__main__":
    main()
