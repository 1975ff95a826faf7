"""`python -m bench.exact_vs_decoding [CKPT]`: does the exact ground truth predict real decoding?

On a checkpoint with ground truth (default checkpoints/hops), the exact ground truth
(recur_core.analysis.ground_truth) gives each family's operating point: the cheapest threshold whose
answer accuracy on the trained hop counts is within 1 point of A0 at r̄. The latent rule's comes from
the masking harness; A1's, a readout rule's, from a walk in teacher-forced decoding that starts at the
fast path's point. The same eval programs are then decoded token by token here (`teacher_forced`, mode
"decode", windows in lockstep: what `generate` computes for each) at that threshold:
  * under the "recompute" KV rule, which freezes a halted token's keys at its exit state exactly as
    the harness does: mean loops and answer accuracy must equal the exact ground truth's for both.
    Also printed: the share of tokens whose harness exit equals decoding's (100% for the latent rule;
    less for A1, because decoding reads token t's per-loop KL with earlier tokens' coda at their exit
    states and the harness at their current loop, docs/DECODING.md), and where A1's walk started (the
    fast path's operating point);
  * under "latest" (Huginn's rule: a halted token's keys at deeper loops are its latest ones), whose
    difference is reported.
Mean loops are over program tokens (padding excluded), as in report.json. Prints a table and a final
JSON line.
"""
from __future__ import annotations

import argparse
import json

from recur_core import load_checkpoint
from recur_core.analysis.exact import ExactPath
from recur_core.analysis.ground_truth import (
    Labels,
    answer_hops,
    eos_id,
    ground_truth_section,
    load_ground_truth,
    program_mask,
)
from recur_core.analysis.harness import run_exact
from recur_core.analysis.stats import Bootstrap
from recur_core.analysis.trace import trace
from recur_core.decoding.teacher_forced import teacher_forced
from recur_core.exits import catalogue
from recur_core.settings import SETTINGS


def decoded(ckpt, windows, policy, kv_rule: str, max_loops: int, ah, program, max_train: int) -> dict:
    """Mean loops (program tokens) and answer accuracy (trained hop counts) of teacher-forced decoding."""
    out = teacher_forced(ckpt, windows, policy, kv_rule, seed=SETTINGS.seed, max_loops=max_loops)
    exits, argmax = out.exit_loop.numpy(), out.argmax.numpy()
    trained = (ah > 0) & (ah <= max_train)
    return {"mean_loops": float(exits[program].mean()),
            "answer_accuracy": float((argmax == windows[:, 1:])[trained].mean()), "exit_loop": exits}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?", default="checkpoints/hops")
    p.add_argument("--windows", type=int, default=SETTINGS.windows, help="eval programs (default 128)")
    p.add_argument("--max-loops", type=int, default=None, help="loop budget (default the recipe's r_max)")
    args = p.parse_args(argv)
    ckpt = load_checkpoint(args.checkpoint)
    hops, max_train = load_ground_truth(args.checkpoint)
    windows = ckpt.windows("eval")[:args.windows].numpy()
    r_max = args.max_loops or ckpt.recipe.r_max
    r_bar = min(round(ckpt.recipe.r_bar), r_max)
    tr = trace(ckpt, windows, r_max, seed=SETTINGS.seed, cache=False)
    families = {name: catalogue.sweep(name, r_max) for name in ("A1", "latent")}
    gt = ground_truth_section(tr, Labels(hops, max_train, eos_id(ckpt.tokenizer())), r_max, r_bar,
                              Bootstrap(tr.n_windows, 20, SETTINGS.seed), families, ExactPath(ckpt, windows))
    ah, program = answer_hops(tr, hops), program_mask(tr, eos_id(ckpt.tokenizer()))
    rows = {}
    print(f"{args.checkpoint}: {len(windows)} programs, loop budget {r_max}, target accuracy "
          f"{gt['target_accuracy']:.3f} on hop counts {gt['target_hops']}")
    print("  policy   threshold   exact loops, acc   recompute loops, acc (harness exits equal)   latest loops, acc"
          "   fast path's point (the walk's start): threshold, loops, acc")
    for name, family in families.items():
        op = gt["policies"][name]
        policy = next(q for q in family if q.threshold == op["threshold"])
        exact_exits = run_exact(ckpt, windows, policy, r_max, SETTINGS.seed).exit_depth
        rec, lat = (decoded(ckpt, windows, policy, rule, r_max, ah, program, max_train)
                    for rule in ("recompute", "latest"))
        same = float((rec.pop("exit_loop") == exact_exits)[program].mean())
        lat.pop("exit_loop")
        start = op["fast_point"]
        rows[name] = {"threshold": op["threshold"], "exact": {k: op[k] for k in ("mean_loops", "answer_accuracy")},
                      "evaluated_by": op["evaluated_by"], "fast_point": start,
                      "recompute": rec, "latest": lat, "recompute_exits_equal_harness": same,
                      "latest_minus_exact": {k: lat[k] - op[k] for k in ("mean_loops", "answer_accuracy")}}
        print(f"  {name:7s} {op['threshold']:10.3g}   {op['mean_loops']:6.3f}, {op['answer_accuracy']:.3f}      "
              f"{rec['mean_loops']:6.3f}, {rec['answer_accuracy']:.3f} ({100 * same:.2f}% of tokens)     "
              f"{lat['mean_loops']:6.3f}, {lat['answer_accuracy']:.3f}      {start['threshold']:.3g}, "
              f"{start['mean_loops']:.3f}, {start['answer_accuracy']:.3f}")
    result = {"checkpoint": args.checkpoint, "windows": len(windows), "max_loops": r_max, "policies": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
