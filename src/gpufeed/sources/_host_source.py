"""FileSource: what every file source shares; HostFileSource: reading rows by byte offset into host memory."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

import torch
from torch.utils.data import get_worker_info

from ._files import FileDescriptors, source_label
from ._gather import FileMaps, NotGathered, file_maps, gather_rows
from ._identity import Identity
from ._layout import Layout
from ._out_tensors import check_outs, rows_bytes
from ._pread import PendingReads, backend, pread_many, submit
from ._runs import Runs, check_rows
from .base import Field, Rows


class FileSource:
    """What every file source (RawSource, H5Source, GDSSource) shares: its fields, files and length, the
    memory-map gather, ``close`` of its descriptors and maps, and the context manager.

    Invariant: ``_maps`` is ``None`` when the source was made with ``mmap_gather=False``, or with the default
    ``None`` where the native gather is not built (``_gather.file_maps``): then no read touches a memory
    map, and no file cut under a read can raise SIGBUS.
    """

    _fields: dict[str, Field]
    _layouts: dict[str, Layout]
    _paths: list[str]
    _len: int
    _where: str
    _fds: FileDescriptors
    _maps: FileMaps | None
    _mmap_gather: bool | None = None  # (a source pickled before the setting existed has none)

    @property
    def mmap_gather(self) -> bool | None:
        """The ``mmap_gather`` setting: ``True``, ``False``, or ``None`` (gather batches found in the page
        cache)."""
        return self._mmap_gather

    def check_unchanged(self) -> None:
        """Raise ``FileChangedError`` (an OSError naming the file) when a file of the source changed since
        it was made: another inode at its path (replaced), or another size or mtime (rewritten in place,
        truncated). Every read checks the files it has open before and after reading, so no read returns
        bytes through a layout the file no longer has; call this to ask before an epoch.

        Raises:
            FileChangedError: a file changed; recreate the source.
            FileNotFoundError: a file not opened yet was deleted (names it).
        """
        self._fds.check_open(open_all=True)

    def _checked_read(self, read: Any) -> None:
        """``read()``, between two checks of the open files: a file that changed before or while it was
        read raises FileChangedError, also when the read itself failed because of the change."""
        # Reads through other handles (h5py's, memory maps) do not open the descriptors: check every file.
        every = self._check_all or self._maps is not None
        self._fds.check_open(open_all=every)
        try:
            read()
        except Exception:
            self._fds.check_open(open_all=True)  # a read that failed on a changed file says so
            raise
        self._fds.check_open()

    #: Open every file before each read to check it (sources whose reads go through h5py's handles).
    _check_all = False

    def close(self) -> None:
        """Close this process's file descriptors and maps (a later ``read`` reopens them). Idempotent."""
        self._fds.close()
        if self._maps is not None:
            self._maps.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def fields(self) -> Mapping[str, Field]:
        """The fields, by name."""
        return MappingProxyType(self._fields)

    @property
    def files(self) -> tuple[str, ...]:
        """The files the source reads, in sample order."""
        return tuple(self._paths)

    def __len__(self) -> int:
        return self._len


class HostFileSource(FileSource):
    """What RawSource and H5Source share beyond :class:`FileSource`: opening their files, and positional
    reads into host memory."""

    _threads: int | None = 1  # (a source pickled before the setting existed reads on one thread)

    def _open_files(self, kind: str, paths: list[str], mmap_gather: bool | None,
                    num_threads: int | None = None, idents: list[Identity] | None = None) -> None:
        """Set the files of the source: their descriptors (checked against ``idents``, each file's identity
        when the source read its layout; default: now), memory maps per ``mmap_gather``, and the threads
        a read spreads over."""
        if num_threads is not None and (type(num_threads) is not int or num_threads < 1):
            raise ValueError(f"{kind}: num_threads must be an int >= 1, got {num_threads!r}")
        self._threads = num_threads  # None: chosen per read (:attr:`num_threads`)
        self._paths = paths
        self._where = source_label(kind, paths)
        idents = [Identity.of_path(p) for p in paths] if idents is None else idents
        self._fds = FileDescriptors(paths, idents, self._where)
        self._mmap_gather = gather_flag(mmap_gather, kind)
        self._maps = file_maps(paths, self._mmap_gather)

    def read(self, rows: Rows, out: Mapping[str, torch.Tensor]) -> None:
        """Write ``rows`` of every field into ``out[name][: len(rows)]``, in the order of ``rows``.

        Raises:
            IndexError: a row is outside ``[0, len(self))``.
            ValueError: an ``out`` tensor is missing, too small, of the wrong dtype/shape or not on the host.
            FileChangedError: (an OSError) a file changed after the source was made (names it).
            OSError: a read failed; the message names the file.
        """
        runs = check_rows(rows, self._len, self._where)
        bufs = check_outs(self._fields, out, runs.n, "cpu", self._where)
        if runs.n == 0:
            return
        self._checked_read(lambda: self._read_fields(runs, bufs))

    def _read_fields(self, runs: Runs, bufs: Mapping[str, torch.Tensor]) -> None:
        for name, layout in self._layouts.items():
            self._read_field(layout, runs, bufs[name])

    def _read_field(self, layout: Layout, runs: Runs, t: torch.Tensor) -> None:
        # A source whose reads gpufeed cuts into pieces for its reader threads reads each on one thread.
        threads = self.num_threads if self.parallel_reads else 1
        read_by_offset(layout, runs, t, self._fds, self._maps, self._paths, threads)

    def submit(self, rows: Rows, out: Mapping[str, torch.Tensor]) -> PendingReads | None:
        """Start the read :meth:`read` makes on this source's native threads and return at once: its
        ``result()`` waits for it (the GIL released) and raises what ``read`` would. None where this read
        goes through ``read`` instead (scattered rows, which may be gathered from a memory map, a field
        not read by byte offset, or no native reader). The returned object holds ``out``'s memory until
        the read is done.
        """
        if not self.parallel_reads:
            return None
        runs = check_rows(rows, self._len, self._where)
        bufs = check_outs(self._fields, out, runs.n, "cpu", self._where)
        reads = []
        for name, layout in self._layouts.items():
            if self._maps is not None and runs.scattered(layout.row_nbytes):
                return None
            if runs.n:
                reads.append((*layout.reads(runs), bufs[name].data_ptr(), runs.n * layout.row_nbytes))
        self._fds.check_open()
        return submit(self._fds, self._paths, reads, self.num_threads, keep=bufs, check=self._fds.check_open)

    @property
    def num_threads(self) -> int:
        """The threads one read spreads over: ``num_threads`` of the constructor, or by default up to 8 of
        the CPUs, which a DataLoader worker shares with the other workers (``cpus // num_workers``, as torch
        gives each worker one intra-op thread): eight workers reading with eight threads each would put 64
        threads on a 16-CPU machine."""
        if self._threads is not None:
            return self._threads
        cpus = os.cpu_count() or 1
        worker = get_worker_info()
        if worker is not None:
            cpus = max(1, cpus // worker.num_workers)
        return min(8, cpus)

    @property
    def parallel_reads(self) -> bool:
        """Whether one read spreads over this source's own threads: with the native reader, when every
        field is read by byte offset. A prefetcher then gives each read a whole staging chunk, rather than
        cutting it into one read per reader thread."""
        return backend() == "native" and all(lay.by_offset for lay in self._layouts.values())

    @property
    def reads_to(self) -> Literal["host"]:
        """Always ``"host"``: reads land in host memory (pinned, when the prefetcher owns it)."""
        return "host"


def read_by_offset(
    layout: Layout, runs: Runs, t: torch.Tensor, fds: FileDescriptors, maps: FileMaps | None,
    paths: Sequence[str], threads: int = 1,
) -> None:
    """Read ``runs`` of an all-by-offset layout into host tensor ``t``: a memory-map gather where
    :func:`try_gather` takes them; else one positional read per run, straight into ``t``'s memory, all of
    them in one ``pread_many`` call that shares them among up to ``threads`` threads (the Python loop of
    ``os.preadv``, on this thread, where the native reader is not built)."""
    if not try_gather(layout, runs, t, maps, threads):
        pread_many(fds, paths, *layout.reads(runs), t.data_ptr(), runs.n * layout.row_nbytes, threads=threads)


def try_gather(layout: Layout, runs: Runs, t: torch.Tensor, maps: FileMaps | None, threads: int = 1) -> bool:
    """Gather ``runs`` into host tensor ``t`` from memory maps, where they are scattered rows (see
    ``Runs.scattered``) that ``maps`` finds worth gathering; whether it did."""
    rn = layout.row_nbytes
    if maps is None or not runs.scattered(rn):
        return False
    files, offsets = layout.row_offsets(runs.rows)
    if not maps.worth_gathering(files, offsets, rn):
        return False
    try:
        gather_rows(maps, files, offsets, rn, rows_bytes(t, runs.n, rn), threads)
    except NotGathered:
        return False
    return True


def gather_flag(mmap_gather: object, where: str) -> bool | None:
    """The ``mmap_gather`` argument, checked: ``True``, ``False`` or ``None``."""
    if mmap_gather is not None and not isinstance(mmap_gather, bool):
        raise ValueError(f"{where}: mmap_gather must be True, False or None, got {mmap_gather!r}")
    return mmap_gather
