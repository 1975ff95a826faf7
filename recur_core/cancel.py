"""Stopping a long computation from outside it, within seconds.

A caller (the app's background jobs) runs recur_core under `stop_when(should_stop)`; the long loops
(every loop of a trace batch, of an exact-harness chunk, every position of decoding) call `check()`,
which raises `Cancelled` once should_stop() is true. The condition travels in a context variable,
which `analysis.parallel.map_batches` hands to its worker threads, so a batch running on another
core stops at its next loop too. Outside `stop_when`, check() costs one lookup and never raises.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

_SHOULD_STOP: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("recur_should_stop",
                                                                                         default=None)


class Cancelled(Exception):
    """Raised inside a computation whose caller asked it to stop."""


@contextlib.contextmanager
def stop_when(should_stop: Callable[[], bool]) -> Iterator[None]:
    """Within the block, check() raises Cancelled once should_stop() returns True."""
    token = _SHOULD_STOP.set(should_stop)
    try:
        yield
    finally:
        _SHOULD_STOP.reset(token)


def check() -> None:
    """Raise Cancelled if the computation running in this context was asked to stop."""
    should_stop = _SHOULD_STOP.get()
    if should_stop is not None and should_stop():
        raise Cancelled
