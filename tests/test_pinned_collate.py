"""gpufeed.host_memory.pinned_collate: default_collate's batch, stacked into pinned blocks where it can be."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from gpufeed import host_memory
from gpufeed.host_memory import pinned_collate as pc


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def samples(n: int = 5) -> list:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(3, 4, generator=g), "y": i, "name": f"s{i}", "w": np.full(2, i, np.int16),
             "pair": (torch.tensor([i, -i], dtype=torch.int64), torch.ones(0)),
             "mask": torch.rand(5, generator=g) > 0.5, "h": torch.randn(2, generator=g).to(torch.bfloat16),
             "grad": torch.randn(3, generator=g).requires_grad_(), "scalar": torch.tensor(float(i)),
             "z": torch.randn(2, generator=g, dtype=torch.complex64), "t": torch.randn(4, 3, generator=g).t()}
            for i in range(n)]


@pytest.fixture
def fake_pinning(monkeypatch):
    """Pinning stood in for on the CPU: every block pinned_collate asks for, counted by its bytes."""
    blocks: list[torch.Tensor] = []

    def pinned_empty(nbytes: int) -> torch.Tensor:
        blocks.append(torch.empty(nbytes, dtype=torch.uint8))
        return blocks[-1]

    monkeypatch.setattr(pc, "_cuda_available", lambda: True)
    monkeypatch.setattr(pc, "_failed", False)
    monkeypatch.setattr(host_memory, "pinned_empty", pinned_empty)
    return blocks


def test_without_cuda_it_is_default_collate():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: pinned_collate pins here")
    batch = samples()
    assert same(pc.pinned_collate(batch), default_collate(batch))


def test_each_stacked_field_is_written_into_a_block_of_its_own(fake_pinning):
    batch = samples()
    got = pc.pinned_collate(batch)
    assert same(got, default_collate(batch))
    # the plain tensors and numpy arrays (made tensors one by one) are stacked into blocks; the empty ones,
    # those that require grad, numbers and strings are collated as default_collate collates them
    stacked = {"x": got["x"], "pair0": got["pair"][0], "mask": got["mask"], "h": got["h"], "w": got["w"],
               "scalar": got["scalar"], "z": got["z"], "t": got["t"]}
    assert got["grad"].requires_grad and not got["pair"][1].numel()
    assert sorted(b.nbytes for b in fake_pinning) == sorted(t.nbytes for t in stacked.values())
    ptrs = {b.data_ptr() for b in fake_pinning}
    assert all(t.data_ptr() in ptrs for t in stacked.values())


def test_tensors_it_cannot_stack_raise_as_default_collate_raises(fake_pinning):
    batch = [torch.zeros(3), torch.zeros(4)]
    with pytest.raises(RuntimeError) as want:
        default_collate(batch)
    with pytest.raises(RuntimeError) as got:
        pc.pinned_collate(batch)
    assert str(got.value) == str(want.value)


class Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("second", [
    pytest.param(lambda: torch.ones(3, dtype=torch.float64), id="another dtype (default_collate promotes)"),
    pytest.param(lambda: torch.ones(3).requires_grad_(), id="a later sample requiring grad"),
    pytest.param(lambda: torch.ones(3).as_subclass(Sub), id="a subclass"),
    pytest.param(lambda: torch.ones(3).to_sparse(), id="a sparse sample"),
])
def test_a_field_the_block_cannot_hold_comes_out_as_default_collate_makes_it(fake_pinning, second):
    batch = [torch.zeros(3), second()]
    try:
        want = default_collate(batch)
    except Exception as exc:  # (then pinned_collate raises the same)
        with pytest.raises(type(exc)) as got:
            pc.pinned_collate(batch)
        assert str(got.value) == str(exc)
        return
    got = pc.pinned_collate(batch)
    assert type(got) is type(want) and got.dtype == want.dtype and got.requires_grad == want.requires_grad
    assert torch.equal(got.detach().to_dense(), want.detach().to_dense())
    assert all(got.data_ptr() != b.data_ptr() for b in fake_pinning)  # (no block kept)


def test_a_failed_pinned_allocation_warns_once_then_collates_as_default_collate(monkeypatch):
    calls = []

    def refused(nbytes: int) -> torch.Tensor:
        calls.append(nbytes)
        raise host_memory.PinnedUnavailable("pinned allocation failed: refused")

    monkeypatch.setattr(pc, "_cuda_available", lambda: True)
    monkeypatch.setattr(pc, "_failed", False)
    monkeypatch.setattr(host_memory, "pinned_empty", refused)
    batch = samples()
    with pytest.warns(RuntimeWarning, match="pinned memory is unavailable"):
        first = pc.pinned_collate(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = pc.pinned_collate(batch)
    assert same(first, default_collate(batch)) and same(second, default_collate(batch))
    assert len(calls) == 1  # (the first field's block, refused; nothing asked for after)


def test_a_dataloader_worker_collates_into_shared_memory_not_pinned_memory(monkeypatch):
    # A worker must not touch CUDA: pinning there is an error that would reach the loop through the worker.
    def forbidden(nbytes: int) -> torch.Tensor:
        raise AssertionError("pinned_collate pinned inside a DataLoader worker")

    monkeypatch.setattr(pc, "_cuda_available", lambda: True)
    monkeypatch.setattr(pc, "_failed", False)
    monkeypatch.setattr(host_memory, "pinned_empty", forbidden)
    data = [{"x": torch.full((4,), float(i)), "y": i} for i in range(8)]
    got = list(DataLoader(data, batch_size=4, num_workers=1, collate_fn=pc.pinned_collate,
                          multiprocessing_context="fork"))
    assert same(got, list(DataLoader(data, batch_size=4)))


@pytest.mark.cuda
def test_on_cuda_the_stacked_fields_are_pinned():
    batch = samples()
    got = pc.pinned_collate(batch)
    assert same(got, default_collate(batch))
    assert got["x"].is_pinned() and got["pair"][0].is_pinned() and got["mask"].is_pinned()
    assert not got["pair"][1].is_pinned()  # (an empty tensor: stacked by default_collate)
