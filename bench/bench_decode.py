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
  3. The FLOP proxy of the same runs (bench/cost.py): multiply-accumulates of prelude, core loops,
     coda, head and exit checks, with the real exit depths, readouts and context lengths; its ratio
     to A0 is the speedup the proxy predicts, to hold the realized speedup against.
  4. Faithfulness: teacher-forced decoding against the masking harness (recur_core.analysis.harness),
     the two KV rules, and how far halted tokens' kept logits drift from a full-depth
     recomputation of the generated text.

The last line of output is one JSON object (the first checkpoint's figures at the top level,
every checkpoint's under "checkpoints").

    python -m bench.bench_decode                      # checkpoints/demo-r8 and checkpoints/demo
    python -m bench.bench_decode --ckpt runs/demo/best --prompts 8 --new-tokens 128 --windows 8

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
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from recur_core import load_checkpoint
from recur_core.analysis.ground_truth import load_ground_truth
from recur_core.analysis.matching import Match
from recur_core.analysis.probe import ProbeSpec, load_or_train_probes
from recur_core.decoding.decode import generate, generation_drift
from recur_core.exits import catalogue
from recur_core.exits.policies import Policy, Uniform
from recur_core.settings import SETTINGS

from .calibrate import HarnessResult, LossCalibrator
from .cost import CostModel, generation_cost
from .hops_decode import bench_hops

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CKPTS = ("checkpoints/demo-r8", "checkpoints/demo")
A1, LATENT, A2 = (catalogue.FAMILIES[name] for name in ("A1", "latent", "A2"))


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
    p.add_argument("--hops-kv-rule", default="latest", choices=("latest", "recompute"),
                   help="on a checkpoint with ground truth: the KV rule of calibration and timing (\"recompute\" "
                        "is the rule the exact ground truth equals)")
    p.add_argument("--no-a2", action="store_true",
                   help="skip A2 (a linear probe on the state trained on A1's KL labels: a check that needs "
                        "no coda or head)")
    p.add_argument("--check-every", type=int, default=2,
                   help="also run A1 checked every n loops, at loops n + 1, 2n + 1, ... (KL(p_i || p_i-n), "
                        "its own eps); 0 or 1: skip")
    return p.parse_args(argv)


def log(*args):
    print(*args, flush=True)


# -- the workload ----------------------------------------------------------------------------------
@dataclass
class Workload:
    """One checkpoint's calibration windows and timed prompts, its depths and A1's check interval
    (every: 0 when A1 checked every n loops is not run)."""
    path: str
    ckpt: object
    r_bar: int
    cap: int
    cal_windows: torch.Tensor
    prompts: list[list[int]]
    prompt_len: int
    every: int


def load_workload(path, args) -> Workload:
    """The first --windows eval windows calibrate; the next --prompts windows' first tokens are the prompts."""
    ckpt = load_checkpoint(path)
    windows = ckpt.windows("eval")
    n_cal = min(args.windows, len(windows) - 1)
    prompt_rows = windows[n_cal:n_cal + args.prompts]
    if len(prompt_rows) < args.prompts:
        prompt_rows = windows[:args.prompts]
    prompt_len = max(1, min(args.prompt_len, ckpt.config.max_seq_len - args.new_tokens, windows.shape[1]))
    return Workload(path=path, ckpt=ckpt, r_bar=ckpt.recipe.depth, cap=args.max_loops or ckpt.recipe.r_max,
                    cal_windows=windows[:n_cal], prompts=[row[:prompt_len].tolist() for row in prompt_rows],
                    prompt_len=prompt_len, every=args.check_every if args.check_every > 1 else 0)


def log_workload(work: Workload) -> None:
    cfg, windows = work.ckpt.config, work.cal_windows
    log(f"\n== {work.path}  (checkpoint {work.ckpt.checkpoint_id}; d {cfg.d_model}, layers {cfg.n_prelude}/"
        f"{cfg.n_core}/{cfg.n_coda}, vocab {cfg.vocab_size}; r_bar {work.r_bar}, loop cap {work.cap}; "
        f"{torch.get_num_threads()} thread(s))")
    log(f"calibration: {len(windows)} eval windows x {windows.shape[1] - 1} tokens, teacher-forced, KV rule 'latest'")


# -- calibration -----------------------------------------------------------------------------------
@dataclass
class Calibration:
    """A0@r_bar's teacher-forced result, the loss target, and each policy's matched threshold
    (None: not run)."""
    a0: object
    target: float
    a1: Match
    latent: Match
    a1_every: Match | None
    a2: Match | None
    a2_recompute: Match | None


def calibrate(calibrator: LossCalibrator, work: Workload, args) -> Calibration:
    """Every policy's threshold matched to A0@r_bar's loss + --tolerance."""
    cap = work.cap
    a0 = calibrator.evaluate(Uniform(work.r_bar))
    target = a0.loss + args.tolerance
    log(f"  target: A0@{work.r_bar} loss {a0.loss:.5f} + {args.tolerance} = {target:.5f}")
    a1 = calibrator.match(lambda th: catalogue.make("A1", th, r_max=cap), A1.calibration, target, args.bisect)
    latent = calibrator.match(lambda th: catalogue.make("latent", th, r_max=cap), LATENT.calibration, target,
                              args.bisect)
    a1_every = None
    if work.every:  # checks at loops n + 1, 2n + 1, ...: KL(p_i || p_{i-n}) from loop 1's readout on (none of p_0)
        a1_every = calibrator.match(lambda th: catalogue.make("A1", th, min_loops=work.every + 1, r_max=cap),
                             A1.calibration, target, args.bisect, check_every=work.every)
    a2 = a2_recompute = None
    if not args.no_a2:
        probe = kl_probe(work, args.seed)
        a2 = calibrator.match(lambda th: catalogue.make("A2", th, r_max=cap, probe=probe), A2.calibration,
                              target, args.bisect)
        # under "latest", A2's own exits make the stale keys help (docs/BENCHMARKS.md, the KV rule and
        # A2's loss); the exact rule ("recompute" = the masking harness) needs its own threshold
        a2_recompute = calibrator.match(lambda th: catalogue.make("A2", th, r_max=cap, probe=probe), A2.calibration,
                                        target, args.bisect, kv_rule="recompute")
    return Calibration(a0=a0, target=target, a1=a1, latent=latent, a1_every=a1_every, a2=a2,
                       a2_recompute=a2_recompute)


def kl_probe(work: Workload, seed: int):
    """A2's probe, trained on A1's KL labels (or read from the cache)."""
    t = time.perf_counter()
    probe = load_or_train_probes(work.ckpt, work.cap, seed, ProbeSpec(kinds=("kl",)))["kl"]
    held = probe.metrics.get("heldout", {})
    log(f"  A2 probe on A1's labels (KL >= {probe.label_eps:g} after the loop): held-out AUC "
        f"{held.get('auc', float('nan')):.3f}, accuracy {held.get('accuracy', float('nan')):.3f} "
        f"({time.perf_counter() - t:.1f}s)")
    return probe


@dataclass
class EqualCompute:
    """Uniform depth at A1's mean loops: A0 at its floor and ceiling, the loss interpolated between
    them at the mean, and A0 at the rounded mean (timed)."""
    lo: int
    hi: int
    at_lo: object
    at_hi: object
    loss_at_mean: float
    rounded: int
    at_rounded: object


def equal_compute(calibrator: LossCalibrator, a1) -> EqualCompute:
    mean = a1.mean_loops
    lo, hi = max(1, math.floor(mean)), max(1, math.ceil(mean))
    at_lo, at_hi = calibrator.evaluate(Uniform(lo)), calibrator.evaluate(Uniform(hi))
    loss_at_mean = at_lo.loss + (mean - lo) * (at_hi.loss - at_lo.loss) if hi > lo else at_lo.loss
    rounded = max(1, int(round(mean)))
    return EqualCompute(lo=lo, hi=hi, at_lo=at_lo, at_hi=at_hi, loss_at_mean=loss_at_mean, rounded=rounded,
                        at_rounded=calibrator.evaluate(Uniform(rounded)))


@dataclass
class Faithfulness:
    """On the calibration windows: the masking harness for A1, the latent rule and A2 (None: not
    run), and A1 and the latent rule teacher-forced under the 'recompute' KV rule."""
    harness_a1: HarnessResult
    harness_latent: HarnessResult
    recompute_a1: object
    recompute_latent: object
    harness_a2: HarnessResult | None


def faithfulness(calibrator: LossCalibrator, calib: Calibration) -> Faithfulness:
    log("faithfulness (same windows):")
    return Faithfulness(harness_a1=calibrator.harness(calib.a1.policy),
                        harness_latent=calibrator.harness(calib.latent.policy),
                        recompute_a1=calibrator.evaluate(calib.a1.policy, "recompute", "decode"),
                        recompute_latent=calibrator.evaluate(calib.latent.policy, "recompute", "decode"),
                        harness_a2=None if calib.a2 is None else calibrator.harness(calib.a2.policy))


# -- timing ----------------------------------------------------------------------------------------
class Spec:
    """What one timed configuration runs: a policy, a KV rule and how often the policy is consulted."""

    def __init__(self, policy: Policy, kv_rule=SETTINGS.kv_rule, check_every=1):
        self.policy, self.kv_rule, self.check_every = policy, kv_rule, check_every

    def run(self, ckpt, prompt, new_tokens, cap, seed, keep_logits=False):
        return generate(ckpt, prompt, new_tokens, self.policy, greedy=True, seed=seed, max_loops=cap,
                        kv_rule=self.kv_rule, check_every=self.check_every,
                        keep_logits=keep_logits)

    def cost(self, cost: CostModel, gens) -> float:
        """FLOP proxy of these generations' decode steps."""
        return sum(generation_cost(cost, g, self.policy, self.check_every) for g in gens)


@dataclass
class Timed:
    """A timed configuration: its label in the table, what runs, and its teacher-forced result."""
    label: str
    spec: Spec
    tf: object


def timed_configs(work: Workload, calib: Calibration, equal: EqualCompute, faith: Faithfulness) -> dict[str, Timed]:
    """The timed configurations by role, in table order (the first, A0@r_bar, is the baseline)."""
    a1, latent = calib.a1, calib.latent
    timed = {"a0": Timed(f"A0@{work.r_bar}", Spec(Uniform(work.r_bar)), calib.a0),
             "a1": Timed(f"A1 eps={a1.threshold:.3g}", Spec(a1.policy), a1.result),
             "latent": Timed(f"latent delta={latent.threshold:.3g}", Spec(latent.policy), latent.result),
             "a0_equal_compute": Timed(f"A0@{equal.rounded} (A1's mean)", Spec(Uniform(equal.rounded)),
                                       equal.at_rounded)}
    if calib.a1_every is not None:
        timed["a1_every"] = Timed(f"A1 every {work.every} eps={calib.a1_every.threshold:.3g}",
                                  Spec(calib.a1_every.policy, check_every=work.every), calib.a1_every.result)
    if calib.a2 is not None:
        timed["a2"] = Timed(f"A2 KL-probe tau={calib.a2.threshold:.3g}", Spec(calib.a2.policy), calib.a2.result)
    timed["latent_recompute"] = Timed(f"latent delta={latent.threshold:.3g} 'recompute'",
                                      Spec(latent.policy, "recompute"), faith.recompute_latent)
    return timed


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
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


@dataclass
class Row:
    """One timed configuration's figures: teacher-forced loss and loops, then the timed generations'
    tokens/s, decode and prefill seconds per prompt, mean exit loops, coda + head passes per token,
    and both speedups over A0@r_bar."""
    loss: float
    tf_loops: float
    tokens_per_s: float
    decode_s: float
    prefill_s: float
    mean_loops: float
    readouts_per_token: float
    flop_proxy_speedup: float
    realized_speedup: float


def table_rows(timed: dict[str, Timed], gens: dict, tps: dict, cost: CostModel) -> dict[str, Row]:
    """{role: Row}, both speedups against A0@r_bar."""
    base_cost = timed["a0"].spec.cost(cost, gens["a0"])
    rows = {}
    for role, t in timed.items():
        gl = gens[role]
        rows[role] = Row(
            loss=t.tf.loss, tf_loops=t.tf.mean_loops,
            tokens_per_s=statistics.median(tps[role]),
            decode_s=sum(g.decode_s for g in gl) / len(gl),
            prefill_s=sum(g.prefill_s for g in gl) / len(gl),
            mean_loops=float(np.mean([x for g in gl for x in g.decode_exit_loops])),
            readouts_per_token=sum(g.readouts for g in gl) / max(1, sum(g.decode_steps for g in gl)),
            flop_proxy_speedup=base_cost / t.spec.cost(cost, gl),
            realized_speedup=median_ratio(tps[role], tps["a0"]),
        )
    return rows


def halted_drift(work: Workload, gens: dict, seed: int) -> dict[str, dict]:
    """{role: drift} of A1's and the latent rule's generations: how far halted tokens' kept logits
    are from a full-depth recomputation of the generated text."""
    drift = {}
    for role in ("a1", "latent"):
        d = [generation_drift(work.ckpt, g, work.cap, seed=seed) for g in gens[role]]
        drift[role] = dict(kl_mean=float(np.mean([x.kl_mean for x in d])), kl_max=max(x.kl_max for x in d),
                           argmax_agree=float(np.mean([x.argmax_agree for x in d])))
    return drift


# -- one checkpoint --------------------------------------------------------------------------------
@dataclass
class CheckpointRun:
    """Everything one checkpoint's benchmark measured (rows and drift keyed by timed_configs' roles)."""
    work: Workload
    calib: Calibration
    equal: EqualCompute
    faith: Faithfulness
    timed: dict[str, Timed]
    rows: dict[str, Row]
    drift: dict[str, dict]


def bench_checkpoint(path, args) -> dict:
    work = load_workload(path, args)
    log_workload(work)
    calibrator = LossCalibrator(work.ckpt, work.cal_windows, work.cap, args.seed, args.tf_batch)
    calib = calibrate(calibrator, work, args)
    equal = equal_compute(calibrator, calib.a1.result)
    faith = faithfulness(calibrator, calib)
    timed = timed_configs(work, calib, equal, faith)
    log(f"timing: {len(work.prompts)} prompts x {work.prompt_len} tokens, {args.new_tokens} new tokens, greedy, "
        f"batch 1, {args.repeats} interleaved repeat(s)")
    gens, tps = time_specs(work.ckpt, work.prompts, {role: t.spec for role, t in timed.items()}, args.new_tokens,
                           args.repeats, work.cap, args.seed)
    rows = table_rows(timed, gens, tps, CostModel(work.ckpt.config))
    run = CheckpointRun(work, calib, equal, faith, timed, rows, halted_drift(work, gens, args.seed))
    report_table(run)
    report_checks(run)
    return summary(run, args)


# -- report ----------------------------------------------------------------------------------------
def report_table(run: CheckpointRun) -> None:
    log(f"\n{'policy':36s} {'tf loss':>8s} {'tf loops':>8s} {'dec loops':>9s} {'ro/tok':>6s} {'tok/s':>8s} "
        f"{'wall s':>7s} {'FLOP-proxy x':>12s} {'realized x':>10s}")
    for role, r in run.rows.items():
        log(f"{run.timed[role].label:36s} {r.loss:8.5f} {r.tf_loops:8.3f} {r.mean_loops:9.3f} "
            f"{r.readouts_per_token:6.2f} {r.tokens_per_s:8.1f} {r.decode_s:7.3f} {r.flop_proxy_speedup:12.3f} "
            f"{r.realized_speedup:10.3f}")
    log("(tf = teacher-forced on the calibration windows; dec loops, ro/tok (coda + head passes per token), "
        "tok/s, wall s (decode per prompt) and both speedups from the timed generations, vs the first row)")


def report_checks(run: CheckpointRun) -> None:
    """The matches, uniform depth at equal compute, the harness and KV-rule checks and the drift."""
    c, e, f, w = run.calib, run.equal, run.faith, run.work
    a1, latent = c.a1.result, c.latent.result
    log(f"matched loss (<= {c.target:.5f}): A1 {c.a1.matched} (eps {c.a1.threshold:.3g}), latent "
        f"{c.latent.matched} (delta {c.latent.threshold:.3g})"
        + ("" if c.a1_every is None else f", A1 every {w.every} {c.a1_every.matched} (eps {c.a1_every.threshold:.3g})")
        + ("" if c.a2 is None else f", A2 {c.a2.matched} (tau {c.a2.threshold:.3g})"))
    log(f"equal compute: A0 at A1's mean loops {a1.mean_loops:.3f} has loss {e.loss_at_mean:.5f} (interpolated "
        f"between A0@{e.lo} {e.at_lo.loss:.5f} and A0@{e.hi} {e.at_hi.loss:.5f}); A1 - that = "
        f"{a1.loss - e.loss_at_mean:+.5f} nats")
    log(f"masking harness (recur_core.analysis.harness): A1 loss {f.harness_a1.loss:.5f} loops "
        f"{f.harness_a1.mean_loops:.3f}; latent loss {f.harness_latent.loss:.5f} loops "
        f"{f.harness_latent.mean_loops:.3f}")
    log(f"teacher-forced decode - harness: A1 'latest' {a1.loss - f.harness_a1.loss:+.5f}, "
        f"A1 'recompute' {f.recompute_a1.loss - f.harness_a1.loss:+.5f}, latent 'latest' "
        f"{latent.loss - f.harness_latent.loss:+.5f}, latent 'recompute' "
        f"{f.recompute_latent.loss - f.harness_latent.loss:+.5f} nats"
        + ("" if f.harness_a2 is None else f", A2 'latest' {c.a2.result.loss - f.harness_a2.loss:+.5f} (harness "
                                           f"loss {f.harness_a2.loss:.5f}, loops {f.harness_a2.mean_loops:.3f})"))
    if c.a2 is not None:
        rec = c.a2_recompute
        log(f"A2 matched under 'latest' with tau {c.a2.threshold:.3g} at {c.a2.result.mean_loops:.3f} loops; under "
            f"'recompute' (the masking harness) {'with' if rec.matched else 'not even with'} tau {rec.threshold:.3g} "
            f"at {rec.result.mean_loops:.3f} loops (loss {rec.result.loss:.5f})")
    log(f"KV rules, latent policy: 'recompute' {run.rows['latent_recompute'].tokens_per_s:.1f} tok/s (loss "
        f"{f.recompute_latent.loss:.5f}) vs 'latest' {run.rows['latent'].tokens_per_s:.1f} tok/s (loss "
        f"{latent.loss:.5f})")
    for role, d in run.drift.items():
        log(f"drift of halted tokens' kept logits vs depth {w.cap} ({run.timed[role].label}): mean KL "
            f"{d['kl_mean']:.2e}, max KL {d['kl_max']:.2e}, argmax unchanged {100 * d['argmax_agree']:.1f}%")


def summary(run: CheckpointRun, args) -> dict:
    """The checkpoint's figures, for the JSON line."""
    c, e, f, w, rows = run.calib, run.equal, run.faith, run.work, run.rows

    def by_label(figure) -> dict:
        return {run.timed[role].label: figure(r) for role, r in rows.items()}
    out = dict(
        checkpoint=str(w.path), r_bar=w.r_bar, loop_cap=w.cap, threads=torch.get_num_threads(),
        calibration_windows=len(w.cal_windows), prompts=len(w.prompts), prompt_len=w.prompt_len,
        new_tokens=args.new_tokens,
        loss_a0=c.a0.loss, loss_a1=c.a1.result.loss, loss_latent=c.latent.result.loss, eps_a1=c.a1.threshold,
        delta_latent=c.latent.threshold, matched_a1=c.a1.matched, matched_latent=c.latent.matched,
        mean_loops_a1=c.a1.result.mean_loops, mean_loops_latent=c.latent.result.mean_loops,
        mean_loops_a1_decode=rows["a1"].mean_loops, mean_loops_latent_decode=rows["latent"].mean_loops,
        realized_speedup=rows["a1"].realized_speedup, flop_proxy_speedup=rows["a1"].flop_proxy_speedup,
        realized_speedup_latent=rows["latent"].realized_speedup,
        flop_proxy_speedup_latent=rows["latent"].flop_proxy_speedup,
        readouts_per_token_a1=rows["a1"].readouts_per_token,
        loss_a0_at_mean_loops_a1=e.loss_at_mean, mean_loops_a0_equal_compute=e.rounded,
        loss_a0_equal_compute=e.at_rounded.loss,
        realized_speedup_a0_equal_compute=rows["a0_equal_compute"].realized_speedup,
        loss_harness_a1=f.harness_a1.loss, loss_harness_latent=f.harness_latent.loss,
        loss_a1_recompute=f.recompute_a1.loss, loss_latent_recompute=f.recompute_latent.loss,
        tokens_per_s_latent_recompute=rows["latent_recompute"].tokens_per_s,
        drift={run.timed[role].label: d for role, d in run.drift.items()},
        tokens_per_s=by_label(lambda r: r.tokens_per_s), wall_s=by_label(lambda r: r.decode_s),
        rows=by_label(asdict),
    )
    if c.a1_every is not None:
        out.update(check_every=w.every, eps_a1_every=c.a1_every.threshold, matched_a1_every=c.a1_every.matched,
                   loss_a1_every=c.a1_every.result.loss, mean_loops_a1_every=c.a1_every.result.mean_loops,
                   realized_speedup_a1_every=rows["a1_every"].realized_speedup,
                   flop_proxy_speedup_a1_every=rows["a1_every"].flop_proxy_speedup)
    if c.a2 is not None:
        rec = c.a2_recompute
        out.update(tau_a2=c.a2.threshold, matched_a2=c.a2.matched, loss_a2=c.a2.result.loss,
                   mean_loops_a2=c.a2.result.mean_loops, loss_harness_a2=f.harness_a2.loss,
                   tau_a2_recompute=rec.threshold, matched_a2_recompute=rec.matched,
                   loss_a2_recompute=rec.result.loss, mean_loops_a2_recompute=rec.result.mean_loops,
                   realized_speedup_a2=rows["a2"].realized_speedup,
                   flop_proxy_speedup_a2=rows["a2"].flop_proxy_speedup)
    return out


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    paths = args.ckpt or [p for p in DEFAULT_CKPTS if (ROOT / p).is_dir() or Path(p).is_dir()]
    if not paths:
        sys.exit(f"no checkpoint: pass --ckpt (defaults {', '.join(DEFAULT_CKPTS)} do not exist)")
    results = [bench_hops(p, args) if load_ground_truth(p) is not None else bench_checkpoint(p, args) for p in paths]
    out = dict(results[0])
    out["checkpoints"] = {r["checkpoint"]: r for r in results}
    print(json.dumps(out, default=float))


if __name__ == "__main__":
    main()
