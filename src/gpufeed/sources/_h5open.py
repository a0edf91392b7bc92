"""Opening an HDF5 file read-only so that it never shows an older version of itself.

HDF5 keeps one open file per inode in a process: a second ``h5py.File`` of a path another handle still
holds open shares that handle's cached metadata. A file rewritten in place since then (same inode) is
read through its old layout: a dataset's old byte offset, now another dataset's bytes. So each open
checks whether HDF5 shares it, and with what: shared with a handle gpufeed opened on this very version of
the file (same identity), it is kept; shared with anything else (another version, or a handle opened
outside gpufeed, whose version is unknown), the file is opened again through a Python file object,
which HDF5 never shares, so its metadata is read from the file as it is now.
"""

from __future__ import annotations

import io
from typing import Any

from ._identity import Identity

#: Per (device, inode): the file's identity when HDF5 last opened it fresh in this process through here.
_FRESH: dict[tuple[int, int], Identity] = {}


class H5Handle:
    """An open ``h5py.File`` and, when it had to be opened unshared, the Python file object beneath it."""

    def __init__(self, file: Any, fileobj: io.BufferedReader | None = None) -> None:
        self.file, self.fileobj = file, fileobj

    def close(self) -> None:
        try:
            self.file.close()
        finally:
            if self.fileobj is not None:
                self.fileobj.close()

    def __enter__(self) -> Any:
        return self.file

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_h5(h5py: Any, path: str, **kwargs: Any) -> H5Handle:
    """``h5py.File(path, "r", **kwargs)``, fresh: never sharing another handle's view of an older version.

    Raises:
        OSError: h5py cannot open it (not HDF5, missing, unreadable).
    """
    ident = Identity.of_path(path)
    f = h5py.File(path, "r", **kwargs)
    key = (ident.dev, ident.ino)
    if h5py.h5f.get_obj_count(f.id, h5py.h5f.OBJ_FILE) == 1:  # no other handle: HDF5 read it just now
        _FRESH[key] = ident
        return H5Handle(f)
    if _FRESH.get(key) == ident:
        return H5Handle(f)
    f.close()
    fileobj = open(path, "rb")  # noqa: SIM115 (closed by H5Handle.close)
    try:
        return H5Handle(h5py.File(fileobj, "r", **kwargs), fileobj)
    except BaseException:
        fileobj.close()
        raise
