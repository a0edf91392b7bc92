"""Convert HDF5 datasets to raw files and a JSON manifest, once: raw files are the fastest path to the GPU."""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed._extras import require
from gpufeed.sources import _manifest
from gpufeed.sources.h5 import _inspect, _open, _resolve_fields

#: Rows are copied through a buffer of about this many bytes: memory stays flat whatever the file size.
CHUNK_BYTES = 64 << 20
MiB = 1 << 20


def convert_h5_to_raw(
    h5_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    fields: Sequence[str] | Mapping[str, str] | None = None,
    align: int = 1,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    progress: bool | None = None,
) -> Path:
    """Write each dataset of an HDF5 file to ``<out_dir>/<field>.bin`` and describe them in ``manifest.json``.

    The result opens with ``RawSource(manifest)`` or ``GDSSource(manifest)``. Rows stream through a
    bounded buffer (about ``chunk_bytes``), so files larger than memory convert. Data start at offset 0
    (aligned for O_DIRECT / GDS) and each file holds its samples and nothing else, unless ``align`` pads
    it with zeros to a multiple of that (the manifest records where the data end). The manifest
    records the source's path, size and mtime: a re-run with an unchanged source returns the existing
    manifest at once; a changed source (or a changed ``fields``) is converted again. The manifest is
    written last and atomically (temporary file + ``os.replace``), and the old one is removed before any
    data file is replaced, so a reader never sees a manifest that does not match its files.

    Args:
        h5_path: the HDF5 file.
        out_dir: directory for the ``.bin`` files and ``manifest.json`` (created if needed).
        fields: dataset names or ``{field name: dataset path}``, as for ``H5Source``; ``None``: every
            dataset that can become raw samples (the others are skipped with a warning, and listed under
            ``skipped`` in the manifest).
        align: pad each file with zeros to a multiple of this, a power of two; 1 (default) pads nothing,
            4096 gives sizes that O_DIRECT reads whole.
        chunk_bytes: about how many bytes to hold in memory at once.
        progress: show bytes done, rate and time left on stderr while converting; ``None``: when stderr
            is a terminal.

    Returns:
        The path of ``manifest.json``.

    Raises:
        FileNotFoundError: ``h5_path`` does not exist.
        ValueError: a named dataset is missing or cannot become raw samples (strings, objects, ...), no
            dataset can, or the fields' sample counts differ; the message names the file and the fix.
            Nothing is written then: an output folder this call created is removed, and an earlier
            conversion in the folder stays as it was (the new files are written beside it, so the disk
            holds both until they are renamed into place; a rename that fails leaves the folder without
            a manifest).

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
    manifest = out / _manifest.NAME
    source_info = {"path": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    with _open(h5py, str(src)) as f:
        names, skipped = _convertible(h5py, f, _resolve_fields(h5py, f, fields, str(src)), str(src),
                                      every=fields is None)
        if _up_to_date(manifest, source_info, names, align):
            return manifest
        counts = {name: int(f[ds].shape[0]) for name, ds in names.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"convert_h5_to_raw: {src}: fields have different sample counts {counts}; every field "
                "needs one row per sample: pass fields= with datasets of equal length"
            )
        files = _file_names(names)
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        written: dict[str, Path] = {}  # each field's new file, under a temporary name until every one is
        try:
            total = sum(int(f[ds].size) * f[ds].dtype.itemsize for ds in names.values())
            entries = {}
            with _Progress(total, sys.stderr.isatty() if progress is None else progress) as shown:
                for name, ds in names.items():
                    entries[name] = _convert_one(f[ds], out, files[name], align, chunk_bytes, shown.add,
                                                 written)
        except BaseException:  # a failed conversion leaves nothing behind, and an earlier one as it was
            for tmp in written.values():
                tmp.unlink(missing_ok=True)
            if created:
                shutil.rmtree(out, ignore_errors=True)
            raise
    doc = {
        "format": _manifest.FORMAT,
        "version": _manifest.VERSION,
        "num_samples": next(iter(counts.values())),
        "align": align,
        "source": source_info,
        "datasets": dict(names),
        "fields": entries,
        "skipped": skipped,
    }
    _move_into_place(out, manifest, written, doc)
    return manifest


def _move_into_place(out: Path, manifest: Path, written: dict[str, Path], doc: dict[str, Any]) -> None:
    """Rename every field's new file, then the new manifest, into place: only a rename can fail here, and
    it leaves the folder without a manifest (never an old one beside new data files) and no temporaries."""
    new_manifest = None
    try:
        new_manifest = _manifest.write_temp(manifest, doc)
        manifest.unlink(missing_ok=True)
        for file, tmp in written.items():
            os.replace(tmp, out / file)
        os.replace(new_manifest, manifest)
    except BaseException:
        for tmp in [*written.values(), new_manifest]:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        raise


def _convertible(h5py: Any, f: Any, names: dict[str, str], src: str, every: bool
                 ) -> tuple[dict[str, str], dict[str, str]]:
    """The datasets that can become raw samples, and why each other one cannot.

    With ``every`` (no fields named), a dataset that cannot (strings, compound or object data) is
    skipped with one warning that names it; a dataset the user named raises instead.
    """
    ok, skipped = {}, {}
    for name, ds in names.items():
        try:
            _inspect(h5py, f, ds, src, 0, use_offsets=False, indirect_ok=True)
            ok[name] = ds
        except ValueError as exc:
            if not every:
                raise
            skipped[name] = str(exc)
    if not ok:
        why = "; ".join(skipped.values())
        raise ValueError(f"convert_h5_to_raw: {src}: no dataset can become raw samples: {why}")
    if skipped:
        warnings.warn(f"convert_h5_to_raw: {src}: skipped {sorted(skipped)}, which cannot become raw "
                      f"samples: {'; '.join(skipped.values())}", RuntimeWarning, stacklevel=3)
    return ok, skipped


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


def _convert_one(dset: Any, out: Path, file: str, align: int, chunk_bytes: int,
                 done: Callable[[int], None], written: dict[str, Path]) -> dict[str, Any]:
    """Write ``dset``'s samples to a temporary file in ``out`` (noted in ``written`` under ``file``, the
    name it takes once every field is written) and return its manifest entry."""
    dtype = dset.dtype.newbyteorder("=") if dset.dtype.itemsize > 1 else dset.dtype
    rows = int(dset.shape[0])
    shape = tuple(int(d) for d in dset.shape[1:])
    row_nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    step = max(1, chunk_bytes // max(1, row_nbytes))
    if dset.chunks:  # read whole chunks at a time: no chunk decompressed twice
        c = dset.chunks[0]
        step = max(c, step // c * c)
    buf = np.empty((min(step, max(rows, 1)), *shape), dtype=dtype)
    tmp = written[file] = out / f".{file}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        for a in range(0, rows, step):
            k = min(step, rows - a)
            dset.read_direct(buf, np.s_[a : a + k], np.s_[0:k])
            fh.write(memoryview(buf[:k].reshape(-1).view(np.uint8)))
            done(buf[:k].nbytes)
        size = fh.tell()
        pad = -size % align
        if pad:
            fh.write(b"\0" * pad)
        fh.flush()
        os.fsync(fh.fileno())
    return {
        "file": file,
        "dtype": dtype.str,
        "shape": list(shape),
        "num_samples": rows,
        "offset": 0,
        "file_size": size + pad,
    }


class _Progress:
    """Bytes done, rate and time left on one stderr line, redrawn at most twice a second (when shown)."""

    def __init__(self, total: int, shown: bool) -> None:
        self.total, self.shown, self.done = total, shown, 0
        self.start = self.last = time.perf_counter()

    def add(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.shown and (now - self.last >= 0.5 or self.done >= self.total):
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            left = (self.total - self.done) / rate if rate > 0 else 0.0
            sys.stderr.write(f"\r  {self.done / MiB:,.0f} of {self.total / MiB:,.0f} MiB, "
                             f"{rate / MiB:,.0f} MiB/s, {left:.0f} s left ")
            sys.stderr.flush()

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.shown and self.done:
            sys.stderr.write("\n")
