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

--compile-probe also times the prelude and the readout (no cache) eager and under
`torch.compile(dynamic=True)` at a few row counts (ratio eager / compiled, same run), and serves the
best uniform depth and the per-token policy of fewest loops with the pool's prelude, core and readout calls
compiled (the cache's gathered attention stays eager: a graph break), eager and compiled
interleaved: whether compiling the calls would cut their fixed cost on this machine.
"""
from __future__ import annotations

import argparse
import json
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from recur_core import load_checkpoint
from recur_core.decoding.kv import GatherKV
from recur_core.decoding.serve import Request, serve

from .bench_serve import _hot_ms, calibrate, fit_lengths, log, median_wall_run, serve_prompts

MIXED = "mixed"
MODEL_CALLS = ("prelude", "core_step", "readout")  # what the pool calls on the model


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
    p.add_argument("--compile-probe", action="store_true", help="also time the edge calls under torch.compile")
    return p.parse_args(argv)


@torch.inference_mode()
def compile_probe(model, rows_list=(1, 8, 32), repeats: int = 200) -> dict:
    """{rows: {call: (eager us, compiled us)}} of the prelude and the readout on single tokens, no
    cache, hot (bench_serve's best of 3 x repeats back-to-back calls); compiled outputs are checked
    against eager."""
    d, out = model.cfg.d_model, {}
    calls = {"prelude": model.prelude, "readout": model.readout}
    compiled = {k: torch.compile(f, dynamic=True) for k, f in calls.items()}
    for rows in rows_list:
        inputs = {"prelude": torch.zeros(rows, 1, dtype=torch.long), "readout": torch.randn(rows, 1, d)}
        out[rows] = {}
        for k, x in inputs.items():
            torch.testing.assert_close(compiled[k](x), calls[k](x), atol=1e-4, rtol=1e-4)
            out[rows][k] = tuple(_hot_ms(lambda f=f, x=x: f(x), repeats, lambda: None) * 1e3
                                  for f in (calls[k], compiled[k]))
    return out


@contextmanager
def compiled_calls(model):
    """The model's prelude, core_step and readout under torch.compile(dynamic=True) (instance
    attributes over the class's methods), GatherKV.attention left to eager; both restored on exit."""
    attention = GatherKV.attention
    GatherKV.attention = torch.compiler.disable(attention)
    for name in MODEL_CALLS:
        setattr(model, name, torch.compile(getattr(model, name), dynamic=True))
    try:
        yield
    finally:
        GatherKV.attention = attention
        for name in MODEL_CALLS:
            delattr(model, name)


def compiled_pool_runs(ckpt, prompts, names: list[str], cal, args, cap) -> dict:
    """{(name, "eager" | "compiled"): tokens/s of each repetition}, the modes interleaved after a
    compiling warm-up run of each name."""
    with compiled_calls(ckpt.model):
        for name in names:
            run_once(ckpt, prompts, [cal.configs[name].policy], args, cap)
    out = {}
    for _ in range(args.repeats):
        for mode in ("eager", "compiled"):
            with compiled_calls(ckpt.model) if mode == "compiled" else nullcontext():
                for name in names:
                    out.setdefault((name, mode), []).append(
                        run_once(ckpt, prompts, [cal.configs[name].policy], args, cap)["tokens_per_s"])
    return out


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
    if args.compile_probe and len(singles) < 2:  # refused before any run
        raise SystemExit("--compile-probe: no per-token policy of the calibration met its target")
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
    probe = pool = None
    if args.compile_probe:
        probe = compile_probe(ckpt.model)
        for rows, calls in probe.items():
            log(f"  {rows:3d} rows: " + "  ".join(f"{k} eager {e:7.1f} us, compiled {c:7.1f} us ({e / c:.2f}x)"
                                               for k, (e, c) in calls.items()))
        pair = [singles[0], min(singles[1:], key=lambda n: cal.configs[n].quality.mean_loops)]  # the fewest loops
        pool = compiled_pool_runs(ckpt, prompts, pair, cal, args, cap)
        for mode in ("eager", "compiled"):
            per_token = [a / b for a, b in zip(pool[(pair[1], mode)], pool[(pair[0], mode)], strict=True)]
            log(f"  pool, {mode:8s}: " + "  ".join(f"{n} {np.median(pool[(n, mode)]):8.1f} tok/s" for n in pair)
                + f"  ({pair[1]} / {pair[0]}: {np.median(per_token):.3f}, paired)")
        pool = {f"{n} {mode}": v for (n, mode), v in pool.items()}
    print(json.dumps(dict(checkpoint=args.ckpt, pool=args.pool, requests=args.requests, repeats=args.repeats,
                          threads=torch.get_num_threads(), singles=singles, step_cost_ratio=ratio, runs=runs,
                          compile_probe=probe, compiled_pool=pool), default=float))


if __name__ == "__main__":
    main()
