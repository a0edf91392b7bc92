"""What an HDF5 file holds beside its samples: its attributes and its small datasets that are not fields
(class names, a mean, a std). ``H5Source.metadata`` reads them from the file; ``convert_h5_to_raw`` keeps
them in the manifest as JSON, and ``RawSource.metadata`` reads them back, equal value for value.

The form: ``{"attrs": {object path: {name: value}}, "datasets": {name: value}}``, each value a numpy array
(strings: an array of ``str`` objects) or a ``str``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

#: A dataset left out of the fields is kept as metadata up to this many bytes.
MAX_BYTES = 64 << 10


def from_h5(h5py: Any, f: Any, datasets: Iterable[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The encoded metadata of open file ``f``: every attribute, and each of ``datasets`` small enough;
    and why each of ``datasets`` not kept was not."""
    attrs: dict[str, Any] = {}

    def visit(name: str, obj: Any) -> None:
        kept = {k: _encode(h5py, v) for k, v in obj.attrs.items()}
        kept = {k: v for k, v in kept.items() if v is not None}
        if kept:
            attrs["/" + name if name else "/"] = kept

    visit("", f)
    f.visititems(visit)
    values, why = {}, {}
    for name in datasets:
        dset = f[name]
        if dset.size * dset.dtype.itemsize > MAX_BYTES:
            why[name] = f"larger than the {MAX_BYTES >> 10} KiB kept as metadata"
            continue
        value = _encode(h5py, _read(h5py, dset))
        if value is None:
            why[name] = f"its dtype {dset.dtype} cannot be kept as metadata"
        else:
            values[name] = value
    return {"attrs": attrs, "datasets": values}, why


def decode(doc: dict[str, Any] | None) -> dict[str, Any]:
    """The values of encoded metadata (as :func:`from_h5` encodes them)."""
    doc = doc or {"attrs": {}, "datasets": {}}
    return {
        "attrs": {obj: {k: _decode(v) for k, v in kv.items()} for obj, kv in doc["attrs"].items()},
        "datasets": {k: _decode(v) for k, v in doc["datasets"].items()},
    }


def _read(h5py: Any, dset: Any) -> Any:
    if h5py.check_string_dtype(dset.dtype) is not None:
        return dset.asstr()[()]
    return dset[()]


def _encode(h5py: Any, value: Any) -> dict[str, Any] | None:
    """A JSON form of an attribute or dataset value that decodes to the same value; None if none does."""
    if isinstance(value, (str, bytes)):
        return {"dtype": "str", "shape": None, "data": _text(value)}
    arr = np.asarray(value)
    if arr.dtype.kind in "OSU":
        try:
            data = np.vectorize(_text, otypes=[object])(arr).tolist() if arr.size else []
        except (TypeError, UnicodeDecodeError):
            return None
        return {"dtype": "str", "shape": list(arr.shape), "data": data}
    if arr.dtype.kind not in "biuf" or arr.dtype.fields is not None:
        return None
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.tolist()}


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, str):
        return value
    raise TypeError(f"not text: {value!r}")


def _decode(v: dict[str, Any]) -> Any:
    if v["shape"] is None:
        return v["data"]
    if v["dtype"] == "str":
        out = np.empty(v["shape"], dtype=object)
        out[...] = v["data"]
        return out
    return np.array(v["data"], dtype=np.dtype(v["dtype"])).reshape(v["shape"])
