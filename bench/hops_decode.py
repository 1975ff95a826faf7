"""`bench_decode.py` on a checkpoint with ground truth (issue 10, goal 5): batch-1 decoding of
held-out multi-hop programs, matched on **answer accuracy** instead of loss.

Decoding here is teacher-forced: each program is fed token by token through the real decoder
(`recur_core.decode.teacher_forced`, mode "decode", KV rule "latest", batch 1), so every token halts
at its own loop exactly as in `generate`, and each answer token's prediction is scored against the
true value. (Free generation would sample the next query, which no model can predict.)

  1. Calibrate on the first --windows eval programs (decoded in lockstep batches): A0 at r_bar's
     answer accuracy is the target; each policy's threshold is the cheapest (fewest loops) whose
     accuracy is within --acc-tolerance of it. Uniform depths 1 .. cap are scored the same way.
  2. The best policy is the matched one with the fewest mean loops; the baseline is the **smallest
     uniform depth whose accuracy is within --acc-tolerance of that policy's** (and A0 at r_bar).
  3. Time batch-1 decoding of the next --prompts programs (each cut at its end, no padding) under
     the best policy and both baselines, interleaved, --repeats times; tokens/s = program tokens /
     decode time; the median repeat's ratios are reported, with the FLOP proxy of the same exits.
"""
from __future__ import annotations

import statistics
import time

import torch

from recur_core import load_checkpoint
from recur_core.decoding.decode import teacher_forced
from recur_core.analysis.ground_truth import load_ground_truth
from recur_core.exits.policies import ConvergenceExit, LatentDiff, LinearRouter, Uniform
from recur_core.analysis.probe import load_or_train_probes
from training.hops import PAD

from matching import match_threshold


def log(*args):
    print(*args, flush=True)


class AccuracyCalibrator:
    """Answer accuracy and mean loops (over program tokens) of policies, teacher-forced (memoised)."""

    def __init__(self, ckpt, windows, hops, cap, seed, batch):
        self.ckpt, self.windows, self.cap, self.seed, self.batch = ckpt, windows, cap, seed, batch
        targets = windows[:, 1:]
        self.answers = torch.as_tensor(hops[:len(windows), 1:] > 0)
        pad = ckpt.tokenizer().token_to_id(PAD)
        self.program = ~((windows[:, :-1] == pad) & (targets == pad))
        self.memo = {}

    def evaluate(self, policy):
        """(answer accuracy, mean loops over program tokens)."""
        key = repr(policy)
        if key not in self.memo:
            t = time.perf_counter()
            tf = teacher_forced(self.ckpt, self.windows, policy, "latest", seed=self.seed, max_loops=self.cap,
                                batch_size=self.batch, keep_logits=True)
            correct = tf.logits.argmax(-1) == self.windows[:, 1:]
            acc = float(correct[self.answers].float().mean())
            loops = float(tf.exit_loop[self.program].float().mean())
            self.memo[key] = (acc, loops)
            log(f"    {key:60s} answer acc {100 * acc:5.1f}%  mean loops {loops:6.3f}  "
                f"({time.perf_counter() - t:.1f}s)")
        return self.memo[key]

    def match(self, make, grid, target, bisect_steps):
        """Largest threshold on the grid (then bisected, log scale) whose accuracy >= target.
        Returns (threshold, (acc, loops), matched)."""
        return match_threshold(self.evaluate, make, grid, lambda res: res[0] >= target, bisect_steps)


def program_rows(windows: torch.Tensor, pad: int) -> list[torch.Tensor]:
    """Each window (1, T + 1) cut after its program's last token (EOS padding dropped)."""
    rows = []
    for w in windows:
        used = int((w != pad).nonzero().max()) + 1  # the leading EOS is position 0
        rows.append(w[:used + 1][None] if used < len(w) else w[None])
    return rows


def time_policies(ckpt, rows, first_window, policies, repeats, cap, seed):
    """({name: [tokens/s per repeat]}, {name: [exit loops per program]}) of batch-1 teacher-forced
    decoding, in an order rotated per program and repeat (exits from the first repeat)."""
    names = list(policies)
    for p in policies.values():  # warm-up
        teacher_forced(ckpt, rows[0], p, "latest", seed=seed, max_loops=cap, batch_size=1)
    tps = {n: [] for n in names}
    exits = {n: [None] * len(rows) for n in names}
    for rep in range(repeats):
        secs = {n: 0.0 for n in names}
        tokens = 0
        for i, row in enumerate(rows):
            k = (rep + i) % len(names)
            for name in names[k:] + names[:k]:
                t = time.perf_counter()
                tf = teacher_forced(ckpt, row, policies[name], "latest", seed=seed, max_loops=cap, batch_size=1,
                                    first_window=first_window + i)
                secs[name] += time.perf_counter() - t
                if rep == 0:
                    exits[name][i] = tf.exit_loop[0].tolist()
            tokens += row.shape[1] - 1
        for name in names:
            tps[name].append(tokens / secs[name])
    return tps, exits


def flop_proxy(cost, exits: list[list[int]], policy) -> float:
    """Multiply-accumulates of decoding programs with these exit loops under policy (bench_decode's CostModel)."""
    total = 0.0
    reads_every_loop = getattr(policy, "needs_readout", False)
    checks = not isinstance(policy, Uniform)
    for program in exits:
        for t, loops in enumerate(program):
            consults = loops if checks else 0
            total += cost.step(t + 1, loops, loops if reads_every_loop else 1, consults,
                               consults if reads_every_loop else 0)
    return total


def bench_hops(path, args, cost_model, grids) -> dict:
    """The hops benchmark for one checkpoint; returns its figures (also printed)."""
    eps_grid, delta_grid, tau_grid = grids
    ckpt = load_checkpoint(path)
    hops, max_train_hops = load_ground_truth(path)
    r_bar, cap = ckpt.recipe.depth, args.max_loops or ckpt.recipe.r_max
    windows = ckpt.windows("eval")
    n_cal = min(args.windows, len(windows) - args.prompts)
    pad = ckpt.tokenizer().token_to_id(PAD)
    log(f"\n== {path}  (checkpoint {ckpt.checkpoint_id}; ground truth: hop counts, trained to {max_train_hops}; "
        f"r_bar {r_bar}, loop cap {cap}; {torch.get_num_threads()} thread(s))")
    log(f"calibration: {n_cal} held-out programs, teacher-forced decode, KV rule 'latest', answer accuracy")
    cal = AccuracyCalibrator(ckpt, windows[:n_cal], hops, cap, args.seed, args.tf_batch)
    acc_rbar, loops_rbar = cal.evaluate(Uniform(r_bar))
    target = acc_rbar - args.acc_tolerance
    log(f"  target: A0@{r_bar} answer accuracy {100 * acc_rbar:.1f}% - {100 * args.acc_tolerance:g} points")
    uniform = {r: cal.evaluate(Uniform(r)) for r in range(1, cap + 1)}
    matched = {}
    for name, make, grid in (("A1", lambda th: ConvergenceExit(th, r_max=cap), eps_grid),
                             ("latent", lambda th: LatentDiff(th, r_max=cap), delta_grid)):
        matched[name] = (make,) + cal.match(make, grid, target, args.bisect)
    if not args.no_a2:
        probe = load_or_train_probes(ckpt, cap, args.seed, kinds=("kl",))["kl"]
        make = lambda th: LinearRouter(probe, th, r_max=cap)
        matched["A2"] = (make,) + cal.match(make, tau_grid, target, args.bisect)
    ok = {n: m for n, m in matched.items() if m[3]}
    if not ok:
        log("no policy reaches A0@r_bar's answer accuracy within the tolerance; nothing to time")
        return dict(checkpoint=str(path), matched=False, accuracy_a0_rbar=acc_rbar)
    best = min(ok, key=lambda n: ok[n][2][1])
    make, th, (acc_best, loops_best), _ = ok[best]
    best_uniform = next((r for r in range(1, cap + 1) if uniform[r][0] >= acc_best - args.acc_tolerance), cap)
    log(f"  best policy: {best} threshold {th:.4g} (accuracy {100 * acc_best:.1f}%, {loops_best:.3f} loops); "
        f"smallest uniform depth within {100 * args.acc_tolerance:g} points of it: {best_uniform} "
        f"({100 * uniform[best_uniform][0]:.1f}%)")

    first = n_cal
    rows = program_rows(windows[first:first + args.prompts], pad)
    policies = {f"A0@{r_bar}": Uniform(r_bar), f"A0@{best_uniform} (best uniform)": Uniform(best_uniform),
                f"{best} {th:.4g}": make(th)}
    log(f"timing: {len(rows)} programs ({sum(r.shape[1] - 1 for r in rows)} tokens), batch 1, "
        f"{args.repeats} interleaved repeat(s)")
    tps, exits = time_policies(ckpt, rows, first, policies, args.repeats, cap, args.seed)
    names = list(policies)
    cost = cost_model(ckpt.config)
    flops = {n: flop_proxy(cost, exits[n], p) for n, p in policies.items()}
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(tps[a], tps[b]))
    log(f"\n{'policy':36s} {'tok/s':>8s} {'vs A0@r_bar':>11s} {'vs best uniform':>15s} {'FLOP-proxy vs best uniform':>26s}")
    for n in names:
        log(f"{n:36s} {statistics.median(tps[n]):8.1f} {ratio(n, names[0]):11.3f} {ratio(n, names[1]):15.3f} "
            f"{flops[names[1]] / flops[n]:26.3f}")
    return dict(
        checkpoint=str(path), r_bar=r_bar, loop_cap=cap, calibration_programs=n_cal, timed_programs=len(rows),
        accuracy_a0_rbar=acc_rbar, mean_loops_a0_rbar=loops_rbar,
        accuracy_uniform={r: a for r, (a, _) in uniform.items()},
        thresholds={n: m[1] for n, m in matched.items()}, matched={n: m[3] for n, m in matched.items()},
        accuracy={n: m[2][0] for n, m in matched.items()}, mean_loops={n: m[2][1] for n, m in matched.items()},
        best_policy=best, best_uniform_depth=best_uniform, accuracy_best_uniform=uniform[best_uniform][0],
        tokens_per_s={n: statistics.median(v) for n, v in tps.items()},
        realized_speedup_vs_best_uniform=ratio(names[2], names[1]),
        realized_speedup_vs_a0_rbar=ratio(names[2], names[0]),
        flop_proxy_speedup_vs_best_uniform=flops[names[1]] / flops[names[2]],
        flop_proxy_speedup_vs_a0_rbar=flops[names[0]] / flops[names[2]],
    )
