"""The JSON manifest that ``convert_h5_to_raw`` writes and ``RawSource`` reads: format and validation."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._files import io_error

FORMAT = "gpufeed.raw"
#: 2: a checksum of the manifest, files named by generation (``x.gen-<id>.bin``), metadata.
VERSION = 2
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
    """Read and check a manifest: its checksum (no edit since gpufeed wrote it), every field's count against
    the manifest's, and every data file's exact size against its samples (and alignment padding).

    Raises:
        FileNotFoundError: no manifest at ``path``.
        ValueError: the manifest is malformed, was edited, or does not match its data files (names the
            file and the fix).
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
        count, align = int(doc["num_samples"]), int(doc["align"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{p} is not a valid gpufeed manifest ({exc}); {FIX}") from exc
    if doc.get("checksum") != checksum(doc):
        raise ValueError(f"{p} was edited after gpufeed convert wrote it (its checksum does not match its "
                         f"contents), so its dtypes, shapes and counts cannot be trusted; {FIX}")
    if not fields:
        raise ValueError(f"{p} lists no fields; {FIX}")
    for f in fields:
        _check_file(p, f, count, align)
    return doc, fields


def checksum(doc: dict[str, Any]) -> str:
    """SHA-256 of the manifest's contents but its checksum, in one canonical JSON form."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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


def _check_file(manifest: Path, f: ManifestField, count: int, align: int) -> None:
    if f.num_samples != count:
        raise ValueError(f"{manifest}: field '{f.name}' has {f.num_samples} samples, the manifest "
                         f"{count}; {FIX}")
    try:
        size = os.stat(f.path).st_size
    except FileNotFoundError:
        raise ValueError(f"{manifest}: data file {f.path} of field '{f.name}' is missing; {FIX}") from None
    row = f.dtype.itemsize * int(np.prod(f.shape, dtype=np.int64))
    want = f.data_end + (-f.data_end % max(align, 1))  # the samples, zero-padded to the alignment
    if size != f.file_size or size != want:
        raise ValueError(
            f"{manifest}: data file {f.path} of field '{f.name}' is {size} bytes, the manifest says "
            f"{f.file_size}, and its {f.num_samples} samples of {row} bytes from offset {f.offset} (aligned "
            f"to {align}) need {want}; {FIX}"
        )


def write_temp(path: Path, doc: dict[str, Any], tag: str) -> Path:
    """Write ``doc`` with its checksum, synced, to a temporary file beside ``path`` named with ``tag``;
    returns it (``os.replace`` it into place). A write that fails removes the temporary and raises an
    OSError naming it and the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{tag}")
    try:
        with open(tmp, "w") as fh:
            json.dump({**doc, "checksum": checksum(doc)}, fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise io_error(exc, f"writing the manifest {tmp} in {path.parent}; free space there or choose "
                       "another folder", str(tmp)) from exc
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
