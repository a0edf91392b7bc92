"""Gzip HDF5 chunks decoded on the GPU: the compressed bytes cross the link, nvCOMP inflates them, torch
undoes the shuffle filter and copies the wanted rows into the output, all on one stream per read.

``decode_stream`` gives a read its stream; ``inflate_rows`` queues one dataset's part of the read on it
and returns a ``Pending`` check that raises, once the stream is synchronized, for a chunk whose nvCOMP
status, decoded size or adler32 is wrong. nvCOMP itself validates little ("passing corrupt data leads to
undefined behavior", deflate.h), so the adler32 every zlib stream carries is checked on the GPU too.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from gpufeed import host_memory

from ._files import pread_exact
from ._out_tensors import host_bytes
from .h5_chunks import ZLIB_HEADER, ZLIB_TRAILER, ChunkTable

_ADLER = 65521  # the adler32 modulus
_WARNED = False
_WARN_LOCK = threading.Lock()


def use_gpu(decode: str, where: str) -> bool:
    """Whether gzip chunks are decoded on the GPU, for ``H5Source(decode=...)``.

    Only with ``"gpu"``, and only where CUDA and nvCOMP are there: a missing one warns once per process and
    falls back to the reader threads, never an error. ``"auto"`` is the reader threads: the GPU path is
    several times faster (docs/design.md), but it holds each batch's decoded chunks in device memory, up to
    ``num_threads`` batches at once (for shuffled rows, a whole chunk per row), memory a training process
    asks for, not one it should find taken.
    """
    if decode != "gpu":
        return False
    if not torch.cuda.is_available():
        _warn_once(f"{where}: decode='gpu' but CUDA is not available; gzip chunks are decoded by reader "
                   "threads on the CPU")
        return False
    try:
        from . import _nvcomp

        _nvcomp.load()
    except ImportError as exc:
        _warn_once(f"{where}: gzip chunks are decoded by reader threads on the CPU, not the GPU: {exc}")
        return False
    return True


def _warn_once(message: str) -> None:
    global _WARNED
    with _WARN_LOCK:
        if _WARNED:
            return
        _WARNED = True
    warnings.warn(message, RuntimeWarning, stacklevel=4)


_STREAMS: dict[int, list[torch.cuda.Stream]] = {}
_STREAMS_LOCK = threading.Lock()


@contextlib.contextmanager
def decode_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """A stream of this process's pool (one per concurrent read, made once: never one per read or epoch)
    made current on ``device``. It first waits for the caller's current stream (whatever produced ``out``
    is done before it is written) and is synchronized before the context exits, also on an error: a
    read returns with every byte in place and no kernel still writing memory the caller may free."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STREAMS_LOCK:
        free = _STREAMS.setdefault(index, [])
        stream = free.pop() if free else None
    if stream is None:
        stream = torch.cuda.Stream(index)
    try:
        with torch.cuda.device(index):
            stream.wait_stream(torch.cuda.current_stream(index))
            try:
                with torch.cuda.stream(stream):
                    yield stream
            finally:
                stream.synchronize()
    finally:
        with _STREAMS_LOCK:
            _STREAMS[index].append(stream)


class Pending:
    """The checks of one ``inflate_rows``, read back after its stream is synchronized."""

    def __init__(self, table: ChunkTable, ids: np.ndarray, results: torch.Tensor, adler: np.ndarray) -> None:
        self.table, self.ids, self.results, self.adler = table, ids, results, adler

    def check(self) -> None:
        """Raise ``CorruptChunkError`` for the first chunk whose status, size or adler32 is wrong."""
        status, size, a, b = self.results.cpu().numpy()
        want = self.table.chunk_nbytes
        for i in np.flatnonzero((status != 0) | (size != want) | (a != self.adler[0]) | (b != self.adler[1])):
            chunk = int(self.ids[i])
            if status[i] != 0:
                why = f"nvCOMP could not decode it (nvcompStatus_t {int(status[i])})"
            elif size[i] != want:
                why = f"it decodes to {int(size[i])} bytes, a chunk holds {want}"
            else:
                why = "its adler32 checksum does not match the decoded bytes"
            raise self.table.corrupt(chunk, why)


def inflate_rows(nv: Any, table: ChunkTable, fd: int, rows: np.ndarray, pos: np.ndarray, out: torch.Tensor,
                 stream: int) -> Pending:
    """Queue on the current stream: decode every chunk holding one of ``rows``, copy ``rows`` to ``out[pos]``.

    ``out`` is the output as bytes, ``(n, *table.sample_byte_shape())``, on the device; ``nv`` is
    ``_nvcomp.load()`` (or a stand-in with its three calls, for tests on the CPU); ``stream`` its
    ``cudaStream_t``. Bytes of a bad zlib header raise here; the rest is checked by ``Pending.check``.
    """
    bands = table.bands(rows, pos)
    ids = table.chunk_ids(bands)
    host, starts, adler = _stage(table, fd, ids, max(8, nv.alignments[0]))
    dev = host.to(out.device, non_blocking=True)
    chunks, results = _decode(nv, table, dev, starts, ids, out.device, stream)
    pieces = table.pieces()
    for b, band in enumerate(bands):
        lr, dst_rows = _index(band.lr, out.device), _index(band.pos, out.device)
        for j, (dst, src) in enumerate(pieces):
            out[(dst_rows, *dst)] = chunks[b * table.per_band + j][(lr, *src)]
    return Pending(table, ids, results, adler)


def _stage(table: ChunkTable, fd: int, ids: np.ndarray, align: int) -> tuple[torch.Tensor, np.ndarray, Any]:
    """Read chunks ``ids`` into one host buffer (pinned with CUDA), each placed so that its raw deflate data,
    after the 2-byte zlib header, starts ``align``-aligned as nvCOMP requires. Returns the buffer, where
    each chunk starts in it, and the adler32 halves (a, b) each chunk's trailer expects."""
    sizes = table.sizes[ids]
    slots = -(-(sizes + align - ZLIB_HEADER) // align) * align
    starts = np.cumsum(slots) - slots + (align - ZLIB_HEADER)
    total = int(slots.sum())
    cuda = torch.cuda.is_available()
    host = host_memory.pinned_empty(total) if cuda else torch.empty(total, dtype=torch.uint8)
    mv = host_bytes(host, total)
    for chunk, start, size in zip(ids.tolist(), starts.tolist(), sizes.tolist(), strict=True):
        pread_exact(fd, mv[start : start + size], int(table.offsets[chunk]), table.path)
    raw = np.frombuffer(mv, dtype=np.uint8)
    _check_headers(table, ids, raw[starts].astype(np.int64), raw[starts + 1].astype(np.int64), sizes)
    tail = raw[(starts + sizes - ZLIB_TRAILER)[:, None] + np.arange(4)].astype(np.int64)
    word = (tail[:, 0] << 24) | (tail[:, 1] << 16) | (tail[:, 2] << 8) | tail[:, 3]  # big-endian
    return host, starts, np.stack([word & 0xFFFF, word >> 16])


def _check_headers(table: ChunkTable, ids: np.ndarray, cmf: np.ndarray, flg: np.ndarray, sizes: np.ndarray):
    # RFC 1950: method 8 (deflate), window <= 32 KiB, header a multiple of 31, no preset dictionary.
    bad = ((cmf & 0x0F) != 8) | ((cmf >> 4) > 7) | ((cmf * 256 + flg) % 31 != 0) | ((flg & 0x20) != 0)
    bad |= sizes < ZLIB_HEADER + ZLIB_TRAILER + 1
    for i in np.flatnonzero(bad)[:1].tolist():
        raise table.corrupt(int(ids[i]), f"it is not a zlib stream (header bytes {int(cmf[i]):#04x} "
                                         f"{int(flg[i]):#04x}, {int(sizes[i])} bytes)")


def _decode(nv: Any, table: ChunkTable, dev: torch.Tensor, starts: np.ndarray, ids: np.ndarray,
            device: torch.device, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nvCOMP inflates every chunk into one scratch buffer; returns the chunks as ``(k, *chunk byte
    shape)`` (shuffle undone) and a ``(4, k)`` int64 tensor: status, decoded size, adler32 a and b."""
    k, nb = len(ids), table.chunk_nbytes
    stride = -(-nb // max(16, nv.alignments[1])) * max(16, nv.alignments[1])
    scratch = torch.empty(k * stride, dtype=torch.uint8, device=device)
    meta = np.empty((4, k), dtype=np.int64)  # compressed pointers, compressed sizes, buffer sizes, outputs
    meta[0] = dev.data_ptr() + starts + ZLIB_HEADER
    meta[1] = table.sizes[ids] - ZLIB_HEADER - ZLIB_TRAILER
    meta[2] = nb
    meta[3] = scratch.data_ptr() + np.arange(k, dtype=np.int64) * stride
    host_meta = torch.from_numpy(meta)
    host_meta = host_memory.pin(host_meta) if device.type == "cuda" else host_meta
    meta_dev = host_meta.to(device, non_blocking=True)
    sizes = torch.full((k,), -1, dtype=torch.int64, device=device)  # -1 until nvCOMP writes the size
    statuses = torch.zeros(k, dtype=torch.int32, device=device)
    temp_bytes = nv.temp_bytes(k, nb, k * nb, stream)
    temp = torch.empty(max(1, temp_bytes), dtype=torch.uint8, device=device)
    row = meta_dev.stride(0) * meta_dev.element_size()
    base = meta_dev.data_ptr()
    nv.decompress(base, base + row, base + 2 * row, sizes.data_ptr(), k, temp.data_ptr(), temp_bytes,
                  base + 3 * row, statuses.data_ptr(), stream)
    flat = scratch.view(k, stride)[:, :nb]
    a, b = _adler32(flat)
    results = torch.stack([statuses.to(torch.int64), sizes, a, b])
    if table.shuffle:  # byte planes (itemsize, elements) back to elements of itemsize bytes
        flat = flat.unflatten(1, (table.itemsize, nb // table.itemsize)).transpose(1, 2).contiguous()
        flat = flat.view(k, nb)
    return flat.unflatten(1, table.chunk_byte_shape()), results


_WEIGHTS: dict[tuple[str, int], torch.Tensor] = {}


def _adler32(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """adler32 of each row of ``flat`` (k, n) uint8, as its halves a and b (int64, shape (k,)).

    a = 1 + sum(d) and b = n + sum((n - i) d_i), both mod 65521. The weights are reduced mod 65521 first,
    so each product fits int32 and the int64 sums cannot overflow for any chunk HDF5 can store (< 4 GiB).
    """
    k, n = flat.shape
    key = (str(flat.device), n)
    w = _WEIGHTS.get(key)
    if w is None:
        w = (n - torch.arange(n, device=flat.device, dtype=torch.int64)) % _ADLER
        w = _WEIGHTS[key] = w.to(torch.int32)
    step = max(1, (64 << 20) // max(1, 4 * n))  # rows at a time: int32 temporaries of at most 64 MiB
    a_parts, b_parts = [], []
    for r in range(0, k, step):
        d = flat[r : r + step].to(torch.int32)
        a_parts.append(d.sum(1, dtype=torch.int64))
        b_parts.append((d * w).sum(1, dtype=torch.int64))
    a = (1 + torch.cat(a_parts)) % _ADLER
    b = (n + torch.cat(b_parts)) % _ADLER
    return a, b


def _index(ix: slice | np.ndarray, device: torch.device) -> slice | torch.Tensor:
    return ix if isinstance(ix, slice) else torch.from_numpy(ix).to(device, non_blocking=True)
