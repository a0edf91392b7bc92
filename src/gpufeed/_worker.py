"""Plumbing of the background thread: stop-aware blocking waits and errors that cross threads."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

#: Every blocking wait wakes at least this often to check its stop flag (seconds).
POLL_S = 0.05


class Stopped(Exception):
    """Raised inside the background thread when its stop flag is set; never reaches the user."""


@dataclass
class Failure:
    """An exception raised in the background thread, carried to the consumer and re-raised there.

    The original exception object is re-raised, so its type and its traceback (through the loader's
    or the source's frames) are what the user sees.
    """

    exc: BaseException

    def reraise(self) -> None:
        raise self.exc.with_traceback(self.exc.__traceback__)


class End:
    """Sentinel put after the last batch of an epoch."""


END = End()


def put(q: queue.Queue, item: Any, stop: threading.Event) -> None:
    """Put ``item`` on ``q``, giving up with :class:`Stopped` once ``stop`` is set."""
    while True:
        try:
            q.put(item, timeout=POLL_S)
            return
        except queue.Full:
            if stop.is_set():
                raise Stopped from None


def acquire(sem: threading.Semaphore, stop: threading.Event) -> None:
    """Acquire ``sem``, giving up with :class:`Stopped` once ``stop`` is set."""
    while not sem.acquire(timeout=POLL_S):
        if stop.is_set():
            raise Stopped
    if stop.is_set():
        sem.release()
        raise Stopped


def check(stop: threading.Event) -> None:
    if stop.is_set():
        raise Stopped
