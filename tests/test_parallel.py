"""recur_core.analysis.parallel: batches on CPU worker threads give what one thread gives, in order, and
leave the caller's torch settings as they were."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.bench_parallel import main as bench_parallel
from recur_core.analysis.harness import run_exact_sweep
from recur_core.analysis.parallel import map_batches
from recur_core.analysis.trace import trace
from recur_core.exits.policies import ConvergenceExit, Uniform


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_map_batches_order_modes_threads_and_callback_thread(two_threads):
    caller = threading.get_ident()
    seen = []

    def fn(i):
        return i * i, torch.get_num_threads(), torch.is_inference_mode_enabled(), threading.get_ident()
    with torch.inference_mode():
        out = map_batches(fn, range(7), "cpu", on_done=lambda i, r: seen.append((i, threading.get_ident())))
    assert [o[0] for o in out] == [i * i for i in range(7)]
    assert all(o[1] == 1 and o[2] for o in out)  # one torch thread each, the caller's inference mode
    assert {o[3] for o in out} != {caller}  # the work ran on worker threads ...
    assert seen == [(i, caller) for i in range(7)]  # ... the callback on the caller's, in order
    assert torch.get_num_threads() == 2


def test_map_batches_runs_a_lone_batch_in_the_caller(two_threads):
    out = map_batches(lambda i: (torch.get_num_threads(), threading.get_ident()), [0], "cpu")
    assert out == [(2, threading.get_ident())]


def test_error_in_a_worker_reaches_the_caller_and_drops_the_batches_not_started(two_threads):
    started = []

    def fn(i):
        started.append(i)
        if i == 1:
            raise ValueError("batch 1 failed")
        time.sleep(0.05)
        return i
    with pytest.raises(ValueError, match="batch 1 failed"):
        map_batches(fn, range(40), "cpu")
    assert torch.get_num_threads() == 2
    assert len(started) < 40


def test_parallel_trace_and_sweep_equal_one_thread(ckpt, two_threads):
    windows = ckpt.windows("eval")[:5]
    parallel = trace(ckpt, windows, 4, seed=1, batch_size=2, cache=False)
    policies = [Uniform(3), ConvergenceExit(1e-2, r_max=4)]
    swept = run_exact_sweep(ckpt, windows, policies, 4, seed=1, window_group=2)
    torch.set_num_threads(1)  # one worker: every batch in the calling thread
    alone = trace(ckpt, windows, 4, seed=1, batch_size=2, cache=False)
    swept_alone = run_exact_sweep(ckpt, windows, policies, 4, seed=1, window_group=2)
    for name in ("kl_prev", "ce", "entropy", "state_change"):
        np.testing.assert_allclose(getattr(parallel, name), getattr(alone, name), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(parallel.argmax, alone.argmax)
    for a, b in zip(swept, swept_alone, strict=True):
        np.testing.assert_array_equal(a.exit_depth, b.exit_depth)
        np.testing.assert_allclose(a.ce, b.ce, rtol=1e-5)


def test_recur_workers_env_sets_the_worker_count(monkeypatch, two_threads):
    monkeypatch.setenv("RECUR_WORKERS", "1")
    out = map_batches(lambda i: (torch.get_num_threads(), threading.get_ident()), range(3), "cpu")
    assert out == [(2, threading.get_ident())] * 3  # all in the caller, with torch's threads
    monkeypatch.setenv("RECUR_WORKERS", "two")
    with pytest.raises(ValueError, match="RECUR_WORKERS"):
        map_batches(lambda i: i, range(3), "cpu")


def test_bench_parallel_runs_on_tiny(tiny_ckpt, capsys):
    before = torch.get_num_threads()
    try:
        out = bench_parallel(["--checkpoint", str(tiny_ckpt), "--windows", "3", "--repeats", "1", "--loops", "4"])
    finally:
        torch.set_num_threads(before)
    for key in ("trace_speedup", "sweep_speedup", "trace_max_abs_kl", "exit_depth_differs"):
        assert np.isfinite(out[key]), key
    assert out["exit_depth_differs"] < 0.01 and out["trace_max_abs_ce"] < 1e-4
    assert "speedup" in capsys.readouterr().out


_FAULTS = """import ctypes, resource, sys, torch
from recur_core.analysis.parallel import keep_freed_memory
if sys.argv[1] == "keep":
    applied = keep_freed_memory()
else:  # a fixed mmap threshold: every 16 MiB tensor a fresh mapping, as glibc's default often does
    applied = ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10) == 1  # M_MMAP_THRESHOLD (malloc.h)

def step():  # three 16 MiB activations alive at once, written, then freed
    a, b, c = (torch.ones(4 << 20) for _ in range(3))
    del a, b, c
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_keep_freed_memory_ends_the_page_faults_of_reallocated_buffers():
    def faults(mode: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
        applied, count = out.stdout.split()
        return applied, int(count)
    # glibc's default adapts its mmap threshold as it goes, so its count varies from run to run
    # (16k to 123k faults measured here); the baseline pins the fresh-mapping case it falls into.
    kept, fresh = faults("keep"), faults("mmap")
    assert kept[0] == "True" and fresh[0] == "True"
    pages = 10 * 3 * (16 << 20) // 4096  # a fresh mapping faults once per 4 KiB page it writes
    assert fresh[1] > pages / 2 and kept[1] < pages / 5
