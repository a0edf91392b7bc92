"""NVTX ranges around each stage, costing nothing when off.

Set ``GPUFEED_NVTX=1`` to turn them on: the ``nvtx`` package (extra ``gpufeed[nvtx]``) when installed,
else ``torch.cuda.nvtx``. When off, :func:`range` is a shared no-op context manager swapped in at import,
and :func:`ranged` leaves the functions it decorates as they are.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

_NULL = contextlib.nullcontext()


def _off(name: str) -> contextlib.AbstractContextManager[Any]:
    return _NULL


def _pick() -> Callable[[str], contextlib.AbstractContextManager[Any]]:
    if os.environ.get("GPUFEED_NVTX", "0") in ("", "0", "false", "no"):
        return _off
    try:
        import nvtx

        return lambda name: nvtx.annotate(name, domain="gpufeed")
    except ImportError:
        import torch

        return torch.cuda.nvtx.range


range = _pick()
enabled = range is not _off


def ranged(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator that puts every call of a function in a range named ``name``; when off, the function
    itself, unwrapped (for the calls made every batch: a ``with`` on a no-op context manager costs three
    Python calls)."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not enabled:
            return fn

        @functools.wraps(fn)
        def in_range(*args: Any, **kwargs: Any) -> Any:
            with range(name):
                return fn(*args, **kwargs)
        return in_range
    return wrap
