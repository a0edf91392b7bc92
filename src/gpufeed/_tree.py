"""Flatten a batch of any structure into its leaves, and rebuild the same structure around new leaves.

Tensors and numpy arrays are leaves that move, and so is an object of any other type that moves itself (a
custom batch type with a ``to`` method, as torch's pin-memory loop honours one with ``pin_memory``);
everything else (str, int, None) passes through untouched. Types are preserved: a namedtuple stays that
namedtuple, a dataclass the same dataclass, an OrderedDict an OrderedDict.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
import torch

#: A compiled rebuild function: takes the new leaves (in flatten order) and returns the batch.
Rebuild = Callable[[Sequence[Any]], Any]


def flatten(batch: Any, leaf: type | tuple[type, ...] = torch.Tensor) -> tuple[list[Any], Rebuild]:
    """Return the batch's tensors (numpy arrays converted, zero-copy) and a function that rebuilds it.

    With ``leaf``, the objects of that type (or types) are the leaves instead (and numpy arrays pass
    through).

    Example:
        >>> leaves, rebuild = flatten({"x": torch.ones(2), "n": 3})
        >>> rebuild([t * 2 for t in leaves])
        {'x': tensor([2., 2.]), 'n': 3}
    """
    kind = type(batch)
    if kind is dict or kind is list or kind is tuple:  # the common batch, flat: built without a tree
        values = list(batch.values()) if kind is dict else list(batch)
        if all([isinstance(v, leaf) for v in values]):  # (a list: no generator frame a leaf)
            if kind is dict:
                keys = list(batch)
                return values, lambda new: dict(zip(keys, new, strict=True))
            return values, kind
    leaves: list[Any] = []
    build = _compile(batch, leaves, leaf)
    return leaves, build


def _compile(obj: Any, leaves: list[Any], leaf: Any) -> Rebuild:
    if isinstance(obj, leaf):
        return _leaf(obj, leaves)
    if leaf is torch.Tensor and isinstance(obj, np.ndarray) and obj.dtype != object:
        return _leaf(torch.from_numpy(np.ascontiguousarray(obj)), leaves)
    if isinstance(obj, Mapping):
        return _compile_mapping(obj, leaves, leaf)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        parts = [_compile(v, leaves, leaf) for v in obj]
        cls = type(obj)
        return lambda new: cls(*(p(new) for p in parts))
    if isinstance(obj, (list, tuple)):
        parts = [_compile(v, leaves, leaf) for v in obj]
        cls = type(obj)
        if cls in (list, tuple):
            return lambda new: cls(p(new) for p in parts)
        return lambda new: _rebuild_sequence(obj, [p(new) for p in parts])
    if leaf is torch.Tensor and moves_itself(obj):
        return _leaf(obj, leaves)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _compile_dataclass(obj, leaves, leaf)
    return lambda new: obj


def moves_itself(obj: Any) -> bool:
    """Whether ``obj`` is a custom batch type that moves itself to a device (``obj.to(device)``)."""
    return (not isinstance(obj, (type, torch.Tensor, torch.nn.Module)) and callable(getattr(obj, "to", None)))


def _leaf(tensor: Any, leaves: list[Any]) -> Rebuild:
    i = len(leaves)
    leaves.append(tensor)
    return lambda new: new[i]


def _compile_mapping(obj: Mapping, leaves: list[Any], leaf: Any) -> Rebuild:
    keys = list(obj.keys())
    parts = [_compile(obj[k], leaves, leaf) for k in keys]
    cls = type(obj)
    if cls is dict:
        return lambda new: {k: p(new) for k, p in zip(keys, parts, strict=True)}

    def rebuild(new: Sequence[Any]) -> Any:
        items = [(k, p(new)) for k, p in zip(keys, parts, strict=True)]
        if isinstance(obj, MutableMapping):  # a copy keeps what the type holds beside its items (as torch's
            try:  # pin_memory and default_collate do): a defaultdict's factory, a ChainMap's maps
                clone = copy.copy(obj)
                for k, v in items:
                    clone[k] = v
                return clone
            except TypeError:
                pass
        try:
            return cls(items)  # immutable Mappings built from pairs
        except TypeError:
            return dict(items)

    return rebuild


def _rebuild_sequence(original: Sequence, items: list[Any]) -> Any:
    try:
        return type(original)(items)
    except TypeError:
        return list(items)


def _compile_dataclass(obj: Any, leaves: list[Any], leaf: Any) -> Rebuild:
    names = [f.name for f in dataclasses.fields(obj) if f.init]
    parts = [_compile(getattr(obj, n), leaves, leaf) for n in names]

    def rebuild(new: Sequence[Any]) -> Any:
        return dataclasses.replace(obj, **{n: p(new) for n, p in zip(names, parts, strict=True)})

    return rebuild
