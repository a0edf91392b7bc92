"""Private plumbing shared by the sources: dtypes, row and ``out`` checks, per-process file handles, pread."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ._layout import Runs
from .base import Field, Rows
from .sampling import _runs

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
    """The runs of consecutive rows in ``rows``, in order; IndexError for rows out of range."""
    starts, stops = _runs(rows)
    runs = Runs(starts, stops)
    if runs.n:
        lo, hi = int(starts.min()), int(stops.max())
        if lo < 0 or hi > num_samples:
            bad = lo if lo < 0 else hi - 1
            raise IndexError(
                f"{where}: row {bad} is out of range for {num_samples} samples (valid: 0..{num_samples - 1})"
            )
    return runs


def out_bytes(
    field: Field, out: Mapping[str, torch.Tensor], n: int, device_type: str, where: str
) -> torch.Tensor:
    """The first ``n`` rows of ``out[field.name]`` as a flat uint8 tensor, after checking the tensor fits."""
    name = field.name
    t = out.get(name) if isinstance(out, Mapping) else None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: out has no tensor for field '{name}'; pass one tensor per field in out")
    if t.dtype != field.dtype:
        raise ValueError(f"{where}: out['{name}'] has dtype {t.dtype}, the field holds {field.dtype}")
    if tuple(t.shape[1:]) != field.shape or t.dim() == 0:
        raise ValueError(
            f"{where}: out['{name}'] has shape {tuple(t.shape)}, expected (rows, *{field.shape})"
        )
    if t.shape[0] < n:
        raise ValueError(
            f"{where}: out['{name}'] has room for {t.shape[0]} rows but {n} rows were asked; "
            f"pass a tensor of at least {n} rows"
        )
    if t.device.type != device_type:
        raise ValueError(
            f"{where}: out['{name}'] is on {t.device}, this source writes to {device_type} memory"
        )
    t = t[:n]
    if not t.is_contiguous():
        raise ValueError(f"{where}: out['{name}'] must be C-contiguous; pass a contiguous tensor")
    return t.reshape(-1).view(torch.uint8)


def check_outs(
    fields: Mapping[str, Field], out: Mapping[str, torch.Tensor], n: int, device_type: str, where: str
) -> dict[str, torch.Tensor]:
    """``out_bytes`` for every field, all checked before any byte is read."""
    return {name: out_bytes(f, out, n, device_type, where) for name, f in fields.items()}


def pread_exact(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Fill ``buf`` from ``offset`` of the file; a read that ends early raises OSError."""
    want = len(buf)
    done = 0
    while done < want:
        got = os.preadv(fd, [buf[done:]], offset + done)
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
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

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


def _reset_in_child() -> None:
    for obj in list(_LIVE):
        obj._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
