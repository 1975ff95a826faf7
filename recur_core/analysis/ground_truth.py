"""Exit policies checked against ground truth: checkpoints whose answer tokens have a known depth.

A checkpoint trained on multi-hop programs (training/hops.py) saves, beside its eval windows, the
hop count of every token (`ground_truth.safetensors`: "hops", N x (T + 1), 0 = no ground truth;
"probe_hops" the same for the probe windows; "max_train_hops").
The token at window position t + 1 is the *target* of input position t, so a trace position's hop
count is hops[:, 1:].

Two paths (`Outcome`): exact, the default of report.json, is what real decoding gets. Each family's
operating point is found by a walk over its thresholds from the fast path's (`_Walk`), and its curve
is the thresholds the walk evaluated. A rule that reads only the state evaluates them in the masking
harness (frozen tokens stay in the context with their exit state), which equals teacher-forced
decoding under the "recompute" KV rule; the state rules' walks share one harness pass per round. A
readout rule such as A1 reads its per-loop output with earlier tokens at their current loop in the
harness, where decoding has them at their exit states, so the harness is not what it gets: its
thresholds are decoded (`_DecodingWalk`, token by token or by the fixed point of parallel passes).
Fast reads each token's answer off the uniform trace at its exit loop, as if every other token had
looped to full depth; its curve is every threshold.

Terms:
  answer accuracy  share of answer tokens whose argmax is the right value, on the trained hop
                   counts 1 .. max_train_hops (longer chains are extrapolation, reported apart).
  mean_loops       mean exit depth over the program's tokens (every position whose input or target
                   is not padding), the FLOP proxy; answers alone are a few percent of them.
  operating point  per policy family, the cheapest swept threshold whose answer accuracy is within
                   `tolerance` (1 point) of A0 at r_bar.
  best uniform     the smallest uniform depth whose answer accuracy reaches the same target.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..decoding.fixed_point import needs_passes
from ..exits import catalogue
from ..exits.policies import Policy
from ..exits.trace_type import Trace
from ..model.checkpoint import read_safetensors, resolve_model
from .exact import ExactPath
from .harness import ExactResult, uniform_run_result
from .matching import cheapest
from .stats import Bootstrap

GROUND_TRUTH = "ground_truth.safetensors"
TOLERANCE = 0.01  # "matches A0 at r_bar": answer accuracy within 1 point


def load_ground_truth(ckpt_path: str | Path) -> tuple[np.ndarray, int] | None:
    """(hops (N, T + 1) aligned with the eval windows, the largest hop count seen in training),
    or None for a checkpoint without ground truth."""
    path = Path(ckpt_path) / GROUND_TRUTH
    if not path.is_file():
        return None
    t = read_safetensors(path)
    return t["hops"].numpy(), int(t["max_train_hops"].item())


@dataclass(frozen=True)
class Labels:
    """A checkpoint's ground truth as the section reads it: hops (N, T + 1) aligned with the eval
    windows (0 = no ground truth), the largest trained hop count, and the padding token (EOS)."""

    hops: np.ndarray
    max_train_hops: int
    pad_id: int

    @classmethod
    def of(cls, ckpt) -> Labels | None:
        """A loaded checkpoint's labels, or None when it ships no ground truth."""
        gt = load_ground_truth(ckpt.path)
        return None if gt is None else cls(*gt, eos_id(ckpt.tokenizer()))


def probe_answers(ckpt_path: str | Path, n_windows: int) -> np.ndarray | None:
    """(n_windows, T) bool: the answer tokens with a trained hop count among the targets of the first
    n_windows probe windows (what A2's KL labels are matched on), or None when the ground-truth file
    has no "probe_hops" (then they are matched on the loss)."""
    path = Path(ckpt_path) / GROUND_TRUTH
    if not path.is_file():
        return None
    t = read_safetensors(path)
    if "probe_hops" not in t:
        return None
    return trained_answers(t["probe_hops"].numpy()[:n_windows], int(t["max_train_hops"].item()))


def trained_answers(hops: np.ndarray, max_train_hops: int) -> np.ndarray:
    """(N, T) bool from window hop counts (N, T + 1): the targets that are answers at a trained hop count."""
    target_hops = hops[:, 1:]
    return (target_hops > 0) & (target_hops <= max_train_hops)


def answer_hops(tr: Trace, hops: np.ndarray) -> np.ndarray:
    """(N, T) hop count of each trace position's target (0 where it has none)."""
    return hops[:tr.n_windows, 1:tr.seq_len + 1]


def program_mask(tr: Trace, pad_id: int) -> np.ndarray:
    """(N, T) positions that belong to a program: not (padding predicting padding)."""
    return ~((tr.ids == pad_id) & (tr.targets == pad_id)) & tr.has_target


def correct_at(tr: Trace, depth: np.ndarray) -> np.ndarray:
    """(N, T) bool: the argmax of the uniform trace at each token's exit depth is its target."""
    pred = np.take_along_axis(tr.argmax, (depth - 1)[..., None], axis=-1)[..., 0]
    return pred == tr.targets


def uniform_answer_accuracy(tr: Trace, answers: np.ndarray, depth: int, boot: Bootstrap) -> np.ndarray:
    """(1 + n_boot,) replicate accuracies of the answer tokens (answers: (N, T) bool) at uniform depth
    `depth`, pooled over the resampled windows (row 0: the data)."""
    correct = correct_at(tr, np.full(answers.shape, depth)) & answers
    return boot.ratio(correct.sum(1).astype(np.float64), answers.sum(1).astype(np.float64))


def accuracy_by_hops(ah: np.ndarray, correct: np.ndarray) -> dict[int, float]:
    """Answer accuracy per hop count."""
    return {int(h): float(correct[ah == h].mean()) for h in np.unique(ah[ah > 0])}


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when either side is constant."""
    rx, ry = _ranks(x), _ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(len(v), dtype=np.float64)
    uniq, inverse = np.unique(v, return_inverse=True)
    sums = np.bincount(inverse, weights=ranks)
    return (sums / np.bincount(inverse))[inverse]


def spearman_ci(depth: np.ndarray, ah: np.ndarray, boot: Bootstrap) -> dict:
    """Spearman(exit depth, hop count) over answer tokens; 95% CI by resampling programs (windows).

    Both sides take few distinct values, so each replicate is a weighted table of (depth, hops)
    counts: its average ranks and their Pearson correlation follow from the table alone, for every
    replicate at once (what `spearman` gives on the resampled tokens, without building them)."""
    answers = ah > 0
    depths, d_index = np.unique(depth[answers], return_inverse=True)
    hops, h_index = np.unique(ah[answers], return_inverse=True)
    table = np.zeros((len(ah), len(depths), len(hops)))
    np.add.at(table, (np.nonzero(answers)[0], d_index, h_index), 1.0)
    rho = _table_spearman(np.tensordot(boot.weights, table, axes=(1, 0)))  # row 0: the data
    reps = rho[1:][~np.isnan(rho[1:])]
    lo, hi = (np.quantile(reps, [(1 - boot.level) / 2, (1 + boot.level) / 2]) if len(reps) else (np.nan, np.nan))
    return {"value": float(rho[0]), "ci_low": float(lo), "ci_high": float(hi)}


def _table_spearman(joint: np.ndarray) -> np.ndarray:
    """Spearman's rho (average ranks for ties) of each (X, Y) count table of joint (R, X, Y), whose
    axes are the two variables' distinct values in ascending order; NaN where a side is constant."""
    def centred_ranks(counts):  # (R, K) counts of the K values -> their average ranks, less the mean
        ranks = np.cumsum(counts, axis=1) - (counts + 1) / 2
        with np.errstate(invalid="ignore", divide="ignore"):  # a replicate that drew no answers: NaN below
            return ranks - (counts * ranks).sum(1, keepdims=True) / counts.sum(1, keepdims=True)
    cx, cy = joint.sum(2), joint.sum(1)
    rx, ry = centred_ranks(cx), centred_ranks(cy)
    var_x, var_y = (cx * rx ** 2).sum(1), (cy * ry ** 2).sum(1)
    cov = np.einsum("rxy,rx,ry->r", joint, rx, ry)
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = cov / np.sqrt(var_x * var_y)
    return np.where((var_x > 0) & (var_y > 0), rho, np.nan)


def operating_point_families(r_max: int, probes: dict | None = None, eps_grid=None, tau_grid=None,
                             lipschitz: float | None = None) -> dict[str, list[Policy]]:
    """The policies ground truth finds operating points for (the catalogue's GROUND_TRUTH): A1 over
    eps_grid, A2 over tau_grid per probe label kind (None: their catalogue sweeps), the others over
    their catalogue sweeps; with the checkpoint's measured Lipschitz bound, the certified exit at that
    L alone (it has no knob to tune: one decoding). A0 is the baseline."""
    families = catalogue.sweeps(catalogue.GROUND_TRUTH, r_max, grids={"A1": eps_grid, "A2": tau_grid}, probes=probes)
    if lipschitz is not None:
        families["Certified"] = [catalogue.make("Certified", lipschitz, r_max=r_max)]
    return families


@dataclass
class Outcome:
    """What one policy did to every token: exit depth (N, T) and whether the prediction there is
    the target (N, T). Fast: the argmax of the uniform trace at the exit loop. Exact: the final
    readout of the masking harness (frozen tokens stay in the context, as in real decoding)."""

    depth: np.ndarray
    correct: np.ndarray

    @classmethod
    def fast(cls, tr: Trace, policy: Policy) -> Outcome:
        depth = policy.exit_depth(tr)
        return cls(depth, correct_at(tr, depth))

    @classmethod
    def exact(cls, result: ExactResult) -> Outcome:
        return cls(result.exit_depth, result.argmax == result.targets)


class NotCached(LookupError):
    """Raised with cache_only when an exact result is not in the disk cache."""


def _operating_points(tr: Trace, families: dict[str, list[Policy]], exact: ExactPath | None,
                      scored: tuple[Trace, _Answers, np.ndarray], target: float) -> dict[str, tuple]:
    """{name: (index, matched, outcome, curve points, extra keys)}: each family's operating point. Fast
    (exact None): the cheapest threshold meeting the target on the uniform trace (else the most
    accurate), every threshold its curve. Exact: a walk from that fast point (`_Walk`), the state rules'
    in the masking harness together, each readout rule's in decoding; its curve is what it evaluated."""
    _, ans, program = scored
    fast = {name: [Outcome.fast(tr, p) for p in family] for name, family in families.items()}
    fast_points = {name: [_point(p, o, ans, program) for p, o in zip(family, fast[name], strict=True)]
                   for name, family in families.items()}
    starts = {name: _cheapest_meeting(points, target) for name, points in fast_points.items()}
    if exact is None:
        return {name: (at, matched, fast[name][at], fast_points[name], {}) for name, (at, matched) in starts.items()}
    by_harness = {name: (_Walk(family, fast_points[name], scored, target), starts[name][0])
                  for name, family in families.items() if _evaluated_by(family, exact) == "harness"}
    walks = {name: walk for name, (walk, _) in by_harness.items()}
    found = _walk_in_harness(exact, by_harness, tr)
    for name, family in families.items():
        if name not in by_harness:
            walks[name] = _DecodingWalk(exact, family, fast[name], fast_points[name], scored, target)
            found[name] = walks[name].operating_point(starts[name][0])
    return {name: (*found[name], walks[name].points(),
                   {"fast_point": {k: fast_points[name][starts[name][0]][k]
                                   for k in ("threshold", "mean_loops", "answer_accuracy")}})
            for name in families}


def _cheapest_meeting(points: list[dict], target: float) -> tuple[int, bool]:
    """(index, matched): the cheapest point whose answer accuracy meets the target, else the most accurate."""
    at = cheapest(range(len(points)), lambda i: points[i]["answer_accuracy"] >= target,
                  lambda i: points[i]["mean_loops"])
    if at is not None:
        return at, True
    return max(range(len(points)), key=lambda i: points[i]["answer_accuracy"]), False


class _Answers:
    """The answer tokens of the eval programs and their bootstrap over programs."""

    def __init__(self, tr: Trace, hops: np.ndarray, max_train_hops: int, boot: Bootstrap):
        self.hops = answer_hops(tr, hops)
        self.trained = (self.hops > 0) & (self.hops <= max_train_hops)
        self.boot = boot

    def accuracy(self, correct: np.ndarray, mask: np.ndarray) -> dict:
        """Accuracy over the masked answers, with its CI over programs and the answer count."""
        est = self.boot.summarise(self.boot.ratio((correct & mask).sum(1).astype(np.float64),
                                                  mask.sum(1).astype(np.float64)))
        return {**est.to_dict(), "n_answers": int(mask.sum())}


def ground_truth_section(tr: Trace, labels: Labels, r_max: int, r_bar: int, boot: Bootstrap,
                         families: dict[str, list[Policy]], exact: ExactPath | None = None,
                         tolerance: float = TOLERANCE) -> dict | None:
    """The `ground_truth` section of report.json (keys: docs/REPORT_KEYS.md) for `families`
    (`operating_point_families`): exact with `exact` (the traced windows), else fast; None when
    exact.cache_only and an exact result is not in the disk cache. The target accuracy and the best
    uniform depth are taken on the trained hop counts (1 .. max_train_hops); longer chains are
    extrapolation, reported on their own with answer counts and CIs. Uniform depth comes from the
    trace, which is what the harness computes for it (nothing freezes before the last loop)."""
    try:
        return _section(tr, labels, r_max, r_bar, boot, families, exact, tolerance)
    except NotCached:
        return None


def _section(tr, labels, r_max, r_bar, boot, families, exact, tolerance) -> dict:
    hops, max_train_hops = labels.hops, labels.max_train_hops
    ans = _Answers(tr, hops, max_train_hops, boot)
    ah, program = ans.hops, program_mask(tr, labels.pad_id)
    r_max = min(r_max, tr.max_loops)
    hop_values = [int(h) for h in np.unique(ah[ah > 0])]
    uniform = [Outcome(np.full(ah.shape, r), correct_at(tr, np.full(ah.shape, r))) for r in range(1, r_max + 1)]
    uniform_acc = {r: accuracy_by_hops(ah, u.correct) for r, u in enumerate(uniform, 1)}
    trained_acc = [float(u.correct[ans.trained].mean()) for u in uniform]
    target = trained_acc[r_bar - 1] - tolerance
    best_uniform = next((r for r in range(1, r_max + 1) if trained_acc[r - 1] >= target), None)

    evaluated_by = {name: _evaluated_by(family, exact) for name, family in families.items()}
    found = _operating_points(tr, families, exact, (tr, ans, program), target)
    policies, answer_exits = {}, {}
    for name, family in families.items():
        at, matched, outcome, points, extra = found[name]
        op, depth = _point(family[at], outcome, ans, program), outcome.depth
        answer_exits[name] = depth[ah > 0].tolist()
        policies[name] = {
            **{k: op[k] for k in ("threshold", "answer_accuracy", "answer_accuracy_all_hops", "mean_loops",
                                  "answer_mean_loops")},
            "threshold_name": family[at].threshold_name, "matches_a0_rbar": matched,
            "evaluated_by": evaluated_by[name],
            "answer_accuracy_ci": ans.accuracy(outcome.correct, ans.trained),
            "accuracy_by_hops": {str(h): v for h, v in accuracy_by_hops(ah, outcome.correct).items()},
            "exit_depth_by_hops": {str(h): _summary(depth[ah == h]) for h in hop_values},
            "spearman_exit_vs_hops": spearman_ci(depth, ah, boot),
            "vs_a0_rbar_loops_ratio": op["mean_loops"] / r_bar,
            "vs_best_uniform_loops_ratio": (op["mean_loops"] / best_uniform) if best_uniform else None,
            "extrapolation_accuracy": {str(h): ans.accuracy(outcome.correct, ah == h)
                                       for h in hop_values if h > max_train_hops},
            "curve": points, **extra,
        }
    return {
        "path": "fast" if exact is None else "exact",
        "max_train_hops": max_train_hops, "hop_counts": hop_values, "r_bar": r_bar, "r_max": r_max,
        "n_programs": int(ah.shape[0]), "n_answers": int((ah > 0).sum()), "n_trained_answers": int(ans.trained.sum()),
        "n_answers_by_hops": {str(h): int((ah == h).sum()) for h in hop_values},
        "uniform": {"loops": list(range(1, r_max + 1)), "answer_accuracy": trained_acc,
                    "answer_accuracy_all_hops": [float(u.correct[ah > 0].mean()) for u in uniform],
                    "accuracy_by_hops": {str(h): [uniform_acc[r].get(h) for r in range(1, r_max + 1)]
                                         for h in hop_values}},
        "target_accuracy": target, "target_hops": f"1..{max_train_hops}", "tolerance": tolerance,
        "best_uniform_depth": best_uniform,
        "policies": policies,
        "answers": {"hops": ah[ah > 0].tolist(), "program": np.nonzero(ah > 0)[0].tolist(),
                    "correct_at_r_bar": uniform[r_bar - 1].correct[ah > 0].tolist(), "exit_depth": answer_exits},
        "extrapolation": {str(h): {"n_answers": int((ah == h).sum()),
                                   "accuracy_at_r_bar": ans.accuracy(uniform[r_bar - 1].correct, ah == h),
                                   "accuracy_at_r_max": ans.accuracy(uniform[r_max - 1].correct, ah == h),
                                   "best_accuracy": max(uniform_acc[r].get(h) for r in range(1, r_max + 1)),
                                   "best_loops": max(range(1, r_max + 1), key=lambda r: (uniform_acc[r].get(h), -r))}
                          for h in hop_values if h > max_train_hops},
    }


def _evaluated_by(family: list[Policy], exact: ExactPath | None) -> str:
    """How a family's operating point is evaluated: "fast" (the uniform trace), "harness" (the masking
    harness, which equals decoding for a rule that reads only the state, and for every rule on a model
    without a coda) or "decoding" (a readout rule read through a coda)."""
    if exact is None:
        return "fast"
    return "decoding" if needs_decoding(family, resolve_model(exact.model)[0]) else "harness"


def needs_decoding(family: list[Policy], model) -> bool:
    """Whether a family's exact points are decoded rather than run in the masking harness: a rule that
    reads the readout, on a model whose coda attends across positions (fixed_point.needs_passes). The
    harness gives the earlier tokens' coda their current loop, decoding their exit state; without a
    coda the readout reads the token's own state alone, and the two are the same."""
    return any(needs_passes(model, p) for p in family)


class _Walk:
    """The search for a family's operating point over its thresholds, exact, from the fast path's
    point. Thresholds are ordered by the fast path's mean loops, from most to fewest (the direction in
    which accuracy falls; ties in the family's reverse order, so that among equal points the walk ends on
    the family's first, as `cheapest` over the grid does); from the start the walk moves towards cheaper
    thresholds while the exact point still meets the target, or towards dearer ones until it does, in
    doubling steps, then bisects (its first probe where the line through the bracket's accuracies
    crosses the target). Where accuracy falls monotonically along the order this is the cheapest
    threshold of the grid that meets the target, for a few evaluations instead of the whole grid.

    `search` is the walk as a generator: it yields each threshold it needs before reading it, so one
    driver evaluates the points of many walks together (the state rules' in one harness pass per round,
    `_walk_in_harness`); a decoding walk drives its own (`_DecodingWalk.operating_point`)."""

    def __init__(self, family: list[Policy], fast_points: list[dict], scored: tuple[Trace, _Answers, np.ndarray],
                 target: float):
        """fast_points: the family's fast points; scored: (the trace, its answers, the program mask)."""
        self.family, self.target = family, target
        self.tr, self.ans, self.program = scored
        self.order = sorted(range(len(family)), key=lambda i: (-fast_points[i]["mean_loops"], -i))
        self.done: dict[int, tuple[Outcome, dict]] = {}

    def record(self, i: int, outcome: Outcome) -> tuple[Outcome, dict]:
        self.done[i] = outcome, _point(self.family[i], outcome, self.ans, self.program)
        return self.done[i]

    def search(self, start: int):
        """Yields the thresholds to evaluate (each recorded in `done` before the next `next`); returns
        (index, matched, outcome): the cheapest threshold meeting the target, or, when none does, the
        most accurate one evaluated. Galloping from `start`, then bisection (its first probe by regula
        falsi, `_crossing`): the last position in `order` that meets the target lies in (good, bad)."""
        pos = self.order.index(start)
        if (yield from self._meets(start)):
            good, bad, step = pos, None, 1
            while bad is None:
                nxt = min(good + step, len(self.order) - 1)
                if nxt == good:
                    break
                meets = yield from self._meets(self.order[nxt])
                good, bad, step = (nxt, None, 2 * step) if meets else (good, nxt, step)
        else:
            good, bad, step = None, pos, 1
            while good is None and bad > 0:
                nxt = max(bad - step, 0)
                meets = yield from self._meets(self.order[nxt])
                good, bad, step = (nxt, bad, step) if meets else (None, nxt, 2 * step)
        if good is None:  # nothing meets the target: the most accurate threshold evaluated
            at = max(self.done, key=lambda i: self.done[i][1]["answer_accuracy"])
            return at, False, self.done[at][0]
        probe = self._crossing
        while bad is not None and bad - good > 1:
            mid, probe = probe(good, bad), self._midpoint
            meets = yield from self._meets(self.order[mid])
            good, bad = (mid, bad) if meets else (good, mid)
        return self.order[good], True, self.done[self.order[good]][0]

    def _meets(self, i: int):
        if i not in self.done:
            yield i
        return self.done[i][1]["answer_accuracy"] >= self.target

    def _crossing(self, good: int, bad: int) -> int:
        """The bisection's first probe in (good, bad): the last position before the line through the two
        ends' accuracies crosses the target (regula falsi; where accuracy falls smoothly it is the answer
        or next to it, while a midpoint costs one evaluation more). Later probes halve the bracket."""
        high, low = (self.done[self.order[p]][1]["answer_accuracy"] for p in (good, bad))
        if not high > low:
            return self._midpoint(good, bad)
        crossing = good + (high - self.target) / (high - low) * (bad - good)
        return min(max(math.floor(crossing), good + 1), bad - 1)

    @staticmethod
    def _midpoint(good: int, bad: int) -> int:
        return (good + bad) // 2

    def points(self) -> list[dict]:
        """The thresholds evaluated, in the family's order."""
        return [self.done[i][1] for i in sorted(self.done)]


class _DecodingWalk(_Walk):
    """A readout rule's walk, each threshold decoded (ExactPath.decoded: teacher-forced, "recompute",
    token by token in lockstep or by the fixed point, whichever is cheaper; the fixed point seeded with
    the nearest decoded threshold's exits, at first the fast path's). Each step decodes every program
    once, up to its last scored position (its trailing padding left out); a threshold whose rule never
    holds (A1 at ε 0) is the uniform run at the cap, read off the trace."""

    def __init__(self, exact: ExactPath, family: list[Policy], fast: list[Outcome], fast_points: list[dict],
                 scored: tuple[Trace, _Answers, np.ndarray], target: float):
        """fast: the family's fast outcomes (the first guess)."""
        super().__init__(family, fast_points, scored, target)
        self.exact, self.fast = exact, fast
        self.lengths = scored_extent(self.program | (self.ans.hops > 0))

    def operating_point(self, start: int) -> tuple[int, bool, Outcome]:
        """`search` from `start`, decoding each threshold it asks for (`evaluate`)."""
        search = self.search(start)
        try:
            while True:
                self.evaluate(next(search))
        except StopIteration as stop:
            return stop.value

    def evaluate(self, i: int) -> tuple[Outcome, dict]:
        if i not in self.done:
            policy = self.family[i]  # a rule that never holds runs every token to its cap: the uniform run
            uniform = uniform_run_result(self.tr, policy) if policy.never_halts else None
            self.record(i, Outcome.exact(uniform) if uniform is not None else self._decoded(i))
        return self.done[i]

    def _decoded(self, i: int) -> Outcome:
        decoded = self.exact.decoded(self.family[i], self.tr.max_loops, self.tr.seed, guess=self.guess(i),
                                     lengths=self.lengths)
        if decoded is None:
            raise NotCached(f"teacher-forced decoding of {self.family[i]!r}")
        exit_loop, argmax = decoded
        return Outcome(exit_loop, argmax == self.tr.targets)

    def guess(self, i: int) -> np.ndarray:
        """The exits that seed threshold i's fixed point: those of the nearest threshold decoded so far
        (closer to i's exact exits than its fast ones: fewer passes), else i's fast exits."""
        if not self.done:
            return self.fast[i].depth
        at = self.order.index(i)
        nearest = min(self.done, key=lambda j: abs(self.order.index(j) - at))
        return self.done[nearest][0].depth


def _walk_in_harness(exact: ExactPath, walks: dict[str, tuple[_Walk, int]], tr: Trace) -> dict[str, tuple]:
    """{name: (index, matched, outcome)}: the state rules' walks (name: (walk, start)) in lockstep, each
    round's thresholds, one per walk still searching, in one batched harness pass (ExactPath.results,
    cached per policy; a threshold that halts nothing early read off the trace)."""
    searches = {name: walk.search(start) for name, (walk, start) in walks.items()}
    wanted, found = {}, {}

    def advance(name: str) -> None:
        try:
            wanted[name] = next(searches[name])
        except StopIteration as stop:
            found[name] = stop.value
            wanted.pop(name, None)
    for name in searches:
        advance(name)
    while wanted:
        asked = list(wanted.items())
        results = exact.results([walks[name][0].family[i] for name, i in asked], tr.max_loops, tr.seed, uniform=tr)
        if results is None:
            raise NotCached("the masking harness's results")
        for (name, i), result in zip(asked, results, strict=True):
            walks[name][0].record(i, Outcome.exact(result))
            advance(name)
    return found


def scored_extent(scored: np.ndarray) -> np.ndarray:
    """(N,) per window, the positions up to its last scored one (a program's trailing padding is
    not scored, so decoding may leave it out)."""
    N, T = scored.shape
    return np.where(scored.any(1), T - np.argmax(scored[:, ::-1], axis=1), 1)


def _point(policy: Policy, outcome: Outcome, ans: _Answers, program: np.ndarray) -> dict:
    """One threshold: answer accuracy on the trained hop counts (and on all), mean loops over the
    program's tokens and over its answers."""
    answers = ans.hops > 0
    return {"threshold": policy.threshold, "answer_accuracy": float(outcome.correct[ans.trained].mean()),
            "answer_accuracy_all_hops": float(outcome.correct[answers].mean()),
            "mean_loops": float(outcome.depth[program].mean()),
            "answer_mean_loops": float(outcome.depth[answers].mean())}


def operating_point_gaps(fast: dict, exact: dict) -> dict:
    """Per policy: how the fast path's operating point differs from the exact one (fast − exact)."""
    return {name: {"mean_loops": fast["policies"][name]["mean_loops"] - pol["mean_loops"],
                   "answer_accuracy": fast["policies"][name]["answer_accuracy"] - pol["answer_accuracy"],
                   "threshold_fast": fast["policies"][name]["threshold"], "threshold_exact": pol["threshold"],
                   "spearman": _minus(fast["policies"][name]["spearman_exit_vs_hops"]["value"],
                                      pol["spearman_exit_vs_hops"]["value"])}
            for name, pol in exact["policies"].items()}


def _minus(a, b):
    return None if a is None or b is None or np.isnan(a) or np.isnan(b) else a - b


def _summary(v: np.ndarray) -> dict:
    if not len(v):
        return {"n": 0}
    q = np.quantile(v, [0.25, 0.5, 0.75])
    return {"n": int(len(v)), "mean": float(v.mean()), "q1": float(q[0]), "median": float(q[1]), "q3": float(q[2]),
            "min": int(v.min()), "max": int(v.max())}


def eos_id(tokenizer) -> int:
    """The padding token of hops windows (EOS)."""
    i = tokenizer.token_to_id("<|endoftext|>")
    if i is None:
        raise ValueError("a ground-truth checkpoint's tokenizer needs <|endoftext|> (its padding)")
    return i


def print_ground_truth(gt: dict, p, fast: dict | None = None) -> None:
    """The ground-truth tables of `python -m recur_core.analyze` (fast: the fast path's section,
    whose operating points are printed beside the exact ones)."""
    hs, loops = gt["hop_counts"], gt["uniform"]["loops"]
    p(f"\nGround truth ({gt['path']} path): answer accuracy by hop count (rows) x uniform loops; trained to "
      f"{gt['max_train_hops']} hops, {gt['n_programs']} programs, {gt['n_answers']} answers "
      f"({gt['n_trained_answers']} at trained hop counts)")
    shown = [r for r in loops if r in (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32) or r == gt["r_bar"]]
    p("  hops " + "".join(f"{r:>6d}" for r in shown))
    for h in hs:
        row = gt["uniform"]["accuracy_by_hops"][str(h)]
        extra = "   (extrapolation)" if h > gt["max_train_hops"] else ""
        p(f"  {h:4d} " + "".join(f"{row[r - 1]:6.2f}" for r in shown) + extra)
    p(f"  target accuracy on hop counts {gt['target_hops']} (A0 at r_bar {gt['r_bar']} - "
      f"{100 * gt['tolerance']:.0f} pt): {gt['target_accuracy']:.3f}; smallest uniform depth reaching it: "
      f"{gt['best_uniform_depth']}")
    if gt["path"] == "exact":
        p("  exact: state rules from the masking harness (equal to decoding for them); readout rules decoded "
          "(teacher-forced, recompute KV rule), walking from the fast path's point")
    p("  policy          evaluated by  threshold  answer acc  mean loops  vs A0@r_bar  vs best uniform  "
      "Spearman(exit, hops) [95% CI]" + ("   fast path: loops, acc" if fast else ""))
    for name, pol in gt["policies"].items():
        sp = pol["spearman_exit_vs_hops"]
        best = pol["vs_best_uniform_loops_ratio"]
        side = ""
        if fast:
            f = fast["policies"][name]
            side = f"   {f['mean_loops']:6.2f}, {f['answer_accuracy']:.3f}"
        p(f"  {name:14s} {pol['evaluated_by']:>13s} {_fmt(pol['threshold'], '.3g'):>10s}  {pol['answer_accuracy']:10.3f}  "
          f"{pol['mean_loops']:10.2f}  {pol['vs_a0_rbar_loops_ratio']:10.2f}x  {_fmt(best, '.2f', 'x'):>15s}  "
          f"{_fmt(sp['value'], '.3f')} [{_fmt(sp['ci_low'], '.3f')}, {_fmt(sp['ci_high'], '.3f')}]"
          + ("" if pol["matches_a0_rbar"] else "  (never matches: its most accurate point)") + side)
    for h, ex in gt["extrapolation"].items():
        at_rbar = ex["accuracy_at_r_bar"]
        p(f"  extrapolation, {h} hops: {ex['n_answers']} answers; accuracy at r_bar {at_rbar['value']:.3f} "
          f"[{at_rbar['ci_low']:.3f}, {at_rbar['ci_high']:.3f}], best {ex['best_accuracy']:.3f} "
          f"at {ex['best_loops']} loops")


def _fmt(x, spec: str, suffix: str = "") -> str:
    """A number of report.json, which may be None (NaN) or a string (inf)."""
    return "n/a" if x is None else (x if isinstance(x, str) else format(x, spec) + suffix)
