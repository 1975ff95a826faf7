"""The measured effects quoted in docs/DEVIATIONS.md, the deviations from the paper.

  1. the depth sampler's mean: E[r], P(r = 1), P(r <= 2) under sampler_mean "r_bar" and "huginn";
  2. plain vs truncated (at +-3 std, Huginn's) initial noise: loss at 1, 2, 4, 8 loops on a
     checkpoint's eval windows, against the change from another noise seed;
  3. A1's first check at loop 1 or 2: loops A1 needs to reach A0's loss at r_bar (fast path);
  4. S1's unique parameter count (2/4/2 blocks at SmolLM2-135M widths) against 30 blocks.

    python -m training.bench_deviations [--ckpt checkpoints/demo] [--draws 40000]
Last line: one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import torch
import torch.nn.functional as F

from recur_core import LoopedLM, load_checkpoint
from recur_core.analysis.cache import TraceCache
from recur_core.analysis.curves import fast_curve, loops_to_match
from recur_core.analysis.stats import Bootstrap
from recur_core.analysis.trace import trace
from recur_core.exits import catalogue
from recur_core.settings import SETTINGS
from training.depth_sampler import sample_depth
from training.presets import PRESETS


def sampler_figures(draws: int) -> dict:
    out = {}
    for r_bar in (4, 8):
        for mean in ("r_bar", "huginn"):
            d = np.array([sample_depth(s, r_bar, 4 * r_bar, 0.5, 11, mean) for s in range(draws)])
            out[f"r_bar{r_bar}_{mean}"] = {"mean": float(d.mean()), "p1": float((d == 1).mean()),
                                           "p_le2": float((d <= 2).mean())}
            print(f"sampler r̄ {r_bar} {mean:6s}: E[r] {d.mean():.3f}  P(r=1) {(d == 1).mean():.4f}  "
                  f"P(r<=2) {(d <= 2).mean():.4f}")
    return out


def with_truncated_noise(model) -> LoopedLM:
    """The same weights with the config variant state_init "trunc_normal" (Huginn's: cut at +-3 std)."""
    other = LoopedLM(dataclasses.replace(model.cfg, state_init="trunc_normal"))
    other.load_state_dict(model.state_dict())
    return other.eval()


@torch.no_grad()
def mean_loss(model, windows, seed: int, depths=(1, 2, 4, 8), batch=16) -> dict[int, float]:
    gen = torch.Generator().manual_seed(seed)
    total, n = {d: 0.0 for d in depths}, 0
    for s in range(0, len(windows), batch):
        x, y = windows[s:s + batch, :-1], windows[s:s + batch, 1:]
        e, state = model.prelude(x), model.init_state(*x.shape, generator=gen)
        for i in range(1, max(depths) + 1):
            state = model.core_step(state, e)
            if i in total:
                logits = model.readout(state).float().flatten(0, 1)
                total[i] += F.cross_entropy(logits, y.flatten(), reduction="sum").item()
        n += y.numel()
    return {d: v / n for d, v in total.items()}


def noise_figures(ckpt) -> dict:
    model, windows = ckpt.model, ckpt.windows("eval")[:SETTINGS.windows]
    plain = mean_loss(model, windows, SETTINGS.seed)
    trunc = mean_loss(with_truncated_noise(model), windows, SETTINGS.seed)
    other = mean_loss(model, windows, SETTINGS.seed + 1)
    out = {}
    for d in plain:
        out[d] = {"plain": plain[d], "truncated_minus_plain": trunc[d] - plain[d], "seed_change": other[d] - plain[d]}
        print(f"noise, {d} loops: plain {plain[d]:.5f}  truncated − plain {trunc[d] - plain[d]:+.5f}  "
              f"other seed − plain {other[d] - plain[d]:+.5f}")
    return out


def first_check_figures(ckpt) -> dict:
    recipe = ckpt.recipe
    tr = trace(ckpt, ckpt.windows("eval")[:SETTINGS.windows], SETTINGS.trace_loops(recipe), SETTINGS.seed,
               cache=TraceCache(), progress=True)
    boot = Bootstrap(tr.n_windows, SETTINGS.n_boot, SETTINGS.seed)
    a0 = fast_curve(tr, "A0", catalogue.sweep("A0", recipe.r_max), boot)
    out = {}
    for first in (1, 2):
        curve = fast_curve(tr, "A1", catalogue.sweep("A1", recipe.r_max, min_loops=first), boot)
        match = loops_to_match(curve, a0, recipe.depth, boot)
        exits = catalogue.make("A1", SETTINGS.moving_kl, min_loops=first, r_max=recipe.r_max).exits(tr).depth[tr.has_target]
        out[first] = {"loops_to_match": match, "frac_exit_loop1_at_1e-3": float((exits == 1).mean())}
        print(f"A1 first check at loop {first}: loops to match A0@{recipe.depth} {match['value']:.3f} "
              f"[{match['ci_low']:.3f}, {match['ci_high']:.3f}]; at ε {SETTINGS.moving_kl:g}, "
              f"{(exits == 1).mean():.4f} of tokens exit at loop 1")
    out["mean_kl_loop1"] = float(tr.kl_prev[..., 0].mean())
    return out


def s1_figures() -> dict:
    model = LoopedLM(PRESETS["s1"].model_config(49_152))
    block = sum(p.numel() for p in model.core_blocks[0].parameters())
    plain_block = sum(p.numel() for p in model.prelude_blocks[0].parameters())
    out = {"unique": model.num_params(), "embedding": model.embed.weight.numel(), "core_block": block,
           "thirty_blocks": 30 * plain_block + model.embed.weight.numel() + model.cfg.d_model}
    print(f"S1: {out['unique']:,} unique parameters ({out['embedding']:,} embedding, {block:,} per core block); "
          f"30 pre-norm blocks at these widths: {out['thirty_blocks']:,}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="checkpoints/demo")
    p.add_argument("--draws", type=int, default=40_000)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.ckpt)
    result = {"sampler": sampler_figures(args.draws), "noise": noise_figures(ckpt),
              "a1_first_check": first_check_figures(ckpt), "s1_params": s1_figures()}
    print(json.dumps(result, default=float))


if __name__ == "__main__":
    main()
