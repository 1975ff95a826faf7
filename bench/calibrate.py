"""The calibrators the decoding benchmarks match exit thresholds with, teacher-forced on held-out
eval windows and memoised per policy: LossCalibrator scores a policy by its loss, AccuracyCalibrator
(a checkpoint with ground truth) by its answer accuracy. Both search with recur_core.analysis.matching."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from recur_core.analysis.harness import run_exact
from recur_core.analysis.matching import Match, match_threshold
from recur_core.decoding.teacher_forced import teacher_forced
from recur_core.exits.policies import Policy
from recur_core.settings import SETTINGS
from recur_core.tasks.hops import PAD


def log(*args):
    print(*args, flush=True)


@dataclass(frozen=True)
class HarnessResult:
    """The masking harness's loss and mean exit loop on the calibration windows."""
    loss: float
    mean_loops: float


@dataclass(frozen=True)
class Accuracy:
    """Answer accuracy and mean loops over program tokens of one policy."""
    accuracy: float
    mean_loops: float


class LossCalibrator:
    """Teacher-forced losses of policies on the calibration windows (memoised)."""

    def __init__(self, ckpt, windows, cap, seed, batch):
        self.ckpt, self.windows, self.cap, self.seed, self.batch = ckpt, windows, cap, seed, batch
        self.memo = {}

    def evaluate(self, policy: Policy, kv_rule=SETTINGS.kv_rule, mode=None, check_every=1):
        # state-based policies: the parallel "prefill" pass equals token-by-token decoding exactly
        # (tests/test_decode.py); A1's readout context differs, so it is decoded token by token
        mode = mode or ("decode" if policy.needs_readout else "prefill")
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

    def harness(self, policy) -> HarnessResult:
        """The masking harness (recur_core.analysis.harness.run_exact) on the same windows and noise."""
        t = time.perf_counter()
        ex = run_exact(self.ckpt, self.windows, policy, self.cap, self.seed, batch_size=self.batch)
        result = HarnessResult(loss=float(np.nanmean(ex.ce)), mean_loops=float(ex.exit_depth.mean()))
        log(f"    {policy!r:66s} {'harness':9s} {'':7s} loss {result.loss:.5f}  "
            f"mean loops {result.mean_loops:6.3f}  ({time.perf_counter() - t:.1f}s)")
        return result

    def match(self, make, grid, target, bisect_steps, check_every=1, kv_rule=SETTINGS.kv_rule) -> Match:
        """Largest threshold on the grid (then bisected, log scale) whose loss <= target under kv_rule."""
        return match_threshold(lambda policy: self.evaluate(policy, kv_rule, check_every=check_every), make, grid,
                               lambda tf: tf.loss <= target, bisect_steps)


class AccuracyCalibrator:
    """Answer accuracy and mean loops (over program tokens) of policies, teacher-forced (memoised)."""

    def __init__(self, ckpt, windows, hops, cap, seed, batch, max_train_hops: int | None = None,
                 kv_rule: str = SETTINGS.kv_rule):
        """max_train_hops: score only answers of the trained hop counts 1..max_train_hops (the ground
        truth's target and best uniform depth are taken on them; None: every answer)."""
        self.ckpt, self.windows, self.cap, self.seed, self.batch = ckpt, windows, cap, seed, batch
        self.kv_rule = kv_rule
        targets = windows[:, 1:]
        answer_hops = torch.as_tensor(hops[:len(windows), 1:])
        self.answers = (answer_hops > 0) & (answer_hops <= (max_train_hops or int(answer_hops.max())))
        pad = ckpt.tokenizer().token_to_id(PAD)
        self.program = ~((windows[:, :-1] == pad) & (targets == pad))
        self.memo = {}

    def evaluate(self, policy) -> Accuracy:
        key = repr(policy)
        if key not in self.memo:
            t = time.perf_counter()
            tf = teacher_forced(self.ckpt, self.windows, policy, self.kv_rule, seed=self.seed, max_loops=self.cap,
                                batch_size=self.batch)
            correct = tf.argmax == self.windows[:, 1:]
            acc = Accuracy(accuracy=float(correct[self.answers].float().mean()),
                           mean_loops=float(tf.exit_loop[self.program].float().mean()))
            self.memo[key] = acc
            log(f"    {key:60s} answer acc {100 * acc.accuracy:5.1f}%  mean loops {acc.mean_loops:6.3f}  "
                f"({time.perf_counter() - t:.1f}s)")
        return self.memo[key]

    def match(self, make, grid, target, bisect_steps) -> Match:
        """Largest threshold on the grid (then bisected, log scale) whose accuracy >= target."""
        return match_threshold(self.evaluate, make, grid, lambda res: res.accuracy >= target, bisect_steps)
