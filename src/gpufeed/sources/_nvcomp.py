"""nvCOMP's batched Deflate decompression, called through its C API with ctypes.

Only what gpufeed needs: the alignments, the scratch size and ``nvcompBatchedDeflateDecompressAsync``
(``nvcomp/deflate.h`` of ``nvidia-libnvcomp-cu13`` 6.x). The C API, rather than the Python binding, because
it reports per chunk what a check needs (a status and the decoded size) and takes a stream and memory
that torch owns. Nothing here touches CUDA until a function is called; loading needs no GPU.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from gpufeed._extras import require


class _DecompressOpts(ctypes.Structure):
    # nvcompBatchedDeflateDecompressOpts_t: 64 bytes, passed by value; reserved bytes must be zero.
    _fields_ = [("backend", ctypes.c_int), ("sort_before_hw_decompress", ctypes.c_int),
                ("reserved", ctypes.c_char * 56)]


class _Alignments(ctypes.Structure):
    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t), ("temp", ctypes.c_size_t)]


class Nvcomp:
    """The loaded library. Thread-safe: the C API keeps no state between calls (each call names its
    stream, buffers and scratch)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._opts = _DecompressOpts()  # backend 0: nvCOMP's choice (the hardware engine where present)
        p, sz, st = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p
        lib.nvcompBatchedDeflateDecompressGetRequiredAlignments.argtypes = [_DecompressOpts,
                                                                            ctypes.POINTER(_Alignments)]
        lib.nvcompBatchedDeflateDecompressGetTempSize.argtypes = [sz, sz, _DecompressOpts,
                                                                  ctypes.POINTER(sz), sz, st]
        lib.nvcompBatchedDeflateDecompressAsync.argtypes = [p, p, p, p, sz, p, sz, p, _DecompressOpts, p, st]
        for name in ("nvcompBatchedDeflateDecompressGetRequiredAlignments",
                     "nvcompBatchedDeflateDecompressGetTempSize", "nvcompBatchedDeflateDecompressAsync"):
            getattr(lib, name).restype = ctypes.c_int
        al = _Alignments()
        _check(lib.nvcompBatchedDeflateDecompressGetRequiredAlignments(self._opts, ctypes.byref(al)),
               "GetRequiredAlignments")
        #: Byte alignment of each compressed input, each decoded output and the scratch buffer.
        self.alignments = (int(al.input), int(al.output), int(al.temp))

    def temp_bytes(self, chunks: int, max_chunk_bytes: int, total_bytes: int, stream: int) -> int:
        """Scratch bytes a decompression of ``chunks`` chunks needs."""
        out = ctypes.c_size_t(0)
        _check(self._lib.nvcompBatchedDeflateDecompressGetTempSize(
            chunks, max_chunk_bytes, self._opts, ctypes.byref(out), total_bytes, stream), "GetTempSize")
        return int(out.value)

    def decompress(self, comp_ptrs: int, comp_bytes: int, buffer_bytes: int, actual_bytes: int, chunks: int,
                   temp: int, temp_bytes: int, out_ptrs: int, statuses: int, stream: int) -> None:
        """Queue the decompression of ``chunks`` raw deflate streams on ``stream`` (every argument a device
        address of ``chunks`` entries; ``actual_bytes`` and ``statuses`` are written per chunk)."""
        _check(self._lib.nvcompBatchedDeflateDecompressAsync(
            comp_ptrs, comp_bytes, buffer_bytes, actual_bytes, chunks, temp, temp_bytes, out_ptrs, self._opts,
            statuses, stream), "BatchedDeflateDecompressAsync")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"nvCOMP {what} failed: status {status} (nvcompStatus_t, nvcomp/shared_types.h)")


_LOCK = threading.Lock()
_LOADED: Nvcomp | None = None


def load() -> Nvcomp:
    """The library of ``nvidia-libnvcomp-cu13`` (``pip install 'gpufeed[nvcomp]'``), loaded once.

    Raises:
        ImportError: the package is missing (the message names the extra), or its library cannot be loaded.
    """
    global _LOADED
    with _LOCK:
        if _LOADED is None:
            pkg = require("nvidia.libnvcomp", "decoding gzip HDF5 chunks on the GPU")
            lib = pkg.load_library()
            if lib is None:
                raise ImportError("nvidia-libnvcomp-cu13 is installed but libnvcomp.so.6 did not load; "
                                  "reinstall it with: pip install --force-reinstall 'gpufeed[nvcomp]'")
            try:
                _LOADED = Nvcomp(lib)
            except AttributeError as exc:  # an nvCOMP without this C API (older than 5)
                raise ImportError(f"libnvcomp lacks {exc}; install nvCOMP 6: pip install 'gpufeed[nvcomp]'") \
                    from exc
        return _LOADED
