"""A file's identity (device, inode, size, mtime), recorded when a source is made and checked on each read:
a file rewritten or replaced under a source raises ``FileChangedError`` instead of giving bytes read
through a layout the file no longer has."""

from __future__ import annotations

import os
from typing import NamedTuple


class FileChangedError(OSError):
    """A file changed (rewritten, truncated, replaced) after the source reading it was made; the message
    names the file (also as ``filename``) and says to recreate the source."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.filename = path

    def __str__(self) -> str:
        return str(self.args[0])


class Identity(NamedTuple):
    """What ``os.stat`` says of a file that changes when its contents do (to the file system's timestamp
    granularity: a rewrite of the same size within one tick of the previous write is not seen)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Identity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    @classmethod
    def of_path(cls, path: str) -> Identity:
        return cls.of(os.stat(path))


def check(path: str, want: Identity, got: Identity, where: str) -> None:
    """Raise FileChangedError naming ``path`` when ``got`` is not ``want``."""
    if got != want:
        raise FileChangedError(changed_message(path, want, got, where), path)


def changed_message(path: str, want: Identity, got: Identity, where: str) -> str:
    if (got.dev, got.ino) != (want.dev, want.ino):
        how = "another file now has its name (replaced)"
    elif got.size != want.size:
        how = f"its size went from {want.size} to {got.size} bytes (truncated or rewritten)"
    else:
        how = "its mtime changed (rewritten in place: its data may have moved)"
    return (f"{where}: {path} changed after the source was made: {how}; gpufeed never reads a changed "
            "file through its old layout: recreate the source (and re-run gpufeed convert if it came from "
            "one)")
