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
from gpufeed.sources import _convert_folder as folder
from gpufeed.sources import _manifest
from gpufeed.sources._files import io_error
from gpufeed.sources._identity import FileChangedError, Identity, check
from gpufeed.sources._interrupt import watching
from gpufeed.sources._metadata import from_h5
from gpufeed.sources.h5 import _inspect, _open, _resolve_fields, datasets, default_fields

#: Rows are copied through a buffer of about this many bytes: memory stays flat whatever the file size.
CHUNK_BYTES = 64 << 20
MiB = 1 << 20


def convert_h5_to_raw(
    h5_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    fields: Sequence[str] | Mapping[str, str] | str | None = None,
    align: int = 1,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    progress: bool | None = None,
    force: bool = False,
) -> Path:
    """Write each dataset of an HDF5 file to a raw file in ``out_dir`` and describe them in ``manifest.json``.

    The result opens with ``RawSource(manifest)`` or ``GDSSource(manifest)``. Rows stream through a
    bounded buffer (about ``chunk_bytes``), so files larger than memory convert. Data start at offset 0
    (aligned for O_DIRECT / GDS) and each file holds its samples and nothing else, unless ``align`` pads
    it with zeros to a multiple of that (the manifest records where the data end). The manifest
    records the source's path, size and mtime: a re-run with an unchanged source returns the existing
    manifest at once; a changed source (or a changed ``fields``) is converted again. The HDF5 file's
    attributes and small datasets that are not fields are kept in the manifest (``RawSource.metadata``).

    Atomic and exclusive: the folder is locked (``flock`` on ``.gpufeed-convert.lock``) for the whole
    conversion, so conversions into one folder run one after the other (the later one waits). A
    conversion writes its files beside the earlier conversion's (``<field>.gen-<id>.bin``), then renames
    its manifest over ``manifest.json``: killed at any instant, the folder holds the earlier conversion or
    the new one, whole, and the next conversion removes what the killed one left. The files of the earlier
    conversion are removed once the new manifest is in place (a RawSource already reading them keeps
    its open files).

    Args:
        h5_path: the HDF5 file.
        out_dir: directory for the data files and ``manifest.json`` (created if needed).
        fields: dataset names (or one name), or ``{field name: dataset path}``, as for ``H5Source``;
            ``None``: as ``H5Source`` chooses, the largest group of datasets sharing one sample count;
            every other dataset is named in a RuntimeWarning and under ``skipped`` in the manifest.
        align: pad each file with zeros to a multiple of this, a power of two; 1 (default) pads nothing,
            4096 gives sizes that O_DIRECT reads whole.
        chunk_bytes: about how many bytes to hold in memory at once.
        progress: show bytes done, rate and time left on stderr while converting; ``None``: when stderr
            is a terminal.
        force: write into a folder that holds files gpufeed convert did not write (they are left as they
            are; a ``manifest.json`` that is not a gpufeed manifest is replaced).

    Returns:
        The path of ``manifest.json``.

    Raises:
        FileNotFoundError: ``h5_path`` does not exist.
        FileExistsError: ``out_dir`` holds files gpufeed convert did not write (named), without ``force``.
        FileChangedError: the HDF5 file changed while it was converted (nothing is written).
        ValueError: a named dataset is missing or cannot become raw samples (strings, objects, ...), no
            dataset can, or the fields' sample counts differ; the message names the file and the fix.
            Nothing is written then: an output folder this call created is removed, and an earlier
            conversion in the folder stays as it was.
        OSError: reading the HDF5 file or writing the folder failed; the message names the file.

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
        ident = Identity.of_path(str(src))
    except FileNotFoundError:
        raise FileNotFoundError(f"convert_h5_to_raw: no such file: {src}") from None
    out = Path(out_dir)
    job = _Job(src, ident, out, align, chunk_bytes, progress)
    with _open(h5py, str(src)) as f:
        names, skipped = _fields(h5py, f, fields, str(src))
        created = not out.exists()
        try:
            with folder.locked(out):
                return job.run(h5py, f, names, skipped, force)
        except BaseException:
            if created:
                shutil.rmtree(out, ignore_errors=True)
            raise


class _Job:
    """One conversion into a locked folder: what it reads, where it writes, and how."""

    def __init__(self, src: Path, ident: Identity, out: Path, align: int, chunk_bytes: int,
                 progress: bool | None) -> None:
        self.src, self.ident, self.out, self.align, self.chunk_bytes = src, ident, out, align, chunk_bytes
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.source_info = {"path": str(src), "size": ident.size, "mtime_ns": ident.mtime_ns}

    def run(self, h5py: Any, f: Any, names: dict[str, str], skipped: dict[str, str], force: bool) -> Path:
        manifest = self.out / _manifest.NAME
        named = folder.named_files(self.out)
        folder.remove_leftovers(self.out, named or set())
        if _up_to_date(manifest, self.source_info, names, self.align):
            return manifest
        foreign = folder.foreign(self.out, named)
        if foreign and not force:
            raise FileExistsError(
                f"convert_h5_to_raw: {self.out} holds files gpufeed convert did not write: "
                f"{', '.join(foreign)}; choose an empty or new folder, or pass force=True (--force) to write "
                "beside them")
        counts = {name: int(f[ds].shape[0]) for name, ds in names.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"convert_h5_to_raw: {self.src}: fields have different sample counts {counts}; every field "
                "needs one row per sample: pass fields= with datasets of equal length"
            )
        meta, _ = from_h5(h5py, f, [d for d in datasets(h5py, f) if d not in _stripped(names)])
        doc = {
            "format": _manifest.FORMAT, "version": _manifest.VERSION,
            "num_samples": next(iter(counts.values())),
            "align": self.align, "source": self.source_info, "datasets": dict(names), "metadata": meta,
            "skipped": {k: f"{v}; kept in metadata" if k in meta["datasets"] else v
                        for k, v in skipped.items()},
        }
        if skipped:
            _warn_skipped(self.src, skipped, meta["datasets"])
        generation = folder.new_generation()
        files = _file_names(names, generation)
        try:
            doc["fields"] = self._write(f, names, files)
            self._check_source()
            folder.switch(self.out, doc, generation)
        except BaseException:  # (interrupted too) the new files go, unless the manifest already names them
            if not set(files.values()) <= (folder.named_files(self.out) or set()):
                for file in files.values():
                    (self.out / file).unlink(missing_ok=True)
            raise
        folder.remove_leftovers(self.out, set(files.values()), named)
        return manifest

    def _write(self, f: Any, names: dict[str, str], files: dict[str, str]) -> dict[str, Any]:
        """Every field's data file, written and synced; their manifest entries."""
        total = sum(int(f[ds].size) * f[ds].dtype.itemsize for ds in names.values())
        entries = {}
        with _Progress(total, self.progress) as shown, watching() as interrupts:
            for name, ds in names.items():
                entries[name] = self._convert_one(f[ds], files[name], shown.add, interrupts)
        return entries

    def _check_source(self) -> None:
        """A source changed while it was read gave rows of two versions: nothing of it is kept."""
        check(str(self.src), self.ident, Identity.of_path(str(self.src)), "convert_h5_to_raw")

    def _convert_one(self, dset: Any, file: str, done: Callable[[int], None], interrupts: Any
                     ) -> dict[str, Any]:
        """Write ``dset``'s samples to ``file`` in the folder and return its manifest entry."""
        dtype = dset.dtype.newbyteorder("=") if dset.dtype.itemsize > 1 else dset.dtype
        rows = int(dset.shape[0])
        shape = tuple(int(d) for d in dset.shape[1:])
        row_nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        step = max(1, self.chunk_bytes // max(1, row_nbytes))
        if dset.chunks:  # read whole chunks at a time: no chunk decompressed twice
            c = dset.chunks[0]
            step = max(c, step // c * c)
        buf = np.empty((min(step, max(rows, 1)), *shape), dtype=dtype)
        path = self.out / file
        writing = f"writing {path} (converting {self.src} into {self.out}); free space there or choose " \
                  "another folder"
        try:
            with open(path, "wb") as fh:
                for a in range(0, rows, step):
                    k = min(step, rows - a)
                    self._read(dset, buf, a, k)
                    interrupts.check()  # a Ctrl-C that h5py swallowed
                    fh.write(memoryview(buf[:k].reshape(-1).view(np.uint8)))
                    done(buf[:k].nbytes)
                size = fh.tell()
                pad = -size % self.align
                if pad:
                    fh.write(b"\0" * pad)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            if isinstance(exc, (_ReadError, FileChangedError)):
                raise
            raise io_error(exc, writing, str(path)) from exc
        return {"file": file, "dtype": dtype.str, "shape": list(shape), "num_samples": rows, "offset": 0,
                "file_size": size + pad}

    def _read(self, dset: Any, buf: np.ndarray, a: int, k: int) -> None:
        try:
            dset.read_direct(buf, np.s_[a : a + k], np.s_[0:k])
        except OSError as exc:  # h5py's message names neither the file nor the dataset
            self._check_source()
            raise _ReadError(
                f"convert_h5_to_raw: reading rows {a}..{a + k - 1} of dataset '{dset.name}' of {self.src} "
                f"failed ({exc}); the file is damaged: check it with h5dump -d {dset.name}, or recreate it"
            ) from exc


class _ReadError(OSError):
    """A read of the HDF5 file that failed, its message naming the file and the dataset."""


def _fields(h5py: Any, f: Any, fields: Any, src: str) -> tuple[dict[str, str], dict[str, str]]:
    """The fields to convert, and why each other dataset is left out (``fields=None``: as H5Source
    chooses, but accepting virtual and external datasets, which the conversion materializes)."""
    if fields is None:
        try:
            return default_fields(h5py, f, src, indirect_ok=True)
        except ValueError as exc:
            raise ValueError(str(exc).replace("H5Source: ", "convert_h5_to_raw: ", 1)) from None
    names = _resolve_fields(h5py, f, fields, src)
    for ds in names.values():
        _inspect(h5py, f, ds, src, 0, use_offsets=False, indirect_ok=True)
    return names, {}


def _stripped(names: Mapping[str, str]) -> set[str]:
    return {ds.strip("/") for ds in names.values()}


def _warn_skipped(src: Path, skipped: Mapping[str, str], kept: Mapping[str, Any]) -> None:
    why = "; ".join(f"'{k}': {v}" for k, v in skipped.items())
    carried = f"; kept in the manifest's metadata: {sorted(kept)}" if kept else ""
    warnings.warn(f"convert_h5_to_raw: {src}: skipped {sorted(skipped)}, not converted as fields: {why}"
                  f"{carried}; pass fields= to choose", RuntimeWarning, stacklevel=4)


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


def _file_names(names: Mapping[str, str], generation: str) -> dict[str, str]:
    files: dict[str, str] = {}
    for name in names:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name.strip("/").replace("/", "__"))
        file = folder.data_file(safe or "field", generation)
        if file in files.values():
            raise ValueError(
                f"convert_h5_to_raw: fields {sorted(names)} map to the same file name {file}; rename one"
            )
        files[name] = file
    return files


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
