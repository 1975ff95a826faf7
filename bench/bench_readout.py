"""Readout statistics: time and peak memory of the fused paths against the materialising reference.

The per-loop analysis workload: V 49,152, d 576, float32 inputs, targets and h_prev given (so KL
is computed too), for T in 256..2048. On CPU the chunked path is compared with the naive one
(readout_stats_reference: float32 logits for h and h_prev, log_softmax, everything from them); on
CUDA, when available, also the Triton kernel.

Peak memory. Each (variant, T) runs in a fresh subprocess. On CPU, tracemalloc does not see torch's
allocations, so the figure is resident memory: with the inputs allocated and touched, the kernel's
peak-RSS mark is reset to the current RSS (writing 5 to /proc/self/clear_refs), the first call
runs, and the figure is the new peak (VmHWM) minus the RSS before it. That is the call's own peak
extra memory, page-accurate, whatever allocator serves it. Timing runs after that first call
(which doubles as the warmup). On CUDA it is torch.cuda.max_memory_allocated minus the allocation
before the call.

Time: median of --repeats calls, with torch's default thread count unless --threads is given.

    python -m bench.bench_readout [--T 256 512 1024 2048] [--repeats 3] [--threads N]
Last line: a JSON object with speedup_vs_naive and peak_memory_ratio (naive / fused) at T 1024.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from recur_core.exits.readout import readout_stats_chunked, readout_stats_reference

ROOT = Path(__file__).resolve().parents[1]
V, D = 49_152, 576
HEADLINE_T = 1024


def backend(variant: str):
    if variant == "naive":
        return readout_stats_reference
    if variant == "chunked":
        return readout_stats_chunked
    from recur_core.exits.readout import readout_stats_triton
    return readout_stats_triton


def proc_status(key: str) -> int:
    """A memory figure (VmRSS, VmHWM) of this process from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024  # reported in kB


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # sets VmHWM to the current RSS (Linux >= 4.0)


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def worker(variant: str, T: int, device: torch.device, repeats: int) -> dict:
    """Run one variant in this (fresh) process: peak extra memory of the first call, then timings."""
    g = torch.Generator().manual_seed(0)
    W = (torch.randn(V, D, generator=g) / math.sqrt(D)).to(device)
    h, h_prev = (torch.randn(T, D, generator=g).to(device) for _ in range(2))
    targets = torch.randint(0, V, (T,), generator=g).to(device)
    fn = backend(variant)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(h, W, targets, h_prev)
        sync(device)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        reset_peak_rss()
        base = proc_status("VmRSS")
        fn(h, W, targets, h_prev)
        peak = proc_status("VmHWM") - base
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(h, W, targets, h_prev)
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"time_s": statistics.median(times), "peak_bytes": peak}


def run_worker(variant: str, T: int, device: str, repeats: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", __spec__.name, "--worker", variant, "--T", str(T), "--device", device,
           "--repeats", str(repeats), "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def compare(device: str, fused: str, Ts: list[int], repeats: int, threads: int) -> dict:
    """Naive vs fused per T, back to back, so that changes in machine load hit both alike."""
    print(f"\n{device}: {fused} vs naive, V {V}, d {D}, float32, with targets and h_prev (KL)")
    print(f"{'T':>6} {'naive s':>9} {fused + ' s':>11} {'speedup':>8} {'naive MiB':>10} "
          f"{fused + ' MiB':>12} {'mem ratio':>9}")
    per_T = {}
    for T in Ts:
        naive = run_worker("naive", T, device, repeats, threads)
        fast = run_worker(fused, T, device, repeats, threads)
        row = {"naive_s": naive["time_s"], f"{fused}_s": fast["time_s"],
               "speedup_vs_naive": naive["time_s"] / fast["time_s"],
               "naive_peak_mib": naive["peak_bytes"] / 2**20, f"{fused}_peak_mib": fast["peak_bytes"] / 2**20,
               "peak_memory_ratio": naive["peak_bytes"] / fast["peak_bytes"]}
        per_T[T] = row
        print(f"{T:>6} {row['naive_s']:>9.3f} {row[f'{fused}_s']:>11.3f} {row['speedup_vs_naive']:>7.2f}x "
              f"{row['naive_peak_mib']:>10.1f} {row[f'{fused}_peak_mib']:>12.1f} {row['peak_memory_ratio']:>8.1f}x")
    return per_T


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--worker", choices=["naive", "chunked", "triton"], help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(worker(args.worker, args.T[0], torch.device(args.device), args.repeats)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} (other processes share the CPUs: times are wall clock)")
    result = {"device": "cpu", "V": V, "d": D, "T": HEADLINE_T, "threads": args.threads,
              "per_T": compare("cpu", "chunked", args.T, args.repeats, args.threads)}
    if torch.cuda.is_available():
        result["cuda"] = {"device": torch.cuda.get_device_name(),
                          "per_T": compare("cuda", "triton", args.T, args.repeats, args.threads)}
    headline = result["per_T"].get(HEADLINE_T) or next(iter(result["per_T"].values()))
    result["loadavg_1min_end"] = os.getloadavg()[0]
    result["speedup_vs_naive"] = headline["speedup_vs_naive"]
    result["peak_memory_ratio"] = headline["peak_memory_ratio"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
