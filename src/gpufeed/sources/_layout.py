"""Where each row of a field lives: a table of extents, and the reads that fetch a list of row runs."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from ._runs import Runs
from .base import Field

#: Reads as four parallel lists: file index, file offset, byte count, output offset.
ReadLists = tuple[list[int], list[int], list[int], list[int]]
#: The same as int64 arrays; the file is one int when every read is in the same file.
ReadArrays = tuple[int | np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class Extent(NamedTuple):
    """Consecutive rows of a field stored in one place.

    ``offset >= 0``: the rows lie back to back in file ``file`` from that byte offset (read by offset).
    ``offset == -1``: they are rows ``row0..`` of HDF5 dataset ``dataset`` in that file (read through h5py).
    """

    file: int
    offset: int
    rows: int
    row0: int = 0
    dataset: str | None = None


class ByteRead(NamedTuple):
    """Read ``nbytes`` from byte ``file_offset`` of file ``file`` into byte ``out_offset`` of the output."""

    file: int
    file_offset: int
    nbytes: int
    out_offset: int


class Layout:
    """The extents of one field, concatenated along samples.

    Example:
        >>> lay = Layout(Field("x", (), torch.uint8), [Extent(0, 128, 10), Extent(1, 0, 5)])
        >>> lay.byte_reads(Runs(np.arange(8, 12)))  # files, file offsets, bytes, out offsets
        ([0, 1], [136, 0], [2, 2], [0, 2])
    """

    def __init__(self, field: Field, extents: Sequence[Extent]) -> None:
        self.field = field
        self.row_nbytes = field.sample_nbytes
        self.extents = [e for e in extents if e.rows > 0]
        self.starts = [0]
        for e in self.extents:
            self.starts.append(self.starts[-1] + e.rows)
        # Arrays for the vectorized plan: extent boundaries, first rows, offsets and files.
        self._bounds = np.array(self.starts[1:-1], dtype=np.int64)
        self._first = np.array(self.starts[:-1], dtype=np.int64)
        self._offsets = np.array([e.offset for e in self.extents], dtype=np.int64)
        self._files = np.array([e.file for e in self.extents], dtype=np.int64)
        self._one_file = self.extents[0].file if len(set(self._files.tolist())) == 1 else None

    @functools.cached_property
    def by_offset(self) -> bool:
        """True when every row can be read by byte offset (no h5py extent); asked on every read."""
        return all(e.offset >= 0 for e in self.extents)

    def __len__(self) -> int:
        return self.starts[-1]

    def row_offsets(self, rows: np.ndarray) -> tuple[int | np.ndarray, np.ndarray]:
        """The file (one index when every extent is in one file, else one per row) and byte offset of
        each of ``rows`` (every extent by offset)."""
        rn = self.row_nbytes
        if len(self.extents) == 1:
            e = self.extents[0]
            return e.file, e.offset + rows * rn
        i = np.searchsorted(self._bounds, rows, side="right")
        offsets = self._offsets[i] + (rows - self._first[i]) * rn
        return (self._one_file if self._one_file is not None else self._files[i]), offsets

    def split(self, runs: Sequence[tuple[int, int]]) -> Iterator[tuple[Extent, int, int, int]]:
        """Yield ``(extent, first row in the extent, rows, first output row)`` covering ``runs`` in order."""
        starts, extents = self.starts, self.extents
        single = len(extents) == 1
        out_row = 0
        for a, b in runs:
            while a < b:
                i = 0 if single else bisect.bisect_right(starts, a) - 1
                end = min(b, starts[i + 1])
                yield extents[i], a - starts[i], end - a, out_row
                out_row += end - a
                a = end

    def byte_reads(self, runs: Runs) -> ReadLists:
        """The reads of ``runs`` (every extent by offset), planned with numpy: one read per run and extent.

        A batch of random rows has thousands of runs; planning them in numpy keeps the Python work per
        read (which holds the GIL that the reader threads share) to the ``preadv`` call itself.
        """
        rn = self.row_nbytes
        if runs.rows is None:  # one run or none
            if runs.one is None:
                return [], [], [], []
            if len(self.extents) > 1:
                return self._split_reads([runs.one])
            (a, b), e = runs.one, self.extents[0]
            return [e.file], [e.offset + a * rn], [(b - a) * rn], [0]
        files, fo, nb, oo = self.read_arrays(runs)
        per_file = [files] * len(nb) if isinstance(files, int) else files.tolist()
        return per_file, fo.tolist(), nb.tolist(), oo.tolist()

    def reads(self, runs: Runs) -> ReadLists | ReadArrays:
        """The reads of ``runs`` as ``pread_many`` takes them: the few of one run as lists (packed without
        numpy, whose cost per call would be most of a sequential batch's), those of rows as arrays."""
        return self.byte_reads(runs) if runs.rows is None else self.read_arrays(runs)

    def read_arrays(self, runs: Runs) -> ReadArrays:
        """``byte_reads`` of runs given as rows, as int64 arrays; the file is one int when every read is in
        the same file (one extent, or several of one file)."""
        rn = self.row_nbytes
        starts, stops = runs.starts, runs.stops
        if len(self.extents) == 1:
            e = self.extents[0]
            files: int | np.ndarray = e.file
            fo = e.offset + starts * rn
        else:
            i0 = np.searchsorted(self._bounds, starts, side="right")
            if (np.searchsorted(self._bounds, stops - 1, side="right") != i0).any():
                # a run crosses extents: rare, plan in Python
                files, fo, nb, oo = (np.array(c, dtype=np.int64) for c in self._split_reads(runs.pairs()))
                return self._one_file if self._one_file is not None else files, fo, nb, oo
            files = self._one_file if self._one_file is not None else self._files[i0]
            fo = self._offsets[i0] + (starts - self._first[i0]) * rn
        nb = (stops - starts) * rn
        return files, fo, nb, np.cumsum(nb) - nb

    def _split_reads(self, runs: Sequence[tuple[int, int]]) -> ReadLists:
        """``byte_reads`` for runs that cross extents, with reads adjacent in file and output merged."""
        rn = self.row_nbytes
        reads: list[ByteRead] = []
        for ext, r, k, o in self.split(runs):
            fo, nb, oo = ext.offset + r * rn, k * rn, o * rn
            if reads:
                last = reads[-1]
                if (
                    last.file == ext.file
                    and last.file_offset + last.nbytes == fo
                    and last.out_offset + last.nbytes == oo
                ):
                    reads[-1] = ByteRead(last.file, last.file_offset, last.nbytes + nb, last.out_offset)
                    continue
            reads.append(ByteRead(ext.file, fo, nb, oo))
        files, fos, nbs, oos = (list(col) for col in zip(*reads, strict=True))
        return files, fos, nbs, oos


def merge_extents(extents: Sequence[Extent], row_nbytes: int) -> list[Extent]:
    """Join by-offset extents that follow each other in the same file (e.g. chunks written in order)."""
    out: list[Extent] = []
    for e in extents:
        if out:
            last = out[-1]
            if (
                e.offset >= 0
                and last.offset >= 0
                and last.file == e.file
                and last.offset + last.rows * row_nbytes == e.offset
            ):
                out[-1] = last._replace(rows=last.rows + e.rows)
                continue
        out.append(e)
    return out
