"""Plumbing of the background thread: stop-aware blocking waits and errors that cross threads."""

from __future__ import annotations

import functools
import queue
import threading
from dataclasses import dataclass

#: Every blocking wait wakes at least this often to check its stop flag (seconds).
POLL_S = 0.05


class Stopped(Exception):
    """Raised inside the background thread when its stop flag is set; never reaches the user."""


@dataclass
class Failure:
    """An exception raised while fetching a batch, carried to the consumer and re-raised there.

    The original exception object is re-raised, so its type and its traceback (through the loader's
    or the source's frames) are what the user sees.
    """

    exc: BaseException

    @classmethod
    def caught(cls, exc: BaseException) -> Failure:
        """``exc``, as caught by the caller, without the caller's frame in its traceback: that frame holds
        what holds the failure (the queue, or the epoch's read-ahead), a reference cycle that would keep
        the loader's iterator and CUDA events alive until the garbage collector runs, maybe in a forked
        DataLoader worker."""
        return cls(exc.with_traceback(exc.__traceback__.tb_next if exc.__traceback__ else None))

    def reraise(self) -> None:
        # Drop our references before raising (as concurrent.futures does): otherwise exception ->
        # traceback -> this frame -> self -> exception is a cycle that keeps the failed loader
        # iterator (and a DataLoader's worker processes) alive until the cyclic GC runs.
        exc, self.exc = self.exc, None  # type: ignore[assignment]
        try:
            raise exc.with_traceback(exc.__traceback__)
        finally:
            del exc, self


class End:
    """Sentinel put after the last batch of an epoch."""


END = End()


class Slots:
    """A counting semaphore in C: ``depth`` tokens in a SimpleQueue.

    ``threading.Semaphore`` is written in Python and costs the consumer microseconds per batch;
    ``SimpleQueue`` put/get are C calls. The consumer returns a token as it takes a batch
    (:meth:`release`); the background thread takes one before it starts a batch (:meth:`acquire`).
    """

    def __init__(self, n: int) -> None:
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(n):
            self._tokens.put(None)
        self.release = functools.partial(self._tokens.put, None)

    def acquire(self, stop: threading.Event) -> None:
        """Take a token, giving up with :class:`Stopped` once ``stop`` is set."""
        while True:
            try:
                self._tokens.get(timeout=POLL_S)
                break
            except queue.Empty:
                if stop.is_set():
                    raise Stopped from None
        if stop.is_set():
            raise Stopped


def check(stop: threading.Event) -> None:
    if stop.is_set():
        raise Stopped
