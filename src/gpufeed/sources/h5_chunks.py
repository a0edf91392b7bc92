"""Compressed HDF5 chunks read by byte offset: the chunk table of a gzip dataset, and decoding on the CPU.

HDF5's deflate filter stores each chunk as one zlib stream (2-byte header, raw deflate, adler32), after the
shuffle filter's byte transpose when ``shuffle=True``. ``ChunkTable`` records where every chunk lies in the
file (``chunk_iter`` / ``get_chunk_info``, read once), so a read needs no h5py: ``os.preadv`` the chunk,
``zlib.decompress`` it (which releases the GIL, so reader threads decode in parallel where h5py's one
lock would serialize them), undo the shuffle with numpy and copy the wanted rows out.
``gpufeed.sources._gpu_inflate`` decodes the same chunks on the GPU with nvCOMP.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ._files import pread_exact

#: HDF5 filter ids (H5Zpublic.h).
DEFLATE, SHUFFLE = 1, 2
#: Filter pipelines gpufeed decodes itself, in HDF5's order (the first is applied first when writing).
DECODABLE = {(DEFLATE,): "gzip", (SHUFFLE, DEFLATE): "shuffle+gzip"}
#: zlib's stream framing around the raw deflate data: a 2-byte header and a 4-byte adler32 trailer.
ZLIB_HEADER, ZLIB_TRAILER = 2, 4


class CorruptChunkError(OSError):
    """A compressed HDF5 chunk that does not decode; the message names the file, the dataset and the chunk."""


class Band(NamedTuple):
    """The rows of one read that fall in one band of chunks (chunks sharing their first-axis range).

    ``lr``: rows inside the band (0 .. chunk rows), ``pos``: their rows in the output; each a ``slice``
    when consecutive (copied as one block), else an int64 array.
    """

    index: int
    lr: slice | np.ndarray
    pos: slice | np.ndarray


@dataclass(frozen=True, eq=False)
class ChunkTable:
    """Where every chunk of one chunked gzip (or shuffle+gzip) dataset is stored.

    Invariants: every chunk of the grid is stored, unfiltered by no filter (filter mask 0), so chunk ``i``
    (C order over the chunk grid) is ``sizes[i]`` bytes at ``offsets[i]`` of ``path`` and decodes to
    exactly ``chunk_nbytes`` bytes. Edge chunks are stored full size (HDF5 pads them); only their part
    inside the dataset is copied out. Immutable, so reader threads share it without a lock.
    """

    path: str
    dataset: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    itemsize: int
    shuffle: bool
    level: int
    offsets: np.ndarray
    sizes: np.ndarray

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-s // c) for s, c in zip(self.shape, self.chunks, strict=True))

    @property
    def per_band(self) -> int:
        """Chunks in one band: the chunk grid over the sample axes."""
        return math.prod(self.grid[1:])

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunks) * self.itemsize

    @property
    def stored_nbytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def filters(self) -> str:
        return "shuffle+gzip" if self.shuffle else "gzip"

    def chunk_byte_shape(self) -> tuple[int, ...]:
        """A decoded chunk as bytes: its shape with the last axis counted in bytes."""
        return _byte_shape(self.chunks, self.itemsize)

    def sample_byte_shape(self) -> tuple[int, ...]:
        """One output row as bytes (the sample's shape, last axis in bytes)."""
        return _byte_shape(self.shape, self.itemsize)[1:]

    def bands(self, rows: np.ndarray, pos: np.ndarray) -> list[Band]:
        """Group dataset rows ``rows`` (going to output rows ``pos``) by band, bands in ascending order."""
        c0 = self.chunks[0]
        band = rows // c0
        if not band.size:
            return []
        if band[0] == band[-1] == band.min() == band.max():  # e.g. consecutive rows in one chunk: one band
            return [Band(int(band[0]), _compact(rows - band[0] * c0), _compact(pos))]
        order = np.argsort(band, kind="stable")
        band, rows, pos = band[order], rows[order], pos[order]
        cuts = np.flatnonzero(np.diff(band)) + 1
        out = []
        for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, band.size].tolist(), strict=True):
            i = int(band[a])
            out.append(Band(i, _compact(rows[a:b] - i * c0), _compact(pos[a:b])))
        return out

    def pieces(self) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
        """Per chunk of a band (C order): ``(where it goes in an output row, which part of the chunk)``,
        as slices over the sample axes in bytes."""
        return _pieces(self.shape, self.chunks, self.itemsize)

    def chunk_ids(self, bands: list[Band]) -> np.ndarray:
        """The chunks of ``bands``, band after band."""
        per = self.per_band
        return (np.array([b.index for b in bands], dtype=np.int64)[:, None] * per + np.arange(per)).ravel()

    def corrupt(self, chunk: int, why: str) -> CorruptChunkError:
        """The error for chunk ``chunk`` that did not decode (``why``)."""
        grid_index = np.unravel_index(chunk, self.grid)
        corner = tuple(int(g) * c for g, c in zip(grid_index, self.chunks, strict=True))
        return CorruptChunkError(
            f"{self.path}: dataset '{self.dataset}': chunk {chunk} (starting at element {corner}, "
            f"{int(self.sizes[chunk])} bytes at byte offset {int(self.offsets[chunk])}) is corrupt: {why}; "
            "the file is damaged, or it was rewritten while this read ran (a file seen changed raises "
            f"FileChangedError instead): recreate the source; if this persists, check the file with "
            f"h5dump -d {self.dataset}"
        )


def chunk_table(dset: Any, path: str) -> ChunkTable | str:
    """The chunk table of a chunked dataset with a filter pipeline gpufeed decodes, else why not (a reason
    that starts with the filters, for ``describe()``)."""
    dcpl = dset.id.get_create_plist()
    filters = [dcpl.get_filter(i) for i in range(dcpl.get_nfilters())]
    codes = tuple(int(f[0]) for f in filters)
    if codes not in DECODABLE:
        names = "+".join(f[3].decode(errors="replace") for f in filters)
        return f"filters {names}: gpufeed decodes gzip and shuffle+gzip only (HDF5 decodes these chunks)"
    level = int(filters[-1][2][0]) if len(filters[-1][2]) else -1
    chunks = tuple(int(c) for c in dset.chunks)
    shape = tuple(int(s) for s in dset.shape)
    grid = tuple(-(-s // c) for s, c in zip(shape, chunks, strict=True))
    offsets = np.full(math.prod(grid), -1, dtype=np.int64)
    sizes = np.zeros(offsets.size, dtype=np.int64)
    for info in _stored_chunks(dset.id):
        if info.filter_mask != 0:
            return f"chunk at {tuple(info.chunk_offset)} skipped filters (filter mask {info.filter_mask})"
        if info.byte_offset is None:
            continue
        i = np.ravel_multi_index(tuple(o // c for o, c in zip(info.chunk_offset, chunks, strict=True)), grid)
        offsets[i], sizes[i] = info.byte_offset, info.size
    missing = int((offsets < 0).sum())
    if missing:
        return f"{missing} of {offsets.size} chunks never written (fill value)"
    return ChunkTable(path, dset.name, shape, chunks, dset.dtype.itemsize, codes[0] == SHUFFLE, level,
                      offsets, sizes)


def _stored_chunks(h5d: Any) -> Iterator[Any]:
    if hasattr(h5d, "chunk_iter"):  # HDF5 >= 1.12.3: one pass over the chunk index
        found: list[Any] = []
        h5d.chunk_iter(found.append)
        return iter(found)
    return (h5d.get_chunk_info(i) for i in range(h5d.get_num_chunks()))


def read_rows(table: ChunkTable, fd: int, rows: np.ndarray, pos: np.ndarray, out: np.ndarray) -> None:
    """Decode, on this thread, every chunk that holds one of ``rows`` and copy ``rows`` into ``out[pos]``.

    ``out`` is the output as bytes, ``(n, *table.sample_byte_shape())``. Each chunk is decoded once per
    call, so a read of shuffled rows costs a whole chunk for every chunk it touches.
    """
    pieces = table.pieces()
    for band in table.bands(rows, pos):
        for j, (dst, src) in enumerate(pieces):
            chunk = inflate(table, fd, band.index * table.per_band + j)
            out[(band.pos, *dst)] = chunk[(band.lr, *src)]


def inflate(table: ChunkTable, fd: int, chunk: int) -> np.ndarray:
    """Chunk ``chunk`` read and decoded, as bytes of shape ``table.chunk_byte_shape()``."""
    raw = bytearray(int(table.sizes[chunk]))
    pread_exact(fd, memoryview(raw), int(table.offsets[chunk]), table.path)
    inflater = zlib.decompressobj()
    try:  # at most one byte more than a chunk holds: a corrupt chunk cannot inflate without bound
        data = inflater.decompress(raw, table.chunk_nbytes + 1)
    except zlib.error as exc:  # a bad header, bad deflate data, or an adler32 mismatch
        raise table.corrupt(chunk, f"zlib: {exc}") from None
    if len(data) > table.chunk_nbytes:
        raise table.corrupt(chunk, f"it decodes to more than the {table.chunk_nbytes} bytes a chunk holds")
    if not inflater.eof:
        raise table.corrupt(chunk, "zlib: incomplete or truncated stream")
    if len(data) != table.chunk_nbytes:
        raise table.corrupt(chunk, f"it decodes to {len(data)} bytes, a chunk holds {table.chunk_nbytes}")
    arr = np.frombuffer(data, dtype=np.uint8)
    if table.shuffle:
        arr = unshuffle(arr, table.itemsize)
    return arr.reshape(table.chunk_byte_shape())


def unshuffle(planes: np.ndarray, itemsize: int) -> np.ndarray:
    """Undo the shuffle filter, which stores byte 0 of every element, then byte 1, ...: one strided copy per
    byte plane, where numpy's copy of the transposed array walks it in tiny steps (docs/design.md)."""
    out = np.empty_like(planes)
    m = planes.size // itemsize
    elements = out.reshape(m, itemsize)
    for j in range(itemsize):
        elements[:, j] = planes[j * m : (j + 1) * m]
    return out


def describe(table: ChunkTable) -> str:
    """A short account of a chunk table for ``H5Source.describe()``."""
    ratio = table.chunk_nbytes * table.sizes.size / max(1, table.stored_nbytes)
    return (f"{table.filters} (deflate level {table.level}), {table.sizes.size} chunks of {table.chunks}, "
            f"compression ratio {ratio:.2f}")


def _byte_shape(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    if len(shape) == 1:
        return (shape[0], itemsize)
    return (*shape[:-1], shape[-1] * itemsize)


def _pieces(shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int):
    dims = [(s, c) for s, c in zip(shape[1:], chunks[1:], strict=True)]
    if not dims:
        return [((slice(None),), (slice(None),))]
    per_axis = []
    for axis, (s, c) in enumerate(dims):
        k = itemsize if axis == len(dims) - 1 else 1  # the last axis counts bytes
        ends = [(g * c, min(s, (g + 1) * c)) for g in range(-(-s // c))]
        per_axis.append([(slice(a * k, b * k), slice(0, (b - a) * k)) for a, b in ends])
    out = []
    for combo in np.ndindex(*(len(a) for a in per_axis)):
        picked = [per_axis[axis][g] for axis, g in enumerate(combo)]
        out.append((tuple(p[0] for p in picked), tuple(p[1] for p in picked)))
    return out


def _compact(a: np.ndarray) -> slice | np.ndarray:
    """``a`` as a slice when it counts up by one (a block copy), else as it is."""
    if a.size and int(a[-1]) - int(a[0]) == a.size - 1 and (a.size < 3 or bool((np.diff(a) == 1).all())):
        return slice(int(a[0]), int(a[-1]) + 1)
    return a


