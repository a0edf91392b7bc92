"""Many positional reads in one call: the compiled ``gpufeed_pread_many`` (``_pread_many.c``) where the
package was built with it, else a Python loop of ``os.preadv``. Both raise the same OSError naming the file.

Why: a batch is read from the page cache at a few GB/s a thread, so it needs several threads, and a
shuffled batch is thousands of short runs; each ``os.preadv`` from Python drops and retakes the GIL, so
Python threads take turns at it however many there are. A ctypes call releases the GIL once for all the
reads of a call, which the library shares among its own threads (:func:`pread_many`) or starts and returns
(:func:`submit`); on Linux it first starts the kernel's reads of every read of a page or more that the
page cache lacks, so a cold batch's reads are all in flight (docs/design.md, "Reading a BatchSource" and
"Shuffled rows").

The library is built by ``hatch_build.py`` when the package is built, never at run time; set
``GPUFEED_NATIVE_PREAD=0`` to use the Python loop anyway.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ._files import FileDescriptors, pread_exact, short_read_message

LIBRARY = Path(__file__).with_name("_pread_many.so")
ABI = 7  # gpufeed_pread_abi() of the library this module calls
#: The fewest bytes a native read gives one thread. A read from the page cache is a memory copy, a few GB/s
#: per thread, so a batch needs several threads; each costs a thread start (about 10 us). Measured on an
#: H200 machine, 8 MiB batches by kvikio's C++ threads: 1 MiB tasks 31.7 GB/s, 4 MiB tasks 16.4
#: (docs/design.md, "Reading a BatchSource").
SHARE_BYTES = 1 << 20


def _load() -> Any:
    """The library beside this module, or None (not built, or turned off)."""
    if os.environ.get("GPUFEED_NATIVE_PREAD", "1") == "0" or not LIBRARY.is_file():
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY))  # CDLL, not PyDLL: calls release the GIL
        lib.gpufeed_pread_abi.restype = ctypes.c_int64
        if lib.gpufeed_pread_abi() != ABI:
            return None
        reads, gather, resident = lib.gpufeed_pread_many, lib.gpufeed_gather, lib.gpufeed_resident
        submit, wait, free = lib.gpufeed_pread_submit, lib.gpufeed_pread_wait, lib.gpufeed_pread_free
    except (OSError, AttributeError):  # built for another platform, or a stale build
        return None
    free.restype = None
    free.argtypes = [ctypes.c_void_p]
    submit.restype = ctypes.c_void_p
    submit.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4
    wait.restype = ctypes.c_int64
    wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    reads.restype = gather.restype = resident.restype = ctypes.c_int64
    reads.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 3
    gather.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int64]
    resident.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    return lib


_LIB = _load()
_NATIVE = _LIB.gpufeed_pread_many if _LIB is not None else None
#: ``gpufeed_gather(base, offsets, n, row_bytes, out, threads, min_share)``: rows copied out of a memory map
#: by up to ``threads`` threads, -1 when whole, else the first row whose page lay past the end of its file
#: (``_gather.py``); None without the library.
GATHER = _LIB.gpufeed_gather if _LIB is not None else None
#: ``gpufeed_resident(base, size, offsets, n, row_bytes)``: 1 when the page cache holds the first page of
#: every row (``mincore``, nothing faulted in), else 0; None without the library.
RESIDENT = _LIB.gpufeed_resident if _LIB is not None else None
_SUBMIT = _LIB.gpufeed_pread_submit if _LIB is not None else None
_WAIT = _LIB.gpufeed_pread_wait if _LIB is not None else None
_FREE = _LIB.gpufeed_pread_free if _LIB is not None else None


def backend() -> str:
    """``"native"`` when reads go through the compiled library, ``"python"`` for the ``os.preadv`` loop."""
    return "native" if _NATIVE is not None else "python"


def pread_many(
    fds: FileDescriptors, paths: Sequence[str], files: Any, offsets: Any, sizes: Any, dst: Any, addr: int,
    nbytes: int, ahead: bool = True, threads: int = 1,
) -> None:
    """Read ``sizes[i]`` bytes at ``offsets[i]`` of file ``files[i]`` (or of file ``files``) into byte
    ``dst[i]`` of the ``nbytes`` of host memory at ``addr``, for every ``i``, in order (the columns are
    lists or numpy arrays: :data:`FieldReads`).

    With ``ahead`` (the native reader on Linux), the reads of a page or more that the page cache holds are
    copied first without blocking and the kernel is asked to read all the others at once
    (``posix_fadvise(WILLNEED)``), so a cold batch keeps the disk's queue full instead of one read in
    flight per thread; ``ahead=False`` is one blocking ``pread`` per read (a plain random-read baseline).
    The Python loop reads without it.

    The native reader shares the bytes among up to ``threads`` threads (this one and the native pool's,
    started once per process), none given less than :data:`SHARE_BYTES`; the Python loop reads them on
    this thread.

    Raises:
        OSError: a read failed, or the file ended early; the message names the file.
        ValueError: a read would land outside the ``nbytes`` at ``addr`` (a planning bug).
    """
    if len(sizes) == 0:
        return
    read = (files, offsets, sizes, dst, addr, nbytes)
    if _NATIVE is None:
        _check_inside(dst, sizes, nbytes, "pread_many")
        _python_loop(fds, paths, *read)
        return
    packed = _pack(fds, [read], "pread_many")
    status = (ctypes.c_int64 * 2)()
    bad = _NATIVE(*packed.args(), ctypes.addressof(status), int(ahead), threads, SHARE_BYTES)
    if bad >= 0:
        raise packed.error(paths, bad, status)


#: One field's reads: ``(files, offsets, sizes, dst, addr, nbytes)`` as :func:`pread_many` takes them, each
#: column a list (``Layout.reads`` of one run) or a numpy array.
FieldReads = tuple[int | list[int] | np.ndarray, list[int] | np.ndarray, list[int] | np.ndarray,
                   list[int] | np.ndarray, int, int]


class PendingReads:
    """Reads in flight on the native reader's threads (:func:`submit`), waited for as a Future is:
    ``result(timeout)`` returns once every byte is in place, the GIL released meanwhile, or raises the
    OSError of the first read that failed (naming its file), or ``TimeoutError`` when not done by then.

    Invariants: the reads are waited for before this object goes (``__del__``), and it keeps the memory
    they land in (``keep``), so no thread writes into memory its owner let go. The native ticket is freed
    only after a wait returned and this object forgot it: an interrupt between the two leaks it, never
    frees it twice.
    """

    def __init__(self, ticket: int, paths: Sequence[str], packed: _Packed, keep: object,
                 check: Callable[[], None] | None = None) -> None:
        self._ticket: int | None = ticket
        self._check = check
        self._where = (paths, packed)
        self._keep = keep
        # Made now, its address too: __del__ may run at interpreter exit, when nothing can be imported.
        self._status = (ctypes.c_int64 * 2)()
        self._status_at = ctypes.addressof(self._status)
        self._error: OSError | None = None

    def result(self, timeout: float | None = None) -> None:
        if self._ticket is not None:
            wait_us = -1 if timeout is None else max(0, int(timeout * 1e6))
            bad = _WAIT(self._ticket, self._status_at, wait_us)  # (the same again if called again)
            if bad == -3:
                raise FutureTimeout
            if bad >= 0:
                paths, packed = self._where
                self._error = packed.error(paths, bad, self._status)
            elif bad == -4:
                self._error = OSError("these reads were started by the process this one was forked from")
            ticket, self._ticket, self._keep = self._ticket, None, None
            _FREE(ticket)
            self._after()
        if self._error is not None:
            raise self._error

    def _after(self) -> None:
        """Run the source's check of its files once the reads are done: a file that changed meanwhile is
        the error (the read's own error, if any, its context)."""
        check, self._check = self._check, None
        if check is None:
            return
        try:
            check()
        except OSError as exc:
            exc.__context__ = self._error
            self._error = exc

    def cancel(self) -> bool:
        """Reads already queued are made: nothing to cancel (as a running Future's ``cancel``)."""
        return False

    def __del__(self) -> None:
        ticket = self._ticket
        if ticket is not None and _WAIT is not None:
            self._ticket = None
            if _WAIT(ticket, self._status_at, -1) != -4:  # a forked child's copy: not its reads
                _FREE(ticket)


def submit(fds: FileDescriptors, paths: Sequence[str], reads: Sequence[FieldReads], threads: int,
           keep: object = None, check: Callable[[], None] | None = None) -> PendingReads | None:
    """Start the reads of several ``pread_many`` calls (one per field, each into its own memory) on the
    native reader's threads, up to ``threads`` of them, and return at once; None without the native reader.
    ``keep``: what holds the memory the reads land in, kept until they are done; ``check``: called once
    they are, its OSError raised by ``result()`` (a file that changed meanwhile).

    Raises:
        ValueError: a read would land outside its memory (a planning bug).
    """
    if _SUBMIT is None or _NATIVE is None:
        return None
    packed = _pack(fds, reads, "submit")
    ticket = _SUBMIT(*packed.args(), 1, threads, SHARE_BYTES)
    if not ticket:
        return None
    return PendingReads(ticket, paths, packed, keep, check)


class _Packed(NamedTuple):
    """Reads as the library takes them: the address of each read's descriptor (int32) and of its offset,
    size and destination columns (int64, one after the other; destinations from ``base``), the objects
    that hold that memory, and each read's file, offset and size, for the error of a read that failed."""

    fd_at: int
    at: int
    n: int
    base: int
    keep: tuple[Any, Any]
    files: int | Sequence[int]
    offsets: Sequence[int]
    sizes: Sequence[int]

    def args(self) -> tuple[int, int, int, int, int, int]:
        """The arguments both library calls begin with: ``fds, offsets, sizes, base, dst, n``."""
        return self.fd_at, self.at, self.at + 8 * self.n, self.base, self.at + 16 * self.n, self.n

    def error(self, paths: Sequence[str], bad: int, status: Any) -> OSError:
        """The OSError of read ``bad``, from the library's ``status`` (errno, bytes read)."""
        f = self.files if isinstance(self.files, int) else int(self.files[bad])
        err, got = int(status[0]), int(status[1])
        return _read_error(paths[f], int(self.offsets[bad]), int(self.sizes[bad]), err, got)


def _pack(fds: FileDescriptors, reads: Sequence[FieldReads], what: str) -> _Packed:
    """Check that every read lands inside its field's memory, then pack the reads of every field into one
    set of columns. The few reads of one run (a sequential batch: a read a field) go from lists into ctypes
    arrays: numpy's cost per call would be most of such a batch's. The library copies the columns before
    the call returns."""
    for _, _, sizes, dst, _, nbytes in reads:
        _check_inside(dst, sizes, nbytes, what)
    base = min((r[4] for r in reads), default=0)
    if all(isinstance(r[1], list) for r in reads):
        files = [int(f) for r in reads for f in (r[0] if isinstance(r[0], list) else [r[0]] * len(r[2]))]
        offsets = [o for r in reads for o in r[1]]
        sizes = [k for r in reads for k in r[2]]
        n = len(sizes)
        cols = (ctypes.c_int64 * (3 * n))(*offsets, *sizes, *(d + r[4] - base for r in reads for d in r[3]))
        fd = {f: fds.get(f) for f in set(files)}  # (one run of a chunked dataset is a read per chunk)
        fd_of = (ctypes.c_int32 * n)(*(fd[f] for f in files))
        keep: tuple[Any, Any] = (fd_of, cols)
        return _Packed(ctypes.addressof(fd_of), ctypes.addressof(cols), n, base, keep, files, offsets, sizes)
    reads = [(int(r[0]) if isinstance(r[0], (int, np.integer)) else np.asarray(r[0], np.int64),
              *(np.asarray(c, np.int64) for c in r[1:4]), r[4], r[5]) for r in reads]
    parts = [r[1] for r in reads] + [r[2] for r in reads] + [r[3] + (r[4] - base) for r in reads]
    cols_a = np.concatenate(parts).astype(np.int64, copy=False)
    n = len(cols_a) // 3
    named = {r[0] for r in reads if isinstance(r[0], int)}
    if len(named) == 1 and all(isinstance(r[0], int) for r in reads):  # the usual case: one file
        file_of: int | np.ndarray = named.pop()
    else:
        file_of = np.concatenate([np.full(len(r[2]), r[0], np.int64) if isinstance(r[0], int) else r[0]
                                  for r in reads])
    fd_arr = _fd_per_read(fds, file_of, n)
    return _Packed(fd_arr.ctypes.data, cols_a.ctypes.data, n, base, (fd_arr, cols_a), file_of, cols_a[:n],
                   cols_a[n : 2 * n])


def _check_inside(dst: Sequence[int], sizes: Sequence[int], nbytes: int, what: str) -> None:
    """A ValueError where a read would land outside the ``nbytes`` of its memory (a planning bug)."""
    if len(sizes) == 1:  # a single read: plain ints, without numpy's cost per call
        d, k = int(dst[0]), int(sizes[0])
        bad = d < 0 or k < 0 or d + k > nbytes
    else:
        d, k = np.asarray(dst), np.asarray(sizes)
        bad = len(k) > 0 and (int(d.min()) < 0 or int(k.min()) < 0 or int((d + k).max()) > nbytes)
    if bad:
        raise ValueError(f"{what}: reads outside the {nbytes}-byte buffer")


def _fd_per_read(fds: FileDescriptors, files: int | np.ndarray, n: int) -> np.ndarray:
    if isinstance(files, int):
        return np.full(n, fds.get(files), dtype=np.int32)
    table = np.full(int(files.max()) + 1, -1, dtype=np.int32)
    for f in np.unique(files).tolist():
        table[f] = fds.get(f)
    return table[files]


def _read_error(path: str, offset: int, want: int, err: int, got: int) -> OSError:
    """The OSError ``pread_exact`` raises for the same failure (OSError picks the errno's subclass)."""
    if err:
        return OSError(err, f"{os.strerror(err)} (reading {want} bytes at offset {offset})", path)
    return OSError(short_read_message(path, offset, want, got))


def _python_loop(
    fds: FileDescriptors, paths: Sequence[str], files: Any, offsets: Any, sizes: Any, dst: Any, addr: int,
    nbytes: int,
) -> None:
    mv = memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")
    per_file = [int(files)] * len(sizes) if isinstance(files, (int, np.integer)) else _ints(files)
    for f, fo, nb, oo in zip(per_file, _ints(offsets), _ints(sizes), _ints(dst), strict=True):
        pread_exact(fds.get(f), mv[oo : oo + nb], fo, paths[f])


def _ints(column: Any) -> list[int]:
    return column.tolist() if isinstance(column, np.ndarray) else list(column)
