"""The BatchSource protocol: a collection of fixed-shape samples that writes rows into given tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch

#: Rows to read: a contiguous ``range(start, stop)`` (step 1) or a sorted 1-D int64 numpy array of indices.
Rows = range | np.ndarray


@dataclass(frozen=True)
class Field:
    """One named field of a source: every sample has the same ``shape`` and ``dtype``.

    Example:
        >>> Field("x", (3, 32, 32), torch.uint8).sample_nbytes
        3072
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def sample_nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * self.dtype.itemsize


@runtime_checkable
class BatchSource(Protocol):
    """A collection of ``len(source)`` samples with named fixed-shape ``fields``.

    ``read(rows, out)`` writes the given rows of every field into ``out[name][: len(rows)]``, in the order
    of ``rows``. ``out`` tensors are C-contiguous, of the field's dtype, with shape ``(len(rows), *shape)``;
    they live in pinned host memory when ``reads_to == "host"`` and on a CUDA device when
    ``reads_to == "device"``. ``read`` is called from several threads at once on disjoint ``out``
    views, so it must be thread-safe; it must either fill every byte or raise (a short read is an
    error, never silent garbage). Sampling, batching, shuffling and sharding live in gpufeed, not in
    the source.

    Optional: a source whose ``read`` spreads over threads of its own says so with a ``parallel_reads``
    attribute that is true; gpufeed then gives it a whole staging chunk per read rather than one piece
    per reader thread. Such a source may also have ``submit(rows, out)``, which starts that read and
    returns at once an object whose ``result(timeout=None)`` waits for it, raising what ``read`` would
    (or ``concurrent.futures.TimeoutError``), or returns None to have ``read`` called on a reader thread.

    Example:
        >>> src = RawSource("x.npy")                       # doctest: +SKIP
        >>> out = {"x": torch.empty(4, *src.fields["x"].shape, dtype=src.fields["x"].dtype)}
        >>> src.read(range(0, 4), out)                     # doctest: +SKIP
    """

    @property
    def fields(self) -> Mapping[str, Field]: ...

    @property
    def reads_to(self) -> Literal["host", "device"]: ...

    def __len__(self) -> int: ...

    def read(self, rows: Rows, out: Mapping[str, torch.Tensor]) -> None: ...

    def close(self) -> None: ...
