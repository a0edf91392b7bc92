"""How a batch of a BatchSource lies in one host buffer (each field's region aligned to ``_staging.ALIGN``)
and is cut into *pieces* (rows ``[a, b)``: one ``source.read`` on a reader thread)."""

from __future__ import annotations

from typing import Any

from gpufeed._staging import aligned

#: The smallest read a batch is split into (a batch smaller than this is one read). Each read costs the
#: background threads GIL handoffs, and every handoff can delay the training thread, whose torch calls
#: each release and retake the GIL (docs/design.md, "Reading a BatchSource", has the figures).
MIN_READ_BYTES = 4 << 20
#: A staged batch that is one read this small runs on the fetching thread itself: handing it to a worker
#: costs GIL handoffs (submit, wake, result, wake), and each can delay the training thread's next torch call.
#: (A direct read always reads its first piece on the calling thread.)
INLINE_BYTES = 1 << 20


def split(total: int, piece: int) -> list[tuple[int, int]]:
    """``[(offset, n), ...]`` covering ``range(total)`` in pieces of at most ``piece``."""
    return [(off, min(piece, total - off)) for off in range(0, total, piece)]


def regions(fields: Any, nrows: int) -> tuple[dict[str, int], int]:
    """Byte offsets of each field's ``nrows`` rows inside one staging buffer, and the buffer's size."""
    offsets, off = {}, 0
    for k, f in fields.items():
        offsets[k] = off
        off += aligned(nrows * f.sample_nbytes)
    return offsets, off


def row_bytes(fields: Any) -> int:
    """The bytes of one sample of every field together."""
    return max(1, sum(f.sample_nbytes for f in fields.values()))


def pieces(r0: int, r1: int, nrows: int, threads: int, row: int,
           fill_bytes: int | None) -> list[tuple[int, int]]:
    """The reads of rows ``[r0, r1)`` of a batch of ``nrows`` rows of ``row`` bytes: one per reader thread
    for the batch, so every thread reads (like a 16-thread pread), but none under ``MIN_READ_BYTES`` (each
    read wakes a thread that takes the GIL, which a launch-bound training step waits for; small batches
    are read by one thread). A read into a staging buffer also fits one worker's share of it
    (``fill_bytes``)."""
    per = max(-(-nrows // threads), MIN_READ_BYTES // row)
    if fill_bytes is not None:
        per = min(fill_bytes // row, per)
    return [(r0 + a, r0 + a + k) for a, k in split(r1 - r0, max(1, per))]
