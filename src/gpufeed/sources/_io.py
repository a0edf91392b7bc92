"""Private plumbing shared by the sources: dtypes, row and ``out`` checks, per-process file handles, pread."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

import numpy as np
import torch

from ._layout import Layout, Runs, row_array
from .base import Field, Rows

PathLike = str | os.PathLike


def torch_dtype(dtype: Any, where: str) -> torch.dtype:
    """Map a numpy-style or torch dtype to the torch dtype of the samples, or say why it cannot be read."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"{where}: {dtype!r} is not a dtype; pass e.g. 'float32' or torch.uint8") from exc
    if dt.hasobject:
        raise ValueError(
            f"{where}: dtype {dt} holds Python objects (e.g. variable-length strings); gpufeed reads "
            "fixed-size numeric samples only: store numbers (e.g. encode text as uint8 token arrays)"
        )
    if dt.fields is not None or dt.subdtype is not None:
        raise ValueError(
            f"{where}: structured dtype {dt} is not supported; store each member as its own field"
        )
    if not dt.isnative and dt.itemsize > 1:
        raise ValueError(
            f"{where}: dtype {dt.str} is not in this machine's byte order; rewrite the data with "
            f"arr.astype('{dt.newbyteorder('=').str}')"
        )
    try:
        return torch.from_numpy(np.empty(0, dt)).dtype
    except TypeError as exc:
        raise ValueError(
            f"{where}: dtype {dt} has no torch equivalent; store the samples as a numeric dtype"
        ) from exc


def sample_shape(shape: Any, where: str) -> tuple[int, ...]:
    """Normalize a per-sample shape (``None``, an int or a sequence of ints >= 0)."""
    if shape is None:
        return ()
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError as exc:
        raise ValueError(f"{where}: shape must be an int or a tuple of ints, got {shape!r}") from exc
    if any(d < 0 for d in dims):
        raise ValueError(f"{where}: shape must not have negative sizes, got {dims}")
    return dims


def check_rows(rows: Rows, num_samples: int, where: str) -> Runs:
    """The rows to read, checked; IndexError for rows out of range."""
    if type(rows) is range and rows.step == 1:  # the prefetcher's usual case: no numpy on this path
        a, b = rows.start, rows.stop
        if b <= a:
            return Runs.single(0, 0)
        if a < 0 or b > num_samples:
            _out_of_range(a if a < 0 else b - 1, num_samples, where)
        return Runs.single(a, b)
    arr = row_array(rows, where)
    if arr.size == 0:
        return Runs.single(0, 0)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_samples:
        _out_of_range(lo if lo < 0 else hi, num_samples, where)
    return Runs(arr)


def _out_of_range(row: int, num_samples: int, where: str) -> None:
    raise IndexError(
        f"{where}: row {row} is out of range for {num_samples} samples (valid: 0..{num_samples - 1})"
    )


def out_tensor(
    field: Field, out: Mapping[str, torch.Tensor], n: int, device_type: str, where: str
) -> torch.Tensor:
    """``out[field.name]``, after checking it can take ``n`` rows of the field (cheap: runs per read)."""
    name = field.name
    try:
        t = out[name]
    except (KeyError, TypeError, IndexError):
        t = None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: out has no tensor for field '{name}'; pass one tensor per field in out")
    if t.dtype is not field.dtype:
        raise ValueError(f"{where}: out['{name}'] has dtype {t.dtype}, the field holds {field.dtype}")
    shape = t.shape
    if len(shape) != len(field.shape) + 1 or shape[1:] != field.shape:
        raise ValueError(f"{where}: out['{name}'] has shape {tuple(shape)}, expected (rows, *{field.shape})")
    if shape[0] < n:
        raise ValueError(
            f"{where}: out['{name}'] has room for {shape[0]} rows but {n} rows were asked; "
            f"pass a tensor of at least {n} rows"
        )
    if t.device.type != device_type:
        raise ValueError(
            f"{where}: out['{name}'] is on {t.device}, this source writes to {device_type} memory"
        )
    if not t.is_contiguous():
        raise ValueError(f"{where}: out['{name}'] must be C-contiguous; pass a contiguous tensor")
    return t


def check_outs(
    fields: Mapping[str, Field], out: Mapping[str, torch.Tensor], n: int, device_type: str, where: str
) -> dict[str, torch.Tensor]:
    """``out_tensor`` for every field, all checked before any byte is read."""
    return {name: out_tensor(f, out, n, device_type, where) for name, f in fields.items()}


def host_bytes(t: torch.Tensor, nbytes: int) -> memoryview:
    """A writable byte view of the first ``nbytes`` of a contiguous host tensor (valid while ``t`` lives).

    Built from the data pointer: about 1 us, against several for slicing, reshaping, viewing as uint8
    and converting to numpy, and it works for dtypes numpy lacks (bfloat16, float8).
    """
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def device_bytes(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of a contiguous tensor as a flat uint8 tensor (for kvikio device reads)."""
    return t.reshape(-1).view(torch.uint8)[:nbytes]


def pread_exact(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Fill ``buf`` from ``offset`` of the file; a read that ends early raises OSError."""
    want = len(buf)
    done = 0
    while done < want:
        try:
            got = os.preadv(fd, [buf[done:]], offset + done)
        except OSError as exc:  # the OS names no file: name it (e.g. a file replaced by a directory)
            raise type(exc)(exc.errno, f"{exc.strerror} (reading {want} bytes at offset {offset})",
                            path) from exc
        if got <= 0:
            raise OSError(short_read_message(path, offset, want, done))
        done += got


def short_read_message(path: str, offset: int, want: int, got: int) -> str:
    return (
        f"short read from {path}: expected {want} bytes at offset {offset}, got {got}; the file is "
        "shorter than when the source was opened (truncated or rewritten?): recreate the source"
    )


def as_paths(paths: PathLike | Sequence[PathLike], what: str) -> list[str]:
    """One path or a non-empty sequence of paths, as strings."""
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    try:
        out = [os.fspath(p) for p in paths]
    except TypeError as exc:
        raise ValueError(f"{what}: expected a path or a list of paths, got {paths!r}") from exc
    if not out:
        raise ValueError(f"{what}: got an empty list of paths; pass at least one file")
    return out


def check_file(path: str, what: str) -> int:
    """Size of the regular file at ``path``; FileNotFoundError naming it when it is missing."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: no such file: {path}") from None
    if not os.path.isfile(path):
        raise ValueError(f"{what}: {path} is not a regular file")
    return st.st_size


_LIVE: weakref.WeakSet[_PerProcess] = weakref.WeakSet()
# Handles a forked child inherited; kept referenced, never closed there: closing an h5py file in the child
# could touch HDF5 state that a thread of the parent held at the fork.
_INHERITED: list[Any] = []


class _PerProcess:
    """A lazily filled, per-process list of open handles, one per path, safe to use from many threads.

    Invariant: ``_handles`` belongs to process ``_pid``. A forked child starts with an empty list (fork
    hook, and a pid check as a backstop) and opens its own handles; pickling carries only the paths.
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
        return {"paths": self.paths}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.paths = state["paths"]
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


class FileDescriptors(_PerProcess):
    """Read-only OS file descriptors, for ``os.preadv`` (positional, so one fd serves every thread)."""

    def _open(self, path: str) -> int:
        try:
            return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise OSError(exc.errno, f"cannot open {path}: too many open files (this process keeps one "
                              "descriptor per source file); raise the limit (ulimit -n, or "
                              "resource.setrlimit(RLIMIT_NOFILE)) or concatenate the files "
                              "(gpufeed convert)") from exc
            raise

    def _close(self, handle: int) -> None:
        os.close(handle)

    def _after_fork(self) -> None:
        # The child's copies of the parent's fds are its own: closing them does not touch the parent's.
        handles = self._handles
        self._reset()
        for fd in handles:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


class FileMaps(_PerProcess):
    """Read-only memory maps of whole files, opened lazily per process, for gathering scattered rows."""

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
        self._rows: dict[int, torch.Tensor] = {}

    def rows(self, row_nbytes: int) -> torch.Tensor:
        """A view whose row ``j`` is bytes ``j .. j + row_nbytes`` of the file (rows overlap)."""
        view = self._rows.get(row_nbytes)
        if view is None:
            n = self.flat.numel() - row_nbytes + 1
            view = self._rows[row_nbytes] = self.flat.as_strided((n, row_nbytes), (1, 1))
        return view


def gather_rows(
    maps: FileMaps, files: int | np.ndarray, offsets: np.ndarray, row_nbytes: int, out: torch.Tensor
) -> None:
    """Copy the ``row_nbytes`` at ``offsets[i]`` of file ``files[i]`` (or of file ``files``) into ``out[i]``.

    ``out`` is an ``(n, row_nbytes)`` uint8 tensor. One ``index_select`` per file: the copy runs in C with
    the GIL released, and few torch calls are made (each one hands the GIL over, which costs a lot when
    many reader threads want it).
    """
    if not isinstance(files, np.ndarray):
        _gather_file(maps, files, offsets, row_nbytes, out)
        return
    for f in np.unique(files).tolist():
        pos = np.flatnonzero(files == f)
        part = torch.empty((len(pos), row_nbytes), dtype=torch.uint8)
        _gather_file(maps, f, offsets[pos], row_nbytes, part)
        out.index_copy_(0, torch.from_numpy(pos), part)


def _gather_file(maps: FileMaps, i: int, offsets: np.ndarray, row_nbytes: int, out: torch.Tensor) -> None:
    m = maps.get(i)
    last = int(offsets.max())
    # Check against the file as it is now: touching a mapped page past its end kills the process (SIGBUS).
    size = min(m.mmap.size(), m.flat.numel()) if m is not None else 0
    if last + row_nbytes > size:
        raise OSError(short_read_message(maps.paths[i], last, row_nbytes, max(0, size - last)))
    torch.index_select(m.rows(row_nbytes), 0, torch.from_numpy(offsets), out=out)


def read_by_offset(
    layout: Layout, runs: Runs, t: torch.Tensor, fds: FileDescriptors, maps: FileMaps, paths: Sequence[str]
) -> None:
    """Read ``runs`` of an all-by-offset layout into host tensor ``t``: a memory-map gather for scattered
    rows (see ``Runs.scattered``), else one ``os.preadv`` per run (straight into ``t``'s memory)."""
    rn = layout.row_nbytes
    if runs.scattered(rn):
        gather_rows(maps, *layout.row_offsets(runs.rows), rn, rows_bytes(t, runs.n, rn))
        return
    mv = host_bytes(t, runs.n * rn)
    for f, fo, nb, oo in zip(*layout.byte_reads(runs), strict=True):
        pread_exact(fds.get(f), mv[oo : oo + nb], fo, paths[f])


def rows_bytes(t: torch.Tensor, n: int, row_nbytes: int) -> torch.Tensor:
    """The first ``n`` rows of a host tensor as an ``(n, row_nbytes)`` uint8 tensor (no torch op)."""
    raw = np.frombuffer(host_bytes(t, n * row_nbytes), dtype=np.uint8).reshape(n, row_nbytes)
    return torch.from_numpy(raw)


def _reset_in_child() -> None:
    for obj in list(_LIVE):
        obj._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


class HostFileSource:
    """What RawSource and H5Source share: their fields, files and length, positional reads into host
    memory, ``close`` and the context manager."""

    _fields: dict[str, Field]
    _layouts: dict[str, Layout]
    _paths: list[str]
    _len: int
    _where: str
    _fds: FileDescriptors
    _maps: FileMaps

    def read(self, rows: Rows, out: Mapping[str, torch.Tensor]) -> None:
        """Write ``rows`` of every field into ``out[name][: len(rows)]``, in the order of ``rows``.

        Raises:
            IndexError: a row is outside ``[0, len(self))``.
            ValueError: an ``out`` tensor is missing, too small, of the wrong dtype/shape or not on the host.
            OSError: a file ended early (changed after the source was opened), or a read failed; the
                message names the file.
        """
        runs = check_rows(rows, self._len, self._where)
        bufs = check_outs(self._fields, out, runs.n, "cpu", self._where)
        if runs.n == 0:
            return
        for name, layout in self._layouts.items():
            self._read_field(layout, runs, bufs[name])

    def _read_field(self, layout: Layout, runs: Runs, t: torch.Tensor) -> None:
        read_by_offset(layout, runs, t, self._fds, self._maps, self._paths)

    def close(self) -> None:
        """Close this process's file descriptors and maps (a later ``read`` reopens them). Idempotent."""
        self._fds.close()
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
    def reads_to(self) -> Literal["host"]:
        """Always ``"host"``: reads land in host memory (pinned, when the prefetcher owns it)."""
        return "host"

    @property
    def files(self) -> tuple[str, ...]:
        """The files the source reads, in sample order."""
        return tuple(self._paths)

    def __len__(self) -> int:
        return self._len
