"""Full-size public formats on this CPU, from folders written by `bench.synthetic` (random weights,
the exact published format): memory, trace speed, the app, and refusals.

    python -m bench.synthetic huginn-0125 /tmp/full/huginn-0125
    python -m bench.synthetic ouro-1.4b /tmp/full/ouro-1.4b
    python -m bench.bench_fullsize /tmp/full/huginn-0125 /tmp/full/ouro-1.4b [--skip-app] [--threads N]

Per folder, each part in a fresh subprocess:
  (a) load + trace  load_checkpoint in bfloat16 (as stored): peak RSS of the load above the RSS
                    before it (VmHWM after resetting it; file-backed pages of the mapped weights
                    count) against the loaded weights' bytes; then traces of 32 tokens (random ids)
                    at the loops of the model (Huginn-0125: 32; Ouro: 4 and 8): seconds, the
                    matmul FLOPs of the trace (counted: prelude once, per loop the adapter and core
                    blocks, the readout's coda and the LM head over h and h_prev, causal attention),
                    GFLOP/s, and the fraction of this CPU's bfloat16 matmul peak (best of 5
                    2048^3 torch.mm in bfloat16, same threads, measured before and after the
                    traces in the same process: the larger). The loader's memory estimate
                    (weights + working memory) against the peak RSS of the load and the traces.
  (b) refusal       RECUR_MEMORY_LIMIT set below the estimate: load_checkpoint refuses before
                    reading weights (seconds, RSS growth, the message with the estimate).
  (c) the app       streamlit's AppTest of app.py with RECUR_CHECKPOINT=FOLDER, two sessions in one
                    process (as two browser tabs on one server), each with its own pasted sentence:
                    seconds from the sentence to the token strip (the first session's includes
                    loading the model; the second's is the trace alone, at the app's depth), the
                    progress bar's updates during each trace, each session's RSS growth, and whether
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


def bf16_matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    a, b = (torch.randn(n, n, generator=torch.Generator().manual_seed(i)).bfloat16() for i in (0, 1))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


# -- FLOPs of a trace ---------------------------------------------------------------------------------
def block_flops(cfg, T: int) -> float:
    """One transformer block over T tokens: the projections and MLP, plus causal QK^T and AV."""
    d, hd = cfg.d_model, cfg.head_dim
    weights = d * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + cfg.n_heads * hd * d + 3 * d * cfg.ffn_dim
    return 2 * T * weights + 2 * T * T * cfg.n_heads * hd


def trace_flops(cfg, T: int, loops: int) -> float:
    """Matmul FLOPs of `trace` over T tokens and `loops` loops (readout every loop, and once for p_0)."""
    adapter = 2 * T * 2 * cfg.d_model * cfg.d_model if cfg.loop_input == "adapter" else 0
    loop = adapter + cfg.n_core * block_flops(cfg, T)
    readout = cfg.n_coda * block_flops(cfg, T) + 2 * (2 * T) * cfg.d_model * cfg.vocab_size  # head of h, h_prev
    return cfg.n_prelude * block_flops(cfg, T) + loops * (loop + readout) + readout


def loops_of(ckpt) -> list[int]:
    """The traces to time: Huginn-0125 at 32 loops; Ouro at its trained steps and twice that."""
    steps = ckpt.meta.get("exit_steps")
    return [steps, 2 * steps] if steps else [32]


# -- (a) in a child: load + traces -------------------------------------------------------------------
def child_load(folder: str) -> dict:
    from recur_core import load_checkpoint
    from recur_core.analysis.trace import trace
    peak_before = bf16_matmul_peak()
    before = proc_status("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    ckpt = load_checkpoint(folder)
    load_s = time.perf_counter() - t0
    load_peak = proc_status("VmHWM") - before
    weights = sum(p.numel() * p.element_size() for p in ckpt.model.parameters())
    ids = torch.randint(0, ckpt.config.vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(0)).numpy()
    t0 = time.perf_counter()
    trace(ckpt, ids[:4], 1, seed=0, cache=False)  # warm-up: the first touch of every weight page (from disk)
    first_touch_s = time.perf_counter() - t0
    traces = []
    for loops in loops_of(ckpt):
        t0 = time.perf_counter()
        tr = trace(ckpt, ids, loops, seed=0, cache=False)
        seconds = time.perf_counter() - t0
        assert np.isfinite(tr.ce[0, :-1]).all()
        flops = trace_flops(ckpt.config, TOKENS, loops)
        traces.append({"tokens": TOKENS, "loops": loops, "seconds": seconds, "gflop": flops / 1e9,
                       "gflops_per_s": flops / seconds / 1e9})
    peak = max(peak_before, bf16_matmul_peak())
    for t in traces:
        t["fraction_of_bf16_peak"] = t["gflops_per_s"] * 1e9 / peak
    use_peak = proc_status("VmHWM") - before
    est = ckpt.meta["memory_estimate"]
    return {"format": ckpt.meta["format"], "n_params": ckpt.model.num_params(), "dtype": ckpt.meta["dtype"],
            "weights_bytes": weights, "load_s": load_s, "first_touch_s": first_touch_s, "load_peak_bytes": load_peak,
            "load_peak_over_weights": load_peak / weights, "peak_bytes": use_peak,
            "estimate": est, "estimate_over_peak": est["total"] / use_peak,
            "bf16_matmul_peak_gflops": peak / 1e9, "traces": traces, "threads": torch.get_num_threads()}


# -- (b) in a child: refusal ---------------------------------------------------------------------------
def child_refuse(folder: str) -> dict:
    from recur_core import CheckpointError, describe_folder, load_checkpoint
    est = describe_folder(folder)["memory_estimate"]
    os.environ["RECUR_MEMORY_LIMIT"] = str(est["total"] - 1)
    before = proc_status("VmRSS")
    t0 = time.perf_counter()
    try:
        load_checkpoint(folder)
        message = None
    except CheckpointError as err:
        message = str(err)
    return {"refused": message is not None, "seconds": time.perf_counter() - t0,
            "rss_growth_bytes": proc_status("VmRSS") - before, "message": message}


# -- (c) in a child: the app ---------------------------------------------------------------------------
def child_app(folder: str) -> dict:
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from ui import compute
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
    for n, sentence in enumerate(SENTENCES):
        before = proc_status("VmRSS")
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=3000)
        at.session_state["text_area"] = at.session_state["text"] = sentence  # pasted before the first run
        t0 = time.perf_counter()
        at.run()
        seconds = time.perf_counter() - t0
        strips = [el for el in at.html if 'data-testid="token-strip"' in el.proto.body]
        trace_updates = [u for u in updates if u[1].startswith("Tracing") and u[0] >= t0]
        rows.append({"session": n + 1, "sentence": sentence, "seconds_text_to_strip": seconds,
                     "strip_drawn": len(strips) == 1,
                     "exceptions": [e.message for e in at.exception], "rss_growth_bytes": proc_status("VmRSS") - before,
                     "trace_progress_updates": len(trace_updates),
                     "trace_label": trace_updates[0][1] if trace_updates else None})
        sessions.append(at)
    ckpt = compute.checkpoint(folder, "cpu")
    weights = sum(p.numel() * p.element_size() for p in ckpt.model.parameters())
    return {"sessions": rows, "weights_bytes": weights, "one_model_object": compute.checkpoint(folder, "cpu") is ckpt,
            "second_session_growth_over_weights": rows[1]["rss_growth_bytes"] / weights}


def run_child(kind: str, folder: Path, threads: int | None) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_fullsize", "--child", kind, str(folder)]
    if threads:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{kind} on {folder} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(folder: Path, r: dict) -> None:
    a = r["load"]
    print(f"\n== {folder.name}: {a['format']}, {a['n_params'] / 1e9:.2f}B parameters, {a['dtype']}, "
          f"{a['threads']} thread(s)")
    print(f"  (a) load {a['load_s']:.1f} s (+ {a['first_touch_s']:.1f} s for the first pass over the mapped weights); "
          f"peak RSS of the load {a['load_peak_bytes'] / 1e9:.2f} GB = "
          f"{a['load_peak_over_weights']:.2f}x the weights ({a['weights_bytes'] / 1e9:.2f} GB)")
    print(f"      estimate {a['estimate']['total'] / 1e9:.2f} GB (weights {a['estimate']['weights'] / 1e9:.2f} + working "
          f"{a['estimate']['working'] / 1e9:.2f}) vs peak RSS of load + traces {a['peak_bytes'] / 1e9:.2f} GB: "
          f"{a['estimate_over_peak']:.2f}x")
    for t in a["traces"]:
        print(f"      trace {t['tokens']} tokens x {t['loops']} loops: {t['seconds']:.1f} s, {t['gflop']:.0f} GFLOP, "
              f"{t['gflops_per_s']:.1f} GFLOP/s = {t['fraction_of_bf16_peak']:.2f} of the bf16 matmul peak "
              f"({a['bf16_matmul_peak_gflops']:.0f} GFLOP/s, same run)")
    b = r["refuse"]
    print(f"  (b) with RECUR_MEMORY_LIMIT below the estimate: refused {b['refused']} in {b['seconds']:.2f} s, "
          f"RSS +{b['rss_growth_bytes'] / 1e6:.0f} MB: {b['message']}")
    if "app" in r:
        c = r["app"]
        for s in c["sessions"]:
            print(f"  (c) app session {s['session']}: {s['sentence']!r} -> token strip {s['seconds_text_to_strip']:.1f} s "
                  f"(strip drawn {s['strip_drawn']}, {s['trace_progress_updates']} progress updates "
                  f"'{s['trace_label']}'), RSS +{s['rss_growth_bytes'] / 1e9:.2f} GB")
        print(f"      two sessions, one model object: {c['one_model_object']}; the second session's RSS growth = "
              f"{c['second_session_growth_over_weights']:.3f}x the weights")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.bench_fullsize", description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="*", type=Path)
    p.add_argument("--child", nargs=2, metavar=("KIND", "FOLDER"), help=argparse.SUPPRESS)
    p.add_argument("--skip-app", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        kind, folder = args.child
        print(json.dumps({"load": child_load, "refuse": child_refuse, "app": child_app}[kind](folder)))
        return
    flags = cpu_flags()
    print(f"CPU flags: {', '.join(flags)}; {os.cpu_count()} CPUs; torch {torch.__version__}")
    results = {"cpu_flags": flags, "folders": {}}
    for folder in args.folders:
        r = {"load": run_child("load", folder, args.threads), "refuse": run_child("refuse", folder, args.threads)}
        if not args.skip_app:
            r["app"] = run_child("app", folder, args.threads)
        results["folders"][folder.name] = r
        report(folder, r)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
