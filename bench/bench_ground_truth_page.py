"""`python -m bench.bench_ground_truth_page [CKPT]`: the wall time of the Ground truth page's exact
figures on a checkpoint (default: the app's default, checkpoints/specimen), from a cold cache (a fresh
temporary folder), stage by stage as the page runs them through `recur_core.analysis.study.Study`:
A2's probes, the eval trace, the certified exit's L, the fast ground truth, then the exact one (the
page's button). Issue 51's goal: the exact figures in under 5 minutes. Per family, the thresholds
its walk evaluated (a state rule's in the harness, a readout rule's decoded) and its operating point;
the harness's work in lane-loops (comparable across machines). Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

from recur_core import load_checkpoint
from recur_core.analysis.cache import TraceCache
from recur_core.analysis.harness import SweepWork
from recur_core.analysis.study import Study, StudySettings

GOAL_S = 300.0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?", default="checkpoints/specimen")
    p.add_argument("--windows", type=int, default=StudySettings().windows, help="eval windows (the page's: 128)")
    args = p.parse_args(argv)
    seconds: dict[str, float] = {}

    def stage(name: str, fn):
        t0 = time.perf_counter()
        out = fn()
        seconds[name] = time.perf_counter() - t0
        return out

    with tempfile.TemporaryDirectory() as tmp:
        study = Study(load_checkpoint(args.checkpoint), StudySettings(windows=args.windows), cache=TraceCache(tmp))
        stage("probes", study.probes)
        stage("trace", study.trace)
        stage("certified L", lambda: study.lipschitz)
        stage("fast ground truth", study.ground_truth)
        work = SweepWork()  # the harness's share of the work, in machine-independent counts
        gt = stage("exact ground truth", lambda: study.ground_truth(study.exact_path(work=work)))
    if gt is None:
        raise SystemExit(f"{args.checkpoint} ships no ground truth: the page has no exact figures")
    print(f"\n{args.checkpoint}, {args.windows} windows: the Ground truth page from a cold cache")
    for name, s in seconds.items():
        print(f"  {name:20s} {s:8.1f} s")
    print(f"  exact ground truth against the goal of {GOAL_S:.0f} s: {seconds['exact ground truth'] / GOAL_S:.2f}x")
    print(f"  its harness: {work.lane_loops:,} lane-loops, {work.live_token_loops:,} live token-loops")
    walks = {by: {name: len(pol["curve"]) for name, pol in gt["policies"].items() if pol["evaluated_by"] == by}
             for by in ("harness", "decoding")}
    for by, verb in (("harness", "ran in the harness"), ("decoding", "decoded")):
        for name, n in walks[by].items():
            pol = gt["policies"][name]
            print(f"  {name:16s} {verb} {n} thresholds; operating point {pol['threshold']:.3g}, "
                  f"{pol['mean_loops']:.2f} mean loops")
    result = {"checkpoint": args.checkpoint, "windows": args.windows, "seconds": seconds, "goal_s": GOAL_S,
              "within_goal": seconds["exact ground truth"] < GOAL_S, "decoded_thresholds": walks["decoding"],
              "harness_thresholds": walks["harness"], "harness_work": work.as_dict()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
