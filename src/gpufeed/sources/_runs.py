"""The rows of one read: checked against the source's length, and split into runs of consecutive rows."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Rows


class Runs:
    """The rows of one read: a single run ``one = (start, stop)`` kept in plain Python (a range: no numpy
    at all), or an int64 array ``rows`` whose runs of consecutive rows (``starts``, ``stops``) are found
    only when needed: the gather path for scattered rows never needs them."""

    __slots__ = ("_count", "_starts", "_stops", "n", "one", "rows")

    def __init__(self, rows: np.ndarray) -> None:
        self.rows, self.one, self.n = rows, None, len(rows)
        self._starts = self._stops = None
        self._count = -1

    @classmethod
    def single(cls, start: int, stop: int) -> Runs:
        runs = cls.__new__(cls)
        runs.rows = runs._starts = runs._stops = None
        runs.one = (start, stop) if stop > start else None
        runs.n = max(0, stop - start)
        runs._count = 1 if runs.one else 0
        return runs

    @property
    def count(self) -> int:
        """The number of runs."""
        if self._count < 0:
            self._count = int(np.count_nonzero(np.diff(self.rows) != 1)) + 1 if self.n else 0
        return self._count

    @property
    def starts(self) -> np.ndarray:
        if self._starts is None:
            self._starts, self._stops = run_bounds(self.rows)
        return self._starts

    @property
    def stops(self) -> np.ndarray:
        if self._stops is None:
            self._starts, self._stops = run_bounds(self.rows)
        return self._stops

    def scattered(self, row_nbytes: int) -> bool:
        """Many short runs (a shuffled batch): a source may gather these rows from a memory map rather
        than issue one pread per run (``_gather.py`` says when).

        Each ``pread`` takes and drops the GIL; thousands of them from several threads spend more time
        handing the GIL over than copying, where one ``index_select`` per read copies every row with the
        GIL released. Long runs always keep ``pread``: they take few calls, so the hand-over costs little.
        """
        return (self.rows is not None and self.count >= 8
                and self.n * row_nbytes < self.count * (256 << 10))

    def pairs(self) -> list[tuple[int, int]]:
        if self.rows is None:
            return [self.one] if self.one else []
        return list(zip(self.starts.tolist(), self.stops.tolist(), strict=True))


def row_array(rows: Any, where: str = "") -> np.ndarray:
    """``rows`` (a range or a 1-D integer array) as an int64 array; a ValueError that says what to pass."""
    if isinstance(rows, range):
        return np.arange(rows.start, rows.stop, rows.step, dtype=np.int64)
    arr = np.asarray(rows)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(
            f"{where + ': ' if where else ''}rows must be a range or a 1-D integer array, got shape "
            f"{arr.shape} dtype {arr.dtype}; pass e.g. np.array([0, 5, 6], dtype=np.int64)"
        )
    return arr.astype(np.int64, copy=False)


def run_bounds(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if rows.size == 0:
        return rows, rows
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = rows[np.concatenate(([0], breaks))]
    stops = rows[np.concatenate((breaks - 1, [rows.size - 1]))] + 1
    return starts, stops


def check_rows(rows: Rows, num_samples: int, where: str) -> Runs:
    """The rows to read, checked; IndexError for rows out of range."""
    if type(rows) is range and rows.step == 1:  # the prefetcher's usual case: no numpy on this path
        a, b = rows.start, rows.stop
        if b <= a:
            return Runs.single(0, 0)
        if a < 0 or b > num_samples:
            _out_of_range(a if a < 0 else b - 1, num_samples, where)
        return Runs.single(a, b)
    arr = row_array(rows, where)
    if arr.size == 0:
        return Runs.single(0, 0)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_samples:
        _out_of_range(lo if lo < 0 else hi, num_samples, where)
    return Runs(arr)


def _out_of_range(row: int, num_samples: int, where: str) -> None:
    raise IndexError(
        f"{where}: row {row} is out of range for {num_samples} samples (valid: 0..{num_samples - 1})"
    )
