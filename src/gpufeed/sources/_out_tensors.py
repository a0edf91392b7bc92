"""The ``out`` tensors of a read: checked before any byte is read, and viewed as bytes to read into."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

import numpy as np
import torch

from .base import Field


def check_outs(
    fields: Mapping[str, Field], out: Mapping[str, torch.Tensor], n: int, device_type: str, where: str
) -> dict[str, torch.Tensor]:
    """``out_tensor`` for every field, all checked before any byte is read."""
    return {name: out_tensor(f, out, n, device_type, where) for name, f in fields.items()}


def out_tensor(
    field: Field, out: Mapping[str, torch.Tensor], n: int, device_type: str, where: str
) -> torch.Tensor:
    """``out[field.name]``, after checking it can take ``n`` rows of the field (cheap: runs per read)."""
    name = field.name
    try:
        t = out[name]
    except (KeyError, TypeError, IndexError):
        t = None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: out has no tensor for field '{name}'; pass one tensor per field in out")
    if t.dtype is not field.dtype:
        raise ValueError(f"{where}: out['{name}'] has dtype {t.dtype}, the field holds {field.dtype}")
    shape = t.shape
    if len(shape) != len(field.shape) + 1 or shape[1:] != field.shape:
        raise ValueError(f"{where}: out['{name}'] has shape {tuple(shape)}, expected (rows, *{field.shape})")
    if shape[0] < n:
        raise ValueError(
            f"{where}: out['{name}'] has room for {shape[0]} rows but {n} rows were asked; "
            f"pass a tensor of at least {n} rows"
        )
    if t.device.type != device_type:
        raise ValueError(
            f"{where}: out['{name}'] is on {t.device}, this source writes to {device_type} memory"
        )
    if not t.is_contiguous():
        raise ValueError(f"{where}: out['{name}'] must be C-contiguous; pass a contiguous tensor")
    return t


def host_bytes(t: torch.Tensor, nbytes: int) -> memoryview:
    """A writable byte view of the first ``nbytes`` of a contiguous host tensor (valid while ``t`` lives).

    Built from the data pointer: cheaper than slicing, reshaping, viewing as uint8 and converting to
    numpy, and it works for dtypes numpy lacks (bfloat16, float8).
    """
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def rows_bytes(t: torch.Tensor, n: int, row_nbytes: int) -> torch.Tensor:
    """The first ``n`` rows of a host tensor as an ``(n, row_nbytes)`` uint8 tensor (no torch op)."""
    raw = np.frombuffer(host_bytes(t, n * row_nbytes), dtype=np.uint8).reshape(n, row_nbytes)
    return torch.from_numpy(raw)


def device_bytes(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of a contiguous tensor as a flat uint8 tensor (for kvikio device reads)."""
    return t.reshape(-1).view(torch.uint8)[:nbytes]
