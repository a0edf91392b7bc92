"""Which rows make up each batch: ordering, shuffling, batching and sharding across ranks.

Sources only read rows; every decision about *which* rows lives here, so that all sources shard and
shuffle the same way and every rank of a distributed job computes the same global plan on its own.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.random  # numpy loads it on first use: here, not in an epoch's first batch

from ._runs import row_array, run_bounds
from .base import Rows

Shuffle = bool | Literal["blocks"]


def plan_batches(
    num_samples: int,
    batch_size: int,
    *,
    shuffle: Shuffle = False,
    drop_last: bool = False,
    seed: int = 0,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
    pad: bool = False,
) -> list[Rows]:
    """Plan one epoch of batches for one rank.

    Every rank computes the same global plan from ``(seed, epoch)`` and keeps its share: global batch
    ``g`` goes to rank ``g % world_size``, so every rank gets the same number of batches, and the union
    over ranks covers each sample exactly once (``drop_last`` drops a tail instead; ``pad`` repeats
    samples from the start of the epoch's order to even the ranks out, like ``DistributedSampler``).

    Batches hold ``batch_size`` rows, except the last round of batches when the samples do not divide
    evenly: that remainder is spread over one batch per rank (over more rounds if needed so that no batch
    is empty), so every batch holds between 1 and ``batch_size`` rows.

    Args:
        num_samples: samples in the source (``len(source)``).
        batch_size: most rows per batch, >= 1.
        shuffle: ``False``: in order, each batch a contiguous ``range``. ``True``: a random permutation
            per epoch; each batch is a sorted int64 array (its membership is random, its rows come in
            ascending order, which lets sources merge adjacent rows into one read; order inside a batch
            does not matter for SGD). ``"blocks"``: the order of contiguous batch-sized blocks is
            shuffled, each batch still a ``range`` (fast sequential reads, coarser randomness: which
            rows share a batch never changes).
        drop_last: drop the samples that do not fill a whole round of ``world_size`` full batches, so every
            batch holds exactly ``batch_size`` rows (with shuffling, which samples are dropped changes
            every epoch).
        seed: seed of the shuffle; the same on every rank.
        epoch: epoch number; each epoch shuffles differently, deterministically.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks sharing the samples.
        pad: repeat samples so that every rank gets the same number of samples, as
            ``torch.utils.data.DistributedSampler`` does; needed when there are fewer samples than
            ``world_size`` non-empty batches could hold.

    Returns:
        This rank's batches, each a ``range`` (contiguous rows) or a sorted 1-D ``np.int64`` array.

    Raises:
        ValueError: on a bad argument, or when ``world_size`` ranks cannot get equally many non-empty
            batches without ``pad`` or ``drop_last`` (the message says which to pass).

    Example:
        >>> plan_batches(10, 4)
        [range(0, 4), range(4, 8), range(8, 10)]
        >>> plan_batches(10, 4, rank=1, world_size=2)
        [range(4, 8), range(9, 10)]
        >>> [len(b) for b in plan_batches(10, 4, shuffle=True, drop_last=True)]
        [4, 4]
    """
    _check_args(num_samples, batch_size, shuffle, drop_last, seed, epoch, rank, world_size, pad)
    rng = np.random.default_rng([seed, epoch])
    n, b, w = num_samples, batch_size, world_size
    if drop_last:
        bounds = _full_bounds(n // (b * w) * w, b)
    else:
        total = -(-n // w) * w if pad else n
        bounds = _balanced_bounds(total, b, w)
    if shuffle == "blocks":
        return _block_batches(bounds, n, b, w, rank, rng, drop_last)
    order = rng.permutation(n) if shuffle else None
    mine = bounds[rank::w]
    return [_batch(order, n, start, stop) for start, stop in mine]


def coalesce(rows: Rows) -> list[tuple[int, int]]:
    """Split rows into runs of consecutive indices, in the order given.

    Sources use it to turn a batch into as few reads as possible.

    Args:
        rows: a ``range`` or a 1-D integer array.

    Returns:
        ``(start, stop)`` pairs with ``stop > start``; reading ``range(start, stop)`` for each pair, in
        order, reads exactly ``rows``.

    Example:
        >>> coalesce(np.array([3, 4, 5, 9, 10, 2]))
        [(3, 6), (9, 11), (2, 3)]
        >>> coalesce(range(5, 8))
        [(5, 8)]
    """
    starts, stops = _runs(rows)
    return list(zip(starts.tolist(), stops.tolist(), strict=True))


def _runs(rows: Rows) -> tuple[np.ndarray, np.ndarray]:
    """``coalesce`` as two int64 arrays, ``starts`` and ``stops``, for vectorized planning."""
    if isinstance(rows, range) and rows.step == 1:
        n = 1 if rows.stop > rows.start else 0
        return np.full(n, rows.start, dtype=np.int64), np.full(n, rows.stop, dtype=np.int64)
    return run_bounds(row_array(rows))


def _check_args(n, b, shuffle, drop_last, seed, epoch, rank, world_size, pad) -> None:
    for name, value, low in (("num_samples", n, 0), ("batch_size", b, 1), ("world_size", world_size, 1)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
    if shuffle not in (False, True, "blocks"):
        raise ValueError(f"shuffle must be False, True or 'blocks', got {shuffle!r}")
    for name, value in (("seed", seed), ("epoch", epoch)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if drop_last and pad:
        raise ValueError("pass drop_last=True or pad=True, not both: one drops the tail, the other fills it")


def _full_bounds(num_batches: int, b: int) -> list[tuple[int, int]]:
    return [(i * b, (i + 1) * b) for i in range(num_batches)]


def _balanced_bounds(total: int, b: int, w: int) -> list[tuple[int, int]]:
    """Split positions ``[0, total)`` into ``k * w`` batches of 1..b rows: full ones, then a balanced tail.

    ``k = ceil(total / (b * w))`` batches per rank. The last ``t`` rounds share what the full rounds before
    them leave, evenly, with the smallest ``t`` that gives every batch at least one row.
    """
    if total == 0:
        return []
    k = -(-total // (b * w))
    for t in range(1, k + 1):
        rest = total - (k - t) * b * w
        if rest >= t * w:
            break
    else:
        raise ValueError(
            f"{total} samples cannot be split into {k} non-empty batches for each of {w} ranks; "
            "pass pad=True (repeat samples, like DistributedSampler) or drop_last=True"
        )
    bounds = _full_bounds((k - t) * w, b)
    pos = (k - t) * b * w
    q, r = divmod(rest, t * w)
    for i in range(t * w):
        size = q + (1 if i < r else 0)
        bounds.append((pos, pos + size))
        pos += size
    return bounds


def _batch(order: np.ndarray | None, n: int, start: int, stop: int) -> Rows:
    """Rows at positions ``[start, stop)`` of the epoch's order; positions past ``n`` wrap (padding)."""
    if order is None and stop <= n:
        return range(start, stop)
    pos = np.arange(start, stop, dtype=np.int64) % n
    rows = pos if order is None else order[pos]
    return np.sort(rows).astype(np.int64, copy=False)


def _block_batches(bounds, n, b, w, rank, rng, drop_last) -> list[Rows]:
    """Shuffle which batch-sized block comes when; each block keeps its contiguous rows."""
    if drop_last:
        # Draw the kept blocks from all full blocks, so the dropped rows change every epoch.
        blocks = _full_bounds(n // b, b)
        picked = rng.permutation(len(blocks))[: len(bounds)]
        chosen = [blocks[i] for i in picked]
    else:
        # Shuffle the full blocks, then the order of rounds of ``w`` blocks: a tail round (smaller
        # blocks, one per rank) lands anywhere in the epoch, and every rank still gets as many rows.
        full = [i for i, (a, c) in enumerate(bounds) if c - a == b]
        order = [full[i] for i in rng.permutation(len(full))] + list(range(len(full), len(bounds)))
        rounds = [order[i : i + w] for i in range(0, len(order), w)]
        chosen = [bounds[i] for r in rng.permutation(len(rounds)) for i in rounds[r]]
    return [_batch(None, n, start, stop) for start, stop in chosen[rank::w]]
