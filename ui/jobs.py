"""Long computations in the background, so a page answers while they run.

A page that needs minutes of work (tracing the eval windows, the exact harness) starts a `Job`: a
thread that calls recur_core with a progress callback and fills recur_core's disk cache. The page
draws what it already has (a first look on fewer windows, or the fast path), and `watch` shows the
job's progress bar (what it computes, done / total, the time left at its own pace so far) with a
Stop button, polling once a second; when the job ends, the page reruns and reads the finished result
from the cache. Widget changes on the page do not restart the job. Stop ends it within seconds (the
work runs under recur_core.cancel.stop_when: recur_core checks it every loop of every batch) and
keeps what the page shows.

Jobs are per server process and keyed by what they compute (checkpoint, device, inputs), so two
tabs asking for the same trace share one job. The thread never calls Streamlit.
"""
from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import streamlit as st

from recur_core.cancel import Cancelled, stop_when


@dataclass
class Job:
    """One background computation: its stage (what is being computed now) and progress. A stage
    restarts (and its clock with it) whenever a progress callback starts over at 0 or changes its
    total: a job made of several runs (a harness pass, then decodings) times each run on its own."""

    key: tuple
    stage: str = "starting"
    done: int = 0
    total: int = 0
    unit: str = ""
    error: str | None = None
    stopped: bool = False
    finished: bool = False
    started: float = field(default_factory=time.monotonic)
    stage_started: float = field(default_factory=time.monotonic)
    stop_event: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)  # set with `finished`
    work: Callable[[Job], object] | None = None
    result: object = None  # what work(job) returned, once it has

    def progress(self, stage: str, unit: str = "") -> Callable[[int, int], None]:
        """A recur_core progress callback (done, total) for one stage of the job; it raises
        Cancelled once Stop was pressed. A callback that starts over (recur_core runs the same
        step again, e.g. decoding at another threshold) numbers its runs, so the bar's fall back
        to 0 reads as the next run."""
        runs = [0]

        def update(done: int, total: int) -> None:
            if self.stop_event.is_set():
                raise Cancelled
            if done == 0 or self.total != total:
                runs[0] += done == 0 and self.done > 0 and self.stage.startswith(stage)
                self.stage_started = time.monotonic()
            self.stage = stage if not runs[0] else f"{stage} · run {runs[0] + 1}"
            self.unit, self.done, self.total = unit, done, total
        return update

    def seconds_left(self, now: float | None = None) -> float | None:
        """The current stage's time left at its own pace so far (elapsed × left / done); None
        until its first step is done."""
        if self.done <= 0 or not self.total:
            return None
        now = time.monotonic() if now is None else now
        return (now - self.stage_started) * max(self.total - self.done, 0) / self.done

    @property
    def running(self) -> bool:
        return not self.finished

    def wait(self, seconds: float) -> bool:
        """Block up to `seconds` for the job to end; whether it has."""
        return self.ended.wait(seconds)

    def fraction(self) -> float:
        return min(self.done / self.total, 1.0) if self.total else 0.0


_JOBS: dict[tuple, Job] = {}
_LOCK = threading.Lock()


def start(key: tuple, work: Callable[[Job], object], again: bool = False) -> Job:
    """The job computing `key` (running, finished, stopped or failed), or a new thread running
    work(job); again: start a stopped or failed one anew."""
    with _LOCK:
        job = _JOBS.get(key)
        if job is not None and (job.running or not again or not (job.stopped or job.error)):
            return job
        job = _JOBS[key] = Job(key, work=work)

    def run() -> None:
        try:
            with stop_when(job.stop_event.is_set):
                job.result = work(job)
        except Cancelled:
            job.stopped = True
        except Exception as err:  # noqa: BLE001  shown on the page, with the stack in the server log
            traceback.print_exc()
            job.error = f"{type(err).__name__}: {err}"
        finally:
            job.finished = True
            job.ended.set()

    threading.Thread(target=run, name=f"recur-job-{key[0]}", daemon=True).start()
    return job


def get(key: tuple) -> Job | None:
    return _JOBS.get(key)


def wait_all(timeout: float = 3600.0) -> bool:
    """Block until no job is running (for tests and scripts driving the app); False on timeout."""
    deadline = time.monotonic() + timeout
    while any(job.running for job in list(_JOBS.values())):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def watch(job: Job, what: str) -> None:
    """The job's progress bar and Stop button, redrawn every second; reruns the page once the job
    is over (then the page reads the finished result). `what`: the sentence above the bar."""
    @st.fragment(run_every=1.0)
    def panel() -> None:
        if job.finished:
            if not (job.error or job.stopped):
                st.rerun(scope="app")
            if job.error:
                st.error(f"The computation failed: {job.error}")
            else:
                st.info(f"Stopped at {job.stage} {job.done:,} / {job.total:,}: the page shows what was computed "
                        "before.")
            if st.button("Resume" if job.stopped else "Try again", key=f"again_{abs(hash(job.key))}"):
                start(job.key, job.work, again=True)
                st.rerun(scope="app")
            return
        st.caption(what)
        st.progress(job.fraction(), text=progress_line(job))
        if job.stop_event.is_set():
            st.caption("Stopping at its next loop…")
        elif st.button("Stop", key=f"stop_{abs(hash(job.key))}", help="Stop this computation (within seconds); the "
                                                                      "page keeps what it shows now."):
            job.stop_event.set()
    panel()


def duration(seconds: float) -> str:
    """A time span in words, to the precision an estimate has: "40 s", "12 min", "3 h 05 min"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes:02d} min"


def progress_line(job: Job, now: float | None = None) -> str:
    """The bar's text: stage, done / total, time spent, and the stage's time left at its pace so far."""
    now = time.monotonic() if now is None else now
    unit = f" {job.unit}" if job.unit else ""
    left = job.seconds_left(now)
    eta = "time left: measuring (after its first step)" if left is None else f"about {duration(left)} left"
    return f"{job.stage}: {job.done:,} / {job.total:,}{unit} · {duration(now - job.started)} so far · {eta}"
