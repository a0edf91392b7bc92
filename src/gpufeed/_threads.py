"""Threads of the pipeline: waits that give up once a stop flag is set, and errors that cross threads.

Every blocking wait of gpufeed (a reader's result, a pinned buffer to come back) checks a stop flag
(:func:`result`, :func:`check`), so that a stop flag set by ``close()``, ``break`` or the garbage collector
ends it within :data:`POLL_S`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

#: Every blocking wait wakes at least this often to check its stop flag (seconds).
POLL_S = 0.05


class Stopped(Exception):
    """Raised inside a wait when its stop flag is set; never reaches the user."""


@dataclass
class Failure:
    """An exception raised while fetching a batch, kept in the batch's place and re-raised in its turn.

    The original exception object is re-raised, so its type and its traceback (through the loader's
    or the source's frames) are what the user sees.
    """

    exc: BaseException

    @classmethod
    def caught(cls, exc: BaseException) -> Failure:
        """``exc`` without the catching frame in its traceback: that frame holds what holds the failure
        (the epoch's read-ahead), a reference cycle that would keep the loader's iterator and its worker
        processes alive until the garbage collector runs."""
        return cls(exc.with_traceback(exc.__traceback__.tb_next if exc.__traceback__ else None))

    def reraise(self) -> None:
        # Drop our references before raising (as concurrent.futures does): exception -> traceback ->
        # this frame -> self -> exception would be a cycle.
        exc, self.exc = self.exc, None  # type: ignore[assignment]
        try:
            raise exc.with_traceback(exc.__traceback__)
        finally:
            del exc, self


def check(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise Stopped


def result(fut: Any, stop: threading.Event | None, swallow: bool = False) -> Any:
    """``fut.result()``, given up with :class:`Stopped` once ``stop`` is set; ``swallow``: None instead of
    the future's exception."""
    while True:
        try:
            return fut.result(timeout=POLL_S)
        except FutureTimeout:
            check(stop)
        except BaseException:
            if swallow:
                return None
            raise


def run_now(job: Callable[[], Any]) -> Future:
    """Run ``job`` on this thread; a done Future with its result or error (as a worker's would be). Ctrl-C
    is not an error of the job: it is raised now."""
    fut: Future = Future()
    try:
        fut.set_result(job())
    except Exception as exc:  # delivered through the future, as from a worker thread
        fut.set_exception(exc)
    return fut


def failed(exc: BaseException) -> Future:
    """A done Future holding ``exc``."""
    fut: Future = Future()
    fut.set_exception(exc)
    return fut
