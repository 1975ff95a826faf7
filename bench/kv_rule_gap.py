"""How the KV rule moves A2's teacher-forced loss (issue 12, item 5).

A2 (the KL-label probe) at one tau (--tau), under the "latest" rule against "recompute" (= the
masking harness). This script measures:

  1. the two rules at that tau on the calibration windows, the masking harness for reference;
  2. tau calibrated to A0@r_bar's loss (+ tolerance) on one set of windows, per rule, and evaluated
     on a disjoint set, beside every uniform depth 1..r_bar on that set;
  3. the per-token gap (latest - recompute), by the token's own exit loop and by token class;
  4. the keys a halted token leaves for later loops: under "latest" the entry of its exit loop
     (computed from s_{e-1}: the noise state for a loop-1 exit), under "recompute" the entry its
     frozen exit state writes at loop i; both against the uniform run's entry at loop i;
  5. the oracle bound: each token at its best loop of the uniform run (the fast path's context);
  6. a control that separates the rule from the policy: A2's own exits, and the same exits shuffled
     within each window (same depth distribution, tokens chosen at random), under both rules.

    python -m bench.kv_rule_gap [--ckpt checkpoints/demo-r8] [--tau 0.671]
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.nn.functional as F

from recur_core import load_checkpoint
from recur_core.analysis.curves import TOKEN_CLASSES, vocab_classes
from recur_core.analysis.harness import run_exact
from recur_core.analysis.probe import ProbeSpec, load_or_train_probes
from recur_core.analysis.trace import trace
from recur_core.decoding.decode import Decoder
from recur_core.decoding.teacher_forced import teacher_forced
from recur_core.exits import catalogue
from recur_core.exits.halting import HaltSchedule
from recur_core.exits.policies import Policy, Uniform

# Section 2's own grid, not A2's catalogue calibration grid: steps of 0.1 with the investigated tau (the
# --tau default) on it, searched without bisection, so both rules are compared at the same thresholds.
TAU_GRID = (0.9, 0.8, 0.7, 0.671, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)


class GivenExits(Policy):
    """Halts token (n, t) of a whole-set prefill at exits[n, t]: a fixed exit pattern (control)."""

    threshold_name = "label"

    def __init__(self, exits: torch.Tensor, label: str):
        super().__init__(1, None)
        self.exits, self.label = exits, label

    def _rule_online(self, loop, signals):
        return self.exits.to(signals.state_change.device) == loop


def log(*a):
    print(*a, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="checkpoints/demo-r8")
    p.add_argument("--tau", type=float, default=0.671)
    p.add_argument("--cal", type=int, default=32, help="calibration windows (eval windows 0 ..)")
    p.add_argument("--held", type=int, default=64, help="disjoint evaluation windows (after the calibration ones)")
    p.add_argument("--key-windows", type=int, default=8)
    p.add_argument("--tolerance", type=float, default=0.002)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sections", default="1,2,3,4,5,6", help="which sections to run (3 needs 1)")
    return p.parse_args(argv)


def tf(ckpt, windows, policy, rule, cap, seed, first=0):
    """Teacher-forced per-token result; state-based policies: the parallel prefill equals decoding."""
    return teacher_forced(ckpt, windows, policy, rule, seed=seed, max_loops=cap, mode="prefill", batch_size=8,
                          first_window=first)


@torch.inference_mode()
def keys_at(ckpt, windows, policy, rule, cap, seed):
    """(core keys (n_core, N, loops, Hkv, T, hd), exits (N, T), loops filled (N, T)) of a prefill."""
    ids = windows[:, :-1]
    dec = Decoder(ckpt.model, HaltSchedule(policy, cap), batch=len(ids), kv_rule=rule,
                  noise=ckpt.model.seeded_state(range(len(ids)), seed))
    _, exits = dec.prefill(ids)
    T = ids.shape[1]
    if rule == "latest":  # its entries of later loops are copied when first read: read them all
        for loop in range(2, cap + 1):
            dec.rule.before_loop(ckpt.model, dec.cache, loop, T)
    return dec.cache.core[0, ..., :T, :].clone(), exits, dec.cache.filled[:, :T].copy()


def rel(a, b):
    """Mean relative L2 distance ||a - b|| / ||b|| and mean cosine over the last dim."""
    a, b = a.reshape(-1, a.shape[-1]).float(), b.reshape(-1, b.shape[-1]).float()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).mean()), float(F.cosine_similarity(a, b, dim=-1).mean())


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.ckpt)
    r_bar, cap = ckpt.recipe.depth, ckpt.recipe.r_max
    windows = ckpt.windows("eval")
    cal, held = windows[:args.cal], windows[args.cal:args.cal + args.held]
    probe = load_or_train_probes(ckpt, cap, args.seed, ProbeSpec(kinds=("kl",)))["kl"]
    a2 = lambda tau: catalogue.make("A2", tau, r_max=cap, probe=probe)  # noqa: E731
    out = {}
    sections = {int(x) for x in args.sections.split(",")}
    if 1 in sections:
        out.update(section_1_3(ckpt, cal, held, a2, args, cap, r_bar, sections))
    if 4 in sections:
        out["keys"] = section_keys(ckpt, cal, a2, args, cap, r_bar)
    if 5 in sections:
        out["oracle"] = section_oracle(ckpt, cal, args, cap, r_bar)
    if 6 in sections:
        out["control"] = control(ckpt, cal, a2(args.tau), cap, r_bar, args.seed)
    print(json.dumps(out, default=float))


def section_1_3(ckpt, cal, held, a2, args, cap, r_bar, sections) -> dict:
    out = {}
    log(f"== 1. A2 tau {args.tau} on {len(cal)} calibration windows (cap {cap})")
    a0 = tf(ckpt, cal, Uniform(r_bar), "latest", cap, args.seed)
    lat = tf(ckpt, cal, a2(args.tau), "latest", cap, args.seed)
    rec = tf(ckpt, cal, a2(args.tau), "recompute", cap, args.seed)
    ex = run_exact(ckpt, cal, a2(args.tau), cap, args.seed, batch_size=8)
    log(f"A0@{r_bar} {a0.loss:.5f} | latest {lat.loss:.5f} loops {lat.mean_loops:.3f} | recompute {rec.loss:.5f} "
        f"loops {rec.mean_loops:.3f} | harness {np.nanmean(ex.ce):.5f} loops {ex.exit_depth.mean():.3f}")
    out["at_tau"] = dict(tau=args.tau, a0=a0.loss, latest=lat.loss, latest_loops=lat.mean_loops, recompute=rec.loss,
                         recompute_loops=rec.mean_loops, harness=float(np.nanmean(ex.ce)),
                         harness_loops=float(ex.exit_depth.mean()))

    # 2. tau calibrated on one set, evaluated on a disjoint one ------------------------------------
    log(f"== 2. tau calibrated per rule on windows 0..{args.cal - 1}, evaluated on {args.cal}..{args.cal + args.held - 1}")
    target = a0.loss + args.tolerance
    held_a0 = {r: tf(ckpt, held, Uniform(r), "latest", cap, args.seed, first=args.cal).loss for r in range(1, r_bar + 1)}
    log("uniform depth on the held-out windows: " + ", ".join(f"A0@{r} {v:.5f}" for r, v in held_a0.items()))
    out["held_uniform"] = held_a0
    out["calibrated"] = {}
    for rule in ("latest", "recompute"):
        tau, res = None, None
        for th in TAU_GRID:  # descending tau: fewest loops first
            res = tf(ckpt, cal, a2(th), rule, cap, args.seed)
            if res.loss <= target:
                tau = th
                break
        if tau is None:
            log(f"{rule}: no tau on the grid reaches {target:.5f}")
            continue
        h = tf(ckpt, held, a2(tau), rule, cap, args.seed, first=args.cal)
        log(f"{rule:9s}: tau {tau} -> calibration loss {res.loss:.5f} loops {res.mean_loops:.3f}; held-out loss "
            f"{h.loss:.5f} loops {h.mean_loops:.3f} (held-out A0@{r_bar} {held_a0[r_bar]:.5f})")
        out["calibrated"][rule] = dict(tau=tau, cal_loss=res.loss, cal_loops=res.mean_loops, held_loss=h.loss,
                                       held_loops=h.mean_loops)

    if 3 not in sections:
        return out
    # 3. per-token decomposition of the gap at the tau ---------------------------------------
    log(f"== 3. per-token gap latest - recompute at tau {args.tau}, calibration windows")
    gap = (lat.ce - rec.ce).numpy()
    exits_lat, exits_rec = lat.exit_loop.numpy(), rec.exit_loop.numpy()
    total = gap.sum()
    log(f"mean gap {gap.mean():+.5f} nats over {gap.size} tokens; same exit under both rules for "
        f"{100 * (exits_lat == exits_rec).mean():.1f}% of tokens")
    rows = []
    for lo, hi, name in ((1, 1, "1"), (2, 2, "2"), (3, 3, "3"), (4, r_bar, f"4-{r_bar}"), (r_bar + 1, cap, f">{r_bar}")):
        m = (exits_lat >= lo) & (exits_lat <= hi)
        if m.any():
            rows.append(dict(exit=name, share_tokens=float(m.mean()), mean_gap=float(gap[m].mean()),
                             share_of_gap=float(gap[m].sum() / total)))
            log(f"  own exit {name:>5s}: {100 * m.mean():5.1f}% of tokens, mean gap {gap[m].mean():+.5f}, "
                f"{100 * gap[m].sum() / total:6.1f}% of the total")
    out["by_exit"] = rows
    # the context: how many earlier tokens of the window exited at loop 1 (under "latest")
    early = np.cumsum(exits_lat == 1, axis=1) - (exits_lat == 1)
    frac = early / np.maximum(np.arange(gap.shape[1])[None, :], 1)
    qs = np.quantile(frac[:, 8:], [0.25, 0.5, 0.75])
    out["by_context"] = []
    for lo, hi in zip([-1, *qs], [*qs, 2], strict=True):
        m = (frac > lo) & (frac <= hi)
        m[:, :8] = False
        if m.any():
            log(f"  earlier tokens exited at loop 1: {max(lo, 0):.2f}..{min(hi, 1):.2f} -> mean gap {gap[m].mean():+.5f} "
                f"({m.sum()} tokens)")
            out["by_context"].append(dict(lo=float(max(lo, 0)), hi=float(min(hi, 1)), mean_gap=float(gap[m].mean())))
    classes = vocab_classes(ckpt.tokenizer(), ckpt.config.vocab_size)[cal[:, :-1].numpy()]
    out["by_class"] = {}
    for i, name in enumerate(TOKEN_CLASSES):
        m = classes == i
        if m.any():
            log(f"  class {name:12s}: {100 * m.mean():5.1f}% of tokens, mean gap {gap[m].mean():+.5f}, "
                f"{100 * gap[m].sum() / total:6.1f}% of the total")
            out["by_class"][name] = dict(share_tokens=float(m.mean()), mean_gap=float(gap[m].mean()),
                                         share_of_gap=float(gap[m].sum() / total))

    return out


def section_keys(ckpt, cal, a2, args, cap, r_bar) -> list:
    log(f"== 4. keys read for halted tokens, {args.key_windows} windows, against the uniform run's")
    kw = cal[:args.key_windows]
    k_uni, _, _ = keys_at(ckpt, kw, Uniform(cap), "latest", cap, args.seed)
    k_lat, e_lat, _ = keys_at(ckpt, kw, a2(args.tau), "latest", cap, args.seed)
    k_rec, e_rec, filled = keys_at(ckpt, kw, a2(args.tau), "recompute", cap, args.seed)
    n_loops = int(filled.min())
    out = []
    for e in (1, 2):
        for i in sorted({e + 1, min(r_bar, n_loops), n_loops}):
            if i <= e or i > n_loops:
                continue
            m = (e_lat == e) & (e_rec == e)  # tokens that exit at e under both rules
            if not m.any():
                continue
            sel = lambda k, i=i, m=m: k[:, :, i - 1].permute(1, 3, 0, 2, 4)[m]  # noqa: E731  (tokens, n_core, Hkv, hd)
            d_lat, c_lat = rel(sel(k_lat), sel(k_uni))
            d_rec, c_rec = rel(sel(k_rec), sel(k_uni))
            log(f"  exit {e}, read at loop {i:2d}: latest vs uniform rel. dist {d_lat:.3f} (cos {c_lat:.3f}); "
                f"recompute vs uniform {d_rec:.3f} (cos {c_rec:.3f})  [{int(m.sum())} tokens]")
            out.append(dict(exit=e, loop=i, latest_rel=d_lat, latest_cos=c_lat, recompute_rel=d_rec,
                                    recompute_cos=c_rec, tokens=int(m.sum())))

    return out


def section_oracle(ckpt, cal, args, cap, r_bar) -> dict:
    log("== 5. oracle: each token at its best loop of the uniform run (calibration windows)")
    tr = trace(ckpt, cal, cap, args.seed)
    ce = np.asarray(tr.ce)  # (N, T, loops)
    best = ce.min(axis=-1)
    best_r = ce[..., :r_bar].min(axis=-1)
    log(f"oracle over loops 1..{cap}: {best.mean():.5f} (mean best loop {ce.argmin(-1).mean() + 1:.2f}); "
        f"over 1..{r_bar}: {best_r.mean():.5f}; fast-path A0@{r_bar} {ce[..., r_bar - 1].mean():.5f}")
    return dict(all_loops=float(best.mean()), upto_r_bar=float(best_r.mean()),
                mean_best_loop=float(ce.argmin(-1).mean() + 1), fast_a0=float(ce[..., r_bar - 1].mean()))


def control(ckpt, cal, policy, cap, r_bar, seed) -> dict:
    """Section 6: the policy's exits (under "latest") replayed, and shuffled within each window."""
    log(f"== 6. control: fixed exit patterns under both rules, {len(cal)} calibration windows")
    run = lambda p, rule: teacher_forced(ckpt, cal, p, rule, seed=seed, max_loops=cap, mode="prefill",  # noqa: E731
                                         batch_size=len(cal))
    exits = run(policy, "latest").exit_loop
    g = torch.Generator().manual_seed(seed)
    shuffled = torch.stack([row[torch.randperm(row.numel(), generator=g)] for row in exits])
    out = {"a0": run(Uniform(r_bar), "latest").loss}
    for label, ex in (("policy exits", exits), ("shuffled exits", shuffled)):
        res = {rule: run(GivenExits(ex, label), rule) for rule in ("latest", "recompute")}
        out[label] = {rule: r.loss for rule, r in res.items()}
        log(f"{label:15s} (mean loops {ex.float().mean():.3f}): latest {res['latest'].loss:.5f}, recompute "
            f"{res['recompute'].loss:.5f}, gap {res['latest'].loss - res['recompute'].loss:+.5f}; A0@{r_bar} {out['a0']:.5f}")
    return out


if __name__ == "__main__":
    main()
