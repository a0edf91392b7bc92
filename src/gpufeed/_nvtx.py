"""NVTX ranges around each stage, costing nothing when off.

Set ``GPUFEED_NVTX=1`` to turn them on: the ``nvtx`` package (extra ``gpufeed[nvtx]``) when installed,
else ``torch.cuda.nvtx``. When off, :func:`range` is a shared no-op context manager swapped in at import.
"""

from __future__ import annotations

import contextlib
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
