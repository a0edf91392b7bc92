"""plan_batches: coverage, sharding, determinism, drop_last, padding, blocks; and coalesce."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gpufeed.sources import coalesce, plan_batches

SHUFFLES = st.sampled_from([False, True, "blocks"])
# Per-test settings, not a global profile: this module must not change other modules' hypothesis runs.
_settings = settings(max_examples=150, deadline=None)


def _rows(batch) -> list[int]:
    if isinstance(batch, range):
        assert batch.step == 1
        return list(batch)
    assert isinstance(batch, np.ndarray) and batch.dtype == np.int64 and batch.ndim == 1
    assert (np.diff(batch) >= 0).all(), "array batches come sorted"
    return batch.tolist()


def _all_ranks(n, b, w, **kw):
    return [plan_batches(n, b, rank=r, world_size=w, **kw) for r in range(w)]


def _feasible(n, b, w):
    """Equal non-empty batch counts without padding need n >= w * ceil(n / (b * w))."""
    return n >= w * -(-n // (b * w))


@_settings
@given(
    n=st.integers(0, 300),
    b=st.integers(1, 40),
    w=st.integers(1, 6),
    shuffle=SHUFFLES,
    seed=st.integers(0, 2**32 - 1),
    epoch=st.integers(0, 50),
)
def test_every_sample_exactly_once_with_equal_counts(n, b, w, shuffle, seed, epoch):
    assume(_feasible(n, b, w))
    plans = _all_ranks(n, b, w, shuffle=shuffle, seed=seed, epoch=epoch)
    assert len({len(p) for p in plans}) == 1, "every rank gets the same number of batches"
    seen = Counter(i for p in plans for batch in p for i in _rows(batch))
    assert sorted(seen) == list(range(n)) and set(seen.values()) <= {1}
    for p in plans:
        for batch in p:
            assert 1 <= len(batch) <= b
            if shuffle is not True:
                assert isinstance(batch, range), "sequential and block batches stay contiguous"


@_settings
@given(
    n=st.integers(0, 300),
    b=st.integers(1, 40),
    w=st.integers(1, 6),
    shuffle=SHUFFLES,
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 5),
)
def test_drop_last_gives_full_batches_and_drops_only_a_tail(n, b, w, shuffle, seed, epoch):
    plans = _all_ranks(n, b, w, shuffle=shuffle, drop_last=True, seed=seed, epoch=epoch)
    k = n // (b * w)
    assert all(len(p) == k for p in plans)
    rows = [i for p in plans for batch in p for i in _rows(batch)]
    assert all(len(batch) == b for p in plans for batch in p)
    assert len(rows) == len(set(rows)) == k * b * w
    assert n - len(rows) < b * w and all(0 <= i < n for i in rows)


@_settings
@given(
    n=st.integers(1, 300),
    b=st.integers(1, 40),
    w=st.integers(1, 8),
    shuffle=SHUFFLES,
    seed=st.integers(0, 1000),
)
def test_pad_covers_everything_with_equal_counts(n, b, w, shuffle, seed):
    plans = _all_ranks(n, b, w, shuffle=shuffle, pad=True, seed=seed)
    assert len({len(p) for p in plans}) == 1
    assert len({sum(len(batch) for batch in p) for p in plans}) == 1, "equal samples per rank"
    seen = Counter(i for p in plans for batch in p for i in _rows(batch))
    assert set(seen) == set(range(n))
    total = sum(seen.values())
    assert total == -(-n // w) * w, "padded to a multiple of world_size, like DistributedSampler"
    assert all(1 <= len(batch) <= b for p in plans for batch in p)


@_settings
@given(
    n=st.integers(1, 200),
    b=st.integers(1, 30),
    w=st.integers(1, 4),
    shuffle=SHUFFLES,
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 10),
    drop_last=st.booleans(),
)
def test_deterministic_for_seed_and_epoch(n, b, w, shuffle, seed, epoch, drop_last):
    assume(drop_last or _feasible(n, b, w))
    kw = dict(shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last)
    a, c = _all_ranks(n, b, w, **kw), _all_ranks(n, b, w, **kw)
    assert [[_rows(x) for x in p] for p in a] == [[_rows(x) for x in p] for p in c]


def test_shuffle_changes_with_epoch_and_seed():
    base = [_rows(x) for x in plan_batches(1000, 10, shuffle=True, seed=1, epoch=0)]
    assert base != [_rows(x) for x in plan_batches(1000, 10, shuffle=True, seed=1, epoch=1)]
    assert base != [_rows(x) for x in plan_batches(1000, 10, shuffle=True, seed=2, epoch=0)]
    blocks = [x.start for x in plan_batches(1000, 10, shuffle="blocks", epoch=0)]
    assert blocks != sorted(blocks)
    assert blocks != [x.start for x in plan_batches(1000, 10, shuffle="blocks", epoch=1)]


def test_drop_last_with_shuffle_drops_different_samples_each_epoch():
    kept = [
        frozenset(
            i for p in _all_ranks(103, 10, 3, shuffle=s, drop_last=True, epoch=e) for x in p for i in _rows(x)
        )
        for s in (True, "blocks")
        for e in (0, 1)
    ]
    assert kept[0] != kept[1] and kept[2] != kept[3]


def test_sequential_examples():
    assert plan_batches(10, 4) == [range(0, 4), range(4, 8), range(8, 10)]
    assert plan_batches(10, 4, drop_last=True) == [range(0, 4), range(4, 8)]
    assert plan_batches(10, 4, rank=1, world_size=2) == [range(4, 8), range(9, 10)]
    assert plan_batches(0, 4) == []
    # 13 samples, 3 ranks of 4: the last two rounds share what is left so no batch is empty.
    plans = _all_ranks(13, 4, 3)
    assert [[len(x) for x in p] for p in plans] == [[3, 2], [2, 2], [2, 2]]


def test_infeasible_split_asks_for_pad_or_drop_last():
    with pytest.raises(ValueError, match=r"pad=True.*drop_last=True"):
        plan_batches(3, 8, world_size=4)
    assert all(len(p) == 1 for p in _all_ranks(3, 8, 4, pad=True))
    assert all(p == [] for p in _all_ranks(3, 8, 4, drop_last=True))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_samples=-1, batch_size=2), "num_samples"),
        (dict(num_samples=10, batch_size=0), "batch_size"),
        (dict(num_samples=10, batch_size=2, world_size=0), "world_size"),
        (dict(num_samples=10, batch_size=2, rank=2, world_size=2), "rank"),
        (dict(num_samples=10, batch_size=2, shuffle="yes"), "shuffle"),
        (dict(num_samples=10, batch_size=2, seed=-1), "seed"),
        (dict(num_samples=10, batch_size=2, drop_last=True, pad=True), "not both"),
        (dict(num_samples=10.0, batch_size=2), "num_samples"),
    ],
)
def test_bad_arguments(kwargs, match):
    n, b = kwargs.pop("num_samples"), kwargs.pop("batch_size")
    with pytest.raises(ValueError, match=match):
        plan_batches(n, b, **kwargs)


@_settings
@given(st.lists(st.integers(0, 50), max_size=40))
def test_coalesce_reproduces_the_rows(rows):
    runs = coalesce(np.array(rows, dtype=np.int64))
    assert [i for a, b in runs for i in range(a, b)] == rows
    assert all(b > a for a, b in runs)


def test_coalesce_examples():
    assert coalesce(range(3, 7)) == [(3, 7)]
    assert coalesce(range(3, 3)) == []
    assert coalesce(range(0, 6, 2)) == [(0, 1), (2, 3), (4, 5)]
    assert coalesce(np.array([5, 6, 7, 1, 2], dtype=np.int32)) == [(5, 8), (1, 3)]
    with pytest.raises(ValueError, match=r"integer"):
        coalesce(np.zeros((2, 2), dtype=np.int64))
