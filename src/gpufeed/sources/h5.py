"""H5Source: HDF5 datasets, read by byte offset where the layout allows it and through h5py otherwise."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from types import MappingProxyType
from typing import Any, Literal

import numpy as np
import torch

from gpufeed import host_memory
from gpufeed._extras import require

from ._files import PathLike, as_paths, check_file, pread_exact
from ._gpu_inflate import decode_stream, inflate_rows, use_gpu
from ._h5open import open_h5
from ._host_source import HostFileSource
from ._identity import Identity
from ._interrupt import Watch, watching
from ._layout import Extent, Layout, merge_extents
from ._metadata import decode, from_h5
from ._out_tensors import check_outs, host_bytes
from ._per_process import _PerProcess
from ._runs import Runs, check_rows
from ._sample_type import torch_dtype
from .base import Field, Rows
from .h5_chunks import ChunkTable, chunk_table, read_rows
from .h5_chunks import describe as describe_chunks

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
    kind: str  # "contiguous" | "chunked" | "gzip" | "h5py"
    reason: str
    extents: list[Extent] = dc_field(default_factory=list)
    table: ChunkTable | None = None  # kind "gzip": where its chunks are


class H5Source(HostFileSource):
    """Fixed-shape samples from HDF5 datasets (one dataset per field, first axis = samples).

    How each dataset is read depends on its storage layout, chosen once when the source is made:

    * **contiguous** datasets: by byte offset (``dset.id.get_offset()``) with ``os.preadv`` straight into
      the output tensors. No h5py in the hot path, so reads run in parallel on many threads.
    * **chunked, uncompressed** datasets whose chunks span whole samples (chunks split only the first
      axis): by byte offset too, from the chunk table (``get_chunk_info`` / ``chunk_iter``).
    * **chunked, gzip** (deflate, alone or after the shuffle filter) datasets: each chunk's compressed
      bytes are read by offset and decoded by gpufeed, once per read that touches the chunk. On the GPU
      (``reads_to == "device"``: CUDA and nvCOMP, ``pip install 'gpufeed[nvcomp]'``) only the compressed
      bytes cross the link and nVCOMP inflates them into the output on a stream of the read; otherwise
      reader threads inflate with zlib, in parallel (zlib releases the GIL).
    * anything else (other filters: lzf, szip, blosc, fletcher32, ...; chunks that split a sample when
      uncompressed, unallocated storage, big-endian data, compact layout): through h5py's ``read_direct``
      into the output, under one lock; HDF5 then does the work on one thread at a time.

    ``describe()`` and ``paths_taken`` say which path each field takes and why. Several files are
    concatenated along samples; each file must hold the same number of samples in every field.

    Process and thread safety: no HDF5 file stays open after construction. File descriptors and h5py
    files are opened on first use in each process, so a forked child or an unpickled copy opens its own
    (HDF5 handles must never cross a fork). ``close()`` must not run while a ``read`` is in flight.

    Args:
        paths: an HDF5 file, or a list of files concatenated along samples.
        fields: dataset names (``["images", "labels"]``; a name like ``"grp/x"`` becomes field
            ``"grp/x"``), one name (``"images"``, the same as ``["images"]``), or ``{field name: dataset
            path}``. ``None``: of the first file's datasets that can become samples, the largest group
            sharing one first-axis length (ties: the most bytes); the others are named with why in one
            RuntimeWarning and in ``skipped``, and ``metadata`` holds the small ones and every attribute.
        use_offsets: ``False`` reads everything through h5py (for comparison and debugging).
        decode: where gzip chunks are decoded: ``"auto"`` and ``"cpu"``: the reader threads (zlib, in
            parallel); ``"gpu"``: nvCOMP on the GPU (``pip install 'gpufeed[nvcomp]'``), several times
            faster, holding each batch's decoded chunks in device memory, up to ``num_threads`` batches of
            a ``SourceLoader`` at once (docs/sources.md). A missing nvCOMP or CUDA warns once and decodes
            on the CPU; ``"gpu"`` raises ValueError when no field is gzip-compressed (or with
            ``use_offsets=False``, which reads every field through h5py). With GPU decoding the source
            reads to the device: its other fields are read into pinned memory and copied by the read
            itself.
        mmap_gather: how shuffled batches are read, as for ``RawSource`` (by default rows in the page
            cache are gathered from memory maps). It applies to the fields read by byte offset in every
            file; the others (gzip chunks decoded here, h5py) keep their path. ``True`` raises ValueError
            when no field is read by byte offset (``describe()`` says how each one is read).
        num_threads: threads one read of the fields read by byte offset spreads over, as for ``RawSource``.

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

    def __init__(
        self,
        paths: PathLike | Sequence[PathLike],
        fields: Sequence[str] | Mapping[str, str] | None = None,
        *,
        use_offsets: bool = True,
        mmap_gather: bool | None = None,
        decode: str = "auto",
        num_threads: int | None = None,
    ) -> None:
        h5py = require("h5py", "H5Source")
        if decode not in ("auto", "gpu", "cpu"):
            raise ValueError(f"H5Source: decode must be 'auto', 'gpu' or 'cpu', got {decode!r}")
        self._paths = as_paths(paths, "H5Source")
        self._sizes = [check_file(p, "H5Source") for p in self._paths]  # h5py reads past a cut as zeros
        idents = [Identity.of_path(p) for p in self._paths]  # before the layouts are read from the files
        names: dict[str, str] = {}
        found: list[dict[str, _Found]] = []
        self._skipped: dict[str, str] = {}
        for i, path in enumerate(self._paths):
            with _open(h5py, path) as f:
                if not names and fields is None:
                    names, self._skipped = default_fields(h5py, f, path)
                names = names or _resolve_fields(h5py, f, fields, path)
                per_field = {name: _inspect(h5py, f, ds, path, i, use_offsets) for name, ds in names.items()}
            _check_counts(path, per_field)
            found.append(per_field)
        self._datasets = dict(names)
        self._metadata: dict[str, Any] | None = None
        if self._skipped:
            warnings.warn(f"H5Source: {self._paths[0]}: reading {list(names)}; left out: "
                          + "; ".join(f"'{k}': {v}" for k, v in self._skipped.items())
                          + " (source.metadata holds the file's attributes and small datasets; pass "
                          "fields= to choose)", RuntimeWarning, stacklevel=2)
        self._layouts = {name: _layout(name, [ff[name] for ff in found], self._paths) for name in names}
        self._fields = {n: lay.field for n, lay in self._layouts.items()}
        self._how = {
            name: [(p, ff[name].kind, ff[name].reason) for p, ff in zip(self._paths, found, strict=True)]
            for name in names
        }
        self._len = len(next(iter(self._layouts.values())))
        if mmap_gather is True and not any(lay.by_offset for lay in self._layouts.values()):
            raise ValueError("H5Source: mmap_gather=True applies to fields read by byte offset, and no field "
                             "here is (describe() says how each is read); leave mmap_gather at None")
        self._open_files("H5Source", self._paths, mmap_gather, num_threads, idents)
        self._check_all = not all(lay.by_offset for lay in self._layouts.values())  # h5py reads its own
        self._h5 = _H5Files(self._paths)
        self._tables = {(i, ff[n].extents[0].dataset): ff[n].table
                        for i, ff in enumerate(found) for n in names if ff[n].table is not None}
        if decode == "gpu" and not self._tables:
            how = "use_offsets=False reads every field through h5py" if not use_offsets else (
                "describe() says how each is read")
            raise ValueError(f"H5Source: decode='gpu' applies to gzip-compressed fields, and no field here "
                             f"is decoded by gpufeed ({how}); leave decode at 'auto'")
        self._gpu = bool(self._tables) and use_gpu(decode, "H5Source")

    @property
    def skipped(self) -> Mapping[str, str]:
        """The datasets left out when no ``fields`` were named, with why (see ``fields``)."""
        return MappingProxyType(getattr(self, "_skipped", {}))

    @property
    def metadata(self) -> Mapping[str, Any]:
        """What the first file holds beside the fields: ``{"attrs": {object path: {name: value}},
        "datasets": {name: value}}``, every attribute and each dataset not read as a field up to 64 KiB
        (class names, a mean, a std), as numpy arrays (strings: arrays of ``str``). Read on first use;
        equal to what ``RawSource(convert_h5_to_raw(...)).metadata`` gives.

        Raises:
            FileChangedError: the file changed since the source was made.
        """
        if getattr(self, "_metadata", None) is None:
            self.check_unchanged()
            h5py = require("h5py", "H5Source")
            mine = {d.strip("/") for d in self._datasets.values()}
            with _open(h5py, self._paths[0]) as f:
                doc, _ = from_h5(h5py, f, [d for d in datasets(h5py, f) if d not in mine])
            self._metadata = decode(doc)
        return MappingProxyType(self._metadata)

    @property
    def reads_to(self) -> Literal["host", "device"]:  # type: ignore[override]
        """``"device"`` when gzip chunks are decoded on the GPU (see ``decode``), else ``"host"``."""
        return "device" if self._gpu else "host"

    @property
    def fork_safe(self) -> bool:
        """A forked child can read (it cannot use CUDA: not when the source decodes on the GPU)."""
        return not self._gpu

    @property
    def paths_taken(self) -> Mapping[str, str]:
        """Per field: ``"contiguous"`` or ``"chunked"`` (by byte offset), ``"gzip-gpu"`` or ``"gzip-cpu"``
        (chunks read by offset, decoded on the GPU or by reader threads), ``"h5py"``, or ``"mixed"``
        when the files differ (see ``describe()``)."""
        out = {}
        for name, how in self._how.items():
            kinds = {self._kind(kind) for _, kind, _ in how}
            out[name] = kinds.pop() if len(kinds) == 1 else "mixed"
        return MappingProxyType(out)

    def describe(self) -> str:
        """A report of every field: shape, dtype, samples, and per file the read path with its reason."""
        lines = []
        for name, f in self._fields.items():
            lines.append(f"field '{name}' {tuple(f.shape)} {f.dtype}, {self._len} samples")
            lines += [f"  {os.path.basename(p)}: {self._reason(k, why)}" for p, k, why in self._how[name]]
        return "\n".join(lines)

    def _kind(self, kind: str) -> str:
        return (f"gzip-{'gpu' if self._gpu else 'cpu'}") if kind == "gzip" else kind

    def _reason(self, kind: str, reason: str) -> str:
        if kind != "gzip":
            return reason
        where = "on the GPU with nvCOMP" if self._gpu else "by reader threads with zlib"
        return f"{self._kind(kind)}: {reason}; chunks read by byte offset, decoded {where}"

    def read(self, rows: Rows, out: Mapping[str, torch.Tensor]) -> None:
        """Write ``rows`` of every field into ``out[name][: len(rows)]``, in the order of ``rows``.

        ``out`` lives on the host, or on a CUDA device when the source decodes on the GPU (host ``out``
        tensors are accepted then too: the CPU decodes). A device read runs on a stream of its own,
        after the caller's current stream, and returns once every byte is in place.

        Raises:
            IndexError: a row is outside ``[0, len(self))``.
            ValueError: an ``out`` tensor is missing, too small, of the wrong dtype/shape or device.
            FileChangedError: (an OSError) a file changed after the source was made (names it); also
                when a read failed or a chunk did not decode because of the change.
            OSError: a file ended early or a read failed; the message names the file.
            CorruptChunkError: (an OSError) a gzip chunk does not decode in a file that did not change;
                the message names the file, the dataset and the chunk.
        """
        if not self._gpu or not any(isinstance(t, torch.Tensor) and t.is_cuda for t in out.values()):
            super().read(rows, out)
            return
        runs = check_rows(rows, self._len, self._where)
        bufs = check_outs(self._fields, out, runs.n, "cuda", self._where)
        if runs.n == 0:
            return
        self._checked_read(lambda: self._read_device(runs, bufs))

    def _read_device(self, runs: Runs, bufs: Mapping[str, torch.Tensor]) -> None:
        pending = []
        with decode_stream(next(iter(bufs.values())).device) as stream:
            for name, layout in self._layouts.items():
                pending += self._read_to_device(layout, runs, bufs[name][: runs.n], stream.cuda_stream)
        for p in pending:  # the stream is synchronized: the checks' results are in
            p.check()

    def _read_to_device(self, layout: Layout, runs: Runs, t: torch.Tensor, stream: int) -> list[Any]:
        """One field into device tensor ``t``: rows not decoded here go through pinned host memory and one
        copy, then gzip chunks are decoded over them (same stream, so in that order)."""
        groups = self._decoded_rows(layout, runs)
        if sum(len(rows) for _, rows, _ in groups.values()) < runs.n:
            host = host_memory.pinned_empty(t.nbytes).view(t.dtype).view(t.shape)
            if layout.by_offset:
                super()._read_field(layout, runs, host)
            else:
                self._read_mixed(layout, runs, host, decode=False)
            t.copy_(host, non_blocking=True)
        if not groups:
            return []
        from . import _nvcomp

        nv = _nvcomp.load()
        table0 = next(iter(groups.values()))[0]
        out = t.reshape(-1).view(torch.uint8).view(runs.n, *table0.sample_byte_shape())
        return [inflate_rows(nv, table, self._fds.get(f), rows, pos, out, stream)
                for (f, _), (table, rows, pos) in groups.items()]

    def _read_field(self, layout: Layout, runs: Runs, t: torch.Tensor) -> None:
        if layout.by_offset:
            super()._read_field(layout, runs, t)
        else:  # some extents are decoded here or read through h5py: see _read_mixed
            self._read_mixed(layout, runs, t[: runs.n])

    def _decoded_rows(self, layout: Layout, runs: Runs) -> dict[tuple[int, str], tuple[ChunkTable, Any, Any]]:
        """Per gzip dataset ``(file, dataset)``: its table, the dataset rows of this read in it and their
        output rows. Grouped so that a read decodes each chunk once, however many runs touch it."""
        if not self._tables or layout.by_offset:
            return {}
        ext = layout.extents[0]
        table = self._tables.get((ext.file, ext.dataset))
        if len(layout.extents) == 1:  # the usual case: one file
            if table is None:
                return {}
            rows = runs.rows if runs.rows is not None else np.arange(*runs.one, dtype=np.int64)
            return {(ext.file, ext.dataset): (table, rows + ext.row0, np.arange(runs.n, dtype=np.int64))}
        parts: dict[tuple[int, str], tuple[ChunkTable, list[Any], list[Any]]] = {}
        for ext, r, k, o in layout.split(runs.pairs()):
            table = self._tables.get((ext.file, ext.dataset)) if ext.offset < 0 else None
            if table is not None:
                _, rows, pos = parts.setdefault((ext.file, ext.dataset), (table, [], []))
                rows.append(np.arange(ext.row0 + r, ext.row0 + r + k, dtype=np.int64))
                pos.append(np.arange(o, o + k, dtype=np.int64))
        return {key: (tab, np.concatenate(rs), np.concatenate(ps)) for key, (tab, rs, ps) in parts.items()}

    def _read_mixed(self, layout: Layout, runs: Runs, t: torch.Tensor, decode: bool = True) -> None:
        """Rows of extents read by offset or through h5py, then (``decode``) those of gzip datasets."""
        groups = self._decoded_rows(layout, runs)
        if sum(len(rows) for _, rows, _ in groups.values()) < runs.n:
            self._read_plain(layout, runs.pairs(), t, host_bytes(t, runs.n * layout.row_nbytes))
        if decode and groups:
            table0 = next(iter(groups.values()))[0]
            out = np.frombuffer(host_bytes(t, runs.n * layout.row_nbytes), dtype=np.uint8)
            out = out.reshape(runs.n, *table0.sample_byte_shape())
            for (f, _), (table, rows, pos) in groups.items():
                read_rows(table, self._fds.get(f), rows, pos, out)

    def _read_plain(
        self, layout: Layout, runs: list[tuple[int, int]], t: torch.Tensor, mv: memoryview
    ) -> None:
        """The runs of extents read by byte offset or through h5py (gzip extents are skipped)."""
        with watching() as interrupts:
            self._read_runs(layout, runs, t, mv, interrupts)

    def _read_runs(self, layout: Layout, runs: list[tuple[int, int]], t: torch.Tensor, mv: memoryview,
                   interrupts: Watch) -> None:
        arr = t.numpy()
        rn = layout.row_nbytes
        for ext, r, k, o in layout.split(runs):
            if ext.offset < 0 and (ext.file, ext.dataset) in self._tables:
                continue
            if ext.offset >= 0:
                dest = mv[o * rn : (o + k) * rn]
                pread_exact(self._fds.get(ext.file), dest, ext.offset + r * rn, self._paths[ext.file])
                continue
            src = np.s_[ext.row0 + r : ext.row0 + r + k]
            what = (f"reading rows {ext.row0 + r}..{ext.row0 + r + k - 1} of dataset '{ext.dataset}' of "
                    f"{self._paths[ext.file]} through h5py")
            try:
                with _H5PY_LOCK:
                    self._h5.dataset(ext.file, ext.dataset).read_direct(arr, src, np.s_[o : o + k])
            except OSError as exc:  # h5py's own message names neither the file nor a fix
                msg = (f"{what} failed ({exc}); the file may be truncated or damaged: check it with h5dump, "
                       "or recreate it")
                raise (OSError(exc.errno, msg) if exc.errno else OSError(msg)) from exc
            interrupts.check()  # a Ctrl-C that h5py swallowed
            self._check_size(ext.file, what)

    def _check_size(self, i: int, what: str) -> None:
        """HDF5 fills a read past the end of a file with zeros, without an error: a file cut while (or
        before) h5py read it gives rows that look valid. Checked after each read, so a cut during it is
        seen too."""
        size = os.fstat(self._fds.get(i)).st_size
        if size < self._sizes[i]:
            raise OSError(f"{what}: the file is {size} bytes, shorter than the {self._sizes[i]} it had "
                          "when the source was opened (truncated or rewritten?); check it with h5dump, or "
                          "recreate the source")

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
        return open_h5(h5py, path, rdcc_nbytes=_CHUNK_CACHE_BYTES), {}

    def _close(self, handle: tuple[Any, dict[str, Any]]) -> None:
        handle[1].clear()
        handle[0].close()

    def dataset(self, i: int, name: str | None) -> Any:
        f, cache = self.get(i)
        dset = cache.get(name)
        if dset is None:
            dset = cache[name] = f.file[name]
        return dset


def _open(h5py: Any, path: str) -> Any:
    """The file as it is now (see ``_h5open``), as a context manager that yields the ``h5py.File``."""
    try:
        return open_h5(h5py, path)
    except OSError as exc:
        raise ValueError(f"H5Source: cannot open {path} as HDF5 ({exc}); is it an HDF5 file?") from exc


def _resolve_fields(h5py: Any, f: Any, fields: Any, path: str) -> dict[str, str]:
    """``{field name: dataset path}`` from the ``fields`` argument: names, one name, or a mapping (``None``:
    see :func:`default_fields`)."""
    if fields is None:
        return default_fields(h5py, f, path)[0]
    if isinstance(fields, str):  # one dataset, by name
        fields = [fields]
    if isinstance(fields, Mapping):
        names = {str(k): str(v) for k, v in fields.items()}
    else:
        names = {str(ds).strip("/"): str(ds) for ds in fields}
    if not names:
        raise ValueError("H5Source: fields is empty; pass dataset names, or None for every dataset")
    return names


def default_fields(h5py: Any, f: Any, path: str, indirect_ok: bool = False
                   ) -> tuple[dict[str, str], dict[str, str]]:
    """The fields read when none are named, and why each other dataset is left out: of the datasets that
    can become samples, the largest group sharing one first-axis length (the most datasets; between
    groups as large, the most bytes). A file's ``mean`` (3,) and ``std`` (3,) beside ``images`` (N, ...)
    and ``labels`` (N,) are metadata, not two more fields of 3 samples.

    Raises:
        ValueError: no dataset can become samples (names the file and each dataset's reason).
    """
    left, groups = {}, {}
    for name in datasets(h5py, f):
        try:
            _inspect(h5py, f, name, path, 0, use_offsets=False, indirect_ok=indirect_ok)
        except ValueError as exc:
            left[name] = str(exc)
            continue
        groups.setdefault(int(f[name].shape[0]), []).append(name)
    if not groups:
        why = "; ".join(left.values()) or "it holds no dataset"
        raise ValueError(f"H5Source: {path}: no dataset can become raw samples: {why}")
    size = {n: sum(f[d].size * f[d].dtype.itemsize for d in ds) for n, ds in groups.items()}
    rows = max(groups, key=lambda n: (len(groups[n]), size[n], n))
    for n, names in groups.items():
        for name in names if n != rows else ():
            left[name] = (f"{n} rows, not the {rows} samples of {groups[rows]} (the largest group of "
                          "datasets of one length)")
    return {name: name for name in groups[rows]}, left


def datasets(h5py: Any, f: Any) -> list[str]:
    """Every dataset of an open file, by path (no leading ``/``)."""
    found: list[str] = []
    f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
    return found


def _available(h5py: Any, f: Any) -> str:
    found = datasets(h5py, f)
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
    table = None
    if kind == "filtered":
        found = chunk_table(dset, path)
        if isinstance(found, str):
            kind, reason = "h5py", f"h5py: {found}"
        else:
            kind, reason, table = "gzip", describe_chunks(found), found
    if kind in ("h5py", "gzip"):
        extents = [Extent(file_index, -1, rows, 0, dset.name)]
    return _Found(field, rows, kind, reason, extents, table)


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
    if nfilters:  # _inspect asks h5_chunks whether gpufeed decodes these filters
        return "filtered", "", []
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
