"""One Ctrl-C stops a read through h5py, even one that h5py swallowed.

h5py frees its objects in weak-reference callbacks; a KeyboardInterrupt raised while one runs is printed
as "Exception ignored" and lost, and the read goes on. While a read on the main thread (the only thread
Python delivers SIGINT to) calls h5py, :func:`watching` puts a handler in place that counts each SIGINT
before raising KeyboardInterrupt as Python's own does; after each h5py call the read checks the count
and raises KeyboardInterrupt itself when one arrived. Only Python's default SIGINT handler is replaced
(for the length of the read, then restored): a program with its own handler keeps it, and gets no such
guarantee.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

_count = 0


def _counting(signum: int, frame: FrameType | None) -> None:
    global _count
    _count += 1
    signal.default_int_handler(signum, frame)


class Watch:
    """Raises KeyboardInterrupt from :meth:`check` once a SIGINT arrived since the watch began."""

    def __init__(self, active: bool) -> None:
        self.active, self.start = active, _count

    def check(self) -> None:
        if self.active and _count != self.start:
            self.start = _count
            raise KeyboardInterrupt


@contextlib.contextmanager
def watching() -> Iterator[Watch]:
    """Count SIGINTs for the length of the block, where this is the main thread and SIGINT has Python's
    default handler; a no-op watch elsewhere."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield Watch(False)
        return
    signal.signal(signal.SIGINT, _counting)
    try:
        yield Watch(True)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
