"""H5Source: HDF5 datasets, read by byte offset where the layout allows it and through h5py otherwise."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from gpufeed._extras import require

from ._files import PathLike, as_paths, check_file, pread_exact
from ._host_source import HostFileSource
from ._layout import Extent, Layout, merge_extents
from ._out_tensors import host_bytes
from ._per_process import _PerProcess
from ._runs import Runs
from ._sample_type import torch_dtype
from .base import Field

# h5py serializes every call behind its own global lock anyway; ours keeps a read_direct and its
# dataset lookup together and documents that the h5py path is single-threaded.
_H5PY_LOCK = threading.Lock()


def _reset_h5py_lock() -> None:
    # A fork copies the lock as it is; if another thread held it, the child would wait forever.
    # (h5py takes its own lock before fork, so no HDF5 call is in flight at the fork.)
    global _H5PY_LOCK
    _H5PY_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_h5py_lock)
# Chunk cache per open file for the h5py path: big enough that reading a batch row run by row run does
# not decompress the same chunk again for every run.
_CHUNK_CACHE_BYTES = 32 << 20


@dataclass
class _Found:
    """What inspecting one dataset in one file found: its samples and how they will be read."""

    field: Field
    rows: int
    kind: str  # "contiguous" | "chunked" | "h5py"
    reason: str
    extents: list[Extent] = dc_field(default_factory=list)


class H5Source(HostFileSource):
    """Fixed-shape samples from HDF5 datasets (one dataset per field, first axis = samples).

    How each dataset is read depends on its storage layout, chosen once when the source is made:

    * **contiguous** datasets: by byte offset (``dset.id.get_offset()``) with ``os.preadv`` straight into
      the output tensors. No h5py in the hot path, so reads run in parallel on many threads.
    * **chunked, uncompressed** datasets whose chunks span whole samples (chunks split only the first
      axis): by byte offset too, from the chunk table (``get_chunk_info`` / ``chunk_iter``).
    * anything else (gzip or other filters, chunks that split a sample, unallocated storage, big-endian
      data, compact layout): through h5py's ``read_direct`` into the output, under one lock; HDF5 then
      does the work on one thread at a time.

    ``describe()`` and ``paths_taken`` say which path each field takes and why. Several files are
    concatenated along samples; each file must hold the same number of samples in every field.

    Process and thread safety: no HDF5 file stays open after construction. File descriptors and h5py
    files are opened on first use in each process, so a forked child or an unpickled copy opens its own
    (HDF5 handles must never cross a fork). ``close()`` must not run while a ``read`` is in flight.

    Args:
        paths: an HDF5 file, or a list of files concatenated along samples.
        fields: dataset names (``["images", "labels"]``; a name like ``"grp/x"`` becomes field
            ``"grp/x"``), or ``{field name: dataset path}``. ``None``: every dataset of the first file.
        use_offsets: ``False`` reads everything through h5py (for comparison and debugging).
        mmap_gather: gather shuffled batches from memory maps, as for ``RawSource`` (opt-in: a file
            truncated while mapped kills the process with SIGBUS). It applies to the fields read by byte
            offset in every file; fields read through h5py keep h5py. ValueError when no field is read by
            byte offset (``describe()`` says why).

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a dataset is missing, unsupported (strings, objects, compound, virtual, external
            storage) or the fields' sample counts differ; the message names the file and the fix.
        ImportError: h5py is not installed (``pip install 'gpufeed[hdf5]'``).

    Example:
        >>> src = H5Source("train.h5", fields=["images", "labels"])      # doctest: +SKIP
        >>> print(src.describe())                                         # doctest: +SKIP
        field 'images' (3, 224, 224) torch.uint8, 50000 samples
          train.h5: contiguous (read by byte offset with os.preadv)
    """

    picklable = True
    fork_safe = True

    def __init__(
        self,
        paths: PathLike | Sequence[PathLike],
        fields: Sequence[str] | Mapping[str, str] | None = None,
        *,
        use_offsets: bool = True,
        mmap_gather: bool = False,
    ) -> None:
        h5py = require("h5py", "H5Source")
        self._paths = as_paths(paths, "H5Source")
        for p in self._paths:
            check_file(p, "H5Source")
        names: dict[str, str] = {}
        found: list[dict[str, _Found]] = []
        for i, path in enumerate(self._paths):
            with _open(h5py, path) as f:
                names = names or _resolve_fields(h5py, f, fields, path)
                per_field = {name: _inspect(h5py, f, ds, path, i, use_offsets) for name, ds in names.items()}
            _check_counts(path, per_field)
            found.append(per_field)
        self._datasets = dict(names)
        self._layouts = {name: _layout(name, [ff[name] for ff in found], self._paths) for name in names}
        self._fields = {n: lay.field for n, lay in self._layouts.items()}
        self._how = {
            name: [(p, ff[name].kind, ff[name].reason) for p, ff in zip(self._paths, found, strict=True)]
            for name in names
        }
        self._len = len(next(iter(self._layouts.values())))
        if mmap_gather is True and not any(lay.by_offset for lay in self._layouts.values()):
            raise ValueError("H5Source: mmap_gather=True applies to fields read by byte offset, and every "
                             "field here is read through h5py (see describe()); leave mmap_gather off")
        self._open_files("H5Source", self._paths, mmap_gather)
        self._h5 = _H5Files(self._paths)

    @property
    def paths_taken(self) -> Mapping[str, str]:
        """Per field: ``"contiguous"`` or ``"chunked"`` (by byte offset), ``"h5py"``, or ``"mixed"``
        when the files differ (see ``describe()``)."""
        out = {}
        for name, how in self._how.items():
            kinds = {kind for _, kind, _ in how}
            out[name] = kinds.pop() if len(kinds) == 1 else "mixed"
        return MappingProxyType(out)

    def describe(self) -> str:
        """A report of every field: shape, dtype, samples, and per file the read path with its reason."""
        lines = []
        for name, f in self._fields.items():
            lines.append(f"field '{name}' {tuple(f.shape)} {f.dtype}, {self._len} samples")
            lines += [f"  {os.path.basename(p)}: {reason}" for p, _, reason in self._how[name]]
        return "\n".join(lines)

    def _read_field(self, layout: Layout, runs: Runs, t: torch.Tensor) -> None:
        if layout.by_offset:
            super()._read_field(layout, runs, t)
        else:  # some extents are read through h5py (chunked or compressed): see _read_mixed
            self._read_mixed(layout, runs.pairs(), t[: runs.n], host_bytes(t, runs.n * layout.row_nbytes))

    def _read_mixed(
        self, layout: Layout, runs: list[tuple[int, int]], t: torch.Tensor, mv: memoryview
    ) -> None:
        arr = t.numpy()
        rn = layout.row_nbytes
        for ext, r, k, o in layout.split(runs):
            if ext.offset >= 0:
                dest = mv[o * rn : (o + k) * rn]
                pread_exact(self._fds.get(ext.file), dest, ext.offset + r * rn, self._paths[ext.file])
                continue
            src = np.s_[ext.row0 + r : ext.row0 + r + k]
            try:
                with _H5PY_LOCK:
                    self._h5.dataset(ext.file, ext.dataset).read_direct(arr, src, np.s_[o : o + k])
            except OSError as exc:  # h5py's own message names neither the file nor a fix
                path = self._paths[ext.file]
                msg = (f"reading rows {ext.row0 + r}..{ext.row0 + r + k - 1} of dataset '{ext.dataset}' of "
                       f"{path} through h5py failed ({exc}); the file may be truncated or damaged: check it "
                       "with h5dump, or recreate it")
                raise (OSError(exc.errno, msg) if exc.errno else OSError(msg)) from exc

    def close(self) -> None:
        """Close this process's file descriptors and h5py files (a later ``read`` reopens). Idempotent."""
        super().close()
        with _H5PY_LOCK:
            self._h5.close()

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}: {self.paths_taken[n]}" for n in self._fields)
        return f"H5Source({len(self)} samples, {len(self._paths)} files, {{{fields}}})"


class _H5Files(_PerProcess):
    """h5py files opened lazily in each process, with their dataset objects cached."""

    def _open(self, path: str) -> tuple[Any, dict[str, Any]]:
        h5py = require("h5py", "H5Source")
        return h5py.File(path, "r", rdcc_nbytes=_CHUNK_CACHE_BYTES), {}

    def _close(self, handle: tuple[Any, dict[str, Any]]) -> None:
        handle[1].clear()
        handle[0].close()

    def dataset(self, i: int, name: str | None) -> Any:
        f, cache = self.get(i)
        dset = cache.get(name)
        if dset is None:
            dset = cache[name] = f[name]
        return dset


def _open(h5py: Any, path: str) -> Any:
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise ValueError(f"H5Source: cannot open {path} as HDF5 ({exc}); is it an HDF5 file?") from exc


def _resolve_fields(h5py: Any, f: Any, fields: Any, path: str) -> dict[str, str]:
    """``{field name: dataset path}`` from the ``fields`` argument (``None``: every dataset)."""
    if fields is None:
        found: list[str] = []
        f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
        if not found:
            raise ValueError(f"H5Source: {path} holds no dataset")
        return {name: name for name in found}
    if isinstance(fields, str):
        fields = [fields]
    if isinstance(fields, Mapping):
        names = {str(k): str(v) for k, v in fields.items()}
    else:
        names = {str(ds).strip("/"): str(ds) for ds in fields}
    if not names:
        raise ValueError("H5Source: fields is empty; pass dataset names, or None for every dataset")
    return names


def _available(h5py: Any, f: Any) -> str:
    found: list[str] = []
    f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
    shown = ", ".join(found[:20]) + (", ..." if len(found) > 20 else "")
    return shown or "none"


def _inspect(
    h5py: Any, f: Any, ds: str, path: str, file_index: int, use_offsets: bool, indirect_ok: bool = False
) -> _Found:
    """Check one dataset and decide how its rows will be read (``indirect_ok``: accept virtual and
    external storage, which h5py reads; the converter materializes them)."""
    try:
        dset = f.get(ds)
    except (KeyError, OSError) as exc:  # e.g. a dangling external link
        raise ValueError(f"H5Source: {path}: dataset '{ds}' cannot be opened ({exc})") from exc
    if dset is None:
        raise ValueError(
            f"H5Source: {path} has no dataset '{ds}'; its datasets are: {_available(h5py, f)}. "
            "Pass fields= with names from that list"
        )
    if not isinstance(dset, h5py.Dataset):
        raise ValueError(f"H5Source: {path}: '{ds}' is a group, not a dataset; name a dataset inside it")
    where = f"H5Source: {path}: dataset '{ds}'"
    dcpl = dset.id.get_create_plist()
    if dset.is_virtual and not indirect_ok:
        raise ValueError(
            f"{where} is a virtual dataset (it maps other files); gpufeed reads stored data only: pass the "
            "source files it maps, or materialize it with gpufeed convert (convert_h5_to_raw)"
        )
    if dcpl.get_external_count() > 0 and not indirect_ok:
        ext = dcpl.get_external(0)[0].decode(errors="replace")
        raise ValueError(
            f"{where} keeps its data in external raw file(s) (first: {ext}); read that file with "
            "RawSource(..., dtype=, shape=), or materialize it with gpufeed convert (convert_h5_to_raw)"
        )
    field = _field(h5py, dset, ds, where)
    rows = int(dset.shape[0])
    kind, reason, extents = _choose(dset, dcpl, field, rows, file_index, use_offsets)
    if kind == "h5py":
        extents = [Extent(file_index, -1, rows, 0, dset.name)]
    return _Found(field, rows, kind, reason, extents)


def _field(h5py: Any, dset: Any, ds: str, where: str) -> Field:
    dt = dset.dtype
    if h5py.check_vlen_dtype(dt) is not None or h5py.check_string_dtype(dt) is not None:
        raise ValueError(
            f"{where} holds strings or variable-length data ({dt}); gpufeed reads fixed-size numeric "
            "samples: store them as numbers (e.g. token ids, or bytes in a uint8 array) in another dataset"
        )
    if dt.fields is not None:
        raise ValueError(f"{where} has a compound dtype {dt}; store each member as its own dataset")
    if dset.ndim == 0:
        raise ValueError(f"{where} is a scalar; a field needs a first axis of samples (shape (N, ...))")
    shape = tuple(int(d) for d in dset.shape[1:])
    field = Field(ds.strip("/"), shape, torch_dtype(dt.newbyteorder("="), where))
    if field.sample_nbytes == 0:
        raise ValueError(f"{where}: samples of shape {shape} hold no bytes")
    return field


def _choose(dset, dcpl, field: Field, rows: int, file_index: int, use_offsets: bool):
    """``(kind, reason, extents)``: read by byte offset when the bytes on disk are the samples, as is."""
    h5d = dset.id
    layout = dcpl.get_layout()
    if not use_offsets:
        return "h5py", "h5py (use_offsets=False)", []
    if not dset.dtype.isnative and dset.dtype.itemsize > 1:
        return "h5py", f"h5py: stored as {dset.dtype.str} (big-endian); HDF5 converts the byte order", []
    if layout == 0:  # H5D_COMPACT: the data lives inside the object header
        return "h5py", "h5py: compact layout (data stored in the object header)", []
    if layout == 1:  # H5D_CONTIGUOUS
        offset = h5d.get_offset()
        if offset is None:
            return "h5py", "h5py: storage never allocated (no data written; reads give the fill value)", []
        return (
            "contiguous",
            "contiguous (read by byte offset with os.preadv)",
            [Extent(file_index, offset, rows)],
        )
    if layout != 2:
        return "h5py", f"h5py: storage layout {layout}", []
    return _choose_chunked(dset, dcpl, field, rows, file_index)


def _choose_chunked(dset, dcpl, field: Field, rows: int, file_index: int):
    h5d = dset.id
    nfilters = dcpl.get_nfilters()
    if nfilters:
        names = ", ".join(dcpl.get_filter(i)[3].decode(errors="replace") for i in range(nfilters))
        return "h5py", f"h5py: filters {names} (HDF5 decodes the chunks)", []
    chunks = tuple(dset.chunks)
    if chunks[1:] != tuple(dset.shape[1:]):
        return (
            "h5py",
            (
                f"h5py: chunks {chunks} split a sample of shape {tuple(dset.shape[1:])}; byte offsets need "
                "chunks that hold whole samples (rechunk with h5repack -l CHUNK=N"
                + "x..." * (dset.ndim - 1)
                + ")"
            ),
            [],
        )
    c = chunks[0]
    want = -(-rows // c) if rows else 0
    stored: list[Any] = []
    if hasattr(h5d, "chunk_iter"):  # HDF5 >= 1.12.3: one pass over the chunk index
        h5d.chunk_iter(stored.append)
    else:
        stored = [h5d.get_chunk_info(i) for i in range(h5d.get_num_chunks())]
    stored = sorted((s for s in stored if s.chunk_offset[0] < rows), key=lambda s: s.chunk_offset[0])
    if len(stored) != want:
        return "h5py", f"h5py: {want - len(stored)} of {want} chunks never written (fill value)", []
    chunk_bytes = c * field.sample_nbytes
    extents = []
    for s in stored:
        start = s.chunk_offset[0]
        if s.size != chunk_bytes or s.filter_mask != 0 or s.byte_offset is None:
            return "h5py", f"h5py: chunk at row {start} is stored as {s.size} bytes, not {chunk_bytes}", []
        extents.append(Extent(file_index, s.byte_offset, min(c, rows - start)))
    extents = merge_extents(extents, field.sample_nbytes)
    return (
        "chunked",
        (f"chunked, uncompressed ({want} chunks of {c} rows in {len(extents)} runs; read by byte offset)"),
        extents,
    )


def _check_counts(path: str, per_field: Mapping[str, _Found]) -> None:
    counts = {name: f.rows for name, f in per_field.items()}
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"'{n}': {c}" for n, c in counts.items())
        raise ValueError(
            f"H5Source: {path}: fields have different sample counts ({detail}); every field needs one row "
            "per sample: pass fields= with datasets of equal length"
        )


def _layout(name: str, found: Sequence[_Found], paths: Sequence[str]) -> Layout:
    first = found[0].field
    field = Field(name, first.shape, first.dtype)
    for path, f in zip(paths, found, strict=True):
        if (f.field.shape, f.field.dtype) != (first.shape, first.dtype):
            raise ValueError(
                f"H5Source: field '{name}' holds samples of {f.field.shape} {f.field.dtype} in {path} but "
                f"{first.shape} {first.dtype} in {paths[0]}; concatenated files must agree"
            )
    return Layout(field, [e for f in found for e in f.extents])
