"""The JSON manifest that ``convert_h5_to_raw`` writes and ``RawSource`` reads: format and validation."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "gpufeed.raw"
VERSION = 1
NAME = "manifest.json"
FIX = "re-run gpufeed convert (convert_h5_to_raw) to rewrite the files"


@dataclass(frozen=True)
class ManifestField:
    """One field of a manifest: its samples back to back in ``path`` from byte ``offset``."""

    name: str
    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    num_samples: int
    offset: int
    file_size: int

    @property
    def data_end(self) -> int:
        """The byte where its samples end (past it: padding to the alignment, if any)."""
        row = self.dtype.itemsize * int(np.prod(self.shape, dtype=np.int64))
        return self.offset + self.num_samples * row


def resolve(path: str | os.PathLike) -> Path:
    """The manifest file for ``path``: the file itself, or ``manifest.json`` inside a directory."""
    p = Path(path)
    return p / NAME if p.is_dir() else p


def load(path: str | os.PathLike) -> tuple[dict[str, Any], list[ManifestField]]:
    """Read and check a manifest: every data file exists and has the size the manifest recorded.

    Raises:
        FileNotFoundError: no manifest at ``path``.
        ValueError: the manifest is malformed or does not match its data files (names the file and the fix).
    """
    p = resolve(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"no gpufeed manifest at {p}; create one with gpufeed convert") from None
    try:
        doc = json.loads(text)
        if doc.get("format") != FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, not {FORMAT!r}")
        if doc.get("version") != VERSION:
            raise ValueError(f"version {doc.get('version')!r} is not {VERSION} (written by another gpufeed)")
        fields = [_field(p.parent, name, spec) for name, spec in doc["fields"].items()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{p} is not a valid gpufeed manifest ({exc}); {FIX}") from exc
    if not fields:
        raise ValueError(f"{p} lists no fields; {FIX}")
    for f in fields:
        _check_file(p, f)
    return doc, fields


def _field(root: Path, name: str, spec: dict[str, Any]) -> ManifestField:
    file = str(spec["file"])
    if os.path.isabs(file) or ".." in Path(file).parts:
        raise ValueError(f"field {name!r}: file {file!r} must be a plain name beside the manifest")
    return ManifestField(
        name=name,
        path=str(root / file),
        dtype=np.dtype(spec["dtype"]),
        shape=tuple(int(d) for d in spec["shape"]),
        num_samples=int(spec["num_samples"]),
        offset=int(spec["offset"]),
        file_size=int(spec["file_size"]),
    )


def _check_file(manifest: Path, f: ManifestField) -> None:
    try:
        size = os.stat(f.path).st_size
    except FileNotFoundError:
        raise ValueError(f"{manifest}: data file {f.path} of field '{f.name}' is missing; {FIX}") from None
    row = f.dtype.itemsize * int(np.prod(f.shape, dtype=np.int64))
    if size != f.file_size or size < f.data_end:
        raise ValueError(
            f"{manifest}: data file {f.path} of field '{f.name}' is {size} bytes, the manifest says "
            f"{f.file_size} ({f.num_samples} samples of {row} bytes from offset {f.offset}); {FIX}"
        )


def write_temp(path: Path, doc: dict[str, Any]) -> Path:
    """Write JSON, synced, to a temporary file beside ``path``; returns it (``os.replace`` it into place)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    return tmp


def data_end_of(path: str) -> int | None:
    """Where the data a manifest beside ``path`` records for it ends (its offset plus its samples' bytes),
    or None: a converted file is zero-padded to its alignment, and that padding is not data, whatever
    dtype and shape the file is read as."""
    beside = Path(path).with_name(NAME)
    try:
        specs = json.loads(beside.read_text())["fields"]
        name = Path(path).name
        f = next(_field(beside.parent, k, s) for k, s in specs.items() if s.get("file") == name)
        same = f.file_size == os.path.getsize(path)  # else not the file the manifest describes
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration):
        return None
    return f.data_end if same else None
