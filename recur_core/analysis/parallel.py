"""Batches of windows in parallel on a CPU: one Python thread per core, each running whole batches
with single-threaded torch ops (torch releases the GIL inside an op).

The tracer and the exact harness run many independent batches of small matrices (a few thousand
rows of width 256 at most). torch's intra-op threads split every op and join after it, which pays
poorly at these sizes; whole batches per core split nothing (docs/BENCHMARKS.md has the measured
gain). A lone batch, and every batch on a GPU, runs in the calling thread as before. So a batch's
float rounding can differ between a lone run (torch's threads) and a parallel one (one thread
each); within either, the same inputs give the same numbers.
"""
from __future__ import annotations

import contextvars
import ctypes
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


def cpu_workers(device: torch.device | str) -> int:
    """Workers for batches on `device`: on a CPU, $RECUR_WORKERS if set (1: every batch in the
    caller with torch's own threads, as before this module), else torch's intra-op thread count (it
    honours OMP_NUM_THREADS and torch.set_num_threads); 1 elsewhere."""
    if torch.device(device).type != "cpu":
        return 1
    env = os.environ.get("RECUR_WORKERS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"RECUR_WORKERS must be a positive integer, got {env!r}")
        return int(env)
    return max(1, torch.get_num_threads())


def map_batches(fn: Callable[[T], R], items: Iterable[T], device: torch.device | str,
                on_done: Callable[[T, R], None] | None = None) -> list[R]:
    """[fn(item) for item in items], in order, on up to cpu_workers(device) threads.

    on_done(item, result) runs in the calling thread as each result is taken (in order), so it
    may touch a UI (a Streamlit progress bar only works from the script's own thread). The workers
    run fn under the caller's inference / grad mode (both are per thread in torch) and its context
    variables."""
    items = list(items)
    workers = min(cpu_workers(device), len(items))
    if workers <= 1:
        return [_done(on_done, item, fn(item)) for item in items]
    threads = torch.get_num_threads()
    modes = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
    pool = ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,))
    try:
        # each item in a copy of the caller's context (recur_core.cancel's stop condition travels in it)
        futures = [pool.submit(contextvars.copy_context().run, _in_modes, modes, fn, item) for item in items]
        return [_done(on_done, item, f.result()) for item, f in zip(items, futures, strict=True)]
    finally:  # on an error or an interrupt, batches not yet started are dropped
        pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(threads)  # the workers' setting must not leak into the caller


def _in_modes(modes: tuple[bool, bool], fn, item):
    inference, grad = modes
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        return fn(item)


def _done(on_done, item, result):
    if on_done is not None:
        on_done(item, result)
    return result


def keep_freed_memory() -> bool:
    """For a batch process on Linux (glibc): keep freed memory for reuse instead of returning it to
    the OS. glibc serves allocations over a threshold (128 KiB to 32 MiB, adapting) with fresh
    mappings and gives freed heap tops back, so the activations of every batch are written to new
    pages, a page fault per 4 KiB (a 16-window trace ran about 10% faster without them on a 2-core
    VM, docs/benchmarks/exact-harness.md). Fixed thresholds (mappings only above 32 MiB, no trimming under 1 GiB)
    end that; the process keeps its peak memory. Returns whether it applied (False elsewhere)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # mallopt's parameters (malloc.h)
    return all(libc.mallopt(param, value) == 1 for param, value in (
        (m_mmap_threshold, 32 << 20), (m_trim_threshold, 1 << 30), (m_top_pad, 64 << 20)))
