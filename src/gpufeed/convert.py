"""Convert HDF5 datasets to raw files and a JSON manifest, once: raw files are the fastest path to the GPU."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed._extras import require
from gpufeed.sources import _manifest
from gpufeed.sources.h5 import _inspect, _open, _resolve_fields

#: Rows are copied through a buffer of about this many bytes: memory stays flat whatever the file size.
CHUNK_BYTES = 64 << 20


def convert_h5_to_raw(
    h5_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    fields: Sequence[str] | Mapping[str, str] | None = None,
    align: int = 4096,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> Path:
    """Write each dataset of an HDF5 file to ``<out_dir>/<field>.bin`` and describe them in ``manifest.json``.

    The result opens with ``RawSource(manifest)`` or ``GDSSource(manifest)``. Rows stream through a
    bounded buffer (about ``chunk_bytes``), so files larger than memory convert. Data start at offset 0
    (aligned for O_DIRECT / GDS) and each file is zero-padded to a multiple of ``align``. The manifest
    records the source's path, size and mtime: a re-run with an unchanged source returns the existing
    manifest at once; a changed source (or a changed ``fields``) is converted again. The manifest is
    written last and atomically (temporary file + ``os.replace``), and the old one is removed before any
    data file is replaced, so a reader never sees a manifest that does not match its files.

    Args:
        h5_path: the HDF5 file.
        out_dir: directory for the ``.bin`` files and ``manifest.json`` (created if needed).
        fields: dataset names or ``{field name: dataset path}``, as for ``H5Source``; ``None``: every dataset.
        align: alignment in bytes of the data start and file sizes, a power of two (4096 suits GDS).
        chunk_bytes: about how many bytes to hold in memory at once.

    Returns:
        The path of ``manifest.json``.

    Raises:
        FileNotFoundError: ``h5_path`` does not exist.
        ValueError: a dataset is missing or cannot become raw samples (strings, objects, ...), or the
            fields' sample counts differ; the message names the file and the fix.

    Example:
        >>> manifest = convert_h5_to_raw("train.h5", "train.raw", ["images", "labels"])  # doctest: +SKIP
        >>> src = RawSource(manifest)                                                     # doctest: +SKIP
    """
    h5py = require("h5py", "convert_h5_to_raw")
    if not isinstance(align, int) or align < 1 or align & (align - 1):
        raise ValueError(f"align must be a power of two >= 1, got {align!r}")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be an int >= 1, got {chunk_bytes!r}")
    src = Path(h5_path).resolve()
    try:
        st = src.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"convert_h5_to_raw: no such file: {src}") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / _manifest.NAME
    source_info = {"path": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    with _open(h5py, str(src)) as f:
        names = _resolve_fields(h5py, f, fields, str(src))
        if _up_to_date(manifest, source_info, names, align):
            return manifest
        found = {
            name: _inspect(h5py, f, ds, str(src), 0, use_offsets=False, indirect_ok=True)
            for name, ds in names.items()
        }
        counts = {name: fd.rows for name, fd in found.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"convert_h5_to_raw: {src}: fields have different sample counts {counts}; every field "
                "needs one row per sample: pass fields= with datasets of equal length"
            )
        files = _file_names(names)
        if manifest.exists():
            manifest.unlink()  # never leave an old manifest beside new data files
        entries = {}
        for name, ds in names.items():
            entries[name] = _convert_one(f[ds], out, files[name], align, chunk_bytes)
    doc = {
        "format": _manifest.FORMAT,
        "version": _manifest.VERSION,
        "num_samples": next(iter(counts.values())),
        "align": align,
        "source": source_info,
        "datasets": dict(names),
        "fields": entries,
    }
    _manifest.write_atomic(manifest, doc)
    return manifest


def _up_to_date(manifest: Path, source_info: dict[str, Any], names: Mapping[str, str], align: int) -> bool:
    """True when the manifest came from this very source, with these fields, and matches its files."""
    if not manifest.exists():
        return False
    try:
        doc, _ = _manifest.load(manifest)
    except (ValueError, FileNotFoundError):
        return False
    return (
        doc.get("source") == source_info and doc.get("datasets") == dict(names) and doc.get("align") == align
    )


def _file_names(names: Mapping[str, str]) -> dict[str, str]:
    files: dict[str, str] = {}
    for name in names:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name.strip("/").replace("/", "__"))
        file = f"{safe or 'field'}.bin"
        if file in files.values():
            raise ValueError(
                f"convert_h5_to_raw: fields {sorted(names)} map to the same file name {file}; rename one"
            )
        files[name] = file
    return files


def _convert_one(dset: Any, out: Path, file: str, align: int, chunk_bytes: int) -> dict[str, Any]:
    dtype = dset.dtype.newbyteorder("=") if dset.dtype.itemsize > 1 else dset.dtype
    rows = int(dset.shape[0])
    shape = tuple(int(d) for d in dset.shape[1:])
    row_nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    step = max(1, chunk_bytes // max(1, row_nbytes))
    if dset.chunks:  # read whole chunks at a time: no chunk decompressed twice
        c = dset.chunks[0]
        step = max(c, step // c * c)
    buf = np.empty((min(step, max(rows, 1)), *shape), dtype=dtype)
    tmp = out / f".{file}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            for a in range(0, rows, step):
                k = min(step, rows - a)
                dset.read_direct(buf, np.s_[a : a + k], np.s_[0:k])
                fh.write(memoryview(buf[:k].reshape(-1).view(np.uint8)))
            size = fh.tell()
            pad = -size % align
            if pad:
                fh.write(b"\0" * pad)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out / file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {
        "file": file,
        "dtype": dtype.str,
        "shape": list(shape),
        "num_samples": rows,
        "offset": 0,
        "file_size": size + pad,
    }
