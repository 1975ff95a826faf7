"""What a serving-pool step costs when its rows mix policies (issue 27, part 2).

    python -m bench.bench_pool_step --ckpt checkpoints/demo-r8 --calibration bench/calibration/demo-r8.json

Serves the same requests through one pool (recur_core.decoding.serve) with each calibrated policy
alone (the best uniform depth, then the per-token policies of the calibration file that
`bench_serve` wrote), and with all of them mixed (request n takes policy n mod k). It prints, per
configuration, the steps, the milliseconds per step, the batched calls per step of each kind and
the tokens per second (median-wall run of --repeats, configurations interleaved), and for the mix:

  step cost ratio = mixed ms per step / the mean of the single-policy pools' ms per step.

A pool whose per-step cost does not depend on how many kinds of rows it holds has a ratio near 1
and at most one prelude and one readout call per step.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from recur_core import load_checkpoint
from recur_core.decoding.serve import Request, serve

from .bench_serve import calibrate, fit_lengths, log, median_wall_run, serve_prompts

MIXED = "mixed"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="checkpoints/demo-r8")
    p.add_argument("--calibration", required=True, help="a bench_serve calibration file of this checkpoint")
    p.add_argument("--pool", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-a2", action="store_true", help="leave A2 out (its probe is trained on first use)")
    return p.parse_args(argv)


def run_once(ckpt, prompts, policies, args, cap) -> dict:
    """One pool run; request n takes policies[n % len(policies)]."""
    reqs = [Request(prompt, args.new_tokens, policies[n % len(policies)], seed=args.seed, greedy=True)
            for n, prompt in enumerate(prompts)]
    run = serve(ckpt, reqs, args.pool, max_loops=cap, max_len=args.prompt_len + args.new_tokens, keep_logits=False)
    return dict(wall_s=run.wall_s, steps=run.steps, ms_per_step=run.wall_s / run.steps * 1e3,
                tokens_per_s=run.tokens_per_s, mean_loops=run.mean_loops,
                calls_per_step={k: n / run.steps for k, n in run.calls.items()},
                model_share=run.model_s / run.wall_s)


def main(argv=None):
    args = parse_args(argv)
    if not Path(args.calibration).exists():
        raise SystemExit(f"{args.calibration}: no such calibration (bench_serve --calibration writes one)")
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.ckpt)
    cap = ckpt.recipe.r_max
    windows = ckpt.windows("eval")
    fit_lengths(args, ckpt.config, windows.shape[1])
    cal = calibrate(ckpt, args, cap, ckpt.recipe.depth)
    singles = [cal.uniform_name] + [n for n in cal.policy_names if cal.configs[n].matched]
    configs = {name: [cal.configs[name].policy] for name in singles}
    configs[MIXED] = [cal.configs[name].policy for name in singles]
    prompts = serve_prompts(windows, cal, args)
    log(f"== {args.ckpt}: pool {args.pool}, {args.requests} requests x {args.prompt_len}-token prompts, "
        f"{args.new_tokens} new tokens, {torch.get_num_threads()} thread(s); {MIXED}: {', '.join(singles)} in turn")
    for policies in configs.values():  # warm-up: the first calls of a process are slow
        serve(ckpt, [Request(prompts[0], 4, policies[0], greedy=True)], 2, max_loops=cap, keep_logits=False)
    trials = {name: [] for name in configs}
    for rep in range(args.repeats):
        for name, policies in configs.items():
            trials[name].append(run_once(ckpt, prompts, policies, args, cap))
            log(f"  {name:32s} {trials[name][-1]['ms_per_step']:7.3f} ms/step (run {rep + 1} of {args.repeats})")
    runs = {name: median_wall_run(t) for name, t in trials.items()}
    log(f"{'configuration':32s} {'steps':>6s} {'ms/step':>8s} {'prelude/step':>12s} {'readout/step':>12s} "
        f"{'tok/s':>8s} {'loops':>6s} {'model share':>11s}")
    for name, r in runs.items():
        c = r["calls_per_step"]
        log(f"{name:32s} {r['steps']:6d} {r['ms_per_step']:8.3f} {c['prelude']:12.3f} {c['readout']:12.3f} "
            f"{r['tokens_per_s']:8.1f} {r['mean_loops']:6.2f} {r['model_share']:11.3f}")
    ratio = runs[MIXED]["ms_per_step"] / float(np.mean([runs[n]["ms_per_step"] for n in singles]))
    log(f"step cost ratio (mixed ms/step / mean of the single-policy pools'): {ratio:.3f}")
    print(json.dumps(dict(checkpoint=args.ckpt, pool=args.pool, requests=args.requests, repeats=args.repeats,
                          threads=torch.get_num_threads(), singles=singles, step_cost_ratio=ratio, runs=runs),
                     default=float))


if __name__ == "__main__":
    main()
