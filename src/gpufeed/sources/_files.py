"""The files a source reads: paths checked up front, per-process descriptors, and positional reads whose
errors name the file."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from ._identity import Identity, check
from ._per_process import _PerProcess

PathLike = str | os.PathLike


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


def source_label(kind: str, paths: Sequence[str]) -> str:
    """How a source names itself in errors: its class and first file, e.g. ``RawSource(x.npy, ...)``."""
    return f"{kind}({os.path.basename(paths[0])}{', ...' if len(paths) > 1 else ''})"


class FileDescriptors(_PerProcess):
    """Read-only OS file descriptors, for ``os.preadv`` (positional, so one fd serves every thread).

    With ``idents`` (each path's identity when the source was made), a descriptor opened later (first
    read, forked child, unpickled copy) must find the same file, and :meth:`check_open` compares every open
    one with it: a source never reads a file other than the one whose layout it recorded.
    """

    idents: dict[str, Identity] | None = None  # (a source pickled before identities existed checks none)
    where = ""

    def __init__(self, paths: Sequence[str], idents: Sequence[Identity] | None = None,
                 where: str = "") -> None:
        super().__init__(paths)
        self.idents = None if idents is None else dict(zip(paths, idents, strict=True))
        self.where = where

    def check_open(self, open_all: bool = False) -> None:
        """Raise FileChangedError when a file open here (``open_all``: every file, opened now if need be)
        is no longer the one the source was made on."""
        if self.idents is None:
            return
        if open_all:
            for i in range(len(self.paths)):
                self.get(i)
        if self._pid != os.getpid():
            return
        for path, fd in zip(self.paths, self._handles, strict=True):
            if fd is not None:
                check(path, self.idents[path], Identity.of(os.fstat(fd)), self.where)

    def _open(self, path: str) -> int:
        fd = self._open_fd(path)
        if self.idents is not None:
            try:
                check(path, self.idents[path], Identity.of(os.fstat(fd)), self.where)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _open_fd(self, path: str) -> int:
        try:
            return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise OSError(exc.errno, f"cannot open {path}: too many open files (this process keeps one "
                              "or two descriptors per source file); raise the limit (ulimit -n, or "
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


def io_error(exc: OSError, what: str, path: str) -> OSError:
    """``exc`` again (same type and errno), its message saying ``what`` failed on ``path``: the OS's own
    (``[Errno 28] No space left on device``) names no file."""
    if exc.errno is None:
        return type(exc)(f"{exc}: {what}")
    return type(exc)(exc.errno, f"{exc.strerror}: {what}", path)
