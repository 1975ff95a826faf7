"""Wall-clock speedup of real per-token halting in batch-1 decoding (issue 6).

For each checkpoint:
  1. Calibrate on --windows eval windows, teacher-forced with the real decoder (KV rule "latest"):
     A0 at r_bar gives the target loss; A1's eps and the latent rule's delta are the largest
     (fewest loops) whose teacher-forced loss is at most target + --tolerance nats.
     A0 at the floor / ceiling of A1's mean loops gives the loss of uniform depth at equal compute.
  2. Time batch-1 generation of --new-tokens tokens after each of --prompts prompts (the first
     --prompt-len tokens of the next eval windows), greedy, every policy on the same prompts in
     the same run, interleaved, --repeats times (the median repeat is reported).
     tokens/s = decode steps / decode time (the prompt's prefill is timed apart).
  3. The FLOP proxy of the same runs: multiply-accumulates of prelude, core loops, coda, head and
     exit checks, with the real exit depths, readouts and context lengths; its ratio to A0 is the
     speedup the proxy predicts, to hold the realized speedup against.
  4. Faithfulness: teacher-forced decoding against the masking harness (recur_core.analysis.harness),
     the two KV rules, and how far halted tokens' kept logits drift from a full-depth
     recomputation of the generated text.

The last line of output is one JSON object (the first checkpoint's figures at the top level,
every checkpoint's under "checkpoints").

    python bench/bench_decode.py                      # checkpoints/demo-r8 and checkpoints/demo
    python bench/bench_decode.py --ckpt runs/demo/best --prompts 8 --new-tokens 128 --windows 8

A checkpoint with ground truth (checkpoints/hops) is benchmarked on its programs instead, matched on
answer accuracy against the smallest uniform depth that reaches it (bench/hops_decode.py).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from recur_core import load_checkpoint  # noqa: E402
from recur_core.decoding.decode import generate, generation_drift, teacher_forced  # noqa: E402
from recur_core.analysis.ground_truth import load_ground_truth  # noqa: E402
from recur_core.analysis.harness import run_exact  # noqa: E402
from recur_core.exits.policies import ConvergenceExit, LatentDiff, LinearRouter, Uniform  # noqa: E402
from recur_core.analysis.probe import load_or_train_probes  # noqa: E402
from recur_core.settings import SETTINGS  # noqa: E402
from hops_decode import bench_hops  # noqa: E402
from matching import match_threshold  # noqa: E402

DEFAULT_CKPTS = ("checkpoints/demo-r8", "checkpoints/demo")
# thresholds tried (descending: fewest loops first) before bisecting between the last miss and the first match
EPS_GRID = (1.0, 0.3, 0.1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 1e-6)
DELTA_GRID = (1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.03, 0.02, 0.01, 5e-3, 2e-3, 1e-3, 1e-4)
TAU_GRID = (0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01, 3e-3, 1e-3)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", action="append", help="checkpoint directory (repeatable)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--windows", type=int, default=32, help="eval windows for the matched-loss calibration")
    p.add_argument("--tolerance", type=float, default=0.002, help="nats above A0@r_bar's loss allowed")
    p.add_argument("--acc-tolerance", type=float, default=0.01,
                   help="checkpoints with ground truth (hops): answer accuracy below A0@r_bar's allowed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bisect", type=int, default=3, help="bisection steps after the grid")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=SETTINGS.seed)
    p.add_argument("--max-loops", type=int, default=None, help="loop cap (default: the recipe's r_max)")
    p.add_argument("--tf-batch", type=int, default=8, help="windows decoded in lockstep")
    p.add_argument("--no-a2", action="store_true",
                   help="skip A2 (a linear probe on the state trained on A1's KL labels: a check that needs "
                        "no coda or head)")
    p.add_argument("--check-every", type=int, default=2,
                   help="also run A1 checked every n loops, at loops n + 1, 2n + 1, ... (KL(p_i || p_i-n), "
                        "its own eps); 0 or 1: skip")
    return p.parse_args(argv)


def log(*args):
    print(*args, flush=True)


# -- FLOP proxy ------------------------------------------------------------------------------------
class CostModel:
    """Multiply-accumulates of one decode step, by part (weights once per token, plus attention)."""

    def __init__(self, cfg):
        self.cfg = cfg
        d, H, Hkv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.block_weights = d * (H + 2 * Hkv) * hd + H * hd * d + 3 * d * cfg.ffn_dim
        self.attn_per_key = 2 * H * hd
        self.head = cfg.vocab_size * d

    def block(self, ctx: int) -> float:
        return self.block_weights + self.attn_per_key * ctx

    def step(self, ctx: int, loops: int, readouts: int, checks: int, kl_checks: int) -> float:
        """ctx keys attended; loops core loops; readouts coda + head passes; checks latent-rule
        evaluations (~3d); kl_checks KL computations (~3V)."""
        c = self.cfg
        prelude = c.n_prelude * self.block(ctx) + c.d_model * c.d_model  # + the adapter's e-part, once
        loop = c.d_model * c.d_model + c.n_core * self.block(ctx)
        readout = c.n_coda * self.block(ctx) + self.head
        return prelude + loops * loop + readouts * readout + 3 * c.d_model * checks + 3 * c.vocab_size * kl_checks


# -- calibration -----------------------------------------------------------------------------------
class Calibrator:
    """Teacher-forced losses of policies on the calibration windows (memoised)."""

    def __init__(self, ckpt, windows, cap, seed, batch):
        self.ckpt, self.windows, self.cap, self.seed, self.batch = ckpt, windows, cap, seed, batch
        self.memo = {}

    def evaluate(self, policy, kv_rule="latest", mode=None, check_every=1):
        # state-based policies: the parallel "prefill" pass equals token-by-token decoding exactly
        # (tests/test_decode.py); A1's readout context differs, so it is decoded token by token
        mode = mode or ("decode" if getattr(policy, "needs_readout", False) else "prefill")
        key = (repr(policy), kv_rule, mode, check_every)
        if key not in self.memo:
            t = time.perf_counter()
            tf = teacher_forced(self.ckpt, self.windows, policy, kv_rule, seed=self.seed, max_loops=self.cap,
                                batch_size=self.batch, mode=mode, check_every=check_every)
            self.memo[key] = tf
            label = repr(policy) + (f" every {check_every}" if check_every > 1 else "")
            log(f"    {label:66s} {kv_rule:9s} {mode:7s} loss {tf.loss:.5f}  "
                f"mean loops {tf.mean_loops:6.3f}  ({time.perf_counter() - t:.1f}s)")
        return self.memo[key]

    def harness(self, policy):
        """The masking harness (recur_core.harness.run_exact) on the same windows and noise."""
        t = time.perf_counter()
        ex = run_exact(self.ckpt, self.windows, policy, self.cap, self.seed, batch_size=self.batch)
        result = SimpleNamespace(loss=float(np.nanmean(ex.ce)), mean_loops=float(ex.exit_depth.mean()))
        log(f"    {policy!r:66s} {'harness':9s} {'':7s} loss {result.loss:.5f}  "
            f"mean loops {result.mean_loops:6.3f}  ({time.perf_counter() - t:.1f}s)")
        return result

    def match(self, make, grid, target, bisect_steps, check_every=1, kv_rule="latest"):
        """Largest threshold on the grid (then bisected, log scale) whose loss <= target under
        kv_rule. Returns (threshold, result, matched)."""
        return match_threshold(lambda policy: self.evaluate(policy, kv_rule, check_every=check_every), make, grid,
                               lambda tf: tf.loss <= target, bisect_steps)


# -- timing ----------------------------------------------------------------------------------------
class Spec:
    """One timed configuration: a policy, a KV rule and how often the policy is consulted."""

    def __init__(self, policy, kv_rule="latest", check_every=1):
        self.policy, self.kv_rule, self.check_every = policy, kv_rule, check_every

    def run(self, ckpt, prompt, new_tokens, cap, seed, keep_logits=False):
        return generate(ckpt, prompt, new_tokens, self.policy, greedy=True, seed=seed, max_loops=cap,
                        kv_rule=self.kv_rule, check_every=self.check_every,
                        keep_logits=keep_logits)


def time_specs(ckpt, prompts, specs, new_tokens, repeats, cap, seed):
    """specs {name: Spec} -> ({name: generations of the first repeat}, {name: tokens/s per repeat}).
    Every prompt runs every spec, in an order rotated per prompt and repeat."""
    gens = {name: [] for name in specs}
    tps = {name: [] for name in specs}
    for spec in specs.values():  # warm-up
        spec.run(ckpt, prompts[0], min(new_tokens, 4), cap, seed)
    names = list(specs)
    for rep in range(repeats):
        steps = {name: 0 for name in names}
        secs = {name: 0.0 for name in names}
        for i, prompt in enumerate(prompts):
            k = (rep + i) % len(names)
            for name in names[k:] + names[:k]:
                g = specs[name].run(ckpt, prompt, new_tokens, cap, seed, keep_logits=rep == 0)
                steps[name] += g.decode_steps
                secs[name] += g.decode_s
                if rep == 0:
                    gens[name].append(g)
        for name in names:
            tps[name].append(steps[name] / secs[name])
    return gens, tps


def median_ratio(num, den):
    return statistics.median(a / b for a, b in zip(num, den))


def run_cost(cost: CostModel, gen, spec: Spec) -> float:
    """FLOP proxy of a generation's decode steps (the first new token comes from the prefill)."""
    policy, prompt_len = spec.policy, len(gen.prompt_ids)
    min_loops = getattr(policy, "min_loops", 1)
    total = 0.0
    for k, (loops, readouts) in enumerate(zip(gen.decode_exit_loops, gen.step_readouts)):
        consults = 0 if isinstance(policy, Uniform) else max(loops - min_loops, -1) // spec.check_every + 1
        kl = consults if getattr(policy, "needs_readout", False) else 0
        total += cost.step(prompt_len + k + 1, loops, readouts, consults, kl)
    return total


# -- one checkpoint --------------------------------------------------------------------------------
def bench_checkpoint(path, args) -> dict:
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    r_bar = ckpt.recipe.depth
    cap = args.max_loops or ckpt.recipe.r_max
    windows = ckpt.windows("eval")
    n_cal = min(args.windows, len(windows) - 1)
    cal_windows = windows[:n_cal]
    prompt_rows = windows[n_cal:n_cal + args.prompts]
    if len(prompt_rows) < args.prompts:
        prompt_rows = windows[:args.prompts]
    prompt_len = max(1, min(args.prompt_len, cfg.max_seq_len - args.new_tokens, windows.shape[1]))
    prompts = [row[:prompt_len].tolist() for row in prompt_rows]
    every = args.check_every if args.check_every > 1 else 0
    log(f"\n== {path}  (checkpoint {ckpt.checkpoint_id}; d {cfg.d_model}, layers {cfg.n_prelude}/{cfg.n_core}/"
        f"{cfg.n_coda}, vocab {cfg.vocab_size}; r_bar {r_bar}, loop cap {cap}; {torch.get_num_threads()} thread(s))")
    log(f"calibration: {n_cal} eval windows x {windows.shape[1] - 1} tokens, teacher-forced, KV rule 'latest'")

    cal = Calibrator(ckpt, cal_windows, cap, args.seed, args.tf_batch)
    a0 = cal.evaluate(Uniform(r_bar))
    target = a0.loss + args.tolerance
    log(f"  target: A0@{r_bar} loss {a0.loss:.5f} + {args.tolerance} = {target:.5f}")
    eps, a1, a1_ok = cal.match(lambda th: ConvergenceExit(th, r_max=cap), EPS_GRID, target, args.bisect)
    delta, lat, lat_ok = cal.match(lambda th: LatentDiff(th, r_max=cap), DELTA_GRID, target, args.bisect)
    if every:  # checks at loops n + 1, 2n + 1, ...: KL(p_i || p_{i-n}) from loop 1's readout on (none of p_0)
        eps_n, a1n, a1n_ok = cal.match(lambda th: ConvergenceExit(th, min_loops=every + 1, r_max=cap), EPS_GRID,
                                       target, args.bisect, check_every=every)
    if not args.no_a2:
        t = time.perf_counter()
        probe = load_or_train_probes(ckpt, cap, args.seed, kinds=("kl",))["kl"]
        held = probe.metrics.get("heldout", {})
        log(f"  A2 probe on A1's labels (KL >= {probe.label_eps:g} after the loop): held-out AUC "
            f"{held.get('auc', float('nan')):.3f}, accuracy {held.get('accuracy', float('nan')):.3f} "
            f"({time.perf_counter() - t:.1f}s)")
        tau, a2, a2_ok = cal.match(lambda th: LinearRouter(probe, th, r_max=cap), TAU_GRID, target, args.bisect)
        # under "latest", A2's own exits make the stale keys help (docs/BENCHMARKS.md, the KV rule and
        # A2's loss); the exact rule ("recompute" = the masking harness) needs its own threshold
        tau_rec, a2_rec, a2_rec_ok = cal.match(lambda th: LinearRouter(probe, th, r_max=cap), TAU_GRID, target,
                                               args.bisect, kv_rule="recompute")
    lo, hi = max(1, math.floor(a1.mean_loops)), max(1, math.ceil(a1.mean_loops))
    a0_lo, a0_hi = cal.evaluate(Uniform(lo)), cal.evaluate(Uniform(hi))
    loss_a0_at_m = a0_lo.loss + (a1.mean_loops - lo) * (a0_hi.loss - a0_lo.loss) if hi > lo else a0_lo.loss
    m_round = max(1, int(round(a1.mean_loops)))
    a0_m = cal.evaluate(Uniform(m_round))

    log("faithfulness (same windows):")
    p_a1, p_lat = ConvergenceExit(eps, r_max=cap), LatentDiff(delta, r_max=cap)
    harness_a1, harness_lat = cal.harness(p_a1), cal.harness(p_lat)
    rec_a1 = cal.evaluate(p_a1, "recompute", "decode")
    rec_lat = cal.evaluate(p_lat, "recompute", "decode")
    harness_a2 = None if args.no_a2 else cal.harness(LinearRouter(probe, tau, r_max=cap))

    specs = {f"A0@{r_bar}": Spec(Uniform(r_bar)), f"A1 eps={eps:.3g}": Spec(p_a1),
             f"latent delta={delta:.3g}": Spec(p_lat), f"A0@{m_round} (A1's mean)": Spec(Uniform(m_round))}
    tf_of = {f"A0@{r_bar}": a0, f"A1 eps={eps:.3g}": a1, f"latent delta={delta:.3g}": lat,
             f"A0@{m_round} (A1's mean)": a0_m}
    if every:
        name = f"A1 every {every} eps={eps_n:.3g}"
        specs[name], tf_of[name] = Spec(ConvergenceExit(eps_n, min_loops=every + 1, r_max=cap),
                                        check_every=every), a1n
    if not args.no_a2:
        name = f"A2 KL-probe tau={tau:.3g}"
        specs[name], tf_of[name] = Spec(LinearRouter(probe, tau, r_max=cap)), a2
    rec_name = f"latent delta={delta:.3g} 'recompute'"
    specs[rec_name], tf_of[rec_name] = Spec(p_lat, "recompute"), rec_lat
    names = list(specs)
    log(f"timing: {len(prompts)} prompts x {prompt_len} tokens, {args.new_tokens} new tokens, greedy, batch 1, "
        f"{args.repeats} interleaved repeat(s)")
    gens, tps = time_specs(ckpt, prompts, specs, args.new_tokens, args.repeats, cap, args.seed)

    cost = CostModel(cfg)
    base = names[0]
    base_cost = sum(run_cost(cost, g, specs[base]) for g in gens[base])
    rows = {}
    for name in names:
        gl = gens[name]
        rows[name] = dict(
            loss=tf_of[name].loss, tf_loops=tf_of[name].mean_loops,
            tokens_per_s=statistics.median(tps[name]),
            decode_s=sum(g.decode_s for g in gl) / len(gl),
            prefill_s=sum(g.prefill_s for g in gl) / len(gl),
            mean_loops=float(np.mean([x for g in gl for x in g.decode_exit_loops])),
            readouts_per_token=sum(g.readouts for g in gl) / max(1, sum(g.decode_steps for g in gl)),
            flop_proxy_speedup=base_cost / sum(run_cost(cost, g, specs[name]) for g in gl),
            realized_speedup=median_ratio(tps[name], tps[base]),
        )
    drift = {}
    for name in names[1:3]:
        d = [generation_drift(ckpt, g, cap, seed=args.seed) for g in gens[name]]
        drift[name] = dict(kl_mean=float(np.mean([x.kl_mean for x in d])), kl_max=max(x.kl_max for x in d),
                           argmax_agree=float(np.mean([x.argmax_agree for x in d])))

    # -- report -----------------------------------------------------------------------------------
    log(f"\n{'policy':36s} {'tf loss':>8s} {'tf loops':>8s} {'dec loops':>9s} {'ro/tok':>6s} {'tok/s':>8s} "
        f"{'wall s':>7s} {'FLOP-proxy x':>12s} {'realized x':>10s}")
    for name, r in rows.items():
        log(f"{name:36s} {r['loss']:8.5f} {r['tf_loops']:8.3f} {r['mean_loops']:9.3f} {r['readouts_per_token']:6.2f} "
            f"{r['tokens_per_s']:8.1f} {r['decode_s']:7.3f} {r['flop_proxy_speedup']:12.3f} "
            f"{r['realized_speedup']:10.3f}")
    log("(tf = teacher-forced on the calibration windows; dec loops, ro/tok (coda + head passes per token), "
        "tok/s, wall s (decode per prompt) and both speedups from the timed generations, vs the first row)")
    log(f"matched loss (<= {target:.5f}): A1 {a1_ok} (eps {eps:.3g}), latent {lat_ok} (delta {delta:.3g})"
        + (f", A1 every {every} {a1n_ok} (eps {eps_n:.3g})" if every else "")
        + (f", A2 {a2_ok} (tau {tau:.3g})" if not args.no_a2 else ""))
    log(f"equal compute: A0 at A1's mean loops {a1.mean_loops:.3f} has loss {loss_a0_at_m:.5f} (interpolated between "
        f"A0@{lo} {a0_lo.loss:.5f} and A0@{hi} {a0_hi.loss:.5f}); A1 - that = {a1.loss - loss_a0_at_m:+.5f} nats")
    log(f"masking harness (recur_core.analysis.harness): A1 loss {harness_a1.loss:.5f} loops {harness_a1.mean_loops:.3f}; "
        f"latent loss {harness_lat.loss:.5f} loops {harness_lat.mean_loops:.3f}")
    log(f"teacher-forced decode - harness: A1 'latest' {a1.loss - harness_a1.loss:+.5f}, "
        f"A1 'recompute' {rec_a1.loss - harness_a1.loss:+.5f}, latent 'latest' {lat.loss - harness_lat.loss:+.5f}, "
        f"latent 'recompute' {rec_lat.loss - harness_lat.loss:+.5f} nats"
        + ("" if harness_a2 is None else f", A2 'latest' {a2.loss - harness_a2.loss:+.5f} (harness loss "
                                          f"{harness_a2.loss:.5f}, loops {harness_a2.mean_loops:.3f})"))
    if not args.no_a2:
        log(f"A2 matched under 'latest' with tau {tau:.3g} at {a2.mean_loops:.3f} loops; under 'recompute' (the masking "
            f"harness) {'with' if a2_rec_ok else 'not even with'} tau {tau_rec:.3g} at {a2_rec.mean_loops:.3f} loops "
            f"(loss {a2_rec.loss:.5f})")
    log(f"KV rules, latent policy: 'recompute' {rows[rec_name]['tokens_per_s']:.1f} tok/s (loss {rec_lat.loss:.5f}) "
        f"vs 'latest' {rows[names[2]]['tokens_per_s']:.1f} tok/s (loss {lat.loss:.5f})")
    for name, d in drift.items():
        log(f"drift of halted tokens' kept logits vs depth {cap} ({name}): mean KL {d['kl_mean']:.2e}, "
            f"max KL {d['kl_max']:.2e}, argmax unchanged {100 * d['argmax_agree']:.1f}%")
    a1_row, lat_row = rows[names[1]], rows[names[2]]
    out = dict(
        checkpoint=str(path), r_bar=r_bar, loop_cap=cap, threads=torch.get_num_threads(),
        calibration_windows=n_cal, prompts=len(prompts), prompt_len=prompt_len, new_tokens=args.new_tokens,
        loss_a0=a0.loss, loss_a1=a1.loss, loss_latent=lat.loss, eps_a1=eps, delta_latent=delta,
        matched_a1=a1_ok, matched_latent=lat_ok,
        mean_loops_a1=a1.mean_loops, mean_loops_latent=lat.mean_loops,
        mean_loops_a1_decode=a1_row["mean_loops"], mean_loops_latent_decode=lat_row["mean_loops"],
        realized_speedup=a1_row["realized_speedup"], flop_proxy_speedup=a1_row["flop_proxy_speedup"],
        realized_speedup_latent=lat_row["realized_speedup"], flop_proxy_speedup_latent=lat_row["flop_proxy_speedup"],
        readouts_per_token_a1=a1_row["readouts_per_token"],
        loss_a0_at_mean_loops_a1=loss_a0_at_m, mean_loops_a0_equal_compute=m_round,
        loss_a0_equal_compute=a0_m.loss, realized_speedup_a0_equal_compute=rows[names[3]]["realized_speedup"],
        loss_harness_a1=harness_a1.loss, loss_harness_latent=harness_lat.loss,
        loss_a1_recompute=rec_a1.loss, loss_latent_recompute=rec_lat.loss,
        tokens_per_s_latent_recompute=rows[rec_name]["tokens_per_s"], drift=drift,
        tokens_per_s={n: r["tokens_per_s"] for n, r in rows.items()},
        wall_s={n: r["decode_s"] for n, r in rows.items()}, rows=rows,
    )
    if every:
        name = f"A1 every {every} eps={eps_n:.3g}"
        out.update(check_every=every, eps_a1_every=eps_n, matched_a1_every=a1n_ok, loss_a1_every=a1n.loss,
                   mean_loops_a1_every=a1n.mean_loops, realized_speedup_a1_every=rows[name]["realized_speedup"],
                   flop_proxy_speedup_a1_every=rows[name]["flop_proxy_speedup"])
    if not args.no_a2:
        name = f"A2 KL-probe tau={tau:.3g}"
        out.update(tau_a2=tau, matched_a2=a2_ok, loss_a2=a2.loss, mean_loops_a2=a2.mean_loops,
                   loss_harness_a2=harness_a2.loss, tau_a2_recompute=tau_rec, matched_a2_recompute=a2_rec_ok,
                   loss_a2_recompute=a2_rec.loss, mean_loops_a2_recompute=a2_rec.mean_loops,
                   realized_speedup_a2=rows[name]["realized_speedup"],
                   flop_proxy_speedup_a2=rows[name]["flop_proxy_speedup"])
    return out


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    paths = args.ckpt or [p for p in DEFAULT_CKPTS if (ROOT / p).is_dir() or Path(p).is_dir()]
    if not paths:
        sys.exit(f"no checkpoint: pass --ckpt (defaults {', '.join(DEFAULT_CKPTS)} do not exist)")
    results = [bench_hops(p, args, CostModel, (EPS_GRID, DELTA_GRID, TAU_GRID)) if load_ground_truth(p) is not None
               else bench_checkpoint(p, args) for p in paths]
    out = dict(results[0])
    out["checkpoints"] = {r["checkpoint"]: r for r in results}
    print(json.dumps(out, default=float))


if __name__ == "__main__":
    main()
