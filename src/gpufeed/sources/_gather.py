"""The memory-map gather: scattered rows copied out of a mapping of each file in one call.

For rows in the page cache, one copy per batch that releases the GIL beats one positional read per row;
for a cold file it loses, since its rows fault in one page at a time where positional reads have all of a
batch's reads in flight. So by default (``mmap_gather=None``) a batch is gathered only where a sample of
its rows lies in the page cache (``gpufeed_resident``, ``mincore``), and only with the native library.

A file cut while it is mapped raises SIGBUS when a page past its new end is touched. The native gather
(``gpufeed_gather`` in ``_pread_many.c``) catches it in the thread that gathers and raises an OSError
naming the file, as a positional read does; without the native library the rows are copied with one
``index_select``, and such a file kills the process: there only ``mmap_gather=True`` maps files.
"""

from __future__ import annotations

import mmap
import os
import warnings

import numpy as np
import torch

from ._files import short_read_message
from ._per_process import _PerProcess
from ._pread import GATHER, RESIDENT, SHARE_BYTES

#: Rows of a batch whose first page is looked up before gathering it (a ``mincore`` call, about 1 us, each).
RESIDENT_SAMPLE = 8


def file_maps(paths: list[str], mmap_gather: bool | None) -> FileMaps | None:
    """The memory maps a source gathers from, per its ``mmap_gather`` setting: ``True`` always gathers
    scattered rows, ``None`` gathers those in the page cache where the native gather is built, ``False``
    (or ``None`` without the native library) maps no file."""
    if mmap_gather is False or (mmap_gather is None and GATHER is None):
        return None
    return FileMaps(paths, always=mmap_gather is True)


class NotGathered(Exception):
    """A read the default gather leaves to positional reads after all: the native gather could not set its
    SIGBUS handler."""


class FileMaps(_PerProcess):
    """Read-only memory maps of whole files, opened lazily per process, for gathering scattered rows.

    ``always``: gather every scattered read; else only those :meth:`worth_gathering` finds resident, and
    only with the native gather, so that no default read can end in SIGBUS or fail where a positional
    read would not (a file that cannot be mapped is read by position).
    """

    always = True  # (a source pickled before the default gather existed mapped files only when asked to)

    def __init__(self, paths: list[str], always: bool = True) -> None:
        super().__init__(paths)
        self.always = always

    def worth_gathering(self, files: int | np.ndarray, offsets: np.ndarray, row_nbytes: int) -> bool:
        """Whether to gather these rows: always, or where the native gather is loaded, every file of the
        read can be mapped, and the page cache holds a page of each of a sample of :data:`RESIDENT_SAMPLE`
        to twice as many of the rows, spread over the read (nothing is faulted in to find out)."""
        if self.always:
            return True
        if RESIDENT is None:  # unpickled in a process without the native library
            return False
        step = max(1, len(offsets) // RESIDENT_SAMPLE)
        sample = offsets[::step]
        if not isinstance(files, np.ndarray):
            return self._resident(files, sample, row_nbytes)
        sampled = files[::step]
        return all(self._resident(f, sample[sampled == f], row_nbytes) for f in np.unique(files).tolist())

    def _resident(self, i: int, offsets: np.ndarray, row_nbytes: int) -> bool:
        """Whether file ``i`` can be mapped and the page cache holds the first page of each of ``offsets``."""
        try:
            m = self.get(i)
        except OSError:  # cannot be mapped (address space, descriptors): read by position
            return False
        if m is None:  # an empty file: no row of the read lies in it
            return False
        if not len(offsets):  # none of the sampled rows lies in it
            return True
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        return bool(RESIDENT(m.addr, m.flat.numel(), offsets.ctypes.data, len(offsets), row_nbytes))

    def _open(self, path: str) -> _Map | None:
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size == 0:
                return None
            return _Map(mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ))

    def _close(self, handle: _Map | None) -> None:
        pass  # the mapping goes with the last tensor over it


class _Map:
    """One file's mapping as a flat uint8 tensor, and "row" views of it per row size (built once)."""

    def __init__(self, m: mmap.mmap) -> None:
        self.mmap = m
        with warnings.catch_warnings():  # a read-only buffer: the tensor is only ever read
            warnings.simplefilter("ignore", UserWarning)
            self.flat = torch.frombuffer(m, dtype=torch.uint8)
        self.addr = self.flat.data_ptr()
        self._rows: dict[int, torch.Tensor] = {}

    def rows(self, row_nbytes: int) -> torch.Tensor:
        """A view whose row ``j`` is bytes ``j .. j + row_nbytes`` of the file (rows overlap)."""
        view = self._rows.get(row_nbytes)
        if view is None:
            n = self.flat.numel() - row_nbytes + 1
            view = self._rows[row_nbytes] = self.flat.as_strided((n, row_nbytes), (1, 1))
        return view


def gather_rows(
    maps: FileMaps, files: int | np.ndarray, offsets: np.ndarray, row_nbytes: int, out: torch.Tensor,
    threads: int = 1,
) -> None:
    """Copy the ``row_nbytes`` at ``offsets[i]`` of file ``files[i]`` (or of file ``files``) into ``out[i]``.

    ``out`` is an ``(n, row_nbytes)`` uint8 tensor. One ``index_select`` per file: the copy runs in C with
    the GIL released, and few torch calls are made (each one hands the GIL over, which costs a lot when
    many reader threads want it). The native gather shares the rows among up to ``threads`` threads.
    """
    if not isinstance(files, np.ndarray):
        _gather_file(maps, files, offsets, row_nbytes, out, threads)
        return
    for f in np.unique(files).tolist():
        pos = np.flatnonzero(files == f)
        part = torch.empty((len(pos), row_nbytes), dtype=torch.uint8)
        _gather_file(maps, f, offsets[pos], row_nbytes, part, threads)
        out.index_copy_(0, torch.from_numpy(pos), part)


def _gather_file(maps: FileMaps, i: int, offsets: np.ndarray, row_nbytes: int, out: torch.Tensor,
                 threads: int) -> None:
    m = maps.get(i)
    last = int(offsets.max())
    # Check against the file as it is now: touching a mapped page past its end kills the process (SIGBUS).
    size = min(m.mmap.size(), m.flat.numel()) if m is not None else 0
    if last + row_nbytes > size:
        raise OSError(short_read_message(maps.paths[i], last, row_nbytes, max(0, size - last)))
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    bad = -2  # -2: not gathered natively (no library, a strided ``out``, or no SIGBUS handler)
    if GATHER is not None and out.is_contiguous():
        bad = GATHER(m.addr, offsets.ctypes.data, len(offsets), row_nbytes, out.data_ptr(), threads,
                     SHARE_BYTES)
    if bad == -2 and not maps.always:  # no SIGBUS handler: the default reads these rows by position
        raise NotGathered(maps.paths[i])
    if bad == -2:
        torch.index_select(m.rows(row_nbytes), 0, torch.from_numpy(offsets), out=out)
    elif bad >= 0:  # the file was cut while the rows were copied
        path, at = maps.paths[i], int(offsets[bad])
        raise OSError(short_read_message(path, at, row_nbytes, min(row_nbytes, max(0, _size_now(path) - at))))


def _size_now(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
