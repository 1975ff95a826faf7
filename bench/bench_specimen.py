"""`python -m bench.bench_specimen [CKPT]`: the four figures of the app's default specimen (issue 39), on
the checkpoint's canonical eval set (its first SETTINGS.windows held-out windows: TinyStories text
and word problems, alternating), from the same seeded trace and disk cache as the app.

  1. loss drop from 1 loop to r_bar (uniform depth; nats per scored token), with a paired bootstrap
     CI over windows (both depths from the same resampled windows);
  2. answer-token accuracy by uniform loops (the word problems' labelled answers,
     ground_truth.safetensors), overall and by composition steps;
     and at r_bar by the length of each answer's problem in tokens: a long story has more names and
     places to confuse than a short one with the same answer;
  3. its rise from 1 loop to r_bar in points, with the same paired bootstrap CI, over every trained
     answer and over the multi-step ones (>= 2 steps: issue 50's goals, 60% at r_bar and a rise of 25);
  4. exact A1 (the masking harness: halted tokens frozen, as in real decoding) at matched loss: the
     mean loops it needs to reach A0's loss at r_bar, against the *best* uniform depth reaching that
     loss (the smallest r whose loss is within float noise of it) and against r_bar;
  5. exact A1 at matched answer accuracy (issue 50's goals; recur_core.analysis.ground_truth: A1
     decoded, or on a model without a coda run in the masking harness, which equals decoding there):
     the cheapest epsilon whose answer accuracy is within 1 point of A0 at r_bar, its mean loops
     against the best uniform depth reaching that accuracy, and Spearman(A1 exit, steps) over the
     answer tokens with a bootstrap CI over windows;
  6. why A1 keeps the answers only at a small epsilon (fast path, uniform trace): per loop i, the answers
     whose argmax at loop i differs from loop i - 1's, the KL(p_i || p_{i-1}) (nats, A1's signal) at
     that change, and p_i's top-1 probability there (a near-tie between two candidate answers flips
     while the rest of the distribution barely moves); and the first loop whose argmax is each token's
     argmax at r_bar: the fewest loops that give A0@r_bar's prediction on every token (on the uniform
     trace), the floor a rule that knew the future would reach.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from recur_core import load_checkpoint
from recur_core.analysis.allocation import allocation, allocation_families
from recur_core.analysis.cache import TraceCache
from recur_core.analysis.curves import fast_sums, smallest_uniform_depth
from recur_core.analysis.exact import ExactPath
from recur_core.analysis.ground_truth import (
    Labels,
    answer_hops,
    correct_at,
    ground_truth_section,
    load_ground_truth,
    operating_point_families,
    uniform_answer_accuracy,
)
from recur_core.analysis.stats import Bootstrap
from recur_core.analysis.trace import trace
from recur_core.exits.policies import Uniform
from recur_core.settings import SETTINGS
from recur_core.tasks.base import EOS

DEFAULT = "checkpoints/specimen"


def uniform_loss(tr, boot: Bootstrap, depth: int) -> np.ndarray:
    """(1 + n_boot,) replicate losses (nats per scored token) of uniform depth `depth`."""
    s = fast_sums(tr, Uniform(depth))
    return boot.ratio(s.loss, s.tokens.astype(np.float64))


LENGTH_BINS = (48, 96, 160)  # problem lengths in tokens: up to 48, 49-96, 97-160, longer


def problem_length(targets: np.ndarray, eos: int) -> np.ndarray:
    """(N, T) the length in tokens of the problem (or text) each target position belongs to: the runs
    between EOS targets, the EOS that ends one included (a window's last one may be cut short)."""
    ends = targets == eos
    segment = np.cumsum(ends, axis=1) - ends
    out = np.zeros_like(targets)
    for n in range(targets.shape[0]):
        out[n] = np.bincount(segment[n])[segment[n]]
    return out


def by_problem_length(correct: np.ndarray, answers: np.ndarray, answer_steps: np.ndarray,
                      length: np.ndarray) -> dict[int, dict[str, dict]]:
    """{answer steps: {length bin: {"accuracy", "answers"}}} of the answers (bool (N, T)); bins by
    LENGTH_BINS, named by their range of tokens."""
    edges = (0, *LENGTH_BINS, np.inf)
    bins = {(f"{lo + 1}-{int(hi)}" if np.isfinite(hi) else f">{lo}"): (length > lo) & (length <= hi)
            for lo, hi in zip(edges[:-1], edges[1:], strict=True)}
    return grouped(correct, answers, answer_steps, bins)


def by_form(correct: np.ndarray, answers: np.ndarray, answer_steps: np.ndarray, ids: np.ndarray,
            question_mark: int) -> dict[int, dict[str, dict]]:
    """{answer steps: {"sentences" / "terse": {"accuracy", "answers"}}}: an answer told in two-word clauses
    ("Amy? zoo.", word_problems' terse_share) is read right after its question mark, one told in
    sentences after "the" ("Amy was at the zoo.")."""
    terse = ids == question_mark
    return grouped(correct, answers, answer_steps, {"sentences": ~terse, "terse": terse})


def grouped(correct: np.ndarray, answers: np.ndarray, answer_steps: np.ndarray,
            groups: dict[str, np.ndarray]) -> dict[int, dict[str, dict]]:
    """{answer steps: {group: {"accuracy", "answers"}}} of the answers (bool (N, T)) in each group (bool
    (N, T)); empty groups left out."""
    out: dict[int, dict[str, dict]] = {}
    for k in np.unique(answer_steps[answers]):
        for name, mask in groups.items():
            at = answers & (answer_steps == k) & mask
            if at.any():
                out.setdefault(int(k), {})[name] = {"accuracy": float(correct[at].mean()), "answers": int(at.sum())}
    return out


def print_groups(title: str, groups: dict[int, dict[str, dict]]) -> None:
    print(f"   at r_bar by {title} (accuracy, answers):")
    for k, row in groups.items():
        print(f"   {k} step{'s' if k > 1 else ' '}    " + "  ".join(f"{b}: {v['accuracy']:.3f} ({v['answers']})"
                                                          for b, v in row.items()))


def a1_at_answer_accuracy(ckpt, tr, boot: Bootstrap, r_max: int, r_bar: int, windows) -> dict:
    """Figure 5: the ground truth's exact A1 operating point (what real decoding gets), printed."""
    a1_family = {"A1": operating_point_families(r_max)["A1"]}  # the ground truth's own A1 sweep
    gt = ground_truth_section(tr, Labels.of(ckpt), r_max, r_bar, boot, a1_family,
                              ExactPath(ckpt, windows, TraceCache(), True))
    a1, best = gt["policies"]["A1"], gt["best_uniform_depth"]
    rho = a1["spearman_exit_vs_hops"]
    out = {"target_accuracy": gt["target_accuracy"], "best_uniform_depth": best,
           **{k: a1[k] for k in ("threshold", "answer_accuracy", "mean_loops", "answer_mean_loops",
                                 "matches_a0_rbar", "vs_best_uniform_loops_ratio", "vs_a0_rbar_loops_ratio")},
           "spearman_exit_vs_steps": rho, "fast_point": a1.get("fast_point"), "decoded": a1["curve"]}
    reached = "reaches" if a1["matches_a0_rbar"] else "does not reach (its best shown)"
    ratio = a1["vs_best_uniform_loops_ratio"]
    print(f"\n5. exact A1 {reached} A0@r_bar's answer accuracy - 1 point ({gt['target_accuracy']:.3f}) at epsilon "
          f"{a1['threshold']:.3g}: answer accuracy {a1['answer_accuracy']:.3f}, {a1['mean_loops']:.2f} mean loops "
          f"over all tokens ({a1['answer_mean_loops']:.2f} on answers); best uniform depth reaching it: {best}"
          + (f", A1 / best uniform = {ratio:.2f}x" if ratio else "")
          + f"\n   Spearman(A1 exit, steps) over all {gt['n_answers']} answer tokens: "
          + (f"{rho['value']:.3f} [{rho['ci_low']:.3f}, {rho['ci_high']:.3f}]" if rho["value"] == rho["value"]
             else "undefined: every answer exits at the same loop"))
    print("   epsilons decoded (answer accuracy, mean loops): " + ", ".join(
        f"{p['threshold']:.3g} ({p['answer_accuracy']:.3f}, {p['mean_loops']:.2f})" for p in a1["curve"]))
    return out


def answer_flips(tr, answers: np.ndarray) -> dict[int, dict]:
    """Figure 6: {loop i: {"answers", "kl_median", "kl_min", "top1_median"}} over the answers (bool
    (N, T)) whose uniform-trace argmax at loop i differs from loop i - 1's; loops with none left out."""
    argmax, kl, top1 = tr.argmax[answers], tr.kl_prev[answers], tr.top1_prob[answers]
    out = {}
    for i in range(1, argmax.shape[1]):
        flipped = argmax[:, i] != argmax[:, i - 1]
        if flipped.any():
            out[i + 1] = {"answers": int(flipped.sum()), "kl_median": float(np.median(kl[flipped, i])),
                          "kl_min": float(kl[flipped, i].min()), "top1_median": float(np.median(top1[flipped, i]))}
    return out


def first_agreeing_loop(argmax: np.ndarray, r_bar: int) -> np.ndarray:
    """(...,) the first loop i <= r_bar whose argmax (..., L) is the argmax at loop r_bar."""
    return np.argmax(argmax[..., :r_bar] == argmax[..., r_bar - 1:r_bar], -1) + 1


def print_flips(flips: dict[int, dict], n_answers: int) -> None:
    print(f"\n6. answers whose argmax changes at loop i (of {n_answers}), and A1's signal KL(p_i || p_{{i-1}}) there "
          "(nats):")
    for i, f in flips.items():
        print(f"   loop {i:2d}: {f['answers']:4d} answers, KL median {f['kl_median']:.2e} min {f['kl_min']:.2e}, "
              f"top-1 probability median {f['top1_median']:.2f}")


def multi_step_rise(tr, multi: np.ndarray, r_bar: int, boot: Bootstrap) -> dict:
    """Figure 3 on the multi-step answers (bool (N, T)): accuracy at 1 loop and r_bar and the rise, each
    with its paired bootstrap CI, printed."""
    at_1, at_r = (uniform_answer_accuracy(tr, multi, r, boot) for r in (1, r_bar))
    est = {"accuracy_1_loop": boot.summarise(at_1), "accuracy_r_bar": boot.summarise(at_r),
           "rise_points": boot.summarise(100 * (at_r - at_1))}
    one, top, rise = est["accuracy_1_loop"], est["accuracy_r_bar"], est["rise_points"]
    print(f"   multi-step answers (>= 2 steps, {int(multi.sum())}): {100 * one.value:.1f}% at 1 loop, "
          f"{100 * top.value:.1f}% [{100 * top.ci_low:.1f}, {100 * top.ci_high:.1f}] at r_bar: rise {rise.value:.1f} "
          f"points [{rise.ci_low:.1f}, {rise.ci_high:.1f}]")
    return {"answers": int(multi.sum()), **{k: v.to_dict() for k, v in est.items()}}


def ci(est) -> str:
    return f"{est.value:.4f} [{est.ci_low:.4f}, {est.ci_high:.4f}]"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", default=DEFAULT)
    p.add_argument("--windows", type=int, default=SETTINGS.windows)
    p.add_argument("--fast-only", action="store_true", help="skip figures 4 and 5 (exact)")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    ckpt = load_checkpoint(args.checkpoint)
    truth = load_ground_truth(args.checkpoint)
    if truth is None:
        raise SystemExit(f"{args.checkpoint} has no ground_truth.safetensors: figures 2-3 need labelled answers")
    max_loops = SETTINGS.trace_loops(ckpt.recipe)
    r_max = min(ckpt.recipe.r_max, max_loops)
    r_bar = min(ckpt.recipe.depth, r_max)
    windows = ckpt.windows("eval")[:args.windows]
    tr = trace(ckpt, windows, max_loops, SETTINGS.seed, cache=TraceCache(), progress=True)
    boot = Bootstrap(tr.n_windows, SETTINGS.n_boot, SETTINGS.seed)
    out: dict = {"checkpoint": ckpt.checkpoint_id, "windows": tr.n_windows, "r_bar": r_bar, "r_max": r_max,
                 "trace_loops": max_loops,
                 "n_boot": boot.n_boot, "ci_level": boot.level}

    loss = {r: uniform_loss(tr, boot, r) for r in range(1, r_max + 1)}
    drop = boot.summarise(loss[1] - loss[r_bar])
    out["loss_by_depth"] = {r: float(v[0]) for r, v in loss.items()}
    out["loss_drop_1_to_rbar"] = drop.to_dict()
    print(f"{ckpt.checkpoint_id}: {tr.n_windows} eval windows x {tr.seq_len} tokens, r_bar {r_bar}, r_max {r_max}; "
          f"{int(100 * boot.level)}% CIs from {boot.n_boot} paired bootstrap replicates over windows")
    print(f"\n1. loss (nats/token) at 1 loop {loss[1][0]:.4f}, at r_bar {loss[r_bar][0]:.4f}: drop {ci(drop)}")

    steps, max_train = truth
    ah = answer_hops(tr, steps)
    answers = (ah > 0) & (ah <= max_train)
    acc = {r: uniform_answer_accuracy(tr, answers, r, boot) for r in range(1, r_max + 1)}
    by_steps = {int(k): {r: float(uniform_answer_accuracy(tr, answers & (ah == k), r, boot)[0]) for r in range(1, r_max + 1)}
                for k in np.unique(ah[answers])}
    out["answer_accuracy_by_depth"] = {r: float(v[0]) for r, v in acc.items()}
    out["answer_accuracy_by_steps"] = by_steps
    out["n_answers"] = int(answers.sum())
    print(f"\n2. answer-token accuracy by uniform loops ({int(answers.sum())} answers, steps 1..{max_train}):")
    shown = [r for r in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if r <= r_max]
    print("   loops      " + " ".join(f"{r:>6d}" for r in shown))
    print("   all        " + " ".join(f"{acc[r][0]:6.3f}" for r in shown))
    for k, row in by_steps.items():
        print(f"   {k} step{'s' if k > 1 else ' '}    " + " ".join(f"{row[r]:6.3f}" for r in shown))
    tok = ckpt.tokenizer()
    correct = correct_at(tr, np.full(ah.shape, r_bar))
    sizes = by_problem_length(correct, answers, ah, problem_length(tr.targets, tok.token_to_id(EOS)))
    out["answer_accuracy_at_rbar_by_problem_length"] = sizes
    print_groups("the length of the answer's problem in tokens", sizes)
    forms = by_form(correct, answers, ah, tr.ids, tok.token_to_id("?"))
    if any("terse" in row for row in forms.values()):
        out["answer_accuracy_at_rbar_by_form"] = forms
        print_groups("the answer's form", forms)
    rise = boot.summarise(100 * (acc[r_bar] - acc[1]))
    out["answer_accuracy_rise_points_1_to_rbar"] = rise.to_dict()
    print(f"\n3. answer accuracy rise from 1 loop to r_bar: {rise.value:.1f} points "
          f"[{rise.ci_low:.1f}, {rise.ci_high:.1f}]")
    multi = answers & (ah >= 2)
    if multi.any():
        out["multi_step"] = multi_step_rise(tr, multi, r_bar, boot)

    if not args.fast_only:
        exact = allocation(tr, boot, r_bar, allocation_families(r_max), ExactPath(ckpt, windows, TraceCache(), True))
        match = exact["report"]["a1_loops_to_match_a0_rbar"]
        best = smallest_uniform_depth(tr, match["a0_loss"], r_max)
        out["exact_a1"] = {**match, "best_uniform_depth": best,
                           "vs_best_uniform": match["value"] / best if best else None,
                           "vs_r_bar": match["value"] / r_bar}
        print(f"\n4. exact A1 (halted tokens frozen) reaches A0@r_bar's loss {match['a0_loss']:.4f} at "
              f"{match['value']:.2f} mean loops [{match['ci_low']:.2f}, {match['ci_high']:.2f}]; the best uniform "
              f"depth reaching that loss is {best}: A1 / best uniform = "
              + (f"{match['value'] / best:.2f}x" if best else "n/a")
              + f"; A1 / r_bar = {match['value'] / r_bar:.2f}x")
        out["exact_a1_at_answer_accuracy"] = a1_at_answer_accuracy(ckpt, tr, boot, r_max, r_bar, windows)
    out["answer_argmax_changes_by_loop"] = answer_flips(tr, answers)
    print_flips(out["answer_argmax_changes_by_loop"], int(answers.sum()))
    first, scored = first_agreeing_loop(tr.argmax, r_bar), tr.targets >= 0
    out["r_bar_prediction_first_reached_mean_loops"] = {"all": float(first[scored].mean()),
                                                         "answers": float(first[answers].mean())}
    print(f"   the fewest loops that give A0@r_bar's prediction on every token: {first[scored].mean():.2f} on average "
          f"({first[answers].mean():.2f} on answers; uniform trace): what a rule that knew the future would use")
    out["seconds"] = time.perf_counter() - t0
    print(f"\n({out['seconds']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=float)
    return out


if __name__ == "__main__":
    main()
