"""Full-size public formats on this CPU, from folders written by `bench.synthetic` (random weights,
the exact published format): memory, trace speed, the app, and refusals.

    python -m bench.synthetic huginn-0125 /tmp/full/huginn-0125
    python -m bench.synthetic ouro-1.4b /tmp/full/ouro-1.4b
    python -m bench.bench_fullsize /tmp/full/huginn-0125 /tmp/full/ouro-1.4b [--skip-app] [--threads N]
        [--app-path exact|fast] [--device cuda]

Per folder, each part in a fresh subprocess:
  (a) load + trace  load_checkpoint in bfloat16 (as stored): peak RSS of the load above the RSS
                    before it (VmHWM after resetting it; file-backed pages of the mapped weights
                    count) against the loaded weights' bytes; then traces of 32 tokens (random ids)
                    at the loops of the model (Huginn-0125: 32; Ouro: 4 and 8) and of 4 windows x
                    128 tokens x 4 loops, each beside a plain torch loop over the same weights and
                    the same matmuls (`plain_loop`), best of 2 alternating: seconds, the matmul
                    FLOPs (`trace_flops`: prelude once, per loop the adapter and core blocks, each
                    readout's coda and LM head once, causal attention),
                    GFLOP/s, and the fraction of this CPU's bfloat16 matmul peak (best of 5
                    2048^3 torch.mm in bfloat16, same threads, measured before and after the
                    traces in the same process: the larger); and the plain loop's weight products
                    alone at its shapes (`matmuls_alone`: what the matmuls cost at these row counts,
                    memory streaming included) as a share of the trace's time. The loader's memory estimate
                    (weights + working memory) against the peak RSS of the load and the traces.
  (b) refusal       RECUR_MEMORY_LIMIT set below the estimate: load_checkpoint refuses before
                    reading weights (seconds, RSS growth, the message with the estimate).
  (c) the app       streamlit's AppTest of app.py with RECUR_CHECKPOINT=FOLDER, two sessions in one
                    process (as two browser tabs on one server), each with its own pasted sentence:
                    seconds from the sentence to the first token strip (the first session's
                    includes loading the model), on the pages' Evaluation --app-path (exact: the
                    app's default: real decoding after the trace, in the background when it takes
                    longer than a few seconds, the fast strip shown meanwhile; then the seconds to
                    the exact strip; fast: the trace alone, at the app's depth), the progress
                    updates (the trace's bar, then the decoding's, one per token) and the longest
                    wait without one, each session's RSS growth, and whether
                    both sessions hold the same model object (one copy of the weights).
The CPU's flags (AVX-512 BF16, AMX) are printed: bfloat16 matmuls are fast only where the CPU has them.
Last line: a JSON object with the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 32
# A batch of windows (N, T tokens, loops): at 32 tokens a trace multiplies each weight matrix by 32 rows,
# which streams the weights from memory faster than the matmul units can use them; at 4 x 128 rows it is
# the matmul units' work, the regime of the analysis traces over a checkpoint's windows.
WINDOWS = (4, 128, 4)
REPEATS = 2  # each trace and its plain loop, best of (this 2-core VM has slow spells of 2-5x)
SENTENCES = ("The little dog ran to the park.", "A cat sat on the warm wall.")  # one per app session
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return [f for f in CPU_FLAGS if f in have]


def proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key + ":")).split()[1]) * 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bf16_matmul_peak(device: str | torch.device = "cpu", repeats: int = 5) -> float:
    """Best of `repeats` bfloat16 n^3 products (n 2048 on a CPU, 8192 on a GPU), FLOP/s."""
    device = torch.device(device)
    n = 2048 if device.type == "cpu" else 8192
    a, b = (torch.randn(n, n, generator=torch.Generator().manual_seed(i)).bfloat16().to(device) for i in (0, 1))
    torch.mm(a, b)
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


# -- FLOPs of a trace ---------------------------------------------------------------------------------
def block_flops(cfg, T: int) -> float:
    """One transformer block over T tokens: the projections and MLP, plus causal QK^T and AV."""
    d, hd = cfg.d_model, cfg.head_dim
    weights = d * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + cfg.n_heads * hd * d + 3 * d * cfg.ffn_dim
    return 2 * T * weights + 2 * T * T * cfg.n_heads * hd


def trace_flops(cfg, T: int, loops: int) -> float:
    """Matmul FLOPs of a trace over T tokens and `loops` loops: the prelude once; per loop the adapter,
    the core blocks and a readout (coda blocks, LM head); one more readout for p_0. Each readout's
    head is counted once, as the plain loop computes it: the work a trace needs, not what it spends
    (the tracer multiplies a group's previous hidden by the head again for the KLs: 17 products per
    16 loops at 32 tokens, 2 per loop at 512 token rows; before issue 41 2 per loop always, and this
    count included both)."""
    adapter = 2 * T * 2 * cfg.d_model * cfg.d_model if cfg.loop_input == "adapter" else 0
    loop = adapter + cfg.n_core * block_flops(cfg, T)
    readout = cfg.n_coda * block_flops(cfg, T) + 2 * T * cfg.d_model * cfg.vocab_size
    return cfg.n_prelude * block_flops(cfg, T) + loops * (loop + readout) + readout


def plain_loop(model, inputs: torch.Tensor, loops: int) -> None:
    """The baseline the trace is measured against: the same work as a plain torch loop over the same
    weights, the model's own pieces (prelude, then per loop the core step and the readout to logits,
    after p_0's), without the trace's statistics, grouping or buffers."""
    device = model.embed.weight.device
    with torch.inference_mode():
        e = model.prelude(inputs.to(device))
        state = model.start_state(model.seeded_state(range(inputs.shape[0]), 0, inputs.shape[1]), e)
        model.readout(state)
        for _ in range(loops):
            state = model.core_step(state, e)
            model.readout(state)
    sync(device)


def weight_products(*modules) -> list[torch.Tensor]:
    """The weight matrices modules multiply token rows by (their Dense layers), in model order; None
    (a model without an adapter) has none."""
    from recur_core.model.looped_lm import Dense
    return [m.weight for module in modules if module is not None for m in module.modules() if isinstance(m, Dense)]


def matmuls_alone(model, rows: int, loops: int, repeats: int = 3) -> tuple[float, float]:
    """The plain loop's weight products alone, at its shapes: (seconds, FLOPs). Each part (prelude,
    a loop's adapter and core, a readout's coda and LM head) is one pass of `linear` over its weights
    in model order on `rows` random rows, best of `repeats`, counted as often as the plain loop runs
    it (readouts: loops + 1). The matmul speed this machine reaches at the trace's shapes, memory
    streaming included: where the trace is bound by its matmuls, it approaches this time."""
    from recur_core.model.looped_lm import linear
    parts = [(weight_products(*model.prelude_blocks), 1), (weight_products(model.adapter, *model.core_blocks), loops),
             ([*weight_products(*model.coda_blocks), model.head_weight], loops + 1)]
    seconds = flops = 0.0
    gen = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for weights, count in parts:
            if not weights:
                continue
            xs = [torch.randn(rows, w.shape[1], generator=gen).to(w) for w in weights]
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                for x, w in zip(xs, weights, strict=True):
                    linear(x, w)
                sync(w.device)
                best = min(best, time.perf_counter() - t0)
            seconds += count * best
            flops += count * sum(2 * rows * w.numel() for w in weights)
    return seconds, flops


def loops_of(ckpt) -> list[int]:
    """The traces to time: Huginn-0125 at 32 loops; Ouro at its trained steps and twice that."""
    steps = ckpt.meta.get("exit_steps")
    return [steps, 2 * steps] if steps else [32]


# -- (a) in a child: load + traces -------------------------------------------------------------------
def child_load(folder: str, device: str = "cpu") -> dict:
    from recur_core import load_checkpoint
    from recur_core.analysis.trace import trace
    device = torch.device(device)
    peak_before = bf16_matmul_peak(device)
    before = proc_status("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    ckpt = load_checkpoint(folder, device)
    sync(device)
    load_s = time.perf_counter() - t0
    load_peak = proc_status("VmHWM") - before
    weights = sum(p.numel() * p.element_size() for p in ckpt.model.parameters())
    ids = torch.randint(0, ckpt.config.vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(0)).numpy()
    t0 = time.perf_counter()
    trace(ckpt, ids[:4], 1, seed=0, cache=False)  # warm-up: the first touch of every weight page (from disk)
    first_touch_s = time.perf_counter() - t0
    n, t, window_loops = WINDOWS
    windows = torch.randint(0, ckpt.config.vocab_size, (n, t + 1), generator=torch.Generator().manual_seed(1)).numpy()
    runs = [(ids, ids[None], loops) for loops in loops_of(ckpt)] + [(windows, windows[:, :-1], window_loops)]
    traces = []
    for inputs, plain_inputs, loops in runs:
        times = {"trace": [], "plain": []}
        for _ in range(REPEATS):  # alternating, so a slow spell of the machine hits both sides
            t0 = time.perf_counter()
            tr = trace(ckpt, inputs, loops, seed=0, cache=False)
            times["trace"].append(time.perf_counter() - t0)
            assert np.isfinite(tr.ce[:, :-1]).all()
            t0 = time.perf_counter()
            plain_loop(ckpt.model, torch.as_tensor(plain_inputs), loops)
            times["plain"].append(time.perf_counter() - t0)
        seconds, plain_s = min(times["trace"]), min(times["plain"])
        flops = len(plain_inputs) * trace_flops(ckpt.config, plain_inputs.shape[1], loops)
        alone_s, alone_flops = matmuls_alone(ckpt.model, plain_inputs.size, loops)
        traces.append({"windows": len(plain_inputs), "tokens": plain_inputs.shape[1], "loops": loops,
                       "seconds": seconds, "plain_loop_seconds": plain_s, "all_seconds": times,
                       "matmuls_alone_seconds": alone_s, "matmuls_alone_gflops_per_s": alone_flops / alone_s / 1e9,
                       "matmuls_alone_over_trace": alone_s / seconds, "matmuls_alone_over_plain_loop": alone_s / plain_s,
                       "trace_over_plain_loop": seconds / plain_s, "gflop": flops / 1e9,
                       "gflops_per_s": flops / seconds / 1e9, "plain_loop_gflops_per_s": flops / plain_s / 1e9})
    peak = max(peak_before, bf16_matmul_peak(device))
    for t in traces:
        t["fraction_of_bf16_peak"] = t["gflops_per_s"] * 1e9 / peak
        t["plain_loop_fraction_of_bf16_peak"] = t["plain_loop_gflops_per_s"] * 1e9 / peak
    # the estimate is of the device's memory: resident memory on a CPU, the allocator's peak on a GPU
    use_peak = proc_status("VmHWM") - before if device.type == "cpu" else torch.cuda.max_memory_allocated(device)
    est = ckpt.meta["memory_estimate"]
    return {"device": str(device), "device_name": device_name(device),
            "format": ckpt.meta["format"], "n_params": ckpt.model.num_params(), "dtype": ckpt.meta["dtype"],
            "weights_bytes": weights, "load_s": load_s, "first_touch_s": first_touch_s, "load_peak_bytes": load_peak,
            "load_peak_over_weights": load_peak / weights, "peak_bytes": use_peak,
            "estimate": est, "estimate_over_peak": est["total"] / use_peak,
            "bf16_matmul_peak_gflops": peak / 1e9, "traces": traces, "threads": torch.get_num_threads()}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{os.cpu_count()}-CPU {platform_cpu()}"


def platform_cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU"
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "CPU")


# -- (b) in a child: refusal ---------------------------------------------------------------------------
def child_refuse(folder: str, device: str = "cpu") -> dict:
    from recur_core import CheckpointError, describe_folder, load_checkpoint
    est = describe_folder(folder)["memory_estimate"]
    os.environ["RECUR_MEMORY_LIMIT"] = str(est["total"] - 1)
    before = proc_status("VmRSS")
    t0 = time.perf_counter()
    try:
        load_checkpoint(folder, device)
        message = None
    except CheckpointError as err:
        message = str(err)
    return {"refused": message is not None, "seconds": time.perf_counter() - t0,
            "rss_growth_bytes": proc_status("VmRSS") - before, "message": message}


# -- (c) in a child: the app ---------------------------------------------------------------------------
def child_app(folder: str, text_path: str = "exact", n_sessions: int = len(SENTENCES)) -> dict:
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from ui import compute, jobs
    from ui.checkpoints import describe
    updates = []
    opened = compute.Progress.__call__

    def counting(self, done, total):
        updates.append((time.perf_counter(), self.label, done, total))
        opened(self, done, total)
    compute.Progress.__call__ = counting
    os.environ["RECUR_CHECKPOINT"] = folder
    os.environ["RECUR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_fullsize_cache_")  # a cold trace
    os.environ.setdefault("RECUR_SHIPPED", "/nonexistent")
    st.cache_resource.clear()
    sessions, rows = [], []
    for n, sentence in enumerate(SENTENCES[:n_sessions]):
        before = proc_status("VmRSS")
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=3000)
        at.session_state[f"text@{describe(folder).task}"] = sentence  # submitted before the first run (kept per task)
        at.session_state["text_path"] = text_path  # the pasted-text pages' Evaluation (the app's default: exact)
        t0 = time.perf_counter()
        at.run()
        seconds = time.perf_counter() - t0
        strips = [el for el in at.html if 'data-testid="token-strip"' in el.proto.body]
        pending = [j for j in jobs._JOBS.values() if j.key[0] == "decoded_text" and j.started >= t0 - 1 and j.running]
        trace_updates = [u for u in updates if u[1].startswith("Tracing") and u[0] >= t0]
        marks = [t0, *(u[0] for u in updates if u[0] >= t0), t0 + seconds]  # the run's start, each update, its end
        row = {"session": n + 1, "sentence": sentence, "seconds_text_to_strip": seconds,
               "strip_drawn": len(strips) == 1, "first_strip": "fast, exact decoding pending" if pending else text_path,
               "exceptions": [e.message for e in at.exception],
               "trace_progress_updates": len(trace_updates), "trace_label": trace_updates[0][1] if trace_updates else None}
        if pending:  # the page's progress bar follows the job (jobs.watch, once a second): sample it as often
            seen, job = pending[0].done, pending[0]
            while job.running:
                time.sleep(0.25)
                if job.done != seen:
                    seen = job.done
                    marks.append(time.perf_counter())
            at.run()
            marks.append(time.perf_counter())
            row.update(seconds_text_to_exact_strip=marks[-1] - t0, decoding_steps=job.total, decoding_error=job.error,
                       exact_strip_drawn=any('data-testid="token-strip"' in el.proto.body for el in at.html)
                       and not any("Exact decoding" in c.value for c in at.caption))
        row.update(longest_wait_without_progress_s=max(b - a for a, b in zip(marks, marks[1:], strict=False)),
                   rss_growth_bytes=proc_status("VmRSS") - before)
        rows.append(row)
        sessions.append(at)
    ckpt = compute.checkpoint(folder, "cpu")
    weights = sum(p.numel() * p.element_size() for p in ckpt.model.parameters())
    return {"text_path": text_path, "sessions": rows, "weights_bytes": weights,
            "one_model_object": compute.checkpoint(folder, "cpu") is ckpt,
            "second_session_growth_over_weights": rows[1]["rss_growth_bytes"] / weights if len(rows) > 1 else None}


def run_child(kind: str, folder: Path, threads: int | None, device: str = "cpu", app_path: str = "exact",
              app_sessions: int = len(SENTENCES)) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_fullsize", "--child", kind, str(folder), "--device", device,
           "--app-path", app_path, "--app-sessions", str(app_sessions)]
    if threads:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{kind} on {folder} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(folder: Path, r: dict) -> None:
    a = r["load"]
    print(f"\n== {folder.name}: {a['format']}, {a['n_params'] / 1e9:.2f}B parameters, {a['dtype']}, on "
          f"{a['device_name']}, {a['threads']} thread(s)")
    print(f"  (a) load {a['load_s']:.1f} s (+ {a['first_touch_s']:.1f} s for the first pass over the mapped weights); "
          f"peak RSS of the load {a['load_peak_bytes'] / 1e9:.2f} GB = "
          f"{a['load_peak_over_weights']:.2f}x the weights ({a['weights_bytes'] / 1e9:.2f} GB)")
    print(f"      estimate {a['estimate']['total'] / 1e9:.2f} GB (weights {a['estimate']['weights'] / 1e9:.2f} + working "
          f"{a['estimate']['working'] / 1e9:.2f}) vs peak RSS of load + traces {a['peak_bytes'] / 1e9:.2f} GB: "
          f"{a['estimate_over_peak']:.2f}x")
    for t in a["traces"]:
        print(f"      trace {t['windows']} x {t['tokens']} tokens x {t['loops']} loops: {t['seconds']:.1f} s "
              f"(best of {', '.join(f'{x:.1f}' for x in t['all_seconds']['trace'])}), {t['gflop']:.0f} GFLOP, "
              f"{t['gflops_per_s']:.1f} GFLOP/s = {t['fraction_of_bf16_peak']:.2f} of the bf16 matmul peak "
              f"({a['bf16_matmul_peak_gflops']:.0f} GFLOP/s, same run)")
        print(f"      plain torch loop, same weights and work: {t['plain_loop_seconds']:.1f} s "
              f"(best of {', '.join(f'{x:.1f}' for x in t['all_seconds']['plain'])}) = "
              f"{t['plain_loop_fraction_of_bf16_peak']:.2f} of the peak; trace / plain loop {t['trace_over_plain_loop']:.2f}x")
        print(f"      its weight products alone at these shapes (`matmuls_alone`): {t['matmuls_alone_seconds']:.1f} s "
              f"({t['matmuls_alone_gflops_per_s']:.0f} GFLOP/s) = {t['matmuls_alone_over_trace']:.2f} of the trace's "
              f"time ({t['matmuls_alone_over_plain_loop']:.2f} of the plain loop's)")
    b = r["refuse"]
    print(f"  (b) with RECUR_MEMORY_LIMIT below the estimate: refused {b['refused']} in {b['seconds']:.2f} s, "
          f"RSS +{b['rss_growth_bytes'] / 1e6:.0f} MB: {b['message']}")
    if "app" in r:
        c = r["app"]
        for s in c["sessions"]:
            print(f"  (c) app session {s['session']} ({c['text_path']}): {s['sentence']!r} -> first token strip "
                  f"{s['seconds_text_to_strip']:.1f} s ({s['first_strip']}; drawn {s['strip_drawn']}, "
                  f"{s['trace_progress_updates']} progress updates '{s['trace_label']}')")
            if "seconds_text_to_exact_strip" in s:
                print(f"      exact strip (real decoding, {s['decoding_steps']} tokens in the background) "
                      f"{s['seconds_text_to_exact_strip']:.1f} s after the text (drawn {s['exact_strip_drawn']}, "
                      f"error {s['decoding_error']})")
            print(f"      longest wait without a progress update {s['longest_wait_without_progress_s']:.1f} s; "
                  f"RSS +{s['rss_growth_bytes'] / 1e9:.2f} GB")
        if c["second_session_growth_over_weights"] is not None:
            print(f"      two sessions, one model object: {c['one_model_object']}; the second session's RSS growth = "
                  f"{c['second_session_growth_over_weights']:.3f}x the weights")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.bench_fullsize", description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="*", type=Path)
    p.add_argument("--child", nargs=2, metavar=("KIND", "FOLDER"), help=argparse.SUPPRESS)
    p.add_argument("--skip-app", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="where (a) and (b) run, e.g. cuda (the app part runs on "
                                                   "the CPU only and is skipped elsewhere)")
    p.add_argument("--app-path", choices=("exact", "fast"), default="exact",
                   help="(c)'s Evaluation on the pasted-text pages: exact (real decoding, the app's default) or fast")
    p.add_argument("--app-sessions", type=int, choices=range(1, len(SENTENCES) + 1), default=len(SENTENCES),
                   help="(c)'s app sessions, one sentence each (2: the second shows that sessions share the model)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        kind, folder = args.child
        child = {"load": child_load, "refuse": child_refuse}.get(kind)
        print(json.dumps(child(folder, args.device) if child else child_app(folder, args.app_path, args.app_sessions)))
        return
    flags = cpu_flags()
    print(f"CPU flags: {', '.join(flags)}; {os.cpu_count()} CPUs; torch {torch.__version__}; device {args.device}")
    results = {"cpu_flags": flags, "device": args.device, "folders": {}}
    for folder in args.folders:
        r = {"load": run_child("load", folder, args.threads, args.device),
             "refuse": run_child("refuse", folder, args.threads, args.device)}
        if not args.skip_app and args.device == "cpu":
            r["app"] = run_child("app", folder, args.threads, app_path=args.app_path, app_sessions=args.app_sessions)
        results["folders"][folder.name] = r
        report(folder, r)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
