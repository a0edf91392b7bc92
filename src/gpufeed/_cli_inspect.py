"""``gpufeed inspect FILE``: what an HDF5, ``.npy`` or manifest file holds, and how gpufeed would read it.

The read path shown for each HDF5 dataset and ``.npy`` file is the one the sources themselves choose:
where ``gpufeed.sources`` is importable, ``H5Source`` / ``RawSource`` are built on the file and asked
(``paths_taken``, their errors), so this report cannot drift from what a training run does. The layout
column and the short labels come from reading the file's metadata with h5py or numpy.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from gpufeed._cli_util import CLIError, format_bytes, say, table

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
NPY_MAGIC = b"\x93NUMPY"

PATH_CONTIGUOUS = "byte-offset pread (contiguous)"
PATH_CHUNKED = "chunk-index pread (uncompressed chunked)"
PATH_RAW = "byte-offset pread (raw samples)"
PATH_GZIP_GPU = "chunk-index pread + GPU inflate (nvCOMP)"
PATH_GZIP_CPU = "chunk-index pread + threaded inflate (zlib)"
PATH_GZIP = "chunk-index pread + gpufeed inflate (GPU or threads)"  # metadata alone cannot tell which
#: Filter pipelines gpufeed decodes itself (h5_chunks.DECODABLE, by the names users know).
_DECODABLE = (["gzip"], ["shuffle", "gzip"])

# HDF5 filter names as HDF5 registers them -> the names users know (h5py's compression= values).
_FILTER_NAMES = {"deflate": "gzip", "szip": "szip", "lzf": "lzf", "shuffle": "shuffle",
                 "fletcher32": "fletcher32", "scaleoffset": "scaleoffset", "nbit": "nbit"}
_NOT_COMPRESSION = {"shuffle", "fletcher32"}


def run(args: argparse.Namespace) -> int:
    path = args.file
    kind = detect(path)
    if kind == "hdf5":
        report = inspect_hdf5(path)
    elif kind == "npy":
        report = inspect_npy(path)
    else:
        report = inspect_manifest(path)
    if args.json:
        print(json.dumps(report, indent=2), flush=True)
    else:
        say(render(report))
    return 0 if report.get("valid", True) else 1


def detect(path: str) -> str:
    """``"hdf5"``, ``"npy"`` or ``"manifest"``, from the file's first bytes (its suffix for JSON)."""
    p = Path(path)
    if p.is_dir():
        if (p / "manifest.json").is_file():
            return "manifest"
        raise CLIError(f"{path} is a folder without a manifest.json; name a file (HDF5, .npy or a manifest)")
    if not p.exists():
        raise CLIError(f"no such file: {path}")
    with open(p, "rb") as fh:
        head = fh.read(8)
    if head.startswith(NPY_MAGIC):
        return "npy"
    if head == HDF5_SIGNATURE or _hdf5_with_userblock(p):
        return "hdf5"
    if p.suffix == ".json" or head.lstrip()[:1] == b"{":
        return "manifest"
    raise CLIError(f"cannot tell what {path} is: expected an HDF5 file, a .npy file or a gpufeed "
                   "manifest (manifest.json)")


def _hdf5_with_userblock(p: Path) -> bool:
    size = p.stat().st_size
    with open(p, "rb") as fh:
        for off in (512, 1024, 2048, 4096, 8192):  # HDF5 looks for its signature at 0, 512, 1024, ...
            if off + 8 > size:
                break
            fh.seek(off)
            if fh.read(8) == HDF5_SIGNATURE:
                return True
    return False


# -- HDF5 ----------------------------------------------------------------------------------------------


def inspect_hdf5(path: str) -> dict[str, Any]:
    from gpufeed._extras import require

    h5py = require("h5py", "gpufeed inspect on HDF5 files")
    datasets: list[dict[str, Any]] = []
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise CLIError(f"cannot open {path} as HDF5 ({exc}); is the file complete?") from exc
    with f:
        names: list[str] = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        for name in names:
            datasets.append(_describe_dataset(h5py, f[name]))
    h5source = _import_source("H5Source")
    for d in datasets:
        _ask_h5source(h5source, path, d)
    return {"file": path, "kind": "hdf5", "bytes": os.path.getsize(path), "datasets": datasets,
            "suggested_fields": _suggest(datasets)}


def _describe_dataset(h5py: Any, dset: Any) -> dict[str, Any]:
    """Shape, dtype, storage layout and the read path that metadata alone implies."""
    d: dict[str, Any] = {"name": dset.name, "shape": list(dset.shape), "dtype": _dtype_name(h5py, dset.dtype)}
    dcpl = dset.id.get_create_plist()
    filters = [_filter_name(dcpl.get_filter(i)[3]) for i in range(dcpl.get_nfilters())]
    layout_code = dcpl.get_layout()  # 0 compact, 1 contiguous, 2 chunked, 3 virtual
    d["layout"] = _layout_text(dset, layout_code, filters)
    d["filters"] = filters
    unsupported = _unsupported(h5py, dset, dcpl, layout_code)
    if unsupported:
        d["read_path"], d["supported"] = f"unsupported: {unsupported}", False
        return d
    d["supported"] = True
    d["read_path"] = _expected_path(dset, layout_code, filters)
    return d


def _dtype_name(h5py: Any, dt: Any) -> str:
    s = h5py.check_string_dtype(dt)
    if s is not None:
        return "vlen str" if s.length is None else f"str[{s.length}]"
    if h5py.check_vlen_dtype(dt) is not None:
        return f"vlen {h5py.check_vlen_dtype(dt)}"
    return dt.str if (not dt.isnative and dt.itemsize > 1) else str(dt)


def _filter_name(raw: bytes) -> str:
    name = raw.decode(errors="replace").strip().lower()
    return _FILTER_NAMES.get(name, name or "unknown")


def _layout_text(dset: Any, code: int, filters: list[str]) -> str:
    if code == 0:
        return "compact"
    if code == 1:
        return "contiguous" if dset.id.get_offset() is not None else "contiguous (not allocated)"
    if code == 3:
        return "virtual"
    if any(f not in _NOT_COMPRESSION for f in filters):
        return f"compressed({', '.join(filters)})"
    if filters:
        return f"chunked {tuple(dset.chunks)}, filtered({', '.join(filters)})"
    return f"chunked {tuple(dset.chunks)}"


def _unsupported(h5py: Any, dset: Any, dcpl: Any, layout_code: int) -> str:
    """A short reason gpufeed cannot read this dataset as samples, or ``""``."""
    dt = dset.dtype
    s = h5py.check_string_dtype(dt)
    if s is not None:
        return "vlen strings" if s.length is None else "fixed-length strings"
    if h5py.check_vlen_dtype(dt) is not None:
        return "variable-length data"
    if dt.fields is not None:
        return "compound dtype"
    if dt.hasobject:
        return "object dtype"
    if dset.ndim == 0:
        return "scalar (no sample axis)"
    if layout_code == 3 or dset.is_virtual:
        return "virtual dataset"
    if dcpl.get_external_count() > 0:
        return "external raw storage"
    return ""


def _expected_path(dset: Any, code: int, filters: list[str]) -> str:
    if not dset.dtype.isnative and dset.dtype.itemsize > 1:
        return "h5py read_direct (big-endian)"
    if code == 0:
        return "h5py read_direct (compact layout)"
    if code == 1:
        return PATH_CONTIGUOUS if dset.id.get_offset() is not None else "h5py read_direct (not allocated)"
    compressors = [f for f in filters if f not in _NOT_COMPRESSION]
    if filters in _DECODABLE:
        return PATH_GZIP
    if compressors:
        return f"h5py read_direct ({'+'.join(filters)}: gpufeed does not decode these filters)"
    if filters:
        return f"h5py read_direct (filtered: {', '.join(filters)})"
    if tuple(dset.chunks[1:]) != tuple(dset.shape[1:]):
        return "h5py read_direct (chunks split a sample)"
    return PATH_CHUNKED


def _ask_h5source(h5source: Any, path: str, d: dict[str, Any]) -> None:
    """Let ``H5Source`` decide (it is what a training run uses); keep the metadata label where they agree."""
    if h5source is None:
        d["decided_by"] = "metadata (gpufeed.sources is not importable)"
        return
    d["decided_by"] = "H5Source"
    field = d["name"].lstrip("/")
    try:
        src = h5source(path, fields=[field])
    except ValueError as exc:
        if d["supported"]:
            d["read_path"], d["supported"] = "unsupported", False
        d["why"] = str(exc)
        return
    try:
        kind = src.paths_taken[field]
        described = src.describe().splitlines()
    finally:
        src.close()
    d["why"] = described[1].split(": ", 1)[-1] if len(described) > 1 else kind
    if kind == "contiguous":
        d["read_path"] = PATH_CONTIGUOUS
    elif kind == "chunked":
        d["read_path"] = PATH_CHUNKED
    elif kind in ("gzip-gpu", "gzip-cpu"):
        d["read_path"] = PATH_GZIP_GPU if kind == "gzip-gpu" else PATH_GZIP_CPU
    elif not d["read_path"].startswith("h5py"):  # metadata looked fast, H5Source found a reason not to
        d["read_path"] = "h5py read_direct (see why)"
    d["supported"] = True


def _suggest(datasets: list[dict[str, Any]]) -> list[str]:
    """The largest group of readable datasets sharing a sample count: what to pass as ``fields=``."""
    groups: dict[int, list[str]] = {}
    for d in datasets:
        if d["supported"] and d["shape"]:
            groups.setdefault(d["shape"][0], []).append(d["name"].lstrip("/"))
    if not groups:
        return []
    return max(groups.values(), key=len)


# -- .npy ----------------------------------------------------------------------------------------------


def inspect_npy(path: str) -> dict[str, Any]:
    import numpy as np

    from gpufeed.sources.raw import npy_header

    size = os.path.getsize(path)
    try:
        version, shape, fortran, dtype, header = npy_header(path)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    data = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    order = "F" if fortran and len(shape) > 1 else "C"
    report: dict[str, Any] = {
        "file": path, "kind": "npy", "bytes": size, "format_version": f"{version[0]}.{version[1]}",
        "shape": list(shape), "dtype": str(dtype), "order": order, "header_bytes": header, "data_bytes": data,
    }
    problem = ""
    if size < header + data:
        problem = f"truncated: the header says {data} data bytes, the file holds {size - header}"
        report["valid"] = False
    elif order == "F":
        problem = "Fortran order (re-save with np.save(path, np.ascontiguousarray(a)))"
    elif dtype.hasobject:
        problem = "object dtype"
    elif not shape:
        problem = "0-d array (no sample axis)"
    report["read_path"] = f"unsupported: {problem}" if problem else PATH_RAW
    raw = _import_source("RawSource")
    if raw is not None:
        try:
            raw(path).close()
            report["why"] = "RawSource reads it by byte offset, after the header"
        except ValueError as exc:
            report["why"] = str(exc)
            if not problem:
                report["read_path"] = "unsupported"
    return report


# -- manifest ------------------------------------------------------------------------------------------


def inspect_manifest(path: str) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "manifest.json"
    report: dict[str, Any] = {"file": str(p), "kind": "manifest", "bytes": p.stat().st_size}
    try:
        doc = json.loads(p.read_text())
        if not isinstance(doc, dict):
            raise ValueError("the top level is not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        return {**report, "valid": False, "why": f"not valid JSON ({exc})", "fields": []}
    report["format"] = f"{doc.get('format')} v{doc.get('version')}"
    report["source"] = doc.get("source")
    fields = []
    raw_fields = doc.get("fields") if isinstance(doc.get("fields"), dict) else {}
    for name, spec in raw_fields.items():
        spec = spec if isinstance(spec, dict) else {}
        file = spec.get("file")
        data_path = p.parent / str(file) if file else None
        on_disk = data_path.stat().st_size if data_path is not None and data_path.is_file() else None
        fields.append({
            "name": name, "file": file, "dtype": spec.get("dtype"), "shape": spec.get("shape"),
            "samples": spec.get("num_samples"), "recorded_bytes": spec.get("file_size"),
            "actual_bytes": on_disk,
        })
    report["fields"] = fields
    report["valid"], report["why"] = _validate_manifest(p)
    usable = f"{PATH_RAW}, by RawSource or GDSSource"
    report["read_path"] = usable if report["valid"] else "unusable until fixed"
    return report


def _validate_manifest(p: Path) -> tuple[bool, str]:
    raw = _import_source("RawSource")
    if raw is None:
        return False, "gpufeed.sources is not importable here: cannot check the manifest"
    try:
        raw(str(p)).close()
    except (ValueError, FileNotFoundError) as exc:
        return False, str(exc)
    return True, "every data file exists and has the size and sample count the manifest records"


def _import_source(name: str) -> Any:
    try:
        import gpufeed.sources as sources
    except ImportError:
        return None
    return getattr(sources, name, None)


# -- rendering -----------------------------------------------------------------------------------------


def render(r: dict[str, Any]) -> str:
    return {"hdf5": _render_hdf5, "npy": _render_npy, "manifest": _render_manifest}[r["kind"]](r)


def _shape(shape: Any) -> str:
    return str(tuple(shape)) if isinstance(shape, list) else str(shape)


def _render_hdf5(r: dict[str, Any]) -> str:
    ds = r["datasets"]
    lines = [f"{r['file']}: HDF5, {len(ds)} dataset(s), {format_bytes(r['bytes'])}"]
    if not ds:
        return lines[0] + "\n(no datasets)"
    rows = [[d["name"], _shape(d["shape"]), d["dtype"], d["layout"], d["read_path"]] for d in ds]
    lines.append(table(["dataset", "shape", "dtype", "layout", "read path"], rows))
    whys = [f"  {d['name']}: {d['why']}" for d in ds if d.get("why")]
    if whys:
        lines.append("why (H5Source):")
        lines += whys
    elif ds and ds[0].get("decided_by", "").startswith("metadata"):
        lines.append("note: read paths inferred from metadata; gpufeed.sources is not importable here")
    if r["suggested_fields"]:
        lines.append(f"use: H5Source({r['file']!r}, fields={r['suggested_fields']!r})")
    return "\n".join(lines)


def _render_npy(r: dict[str, Any]) -> str:
    lines = [
        f"{r['file']}: .npy (format {r['format_version']}), {format_bytes(r['bytes'])}",
        f"  shape        {_shape(r['shape'])}",
        f"  dtype        {r['dtype']}",
        f"  order        {r['order']}",
        f"  header size  {r['header_bytes']} bytes (data starts at byte {r['header_bytes']})",
        f"  data         {r['data_bytes']} bytes",
        f"  read path    {r['read_path']}",
    ]
    if r.get("why"):
        lines.append(f"  why          {r['why']}")
    return "\n".join(lines)


def _render_manifest(r: dict[str, Any]) -> str:
    fmt = r.get("format", "unknown format")
    lines = [f"{r['file']}: gpufeed manifest ({fmt}), {len(r['fields'])} field(s)"]
    if r["fields"]:
        rows = []
        for f in r["fields"]:
            actual = "missing" if f["actual_bytes"] is None else f["actual_bytes"]
            rows.append([f["name"], f["samples"], _shape(f["shape"]), f["dtype"], f["file"],
                         f["recorded_bytes"], actual])
        header = ["field", "samples", "shape", "dtype", "file", "bytes", "on disk"]
        lines.append(table(header, rows, "lrlllrr"))
    src = r.get("source")
    if isinstance(src, dict) and src.get("path"):
        lines.append(f"source: {src['path']} ({src.get('size')} bytes)")
    lines.append(f"valid: {'yes' if r['valid'] else 'no'}: {r['why']}")
    if r.get("read_path"):
        lines.append(f"read path: {r['read_path']}")
    return "\n".join(lines)
