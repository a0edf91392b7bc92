"""RawSource: raw binary and ``.npy`` files, read with ``os.preadv`` straight into the output tensors."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from . import _manifest
from ._files import PathLike, as_paths, check_file
from ._host_source import HostFileSource
from ._layout import Extent, Layout
from ._metadata import decode
from ._sample_type import sample_shape, torch_dtype
from .base import Field

FieldSpec = PathLike | Sequence[PathLike] | Mapping[str, Any]


class RawSource(HostFileSource):
    """Fixed-shape samples stored back to back in raw binary files, ``.npy`` files or a gpufeed manifest.

    Each field is one file, or several files concatenated along samples; all fields have the same number
    of samples. ``read`` issues one ``pread`` per run of consecutive rows (per file), straight into the
    memory of the ``out`` tensors: no intermediate copy, no Python work per byte, and the GIL is released
    while the kernel copies (for rows given as an array, once for all their reads: see docs/sources.md).
    Any host tensor works as ``out`` (the prefetcher passes pinned ones).

    Thread and process safety: reads are positional, so one file descriptor per file serves every
    thread (a file mapped for gathering takes a second one on Python 3.12 and older, where ``mmap``
    duplicates it; a file that cannot be mapped is read by position). Descriptors and maps are opened on
    first use in each process: a forked child (DataLoader worker) or an unpickled copy opens its own.
    ``close()`` must not run while a ``read`` is in flight.

    Args:
        paths: a ``.npy`` file, a raw binary file, a manifest (``manifest.json`` or the directory holding
            it, as written by ``convert_h5_to_raw``), or a list of ``.npy``/raw files concatenated along
            samples. Leave it ``None`` when passing ``fields``.
        dtype: sample dtype of raw files (numpy-style like ``"float32"``, or a torch dtype such as
            ``torch.bfloat16``). ``.npy`` files carry their own; if given, it must match.
        shape: per-sample shape of raw files (``()`` for scalars). ``.npy`` files carry their own.
        name: the field name when ``paths`` holds a single field (default ``"x"``; a manifest names its own;
            with ``fields=`` its keys name the fields, and ``name=`` raises ValueError).
        fields: several fields, ``{name: spec}``, where spec is a path, a list of paths, or a dict with
            ``paths`` and optionally ``dtype``, ``shape``, ``offset`` (defaults: the arguments above).
            With a manifest, the fields to load, as for ``H5Source``: a list of names, or
            ``{new name: field}``; default every field.
        offset: bytes to skip at the start of each raw file (a header). ``.npy`` files skip their own
            header: an offset that applies to no raw file (every file ``.npy``, or a manifest) raises
            ValueError.
        mmap_gather: how a shuffled batch (many short runs) is read. ``None`` (default): rows found in
            the page cache are gathered from a read-only memory map of each file, in one copy that
            releases the GIL, others with one positional read per run, all in flight at once; a sample of
            each batch's rows decides (``mincore``), and only where the native library is built, so that
            a file cut while mapped raises the OSError naming it that a short read does. ``True``: always
            gather (a cold file's pages then fault in one at a time; without the native library a cut
            file kills the process with SIGBUS). ``False``: never map a file. Runs of consecutive rows
            are always read with ``os.preadv``.
        num_threads: threads one read spreads over (default: up to 8, and in a DataLoader worker its
            share of the CPUs), each given at least 1 MiB; a prefetcher hands such a source a whole
            staging chunk per read (see ``parallel_reads``).

    Example:
        >>> np.save("x.npy", np.zeros((100, 3, 32, 32), np.uint8))      # doctest: +SKIP
        >>> src = RawSource("x.npy")                                      # doctest: +SKIP
        >>> src = RawSource(fields={"x": "x.npy", "y": {"paths": "y.bin", "dtype": "i8"}})  # doctest: +SKIP
        >>> out = {"x": torch.empty(8, 3, 32, 32, dtype=torch.uint8), "y": torch.empty(8, dtype=torch.int64)}
        >>> src.read(range(0, 8), out)                                    # doctest: +SKIP
    """

    #: Safe to pickle (only paths travel) and to use in a forked child (it opens its own descriptors).
    picklable = True
    fork_safe = True

    def __init__(
        self,
        paths: PathLike | Sequence[PathLike] | None = None,
        dtype: Any = None,
        shape: int | Sequence[int] | None = None,
        name: str | None = None,
        fields: Mapping[str, FieldSpec] | Sequence[str] | None = None,
        *,
        offset: int = 0,
        mmap_gather: bool | None = None,
        num_threads: int | None = None,
    ) -> None:
        if paths is not None and _is_manifest(paths):
            if dtype is not None or shape is not None or name is not None or offset:
                raise ValueError(f"RawSource: the manifest {os.fspath(paths)} records each field's name, "
                                 "dtype, shape and data offset; do not pass name=, dtype=, shape= or offset= "
                                 "(select fields with fields=[...])")
            per_field, self._metadata = _from_manifest(paths)
            self._build(_select(per_field, fields, str(paths)), mmap_gather, num_threads)
            return
        self._metadata = decode(None)
        name_given = name is not None
        name = "x" if name is None else name
        if isinstance(paths, Mapping):  # else its keys would be taken for file names
            raise TypeError(
                f"RawSource: the first argument is paths=, a file or a list of files, got a dict {paths!r}; "
                f"name fields with fields=, e.g. RawSource(fields={paths!r})")
        if fields is None:
            if paths is None:
                raise ValueError("RawSource: pass paths=... (a file or a list of files) or fields={...}")
            for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
                if not os.path.exists(path):
                    raise FileNotFoundError(
                        f"RawSource: no such file or directory: {os.fspath(path)} (pass a .npy file, a raw "
                        "file with dtype= and shape=, or a directory that gpufeed convert wrote)")
            fields = {name: paths}
        elif paths is not None:
            raise ValueError("RawSource: pass either paths=... or fields={...}, not both")
        elif name_given:
            raise ValueError(f"RawSource: name={name!r} names the one field of paths=; with fields=, each "
                             "key names its field: RawSource(fields={name: files})")
        if not isinstance(fields, Mapping) or not fields:
            raise ValueError(
                f"RawSource: fields must be a non-empty mapping of name -> files, got {fields!r}"
            )
        defaults = {"dtype": dtype, "shape": shape, "offset": offset}
        per_field = [_field_files(str(n), spec, defaults) for n, spec in fields.items()]
        if offset and all(path.endswith(".npy") for _, files in per_field for path, _, _ in files):
            raise ValueError(f"RawSource: offset={offset} skips a header of raw files, and every file here "
                             "is .npy, whose header says where its data start; leave offset out")
        self._build(per_field, mmap_gather, num_threads)

    @classmethod
    def from_manifest(cls, path: PathLike, *, mmap_gather: bool | None = None,
                      num_threads: int | None = None) -> RawSource:
        """Open the files a gpufeed manifest describes (``manifest.json``, or the directory holding it);
        ``mmap_gather`` and ``num_threads`` as for the constructor.

        Raises:
            FileNotFoundError: no manifest there.
            ValueError: the manifest does not match its files (names the file; re-run gpufeed convert).

        Example:
            >>> src = RawSource.from_manifest(convert_h5_to_raw("train.h5", "train.raw"))  # doctest: +SKIP
        """
        self = cls.__new__(cls)
        per_field, self._metadata = _from_manifest(path)
        self._build(per_field, mmap_gather, num_threads)
        return self

    @property
    def metadata(self) -> Mapping[str, Any]:
        """What a manifest keeps beside the fields (``convert_h5_to_raw`` carries the HDF5 file's attributes
        and small datasets: see ``H5Source.metadata``); empty for files given directly."""
        return MappingProxyType(getattr(self, "_metadata", None) or decode(None))

    def _build(
        self, per_field: list[tuple[Field, list[tuple[str, int, int]]]], mmap_gather: bool | None,
        num_threads: int | None,
    ) -> None:
        paths: list[str] = []
        index: dict[str, int] = {}
        layouts: dict[str, Layout] = {}
        for field, files in per_field:
            extents = []
            for path, off, rows in files:
                if path not in index:
                    index[path] = len(paths)
                    paths.append(path)
                extents.append(Extent(index[path], off, rows))
            layouts[field.name] = Layout(field, extents)
        _check_counts(layouts, paths)
        self._layouts = layouts
        self._fields = {n: lay.field for n, lay in layouts.items()}
        self._len = len(next(iter(layouts.values())))
        self._open_files("RawSource", paths, mmap_gather, num_threads)

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}: {tuple(f.shape)} {f.dtype}" for n, f in self._fields.items())
        return f"RawSource({len(self)} samples, {len(self._paths)} files, {{{fields}}})"


def _is_manifest(paths: Any) -> bool:
    if not isinstance(paths, (str, os.PathLike)):
        return False
    p = os.fspath(paths)
    return p.endswith(".json") or os.path.isdir(p)


def _from_manifest(path: PathLike) -> tuple[list[tuple[Field, list[tuple[str, int, int]]]], dict[str, Any]]:
    """Each field of a manifest with its file, and the manifest's metadata."""
    doc, entries = _manifest.load(path)
    out = []
    for e in entries:
        field = Field(e.name, e.shape, torch_dtype(e.dtype, f"{e.path} (field '{e.name}')"))
        out.append((field, [(e.path, e.offset, e.num_samples)]))
    return out, decode(doc.get("metadata"))


def _select(per_field: list[tuple[Field, list[tuple[str, int, int]]]],
            fields: Mapping[str, str] | Sequence[str] | None, manifest: str
            ) -> list[tuple[Field, list[tuple[str, int, int]]]]:
    """The manifest's fields that ``fields`` names (as for H5Source: names, or ``{new name: field}``)."""
    if fields is None:
        return per_field
    wanted = {fields: fields} if isinstance(fields, str) else (
        dict(fields) if isinstance(fields, Mapping) else {f: f for f in fields})
    known = {f.name: (f, files) for f, files in per_field}
    missing = [v for v in wanted.values() if v not in known]
    if missing or not wanted:
        raise ValueError(f"RawSource: {manifest} has no field {missing or wanted!r}; its fields are: "
                         f"{', '.join(known)}")
    return [(Field(new, known[old][0].shape, known[old][0].dtype), known[old][1])
            for new, old in wanted.items()]


def _field_files(
    name: str, spec: FieldSpec, defaults: dict[str, Any]
) -> tuple[Field, list[tuple[str, int, int]]]:
    """The field and its ``(path, data offset, rows)`` files, from a spec of paths or a dict."""
    opts = dict(defaults)
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"paths", "dtype", "shape", "offset"}
        if unknown or "paths" not in spec:
            raise ValueError(
                f"RawSource: field '{name}': a dict spec takes keys paths (required), dtype, shape, offset; "
                f"got {sorted(spec)}"
            )
        opts.update({k: v for k, v in spec.items() if k != "paths"})
        own_offset, spec = spec.get("offset"), spec["paths"]
        if own_offset and all(p.endswith(".npy") for p in as_paths(spec, f"RawSource field '{name}'")):
            raise ValueError(f"RawSource: field '{name}': offset={own_offset} skips a header of raw files, "
                             "and its files are .npy, whose header says where their data start; leave offset "
                             "out of its spec")
    paths = as_paths(spec, f"RawSource field '{name}'")
    opened = [_open_one(name, path, opts) for path in paths]
    field = opened[0][0]
    for path, (f, _, _) in zip(paths, opened, strict=True):
        if (f.dtype, f.shape) != (field.dtype, field.shape):
            raise ValueError(
                f"RawSource field '{name}': {path} holds samples of {f.shape} {f.dtype} but {paths[0]} "
                f"holds {field.shape} {field.dtype}; concatenated files must agree"
            )
    return field, [(path, off, rows) for path, (_, off, rows) in zip(paths, opened, strict=True)]


def _open_one(name: str, path: str, opts: dict[str, Any]) -> tuple[Field, int, int]:
    size = check_file(path, f"RawSource field '{name}'")
    if path.endswith(".npy"):
        return _npy(name, path, size, opts)
    if not opts["offset"] and is_hdf5(path, size):  # an offset= says the caller knows the file's layout
        raise ValueError(
            f"RawSource: {path} is an HDF5 file, not raw samples: read it with H5Source({path!r}, "
            f"fields=[...]), or convert it once with `gpufeed convert {path} OUTDIR` and pass "
            "RawSource(OUTDIR)")
    if opts["dtype"] is None:
        raise ValueError(
            f"RawSource: {path} is a raw file: pass dtype= (and shape= per sample), or save it with np.save "
            "as .npy, which records both"
        )
    dtype = torch_dtype(opts["dtype"], path)
    shape = sample_shape(opts["shape"], path)
    field = Field(name, shape, dtype)
    off = int(opts["offset"] or 0)
    if off < 0 or off > size:
        raise ValueError(f"RawSource: offset={off} is outside {path} ({size} bytes)")
    end = _manifest.data_end_of(path)
    if end is None or not off <= end <= size:  # else a converted file: its alignment padding is not data
        end = size
    rows, rest = divmod(end - off, _row_bytes(field, path))
    if rest:
        what = "bytes" if end == size else "bytes of data (its manifest says where they end)"
        raise ValueError(
            f"RawSource: {path} holds {end - off} {what} after offset {off}, not a whole number of "
            f"{field.sample_nbytes}-byte samples ({dtype}, shape {shape}); check dtype=, shape= and offset="
        )
    return field, off, rows


def _npy(name: str, path: str, size: int, opts: dict[str, Any]) -> tuple[Field, int, int]:
    try:
        _, shape, fortran, dt, off = npy_header(path)
    except ValueError as exc:
        raise ValueError(f"RawSource: {exc}") from exc
    if fortran and len(shape) > 1:
        raise ValueError(
            f"RawSource: {path} is stored in Fortran order; gpufeed reads C order: re-save it with "
            "np.save(path, np.ascontiguousarray(arr))"
        )
    if len(shape) == 0:
        raise ValueError(f"RawSource: {path} holds a 0-d array; samples need a leading axis (shape (N, ...))")
    field = Field(name, tuple(int(d) for d in shape[1:]), torch_dtype(dt, path))
    for key, got in (("dtype", field.dtype), ("shape", field.shape)):
        want = opts[key]
        if want is not None:
            want = torch_dtype(want, path) if key == "dtype" else sample_shape(want, path)
            if want != got:
                raise ValueError(f"RawSource: {path} holds {key} {got}, but {key}={want} was passed")
    rows = int(shape[0])
    need = off + rows * _row_bytes(field, path)
    if size != need:
        what = "is truncated" if size < need else "holds more than its header describes"
        raise ValueError(
            f"RawSource: {path} {what}: its header says {rows} samples of {tuple(shape[1:])} {dt} from "
            f"byte {off} ({need} bytes in all) but the file holds {size} bytes; the header or the data is "
            "damaged: re-save it with np.save"
        )
    return field, off, rows


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def is_hdf5(path: str, size: int | None = None) -> bool:
    """True when ``path`` holds HDF5's signature where HDF5 looks for it: at byte 0, 512, 1024, 2048 ...
    (a user block of a power-of-two size may precede the superblock)."""
    size = os.path.getsize(path) if size is None else size
    with open(path, "rb") as fh:
        at = 0
        while at + len(HDF5_SIGNATURE) <= size:
            fh.seek(at)
            if fh.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                return True
            at = 512 if at == 0 else 2 * at
    return False


class NpyHeader(NamedTuple):
    """What a ``.npy`` file's header says, and where its data start."""

    version: tuple[int, int]
    shape: tuple[int, ...]
    fortran: bool
    dtype: np.dtype
    offset: int


# numpy parses a header with ast.literal_eval, and CPython's AST constructor can raise a spurious
# "SystemError: AST constructor recursion depth mismatch" when several threads parse at once (cpython
# gh-106905; seen here on 3.11.7, a RawSource of valid files opened by many threads): one parse at a time.
_HEADER_LOCK = threading.Lock()


def npy_header(path: str) -> NpyHeader:
    """Read the header of a ``.npy`` file.

    Raises:
        ValueError: not a valid ``.npy`` file (names the file and the fix).
    """
    fmt = np.lib.format
    with open(path, "rb") as fh:
        try:
            version = fmt.read_magic(fh)
            # 3.0 only differs from 2.0 by allowing utf-8 in the header, which dtype/shape never need.
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            with _HEADER_LOCK:
                shape, fortran, dtype = read(fh)
        except OSError:
            raise
        except Exception as exc:  # numpy's parser raises ValueError, SyntaxError, tokenize.TokenError ...
            raise ValueError(f"{path} is not a valid .npy file (its header does not parse: "
                             f"{type(exc).__name__}: {exc}); write it with np.save") from exc
        return NpyHeader(version, shape, fortran, dtype, fh.tell())


def _row_bytes(field: Field, path: str) -> int:
    n = field.sample_nbytes
    if n == 0:
        raise ValueError(f"RawSource: {path}: samples of shape {field.shape} hold no bytes")
    return n


def _check_counts(layouts: Mapping[str, Layout], paths: Sequence[str]) -> None:
    counts = {name: len(lay) for name, lay in layouts.items()}
    if len(set(counts.values())) > 1:
        detail = ", ".join(
            f"'{n}': {c} ({paths[layouts[n].extents[0].file] if layouts[n].extents else 'empty'})"
            for n, c in counts.items()
        )
        raise ValueError(
            f"RawSource: fields have different sample counts: {detail}; every field needs one row per sample"
        )
