"""Throughput of depth-wise batched decoding (recur_core.decoding.serve.Pool), issue 11.

For one checkpoint:
  1. Calibrate on --windows eval windows, teacher-forced (KV rule "latest"; bench/calibrate.py): the
     target is A0@r_bar's loss + --tolerance nats, or on a checkpoint with ground truth
     (checkpoints/hops) A0@r_bar's answer accuracy - --acc-tolerance; each policy's threshold is the
     largest (fewest loops) that meets it; the best uniform depth is the smallest r whose A0@r meets it.
  2. Serve --requests requests (the first --prompt-len tokens of the next eval windows, --new-tokens
     new tokens each, greedy) through pools of each size in --pools, once per configuration, the
     configurations in an order rotated per pool, --repeats times (interleaved); each figure comes
     from the run with the median wall time (the faster of two). tokens/s = new tokens / wall time of the whole run
     (prefills included). With --repeats > 1 the ratios are also given paired: the median over
     repetitions of the ratio within one repetition (`*_paired`), since runs moments apart share
     the machine's state and a shared machine's throughput drifts between runs.
  3. The FLOP proxy of the same runs (bench/cost.py: prelude, core loops, coda, head and
     exit checks with the actual exits, readouts and context lengths; a prompt position counted with
     the loops and readouts the pool ran it for: its own exit loop under "latest", where a halted
     position leaves the core step, its chunk's deepest exit under "recompute", where it rides along
     frozen). flop_proxy_speedup = cost(A0@r_bar) / cost(policy); fraction_of_bound = realized
     speedup / flop_proxy_speedup.
     Where the rest goes: the pool times its batched model calls (prelude, core, readout; cache
     reads included). model_call_speedup is the same speedup counted on that time alone, i.e. with a
     scheduler that cost nothing; scheduler_share = 1 - model-call time / wall time. So
     fraction_of_bound splits into model_call_fraction_of_bound (what the batched calls themselves
     give: on a CPU a small call costs far more per row than a large one) times realized /
     model_call_speedup (what the scheduler's own work takes).
  4. Per-token latency: seconds between a sequence's consecutive new tokens (p50, p95). Per
     sequence, its decode time over the same request's at pool 1 (p50, p95, max): a sequence takes
     the same steps in a pool as alone, so this spreads only as far as some steps are longer than others.

The last line is a JSON object: the headline (the largest pool, the per-token policy with the best
realized speedup among those that met the target) at the top level, every figure under "pools".

    python -m bench.bench_serve                      # checkpoints/demo-r8, 64 requests, pools 1 8 32
    python -m bench.bench_serve --ckpt runs/x/best --requests 16 --pools 1,8
    python -m bench.bench_serve --ckpt checkpoints/hops   # 32-token program prefixes, 33 new tokens
    python -m bench.bench_serve --pools 32 --calibration bench/calibration/demo-r8.json   # the search skipped
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from recur_core import load_checkpoint
from recur_core.analysis.ground_truth import load_ground_truth
from recur_core.analysis.matching import match_threshold
from recur_core.analysis.probe import ProbeSpec, load_or_train_probes
from recur_core.decoding.serve import Request, serve
from recur_core.exits import catalogue
from recur_core.exits.policies import Policy, Uniform

from .calibrate import AccuracyCalibrator, LossCalibrator
from .cost import CostModel, served_cost


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="checkpoints/demo-r8")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=None,
                   help="new tokens per request (default 128, or what fits the context after the prompt)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--pools", default="1,8,32", help="pool sizes, comma-separated")
    p.add_argument("--windows", type=int, default=32, help="eval windows for the matched-loss calibration")
    p.add_argument("--tolerance", type=float, default=0.002, help="nats above A0@r_bar's loss allowed")
    p.add_argument("--acc-tolerance", type=float, default=0.01,
                   help="checkpoints with ground truth (hops): answer accuracy below A0@r_bar's allowed")
    p.add_argument("--bisect", type=int, default=3)
    p.add_argument("--tf-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="where the model and the pool run (cpu, cuda)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each configuration per pool (interleaved); the median-wall run is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="each prompt loops in chunks of this many positions (default: all at once)")
    p.add_argument("--max-loops", type=int, default=None, help="loop cap (default: the recipe's r_max)")
    p.add_argument("--no-a2", action="store_true", help="skip A2 (its probe is trained on first use)")
    p.add_argument("--serve", default="a1,latent,a2",
                   help="per-token policies to serve after calibrating (A0@r_bar and the best uniform depth always run)")
    p.add_argument("--calibration", default=None,
                   help="JSON file of the calibration: read if it exists (the search is skipped; it must be of "
                        "this checkpoint and loop cap), else written. bench/calibration/ holds the ones of the "
                        "shipped checkpoints that docs/BENCHMARKS.md used")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 6 requests, 8 new tokens, 8-token prompts, pools 1 and 3, 4 windows, 2 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.new_tokens, args.prompt_len, args.pools = 6, 8, 8, "1,3"
        args.windows, args.bisect, args.tf_batch, args.repeats = 4, 1, 4, 2
    args.pools = [int(x) for x in args.pools.split(",")]
    return args


def log(*a):
    print(*a, flush=True)


def policy_of(kind: str, threshold: float, cap: int, probe=None):
    """A saved configuration's policy: kind is a catalogue family's name or alias ("uniform", "a1",
    "latent", "a2" in the shipped calibrations)."""
    return catalogue.make(kind, threshold, r_max=cap, probe=probe)


@dataclass(frozen=True)
class Quality:
    """A policy's teacher-forced quality on the calibration windows: its score (loss, or answer
    accuracy) and mean loops."""
    score: float
    mean_loops: float


@dataclass
class Config:
    """One served configuration: how to rebuild its policy (kind "uniform", "a1", "latent" or "a2",
    and threshold), the policy, its teacher-forced quality and whether it met the target."""
    kind: str
    threshold: float
    policy: Policy
    quality: Quality
    matched: bool

    def saved(self) -> list:
        """Its entry in a calibration file: [kind, threshold, score, mean loops, matched]."""
        return [self.kind, self.threshold, self.quality.score, self.quality.mean_loops, self.matched]

    @staticmethod
    def saved_kind(entry: list) -> str:
        return entry[0]

    @classmethod
    def from_saved(cls, entry: list, cap: int, probe) -> Config:
        kind, threshold, score, mean_loops, matched = entry
        return cls(kind, threshold, policy_of(kind, threshold, cap, probe), Quality(score, mean_loops), matched)


@dataclass
class Calibration:
    """The configurations by name (A0@r_bar, the best uniform depth, then the per-token policies),
    the target they were held to, the calibration windows, and the metric ("loss": lower is better;
    "answer_accuracy": higher is better)."""
    configs: dict[str, Config]
    target: float
    r_bar: int
    best_uniform: int
    windows: int
    metric: str

    @property
    def label(self) -> str:
        return "tf loss" if self.metric == "loss" else "answer acc"

    @property
    def a0_name(self) -> str:
        return f"A0@{self.r_bar}"

    @property
    def uniform_name(self) -> str:
        return f"A0@{self.best_uniform} (best uniform)"

    @property
    def policy_names(self) -> list[str]:
        """The per-token policies' names."""
        return [name for name, c in self.configs.items() if c.kind != "uniform"]

    def saved(self, checkpoint_id: str, cap: int) -> dict:
        """Its calibration file's content."""
        return dict(checkpoint=checkpoint_id, loop_cap=cap, target=self.target, best_uniform=self.best_uniform,
                    windows=self.windows, metric=self.metric,
                    configs={name: c.saved() for name, c in self.configs.items()})


def calibrate(ckpt, args, cap, r_bar) -> Calibration:
    """Thresholds matched to A0@r_bar's teacher-forced quality; read from / written to --calibration when given."""
    path = Path(args.calibration) if args.calibration else None
    saved = read_calibration(path, ckpt.checkpoint_id, cap) if path is not None and path.exists() else None
    probe = None if args.no_a2 else load_or_train_probes(ckpt, cap, args.seed, ProbeSpec(kinds=("kl",)))["kl"]
    if saved is not None:
        log(f"  calibration read from {path}: {saved['metric']} target {saved['target']:.5f} "
            f"({saved['windows']} windows)")
        configs = {name: Config.from_saved(entry, cap, probe) for name, entry in saved["configs"].items()
                   if not (args.no_a2 and Config.saved_kind(entry) == "a2")}
        return Calibration(configs=configs, r_bar=r_bar,
                           **{k: saved[k] for k in ("target", "best_uniform", "windows", "metric")})
    cal = search(ckpt, args, cap, r_bar, probe)
    if path is not None:
        path.write_text(json.dumps(cal.saved(ckpt.checkpoint_id, cap), indent=1))
    return cal


def read_calibration(path: Path, checkpoint_id: str, cap: int) -> dict:
    """A saved calibration, refused (SystemExit) unless it is of this checkpoint and loop cap."""
    try:
        saved = json.loads(path.read_text())
        made_for = (saved.get("checkpoint"), saved.get("loop_cap"))
    except (json.JSONDecodeError, AttributeError) as err:
        raise SystemExit(f"{path} is not a calibration file ({err})") from None
    if made_for != (checkpoint_id, cap):
        raise SystemExit(f"{path} calibrates checkpoint {made_for[0]} at loop cap {made_for[1]}, not "
                         f"{checkpoint_id} at {cap}: pass another file, or a new path to calibrate")
    return saved


def quality_measure(ckpt, args, cap, windows):
    """(metric, evaluate(policy) -> Quality, tolerance): teacher-forced loss (lower is better,
    tolerance +--tolerance), or on a checkpoint with ground truth answer accuracy on the trained hop
    counts (higher is better, tolerance -(--acc-tolerance))."""
    truth = load_ground_truth(args.ckpt)
    if truth is None:
        loss = LossCalibrator(ckpt, windows, cap, args.seed, args.tf_batch)

        def evaluate(policy) -> Quality:
            tf = loss.evaluate(policy)
            return Quality(score=tf.loss, mean_loops=tf.mean_loops)
        return "loss", evaluate, args.tolerance
    hops, max_train_hops = truth  # scored on the trained hop counts, as the ground truth is
    accuracy = AccuracyCalibrator(ckpt, windows, hops, cap, args.seed, args.tf_batch, max_train_hops)

    def evaluate(policy) -> Quality:
        res = accuracy.evaluate(policy)
        return Quality(score=res.accuracy, mean_loops=res.mean_loops)
    return "answer_accuracy", evaluate, -args.acc_tolerance


def search(ckpt, args, cap, r_bar, probe) -> Calibration:
    windows = ckpt.windows("eval")
    n_cal = min(args.windows, len(windows) - 1)
    metric, evaluate, tolerance = quality_measure(ckpt, args, cap, windows[:n_cal])
    a0 = evaluate(Uniform(r_bar))
    target = a0.score + tolerance

    def meets(res):  # no worse than the target: loss at most it, or accuracy at least it
        return res.score <= target if tolerance >= 0 else res.score >= target
    log(f"  target: A0@{r_bar} {metric} {a0.score:.5f} -> {target:.5f}  ({n_cal} windows)")
    best_u = next((r for r in range(1, r_bar + 1) if meets(evaluate(Uniform(r)))), r_bar)
    cal = Calibration(configs={}, target=target, r_bar=r_bar, best_uniform=best_u, windows=n_cal, metric=metric)
    cal.configs[cal.a0_name] = Config("uniform", r_bar, Uniform(r_bar), a0, True)
    cal.configs[cal.uniform_name] = Config("uniform", best_u, Uniform(best_u), evaluate(Uniform(best_u)), True)
    grids = {"a1": ("A1 eps", catalogue.FAMILIES["A1"].calibration),
             "latent": ("latent delta", catalogue.FAMILIES["latent"].calibration)}
    if probe is not None:
        grids["a2"] = ("A2 tau", catalogue.FAMILIES["A2"].calibration)
    for kind, (label, grid) in grids.items():
        m = match_threshold(evaluate, lambda x: policy_of(kind, x, cap, probe), grid, meets,  # noqa: B023
                            args.bisect)
        cal.configs[f"{label}={m.threshold:.3g}"] = Config(kind, m.threshold, m.policy, m.result, m.matched)
    return cal


def serve_run(ckpt, prompts, policy, slots, args, cap, new_tokens=None):
    """recur_core.decoding.serve.ServeRun of every prompt through one pool."""
    reqs = [Request(prompt, new_tokens or args.new_tokens, policy, seed=args.seed, greedy=True,
                    prefill_chunk=args.prefill_chunk) for prompt in prompts]
    return serve(ckpt, reqs, slots, max_loops=cap, max_len=args.prompt_len + args.new_tokens, keep_logits=False)


def measure(ckpt, prompts, policy, slots, args, cap, cost: CostModel) -> dict:
    """One served run of every prompt: throughput, mean exit loop, FLOP proxy, latency percentiles,
    and the pool's batched calls per new token with their mean rows (a prompt's rows included: it
    loops inside the shared calls)."""
    run = serve_run(ckpt, prompts, policy, slots, args, cap)
    comps, wall = run.completions, run.wall_s
    lat = np.array([x for c in comps for x in c.latencies_s[1:]]) * 1e3
    loops = [x for c in comps for x in c.decode_exit_loops]
    new = run.new_tokens
    return dict(tokens_per_s=new / wall, wall_s=wall, decode_s=[c.token_s[-1] - c.token_s[0] for c in comps],
                model_tokens_per_s=new / run.model_s, scheduler_share=1 - run.model_s / wall,
                mean_loops=float(np.mean(loops)) if loops else float("nan"),
                cost=served_cost(cost, comps, policy), mixed_step_fraction=run.mixed_steps / max(run.steps, 1),
                latency_p50_ms=float(np.percentile(lat, 50)) if lat.size else float("nan"),
                latency_p95_ms=float(np.percentile(lat, 95)) if lat.size else float("nan"),
                calls_per_token={k: n / new for k, n in run.calls.items()},
                rows_per_call={k: run.call_rows[k] / n if n else float("nan") for k, n in run.calls.items()})


# Bytes written between two cold-timed calls: more than any last-level cache here (this CPU's L3 is
# 32 MiB, an H200's L2 about 60 MB), so the call reads its weights (and, on a CPU, the interpreter's
# and torch's code and data) from memory; inside the pool each step streams the cache's keys and
# values through the caches between two calls of a kind.
FLUSH_BYTES = 128 << 20


@torch.inference_mode()
def call_times_ms(model, rows_list, repeats: int = 30, cold: bool = False) -> dict[int, dict[str, float]]:
    """Milliseconds per call of the prelude, one core loop and the readout (coda + head) on `rows`
    single tokens without a cache: how a call's cost grows with its rows. Hot (cold False): best of
    3 x repeats back-to-back calls, the weights in cache. Cold: the median of `repeats` calls, each
    after FLUSH_BYTES were written, so it reads its weights from memory."""
    d, out, device = model.cfg.d_model, {}, model.embed.weight.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flush = torch.zeros(FLUSH_BYTES // 4, device=device) if cold else None
    for rows in rows_list:
        ids, x = torch.zeros(rows, 1, dtype=torch.long, device=device), torch.randn(rows, 1, d, device=device)
        calls = {"prelude": lambda ids=ids: model.prelude(ids), "core": lambda x=x: model.core_step(x, x),
                 "readout": lambda x=x: model.readout(x)}
        out[rows] = {kind: _cold_ms(fn, repeats, sync, flush) if cold else _hot_ms(fn, repeats, sync)
                     for kind, fn in calls.items()}
    return out


def _hot_ms(fn, repeats, sync) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        sync()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) / repeats * 1e3)
    return best


def _cold_ms(fn, repeats, sync, flush) -> float:
    times = []
    for _ in range(repeats):
        flush.add_(1.0)
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def fit_lengths(args, cfg, window_len: int) -> None:
    """Prompt and new-token counts that fit the context (the last new token is never run)."""
    if args.new_tokens is None:
        args.prompt_len = max(1, min(args.prompt_len, window_len, cfg.max_seq_len // 2))
        args.new_tokens = min(128, cfg.max_seq_len - args.prompt_len + 1)
    else:
        args.prompt_len = max(1, min(args.prompt_len, cfg.max_seq_len - args.new_tokens + 1, window_len))


def sequence_slowdowns(pools: dict, runs_by_pool: dict, name: str) -> None:
    """Per request, its decode time (first to last new token) in each pool over the same request's at
    pool 1: every sequence of a pool takes the same steps as alone (Completion.token_steps), so a
    uniform slowdown is the step getting longer with the batch, and a spread across sequences is
    what batching does not explain. Adds p50 / p95 / max to pools[slots][name]."""
    if 1 not in runs_by_pool:
        return
    alone = np.array(runs_by_pool[1][name]["decode_s"])
    for slots, runs in runs_by_pool.items():
        ratio = np.array(runs[name]["decode_s"]) / np.maximum(alone, 1e-9)
        pools[slots][name].update(sequence_slowdown_p50=float(np.median(ratio)),
                                  sequence_slowdown_p95=float(np.percentile(ratio, 95)),
                                  sequence_slowdown_max=float(ratio.max()))


def paired_ratio(trials: dict, name: str, base: str) -> float:
    """Median over repetitions of name's tokens/s over base's in the same repetition."""
    return float(np.median([a["tokens_per_s"] / b["tokens_per_s"]
                            for a, b in zip(trials[name], trials[base], strict=True)]))


def served_names(cal: Calibration, kinds: list[str]) -> list[str]:
    """A0@r_bar, the best uniform depth, then the per-token policies of these kinds."""
    return [cal.a0_name, cal.uniform_name] + [n for n in cal.policy_names if cal.configs[n].kind in kinds]


def pool_trials(ckpt, prompts, cal: Calibration, order: list[str], slots: int, args, cap,
                cost) -> dict[str, list[dict]]:
    """{name: measure() of each repetition} at one pool size, the configurations run in turn in `order`."""
    trials = {name: [] for name in order}
    for rep in range(args.repeats):
        for name in order:
            trials[name].append(measure(ckpt, prompts, cal.configs[name].policy, slots, args, cap, cost))
            log(f"  pool {slots:3d}  {name:28s} {trials[name][-1]['tokens_per_s']:8.1f} tok/s  "
                f"({trials[name][-1]['wall_s']:.1f}s, run {rep + 1} of {args.repeats})")
    return trials


def median_wall_run(trials: list[dict]) -> dict:
    """The run with the median wall time (the faster of the middle two)."""
    return sorted(trials, key=lambda r: r["wall_s"])[(len(trials) - 1) // 2]


def pool_table(cal: Calibration, trials: dict, runs: dict) -> dict[str, dict]:
    """{name: figures} of one pool size, speedups against A0@r_bar and the best uniform depth."""
    a0, uniform = runs[cal.a0_name], runs[cal.uniform_name]
    table = {}
    for name, r in runs.items():
        config = cal.configs[name]
        realized = r["tokens_per_s"] / a0["tokens_per_s"]
        proxy = a0["cost"] / r["cost"]
        in_calls = r["model_tokens_per_s"] / a0["model_tokens_per_s"]
        paired = paired_ratio(trials, name, cal.a0_name)
        table[name] = dict(
            tf_score=config.quality.score, tf_mean_loops=config.quality.mean_loops, matched=config.matched,
            tokens_per_s=r["tokens_per_s"], wall_s=r["wall_s"], mean_loops=r["mean_loops"],
            realized_speedup_vs_a0_rbar=realized, flop_proxy_speedup=proxy, fraction_of_bound=realized / proxy,
            model_call_speedup=in_calls, model_call_fraction_of_bound=in_calls / proxy,
            scheduler_share=r["scheduler_share"],
            realized_speedup_vs_best_uniform=r["tokens_per_s"] / uniform["tokens_per_s"],
            realized_speedup_vs_a0_rbar_paired=paired, fraction_of_bound_paired=paired / proxy,
            realized_speedup_vs_best_uniform_paired=paired_ratio(trials, name, cal.uniform_name),
            flop_proxy_speedup_vs_best_uniform=uniform["cost"] / r["cost"],
            latency_p50_ms=r["latency_p50_ms"], latency_p95_ms=r["latency_p95_ms"],
            mixed_step_fraction=r["mixed_step_fraction"], calls_per_token=r["calls_per_token"],
            rows_per_call=r["rows_per_call"])
    return table


def run_pools(ckpt, prompts, cal: Calibration, args, cap, cost) -> dict:
    """{slots: {config name: figures}} over every pool size, configurations interleaved."""
    names = served_names(cal, args.serve.split(","))
    for name in names:  # warm-up: the first calls of a process are slow
        serve_run(ckpt, prompts[:2], cal.configs[name].policy, 2, args, cap, new_tokens=4)
    pools, runs_by_pool = {}, {}
    for k, slots in enumerate(args.pools):
        first = k % len(names)  # each pool size starts the round at another configuration
        trials = pool_trials(ckpt, prompts, cal, names[first:] + names[:first], slots, args, cap, cost)
        trials = {name: trials[name] for name in names}
        runs_by_pool[slots] = {name: median_wall_run(t) for name, t in trials.items()}
        pools[slots] = pool_table(cal, trials, runs_by_pool[slots])
    for name in names:
        sequence_slowdowns(pools, runs_by_pool, name)
    return pools


def report(pools: dict, cal: Calibration) -> None:
    log(f"\ntarget {cal.metric} {cal.target:.5f}; best uniform depth meeting it: {cal.best_uniform} "
        f"(A0@{cal.best_uniform})")
    for slots, table in pools.items():
        log(f"\npool {slots}:")
        log(f"{'policy':28s} {cal.label:>10s} {'loops':>6s} {'tok/s':>8s} {'FLOP-proxy x':>12s} {'realized x':>10s} "
            f"{'realized/bound':>14s} {'vs best uniform':>15s} {'p50 ms':>7s} {'p95 ms':>7s} {'mixed':>6s}")
        for name, r in table.items():
            log(f"{name:28s} {r['tf_score']:10.5f} {r['mean_loops']:6.2f} {r['tokens_per_s']:8.1f} "
                f"{r['flop_proxy_speedup']:12.3f} {r['realized_speedup_vs_a0_rbar']:10.3f} "
                f"{r['fraction_of_bound']:14.3f} {r['realized_speedup_vs_best_uniform']:15.3f} "
                f"{r['latency_p50_ms']:7.2f} {r['latency_p95_ms']:7.2f} {r['mixed_step_fraction']:6.2f}")
        log(f"{'batched calls per new token (mean rows per call)':50s} {'core':>14s} {'prelude':>14s} {'readout':>14s}")
        for name, r in table.items():
            log(f"{name:50s} " + " ".join(f"{r['calls_per_token'][k]:7.3f} ({r['rows_per_call'][k]:4.1f})"
                                          for k in ("core", "prelude", "readout")))
        log(f"{'where the time goes':50s} {'scheduler share':>15s} {'model-call x':>12s} {'model-call/bound':>16s}")
        for name, r in table.items():
            log(f"{name:50s} {r['scheduler_share']:15.3f} {r['model_call_speedup']:12.3f} "
                f"{r['model_call_fraction_of_bound']:16.3f}")
        log(f"{'paired over repetitions (median of same-run ratios)':50s} {'realized x':>12s} {'realized/bound':>14s} "
            f"{'vs best uniform':>15s}")
        for name, r in table.items():
            log(f"{name:50s} {r['realized_speedup_vs_a0_rbar_paired']:12.3f} {r['fraction_of_bound_paired']:14.3f} "
                f"{r['realized_speedup_vs_best_uniform_paired']:15.3f}")
        if slots != 1 and "sequence_slowdown_p50" in next(iter(table.values())):
            log(f"{'per-sequence decode time / the same request at pool 1':50s} {'p50':>7s} {'p95':>7s} {'max':>7s}")
            for name, r in table.items():
                log(f"{name:50s} {r['sequence_slowdown_p50']:7.2f} {r['sequence_slowdown_p95']:7.2f} "
                    f"{r['sequence_slowdown_max']:7.2f}")
    log(f"({cal.label}: teacher-forced on the calibration windows; loops: mean exit loop of the decoded tokens; "
        "FLOP-proxy x and realized x against A0@r_bar in the same pool; realized/bound = fraction_of_bound; "
        "vs best uniform: tokens/s ratio to the smallest uniform depth at the target; p50 / p95: per-token "
        "latency; mixed: fraction of core steps whose batch held tokens at different loops)")


def headline_policy(table: dict, cal: Calibration) -> str:
    """The served per-token policy with the best realized speedup among those that met the target
    (else among all served; with none served, the best uniform depth)."""
    served = [name for name in table if name in cal.policy_names]
    candidates = [name for name in served if cal.configs[name].matched] or served or [cal.uniform_name]
    return max(candidates, key=lambda name: table[name]["realized_speedup_vs_a0_rbar"])


def serve_prompts(windows, cal: Calibration, args) -> list[list[int]]:
    """--requests prompts: the first --prompt-len tokens of the eval windows after the calibration ones, in turn."""
    rows = windows[cal.windows:]
    if len(rows) == 0:
        rows = windows
    return [rows[n % len(rows), :args.prompt_len].tolist() for n in range(args.requests)]


def report_call_times(model, pools: list[int]) -> tuple[dict, dict]:
    """(hot, cold) call_times_ms at 1, 4, 16 rows and every pool size, printed."""
    rows_list = sorted({1, 4, 16, *pools})
    hot, cold = call_times_ms(model, rows_list), call_times_ms(model, rows_list, repeats=15, cold=True)
    log("\nms per batched call on single tokens, no cache, by rows per call (hot: weights in cache, back to back;"
        f" cold: after writing {FLUSH_BYTES >> 20} MiB, weights and code from memory):")
    for rows, t in hot.items():
        log(f"  {rows:3d} rows: " + "  ".join(f"{k} {v:6.3f} / {cold[rows][k]:6.3f}" for k, v in t.items()))
    return hot, cold


HEADLINE_FIGURES = ("realized_speedup_vs_a0_rbar", "realized_speedup_vs_best_uniform", "flop_proxy_speedup",
                    "fraction_of_bound", "realized_speedup_vs_a0_rbar_paired", "fraction_of_bound_paired",
                    "realized_speedup_vs_best_uniform_paired", "model_call_speedup", "model_call_fraction_of_bound",
                    "scheduler_share", "latency_p50_ms", "latency_p95_ms", "sequence_slowdown_p50",
                    "sequence_slowdown_p95", "sequence_slowdown_max")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.ckpt, device=args.device)
    cfg = ckpt.config
    r_bar = ckpt.recipe.depth
    cap = args.max_loops or ckpt.recipe.r_max
    windows = ckpt.windows("eval")
    fit_lengths(args, cfg, windows.shape[1])
    log(f"== {args.ckpt} (checkpoint {ckpt.checkpoint_id}; d {cfg.d_model}, layers {cfg.n_prelude}/{cfg.n_core}/"
        f"{cfg.n_coda}; r_bar {r_bar}, loop cap {cap}; {torch.get_num_threads()} thread(s))")
    cal = calibrate(ckpt, args, cap, r_bar)
    prompts = serve_prompts(windows, cal, args)
    log(f"serving: {args.requests} requests x {args.prompt_len}-token prompts (eval windows {cal.windows}..), "
        f"{args.new_tokens} new tokens, greedy, pools {args.pools}, prefill chunk {args.prefill_chunk or 'none'}")
    pools = run_pools(ckpt, prompts, cal, args, cap, CostModel(cfg))
    report(pools, cal)
    hot, cold = report_call_times(ckpt.model, args.pools)

    largest = pools[args.pools[-1]]
    head = headline_policy(largest, cal)
    out = dict(checkpoint=str(args.ckpt), pool=args.pools[-1], policy=head, device=args.device,
               threads=torch.get_num_threads(),
               repeats=args.repeats, requests=args.requests, prefill_chunk=args.prefill_chunk,
               new_tokens=args.new_tokens, prompt_len=args.prompt_len,
               loop_cap=cap, r_bar=r_bar, calibration_metric=cal.metric, target=cal.target,
               best_uniform_depth=cal.best_uniform, **{k: largest[head].get(k) for k in HEADLINE_FIGURES},
               pools={str(k): v for k, v in pools.items()}, call_ms={str(k): v for k, v in hot.items()},
               call_ms_cold={str(k): v for k, v in cold.items()})
    print(json.dumps(out, default=float))


if __name__ == "__main__":
    main()
