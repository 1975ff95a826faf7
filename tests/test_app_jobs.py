"""The app's background jobs (ui/jobs.py): the time left from a job's own progress, runs numbered
when a step starts over, and Stop acting inside a unit of work (recur_core.cancel), not after it."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from recur_core.analysis.harness import run_exact_sweep
from recur_core.analysis.trace import trace
from recur_core.cancel import Cancelled, check, stop_when
from recur_core.exits.policies import ArgmaxStable, ConvergenceExit, Uniform
from ui import jobs


def test_time_left_comes_from_the_stage_own_pace():
    job = jobs.Job(("eta",))
    update = job.progress("Tracing", "window-loops")
    update(0, 100)
    assert job.seconds_left() is None and "measuring" in jobs.progress_line(job)
    job.started = job.stage_started = job.stage_started - 20.0  # 20 s into the stage ...
    update(25, 100)  # ... a quarter done
    now = job.stage_started + 20.0
    assert job.seconds_left(now=now) == pytest.approx(60.0)
    assert "20 s so far · about 60 s left" in jobs.progress_line(job, now=now)
    job.progress("Decoding", "tokens")(0, 40)  # a new stage: its own clock, nothing measured yet
    assert job.seconds_left() is None


def test_a_step_that_starts_over_is_numbered_as_the_next_run():
    job = jobs.Job(("runs",))
    update = job.progress("Decoding the readout rules", "windows")
    update(0, 8)
    update(8, 8)
    update(0, 8)  # the same step again (another threshold)
    assert job.stage.endswith("run 2") and job.done == 0
    update(3, 8)
    assert job.stage.endswith("run 2") and job.done == 3


@pytest.mark.parametrize("words", [("40 s", 40), ("12 min", 720), ("3 h 05 min", 3 * 3600 + 300)])
def test_durations_in_words(words):
    text, seconds = words
    assert jobs.duration(seconds) == text


def stop_after(n_checks: int):
    """A stop condition that turns true at its n-th look (thread-safe: workers look too)."""
    seen, lock = [0], threading.Lock()

    def should_stop() -> bool:
        with lock:
            seen[0] += 1
            return seen[0] > n_checks
    return should_stop


def test_check_raises_only_inside_a_stopped_block():
    check()  # outside any block: never raises
    with stop_when(lambda: False):
        check()
    with stop_when(lambda: True), pytest.raises(Cancelled):
        check()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_stop_acts_inside_the_first_unit_of_the_harness_and_the_trace(ckpt, monkeypatch, workers):
    """Stopped at the third loop it checks, the harness and the tracer end before their first unit
    of progress (a window group / a batch): they look at the stop condition every loop, in the worker
    threads too."""
    monkeypatch.setenv("RECUR_WORKERS", workers)
    windows = ckpt.windows("eval")[:8]
    done = []
    policies = [Uniform(4), ConvergenceExit(1e-3, r_max=8), ArgmaxStable(2, r_max=8)]
    with stop_when(stop_after(3)), pytest.raises(Cancelled):
        run_exact_sweep(ckpt, windows, policies, 8, 0, window_group=4, progress=lambda d, t: done.append(d))
    assert max(done) == 0
    done.clear()
    with stop_when(stop_after(3)), pytest.raises(Cancelled):
        trace(ckpt, windows, 8, 0, cache=False, batch_size=4, progress=lambda d, t: done.append(d))
    assert max(done) < 8 * 4  # not even one batch of 4 windows × 8 loops


def test_a_stopped_job_ends_stopped_and_can_resume(ckpt):
    """Stop pressed while the job runs: it ends as stopped (not failed); Resume runs it again."""
    started = threading.Event()

    def work(job: jobs.Job) -> int:
        started.set()
        while True:  # a computation of unbounded length that looks at Stop as recur_core's loops do
            check()
            job.stop_event.wait(0.01)

    job = jobs.start(("stop-test",), work)
    assert started.wait(10)
    job.stop_event.set()
    assert job.wait(10) and job.stopped and not job.error
    again = jobs.start(("stop-test",), lambda j: np.int64(7), again=True)
    assert again is not job and again.wait(10) and again.result == 7
