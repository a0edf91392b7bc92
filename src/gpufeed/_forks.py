"""A process forked from this one freezes the collector's objects it inherits.

This process's unreachable reference cycles are copied into a forked child. Collected there, a CUDA object
among them (an event, a stream's wrapper, a block of pinned memory a copy read) makes a CUDA call in the
child, which aborts it (``CUDA error: initialization error``). A cycle holding a prefetcher is common: a
frame kept by an exception's traceback, a trainer's callbacks. So once gpufeed has made CUDA objects in this
process (:func:`guard_every_fork`), and, on the CPU, while a gpufeed iteration starts its DataLoader's
workers (:func:`starting`), every forked child freezes what it inherited (``gc.freeze()``): it never
collects this process's cycles, nor dirties their pages, as Python's docs advise for a process that forks
workers. The collector is off across the fork, so that no collection runs in the child before the freeze
(other fork handlers allocate first). This process's collector is left as it was: a program's own
``gc.freeze()`` or ``gc.disable()`` stays its own.
"""

from __future__ import annotations

import gc
import os

_guard_all = False  # gpufeed made CUDA objects here: every later fork is guarded
_starting = 0  # iterations starting their workers now (from ``iter()`` to the first batch)
# Guarded forks under way (two threads may fork at once; each fork's handlers run outside any lock), and
# whether the collector was on before the first of them: it is turned back on after the last.
_forking = 0
_was_collecting = False


def guard_every_fork() -> None:
    """gpufeed made CUDA objects in this process: every child forked from now on freezes what it inherits."""
    global _guard_all
    _guard_all = True


def starting(delta: int) -> None:
    """An iteration starts its workers (``+1``), or its workers started (``-1``)."""
    global _starting
    _starting += delta


def _before() -> None:
    global _forking, _was_collecting
    if not (_guard_all or _starting > 0):
        return
    if _forking == 0:
        _was_collecting = gc.isenabled()
    _forking += 1
    gc.disable()


def _after(child: bool) -> None:
    global _forking
    if _forking == 0:
        return
    if child:  # (the child forked once, whatever other threads of the parent were doing)
        gc.freeze()
        _forking = 0
    else:
        _forking -= 1
    if _forking == 0 and _was_collecting:
        gc.enable()


os.register_at_fork(before=_before, after_in_parent=lambda: _after(False),
                    after_in_child=lambda: _after(True))
