"""gpufeed's one handle on the CUDA driver: calls made without releasing the GIL, and the addresses of the
functions the compiled staging copy calls itself (``gpufeed_stage``).

Every torch CUDA call (an event's ``query`` or ``wait``, a tensor op) releases the GIL and takes it back.
With two threads running Python (the training thread and gpufeed's background thread) each release
is a chance for the other thread to take the GIL, and the caller then waits, asleep, for it back:
microseconds of thread time for a call whose own work takes one. The calls here return at once
(they queue work or read a flag), so they keep the GIL: ``ctypes.PyDLL`` calls do not release it.

Each function answers ``False`` (or ``None``) where the driver is not reachable or refuses the call;
the caller then makes torch's own call, which raises the error if there is one.
"""

from __future__ import annotations

import ctypes
from typing import Any

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_READY = 600
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_MEMORYTYPE_HOST = 1

_lib: Any = None
_failed = False


def _load() -> Any:
    global _lib, _failed
    if _lib is None and not _failed:
        try:
            lib = ctypes.PyDLL("libcuda.so.1")  # loaded already by torch's CUDA runtime
            lib.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
            lib.cuEventQuery.argtypes = [ctypes.c_void_p]
            lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong]
            elapsed = getattr(lib, "cuEventElapsedTime_v2", None) or lib.cuEventElapsedTime
            elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
            lib.gpufeed_elapsed = elapsed
            lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.gpufeed_addresses = (ctypes.cast(lib.cuMemcpyHtoDAsync_v2, ctypes.c_void_p).value,
                                     ctypes.cast(lib.cuEventRecord, ctypes.c_void_p).value)
            _lib = lib
        except (OSError, AttributeError):
            _failed = True
    return _lib


def addresses() -> tuple[int, int] | None:
    """Addresses of ``cuMemcpyHtoDAsync_v2`` and ``cuEventRecord`` for C to call; None without a driver."""
    lib = _lib if _lib is not None else _load()
    return None if lib is None else lib.gpufeed_addresses


def error_name(code: int) -> str:
    """The driver's name of CUresult ``code`` (``CUDA_ERROR_ILLEGAL_ADDRESS``), or ``unknown``."""
    lib = _lib if _lib is not None else _load()
    name = ctypes.c_char_p()
    if lib is not None and lib.cuGetErrorName(code, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
        return name.value.decode()
    return "unknown"


def done(event: Any) -> bool:
    """Whether the work before torch event ``event``'s last record completed: the driver's answer, or
    torch's ``query()`` (which releases the GIL) where the driver gives none."""
    finished = query(event.cuda_event)
    return event.query() if finished is None else finished


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


def record(event: int, stream: int) -> bool:
    """Record the raw CUevent ``event`` on the raw CUstream ``stream``; whether the driver did."""
    lib = _lib if _lib is not None else _load()
    return lib is not None and event != 0 and lib.cuEventRecord(event, stream) == CUDA_SUCCESS


def elapsed_ms(start: int, end: int) -> float | None:
    """Milliseconds between two completed raw CUevents recorded with timing; None if not asked."""
    lib = _lib if _lib is not None else _load()
    if lib is None or start == 0 or end == 0:
        return None
    ms = ctypes.c_float()
    return ms.value if lib.gpufeed_elapsed(ctypes.byref(ms), start, end) == CUDA_SUCCESS else None


def is_pinned(address: int) -> bool | None:
    """Whether host ``address`` lies in page-locked memory the driver knows (as torch's ``is_pinned``);
    None where the driver does not say (the caller asks torch)."""
    lib = _lib if _lib is not None else _load()
    if lib is None or address == 0:
        return None
    kind = ctypes.c_uint()
    rc = lib.cuPointerGetAttribute(ctypes.byref(kind), CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address)
    if rc == CUDA_ERROR_INVALID_VALUE:  # not memory the driver knows of: pageable
        return False
    if rc == CUDA_SUCCESS and kind.value == CU_MEMORYTYPE_HOST:
        return True
    return None
