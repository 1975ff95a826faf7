"""Ouro decoding on its learned exit gate (issue 40): batch-1 tokens/s of GateExit, a halting policy
whose halted tokens' later steps are not run for them, against every token running all steps.

    python -m bench.bench_ouro_decode /tmp/full/ouro-1.4b [--q 0.3 0.5 0.7 0.9] [--threads N]

FOLDER: an Ouro folder; an empty or missing one is first written by `bench.synthetic ouro-1.4b`
(Ouro-1.4B's published config and tensor shapes, random bfloat16 weights, seed 0), which is what the
figures in docs/BENCHMARKS.md ran on. The weights stay as stored (bfloat16).

Every run is `recur_core.decoding.decode.generate` under the KV rule "continue" (Ouro's default:
its output is the reference's full recompute, tests/test_ouro.py): greedy, --new-tokens tokens after
a --prompt-len prompt of seeded random ids, keep_logits off. Policies:
  - all steps: `Uniform(total_ut_steps)`, every token through every step with the same per-(step,
    layer) KV cache (what vLLM's Ouro runs): the baseline of the speedups;
  - `GateExit.of_checkpoint(ckpt, q)` for each --q: each token halts at the first step whose exit
    CDF reaches q; a later token that goes deeper than an earlier halted one runs the missing step
    of that position in its own core call ("continue": the extra rows ride the same weight pass).
  - with --recompute N (default 4): full recompute, N tokens: each new token runs the whole
    sequence through all steps, no cache (the hub code's `use_cache=False` workaround).
Each policy is timed --repeats times, interleaved, after a warm-up generation that touches every
weight page; tokens/s is decode steps / decode seconds (the prompt's prefill apart), the median
repeat is reported. Core work is counted, not estimated: the token positions the first core block
runs per decode step (its own exit steps plus the earlier positions' missing steps).

The last line of output is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from recur_core import load_checkpoint
from recur_core.decoding.decode import generate
from recur_core.exits.policies import GateExit, Uniform


def log(*args):
    print(*args, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.bench_ouro_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--q", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.9], help="gate thresholds in (0, 1)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--recompute", type=int, default=4, help="tokens of the full-recompute row (0: skip)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def ensure_folder(folder: Path) -> dict | None:
    """Write the synthetic full-size Ouro-1.4B into folder unless it holds a config.json."""
    if (folder / "config.json").is_file():
        return None
    from .synthetic import write
    log(f"writing the synthetic Ouro-1.4B folder to {folder} ...")
    return write("ouro-1.4b", folder)


class CoreRows:
    """Counts the token positions each core call runs (the first core block's input rows)."""

    def __init__(self, model):
        self.rows: list[int] = []
        self.handle = model.core_blocks[0].register_forward_pre_hook(lambda _, a: self.rows.append(a[0].shape[1]))

    def close(self):
        self.handle.remove()


def timed_generate(ck, prompt, n_new, policy, counter: CoreRows) -> dict:
    """One greedy generation; the core rows of its decode steps (after the prefill's first token)."""
    mark = {}

    def on_token(index, _tok, _exit):
        if index == 0:
            mark["prefill_rows"] = len(counter.rows)

    counter.rows.clear()
    gen = generate(ck, prompt, n_new, policy, greedy=True, keep_logits=False, on_token=on_token)
    decode_rows = counter.rows[mark["prefill_rows"]:]
    steps = gen.decode_steps
    return {"tokens_per_s": gen.tokens_per_s, "decode_s": gen.decode_s, "prefill_s": gen.prefill_s,
            "decode_steps": steps, "mean_exit": statistics.fmean(gen.decode_exit_loops),
            "exits": gen.decode_exit_loops, "core_calls_per_token": len(decode_rows) / steps,
            "core_rows_per_token": sum(decode_rows) / steps, "ids": gen.ids, "kv_rule": gen.kv_rule}


@torch.inference_mode()
def full_recompute(ck, prompt, n_new, steps) -> dict:
    """Greedy decoding with no cache: each new token runs the whole sequence through every step."""
    ids = list(prompt)
    t0 = time.perf_counter()
    logits = ck.model(torch.tensor([ids]), steps)[0, -1]
    ids.append(int(logits.argmax()))
    t1 = time.perf_counter()
    for _ in range(n_new - 1):
        ids.append(int(ck.model(torch.tensor([ids]), steps)[0, -1].argmax()))
    t2 = time.perf_counter()
    return {"tokens_per_s": (n_new - 1) / (t2 - t1), "decode_s": t2 - t1, "prefill_s": t1 - t0,
            "decode_steps": n_new - 1, "mean_exit": float(steps), "ids": ids[len(prompt):]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    written = ensure_folder(args.folder)
    t0 = time.perf_counter()
    ck = load_checkpoint(args.folder)
    load_s = time.perf_counter() - t0
    model, steps = ck.model, ck.recipe.depth
    if model.exit_gate is None:
        raise SystemExit(f"{args.folder} has no exit gate: not an Ouro folder")
    cfg = ck.config
    log(f"== {args.folder}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters, "
        f"{next(model.parameters()).dtype}, d {cfg.d_model}, {cfg.n_core} looped layers x {steps} steps, "
        f"vocab {cfg.vocab_size}; loaded in {load_s:.1f} s; {torch.get_num_threads()} thread(s), "
        f"torch {torch.__version__}")
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
    policies = {"all steps": Uniform(steps), **{f"gate q={q:g}": GateExit.of_checkpoint(ck, q) for q in args.q}}
    counter = CoreRows(model)
    try:
        t0 = time.perf_counter()
        timed_generate(ck, prompt, 2, Uniform(steps), counter)  # warm-up: every weight page touched once
        log(f"warm-up: {time.perf_counter() - t0:.1f} s")
        runs = {name: [] for name in policies}
        for rep in range(args.repeats):
            for name, policy in policies.items():
                r = timed_generate(ck, prompt, args.new_tokens, policy, counter)
                runs[name].append(r)
                log(f"  repeat {rep + 1} {name:>10}: {r['tokens_per_s']:.3f} tok/s, mean exit {r['mean_exit']:.2f}")
    finally:
        counter.close()
    rows = {}
    for name, reps in runs.items():
        med = sorted(reps, key=lambda r: r["tokens_per_s"])[len(reps) // 2]
        rows[name] = {**med, "tokens_per_s_repeats": [r["tokens_per_s"] for r in reps]}
    if args.recompute > 1:
        rows["full recompute"] = full_recompute(ck, prompt, args.recompute, steps)
    base = rows["all steps"]["tokens_per_s"]
    log(f"\n{args.prompt_len}-token prompt, {args.new_tokens} new tokens, greedy, KV rule "
        f"'{rows['all steps']['kv_rule']}'; median of {args.repeats} (full recompute: {args.recompute} tokens, once)")
    log(f"{'policy':>16} {'tok/s':>8} {'x all steps':>12} {'mean exit':>10} {'core calls/tok':>15} "
        f"{'core rows/tok':>14}")
    for name, r in rows.items():
        calls = f"{r['core_calls_per_token']:.2f}" if "core_calls_per_token" in r else "-"
        crow = f"{r['core_rows_per_token']:.2f}" if "core_rows_per_token" in r else "-"
        log(f"{name:>16} {r['tokens_per_s']:>8.3f} {r['tokens_per_s'] / base:>11.2f}x {r['mean_exit']:>10.2f} "
            f"{calls:>15} {crow:>14}")
    for r in rows.values():
        r.pop("ids")
    out = {"folder": str(args.folder), "written": written, "load_s": load_s, "threads": torch.get_num_threads(),
           "torch": torch.__version__, "machine": platform.machine(), "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "steps": steps, "baseline": "all steps",
           "speedup": {name: r["tokens_per_s"] / base for name, r in rows.items()}, "rows": rows}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
