"""`python -m bench.bench_decode` on a checkpoint with ground truth (issue 10, goal 5): batch-1 decoding of
held-out multi-hop programs, matched on **answer accuracy** instead of loss.

Decoding here is teacher-forced: each program is fed token by token through the real decoder
(`recur_core.decoding.teacher_forced`, mode "decode", KV rule "latest" unless --hops-kv-rule
"recompute", the rule the exact ground truth equals; batch 1), so every token halts
at its own loop exactly as in `generate`, and each answer token's prediction is scored against the
true value. (Free generation would sample the next query, which no model can predict.)

  1. Calibrate on the first --windows eval programs (decoded in lockstep batches), scoring the
     answers of the trained hop counts (as the ground truth does): A0 at r_bar's answer accuracy is
     the target; each policy's threshold (A1, the latent rule, A2 for every probe label kind) is the
     cheapest (fewest loops) whose accuracy is within --acc-tolerance of it. Uniform depths 1 .. cap are scored the same way.
  2. The best policy is the matched one with the fewest mean loops; the baseline is the **smallest
     uniform depth whose accuracy is within --acc-tolerance of that policy's** (and A0 at r_bar).
  3. Time batch-1 decoding of the next --prompts programs (each cut at its end, no padding) under
     the best policy and both baselines, interleaved, --repeats times; tokens/s = program tokens /
     decode time; the median repeat's ratios are reported, with the FLOP proxy of the same exits.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from recur_core import load_checkpoint
from recur_core.analysis.ground_truth import load_ground_truth, probe_answers
from recur_core.analysis.matching import Match
from recur_core.analysis.probe import ProbeSpec, load_or_train_probes
from recur_core.decoding.teacher_forced import teacher_forced
from recur_core.exits import catalogue
from recur_core.exits.policies import Uniform
from recur_core.settings import SETTINGS
from recur_core.tasks.hops import PAD

from .calibrate import Accuracy, AccuracyCalibrator
from .cost import CostModel, program_cost


def log(*args):
    print(*args, flush=True)


def program_rows(windows: torch.Tensor, pad: int) -> list[torch.Tensor]:
    """Each window (1, T + 1) cut after its program's last token (EOS padding dropped)."""
    rows = []
    for w in windows:
        used = int((w != pad).nonzero().max()) + 1  # the leading EOS is position 0
        rows.append(w[:used + 1][None] if used < len(w) else w[None])
    return rows


def time_policies(ckpt, rows, first_window, policies, repeats, cap, seed, kv_rule="latest"):
    """({name: [tokens/s per repeat]}, {name: [exit loops per program]}) of batch-1 teacher-forced
    decoding, in an order rotated per program and repeat (exits from the first repeat)."""
    names = list(policies)
    for p in policies.values():  # warm-up
        teacher_forced(ckpt, rows[0], p, kv_rule, seed=seed, max_loops=cap, batch_size=1)
    tps = {n: [] for n in names}
    exits = {n: [None] * len(rows) for n in names}
    for rep in range(repeats):
        secs = {n: 0.0 for n in names}
        tokens = 0
        for i, row in enumerate(rows):
            k = (rep + i) % len(names)
            for name in names[k:] + names[:k]:
                t = time.perf_counter()
                tf = teacher_forced(ckpt, row, policies[name], kv_rule, seed=seed, max_loops=cap, batch_size=1,
                                    first_window=first_window + i)
                secs[name] += time.perf_counter() - t
                if rep == 0:
                    exits[name][i] = tf.exit_loop[0].tolist()
            tokens += row.shape[1] - 1
        for name in names:
            tps[name].append(tokens / secs[name])
    return tps, exits


def match_policies(calibrator: AccuracyCalibrator, ckpt, cap: int, target: float, args) -> dict[str, Match]:
    """{"A1", "latent", "A2_<label kind>" for every probe kind that trains (unless --no-a2): the
    cheapest threshold whose accuracy is at least target}."""
    matched = {name: calibrator.match(lambda th, name=name: catalogue.make(name, th, r_max=cap),
                                      catalogue.FAMILIES[name].calibration, target, args.bisect)
               for name in ("A1", "latent")}
    if not args.no_a2:
        answers = probe_answers(ckpt.path, SETTINGS.probe_windows)  # labels matched on answers, as the card's
        for kind, probe in load_or_train_probes(ckpt, cap, args.seed, ProbeSpec(n_windows=SETTINGS.probe_windows),
                                                answers=answers).items():
            matched[f"A2_{kind}"] = calibrator.match(lambda th, probe=probe: catalogue.make("A2", th, r_max=cap, probe=probe),
                                                     catalogue.FAMILIES["A2"].calibration, target, args.bisect)
    return matched


def smallest_uniform_depth(uniform: dict[int, Accuracy], accuracy: float, cap: int) -> int:
    """The smallest uniform depth whose accuracy reaches `accuracy` (cap if none does)."""
    return next((r for r in range(1, cap + 1) if uniform[r].accuracy >= accuracy), cap)


def median_speedup(tps: dict, role: str, base: str) -> float:
    """Median over repeats of role's tokens/s over base's in the same repeat."""
    return statistics.median(x / y for x, y in zip(tps[role], tps[base], strict=True))


def report_timing(labels: dict[str, str], tps: dict, flops: dict) -> None:
    log(f"\n{'policy':36s} {'tok/s':>8s} {'vs A0@r_bar':>11s} {'vs best uniform':>15s} "
        f"{'FLOP-proxy vs best uniform':>26s}")
    for role, label in labels.items():
        log(f"{label:36s} {statistics.median(tps[role]):8.1f} {median_speedup(tps, role, 'a0'):11.3f} "
            f"{median_speedup(tps, role, 'uniform'):15.3f} {flops['uniform'] / flops[role]:26.3f}")


@dataclass
class HopsCalibration:
    """A0@r_bar's accuracy, every uniform depth's, each policy's match and the target they met."""
    a0: Accuracy
    target: float
    uniform: dict[int, Accuracy]
    matched: dict[str, Match]


def calibrate(calibrator: AccuracyCalibrator, ckpt, r_bar: int, cap: int, args) -> HopsCalibration:
    a0 = calibrator.evaluate(Uniform(r_bar))
    target = a0.accuracy - args.acc_tolerance
    log(f"  target: A0@{r_bar} answer accuracy {100 * a0.accuracy:.1f}% - {100 * args.acc_tolerance:g} points")
    uniform = {r: calibrator.evaluate(Uniform(r)) for r in range(1, cap + 1)}
    return HopsCalibration(a0=a0, target=target, uniform=uniform,
                           matched=match_policies(calibrator, ckpt, cap, target, args))


def bench_hops(path, args) -> dict:
    """The hops benchmark for one checkpoint; returns its figures (also printed)."""
    ckpt = load_checkpoint(path)
    hops, max_train_hops = load_ground_truth(path)
    r_bar, cap = ckpt.recipe.depth, args.max_loops or ckpt.recipe.r_max
    windows = ckpt.windows("eval")
    n_cal = min(args.windows, len(windows) - args.prompts)
    log(f"\n== {path}  (checkpoint {ckpt.checkpoint_id}; ground truth: hop counts, trained to {max_train_hops}; "
        f"r_bar {r_bar}, loop cap {cap}; {torch.get_num_threads()} thread(s))")
    log(f"calibration: {n_cal} held-out programs, teacher-forced decode, KV rule {args.hops_kv_rule!r}, answer "
        f"accuracy on the trained hop counts 1..{max_train_hops}")
    calibrator = AccuracyCalibrator(ckpt, windows[:n_cal], hops, cap, args.seed, args.tf_batch, max_train_hops,
                                    args.hops_kv_rule)
    calib = calibrate(calibrator, ckpt, r_bar, cap, args)
    ok = {name: m for name, m in calib.matched.items() if m.matched}
    if not ok:
        log("no policy reaches A0@r_bar's answer accuracy within the tolerance; nothing to time")
        return dict(checkpoint=str(path), matched=False, accuracy_a0_rbar=calib.a0.accuracy)
    best_name = min(ok, key=lambda name: ok[name].result.mean_loops)
    best, uniform = ok[best_name], calib.uniform
    best_uniform = smallest_uniform_depth(uniform, best.result.accuracy - args.acc_tolerance, cap)
    log(f"  best policy: {best_name} threshold {best.threshold:.4g} (accuracy {100 * best.result.accuracy:.1f}%, "
        f"{best.result.mean_loops:.3f} loops); smallest uniform depth within {100 * args.acc_tolerance:g} points "
        f"of it: {best_uniform} ({100 * uniform[best_uniform].accuracy:.1f}%)")

    rows = program_rows(windows[n_cal:n_cal + args.prompts], ckpt.tokenizer().token_to_id(PAD))
    labels = {"a0": f"A0@{r_bar}", "uniform": f"A0@{best_uniform} (best uniform)",
              "best": f"{best_name} {best.threshold:.4g}"}
    policies = {"a0": Uniform(r_bar), "uniform": Uniform(best_uniform), "best": best.policy}
    log(f"timing: {len(rows)} programs ({sum(r.shape[1] - 1 for r in rows)} tokens), batch 1, "
        f"{args.repeats} interleaved repeat(s)")
    tps, exits = time_policies(ckpt, rows, n_cal, policies, args.repeats, cap, args.seed, args.hops_kv_rule)
    cost = CostModel(ckpt.config)
    flops = {role: program_cost(cost, exits[role], p) for role, p in policies.items()}
    report_timing(labels, tps, flops)
    matched = calib.matched
    return dict(
        checkpoint=str(path), kv_rule=args.hops_kv_rule, r_bar=r_bar, loop_cap=cap, calibration_programs=n_cal,
        timed_programs=len(rows),
        accuracy_a0_rbar=calib.a0.accuracy, mean_loops_a0_rbar=calib.a0.mean_loops,
        accuracy_uniform={r: u.accuracy for r, u in uniform.items()},
        thresholds={n: m.threshold for n, m in matched.items()}, matched={n: m.matched for n, m in matched.items()},
        accuracy={n: m.result.accuracy for n, m in matched.items()},
        mean_loops={n: m.result.mean_loops for n, m in matched.items()},
        best_policy=best_name, best_uniform_depth=best_uniform, accuracy_best_uniform=uniform[best_uniform].accuracy,
        tokens_per_s={labels[role]: statistics.median(v) for role, v in tps.items()},
        realized_speedup_vs_best_uniform=median_speedup(tps, "best", "uniform"),
        realized_speedup_vs_a0_rbar=median_speedup(tps, "best", "a0"),
        flop_proxy_speedup_vs_best_uniform=flops["uniform"] / flops["best"],
        flop_proxy_speedup_vs_a0_rbar=flops["a0"] / flops["best"],
    )
