"""A few CUDA driver calls made without releasing the GIL.

Every torch CUDA call (an event's ``query`` or ``wait``, a tensor op) releases the GIL and takes it back.
With two threads running Python (the training thread and gpufeed's background thread) each release
is a chance for the other thread to take the GIL, and the caller then waits, asleep, for it back:
microseconds of thread time for a call whose own work takes one. The calls here return at once
(they queue work or read a flag), so they keep the GIL: ``ctypes.PyDLL`` calls do not release it.

Each function answers ``False`` where the driver is not reachable or refuses the call; the caller
then makes torch's own call, which raises the error if there is one.
"""

from __future__ import annotations

import ctypes
from typing import Any

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600

_lib: Any = None
_failed = False


def _load() -> Any:
    global _lib, _failed
    if _lib is None and not _failed:
        try:
            lib = ctypes.PyDLL("libcuda.so.1")  # loaded already by torch's CUDA runtime
            lib.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
            lib.cuEventQuery.argtypes = [ctypes.c_void_p]
            _lib = lib
        except (OSError, AttributeError):
            _failed = True
    return _lib


def wait_event(stream: int, event: int) -> bool:
    """Make the raw CUstream ``stream`` wait on the raw CUevent ``event``; whether the driver did."""
    lib = _lib if _lib is not None else _load()
    return lib is not None and event != 0 and lib.cuStreamWaitEvent(stream, event, 0) == CUDA_SUCCESS


def query(event: int) -> bool | None:
    """Whether the work before the raw CUevent ``event``'s last record completed; None if not asked."""
    lib = _lib if _lib is not None else _load()
    if lib is None or event == 0:
        return None
    rc = lib.cuEventQuery(event)
    if rc == CUDA_SUCCESS:
        return True
    if rc == CUDA_ERROR_NOT_READY:
        return False
    return None
