"""docs/integrations.md's accelerate recipes, on the CPU: shard, dispatcher, skip; resume; accumulation."""

from __future__ import annotations

import math

import pytest
import torch
from _recipes import assert_same_batches, load
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

pytest.importorskip("accelerate")
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

WORKERS = [0, 2]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test builds its own Accelerator: accelerate's process-wide states are reset around it."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _data(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


class _Stream(IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, 24, workers):
            yield torch.full((3,), float(i)), i % 4


def _loader(workers: int, **kw) -> DataLoader:
    return DataLoader(_data(), batch_size=4, num_workers=workers, **kw)


@pytest.mark.parametrize("workers", WORKERS)
def test_shard_delivers_every_batch_and_trains(workers):
    ns = load("accelerate")
    acc = Accelerator(cpu=True)
    plain = list(acc.prepare_data_loader(_loader(workers), device_placement=False))
    batches = ns["gpufeed_loader"](acc, _loader(workers))
    assert type(batches.source).__name__ == "DataLoaderShard"
    for _ in range(2):  # two epochs of the same prefetcher
        assert_same_batches(list(batches), plain)
    batches.close()
    model = torch.nn.Linear(8, 4)
    losses = ns["train"](acc, model, torch.optim.SGD(model.parameters(), lr=0.1), _loader(workers), epochs=2)
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize("workers", WORKERS)
def test_dispatcher_places_batches_itself_and_passes_through(workers):
    from gpufeed import CudaPrefetcher

    acc = Accelerator(cpu=True, dataloader_config=_config(dispatch_batches=True))
    with pytest.raises(ValueError, match="requires `put_on_device=True`"):
        acc.prepare_data_loader(_loader(workers), device_placement=False)
    plain = list(acc.prepare_data_loader(_loader(workers)))
    prepared = acc.prepare_data_loader(_loader(workers))
    assert type(prepared).__name__ == "DataLoaderDispatcher"
    with CudaPrefetcher(prepared, device=acc.device) as batches:
        assert_same_batches(list(batches), plain)


@pytest.mark.parametrize("workers", WORKERS)
def test_skip_first_batches(workers):
    ns = load("accelerate", "accelerate-skip")
    acc = Accelerator(cpu=True)
    plain = list(acc.prepare_data_loader(_loader(workers), device_placement=False))
    with ns["skipped_loader"](acc, _loader(workers), 3) as batches:
        assert len(batches) == len(plain) - 3
        assert_same_batches(list(batches), plain[3:])
    # A DataLoader of an IterableDataset is skipped by a SkipDataLoader.
    stream = DataLoader(_Stream(), batch_size=4, num_workers=workers)
    plain = list(stream)
    skipped = acc.skip_first_batches(stream, 2)
    assert type(skipped).__name__ == "SkipDataLoader"
    with ns["CudaPrefetcher"](skipped, device=acc.device) as batches:
        assert_same_batches(list(batches), plain[2:])
        with pytest.raises(TypeError, match="accelerate's SkipDataLoader takes its state only with"):
            batches.state_dict()


def test_without_stateful_mode_the_batches_come_and_state_dict_says_why():
    ns = load("accelerate")
    acc = Accelerator(cpu=True)
    with ns["gpufeed_loader"](acc, _loader(0)) as batches:
        next(iter(batches))
        with pytest.raises(TypeError, match=r"use_stateful_dataloader=True \(Accelerator\(dataloader_conf"):
            batches.state_dict()


@pytest.mark.parametrize("workers", WORKERS)
def test_stateful_mode_resumes_after_the_last_batch_received(workers):
    pytest.importorskip("torchdata.stateful_dataloader")
    ns = load("accelerate", "accelerate-resume")
    acc = ns["stateful_accelerator"](cpu=True)
    plain = list(acc.prepare_data_loader(_loader(workers), device_placement=False))
    batches = ns["gpufeed_loader"](acc, _loader(workers))
    it = iter(batches)
    got = [next(it) for _ in range(4)]
    ckpt = ns["checkpoint"](batches)
    batches.close()
    assert_same_batches(got, plain[:4])
    resumed = ns["resume"](acc, _loader(workers), ckpt)
    assert_same_batches(list(resumed), plain[4:])
    resumed.close()


def _config(**kw):
    from accelerate.utils import DataLoaderConfiguration

    return DataLoaderConfiguration(**kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_accumulation_syncs_as_without_gpufeed(workers):
    ns = load("accelerate", "accelerate-resume", "accelerate-accumulate")
    loader = _loader(workers, drop_last=False)  # 10 batches: 4 + 4 + a partial 2

    def run(wrap: bool) -> list[bool]:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = ns["accumulating_accelerator"](4, cpu=True) if wrap else Accelerator(
            cpu=True, gradient_accumulation_steps=4)
        model = torch.nn.Linear(8, 4)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        prepared = ns["gpufeed_loader"](acc, loader) if wrap else acc.prepare_data_loader(loader)
        syncs = [s for _ in range(2) for s in ns["train_accumulating"](acc, model, opt, prepared)]
        if wrap:
            prepared.close()
        return syncs

    expected = [False, False, False, True, False, False, False, True, False, True] * 2
    assert run(wrap=False) == expected  # accelerate alone, as a reference
    assert run(wrap=True) == expected


def test_worker_slots_over_a_prepared_loader():
    """On CUDA a DataLoader's workers collate into gpufeed's pinned slots (``worker_slots``, on the CPU
    when asked). accelerate's loader keeps its workers' collate_fn on the DataLoader inside it
    (``base_dataloader``), which it iterates lazily: the slots reach those workers too."""
    from gpufeed import CudaPrefetcher

    acc = Accelerator(cpu=True)
    plain_loader = _loader(2)
    with CudaPrefetcher(plain_loader, device="cpu", worker_slots=True) as pf:
        plain = list(pf)
        assert pf.stats.slot_batches == len(plain)  # a plain DataLoader's workers use the slots
    prepared = acc.prepare_data_loader(_loader(2), device_placement=False)
    with CudaPrefetcher(prepared, device="cpu", worker_slots=True) as pf:
        assert_same_batches(list(pf), plain)
        slot_batches = pf.stats.slot_batches
    assert slot_batches == len(plain)
