"""A field's sample type from user arguments: the torch dtype and the per-sample shape, checked."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def torch_dtype(dtype: Any, where: str) -> torch.dtype:
    """Map a numpy-style or torch dtype to the torch dtype of the samples, or say why it cannot be read."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"{where}: {dtype!r} is not a dtype; pass e.g. 'float32' or torch.uint8") from exc
    if dt.hasobject:
        raise ValueError(
            f"{where}: dtype {dt} holds Python objects (e.g. variable-length strings); gpufeed reads "
            "fixed-size numeric samples only: store numbers (e.g. encode text as uint8 token arrays)"
        )
    if dt.fields is not None or dt.subdtype is not None:
        raise ValueError(
            f"{where}: structured dtype {dt} is not supported; store each member as its own field"
        )
    if not dt.isnative and dt.itemsize > 1:
        raise ValueError(
            f"{where}: dtype {dt.str} is not in this machine's byte order; rewrite the data with "
            f"arr.astype('{dt.newbyteorder('=').str}')"
        )
    try:
        return torch.from_numpy(np.empty(0, dt)).dtype
    except TypeError as exc:
        raise ValueError(
            f"{where}: dtype {dt} has no torch equivalent; store the samples as a numeric dtype"
        ) from exc


def sample_shape(shape: Any, where: str) -> tuple[int, ...]:
    """Normalize a per-sample shape (``None``, an int or a sequence of ints >= 0)."""
    if shape is None:
        return ()
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError as exc:
        raise ValueError(f"{where}: shape must be an int or a tuple of ints, got {shape!r}") from exc
    if any(d < 0 for d in dims):
        raise ValueError(f"{where}: shape must not have negative sizes, got {dims}")
    return dims
