"""Per-process handles: open files that a forked child or an unpickled copy never shares."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

_LIVE: weakref.WeakSet[_PerProcess] = weakref.WeakSet()
# Handles a forked child inherited; kept referenced, never closed there: closing an h5py file in the child
# could touch HDF5 state that a thread of the parent held at the fork.
_INHERITED: list[Any] = []


class _PerProcess:
    """A lazily filled, per-process list of open handles, one per path, safe to use from many threads.

    Invariant: ``_handles`` belongs to process ``_pid``. A forked child starts with an empty list (fork
    hook, and a pid check as a backstop) and opens its own handles; pickling carries the paths and
    settings, no handle.
    Subclasses define ``_open(path)`` and ``_close(handle)``.
    """

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = tuple(paths)
        self._reset()
        _LIVE.add(self)

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._handles: list[Any] = [None] * len(self.paths)
        self._lock = threading.Lock()

    def _after_fork(self) -> None:
        _INHERITED.extend(h for h in self._handles if h is not None)
        self._reset()

    def get(self, i: int) -> Any:
        if self._pid != os.getpid():
            self._after_fork()
        h = self._handles[i]
        if h is None:
            with self._lock:
                h = self._handles[i]
                if h is None:
                    h = self._handles[i] = self._open(self.paths[i])
        return h

    def close(self) -> None:
        if self._pid != os.getpid():
            self._after_fork()
            return
        with self._lock:
            handles, self._handles = self._handles, [None] * len(self.paths)
        for h in handles:
            if h is not None:
                try:
                    self._close(h)
                except Exception:
                    pass

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_pid", "_handles", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()
        _LIVE.add(self)

    def __del__(self) -> None:
        try:
            if self._pid == os.getpid():
                self.close()
        except Exception:
            pass

    def _open(self, path: str) -> Any:
        raise NotImplementedError

    def _close(self, handle: Any) -> None:
        raise NotImplementedError


def _reset_in_child() -> None:
    for obj in list(_LIVE):
        obj._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
