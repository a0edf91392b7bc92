"""Datasets and samplers for DataLoader workers: a module of its own, so spawned workers can import them.

"Once" behaviours (raise once, kill once) use a flag file, because every worker process has its own
memory: the first process to create the file does the deed, every later call behaves.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler


def _first_time(flag: str) -> bool:
    try:
        fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


class Rows(Dataset):
    """Sample ``i`` is ``{"x": [i] * 4 (int64), "i": i}``; optional misbehaviour at one index."""

    def __init__(self, n: int, at: int = -1, flag: str = "", what: str = "", delay: float = 0.0) -> None:
        self.n, self.at, self.flag, self.what, self.delay = n, at, flag, what, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.at:
            if self.what == "slow":
                time.sleep(self.delay)
            elif self.flag and _first_time(self.flag):
                if self.what == "raise":
                    raise ValueError(f"dataset failed at index {i}")
                if self.what == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
        return {"x": torch.full((4,), i, dtype=torch.int64), "i": i}


class RaisingSampler(Sampler):
    """A sampler whose ``__iter__`` raises once: the DataLoader's iterator fails as it starts."""

    def __init__(self, n: int, flag: str) -> None:
        self.n, self.flag = n, flag

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if _first_time(self.flag):
            raise LookupError("sampler cannot start this epoch")
        return iter(range(self.n))


class SourceRows(Dataset):
    """Sample ``i`` of a BatchSource (RawSource or H5Source), read in the worker with ``source.read``.

    The source travels to spawned workers by pickling (paths only) and to forked workers by fork; either
    way the worker opens its own file descriptors and h5py files.
    """

    def __init__(self, source: Any) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        out = {k: torch.empty((1, *f.shape), dtype=f.dtype) for k, f in self.source.fields.items()}
        self.source.read(range(i, i + 1), out)
        return {k: v[0] for k, v in out.items()} | {"pid": torch.tensor(os.getpid())}


class TwoSourceRows(Dataset):
    """Sample ``i`` of two sources with the same rows: the first's fields as they are, the second's
    prefixed with ``b_``."""

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = SourceRows(a), SourceRows(b)

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.a[i] | {f"b_{k}": v for k, v in self.b[i].items()}
