"""``why_not_resumable``: which loaders' positions can really be saved, probed without starting anything."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from gpufeed import CudaPrefetcher
from gpufeed._resumable import why_not_resumable


def _data(n: int = 24) -> TensorDataset:
    return TensorDataset(torch.arange(n * 2, dtype=torch.float32).view(n, 2), torch.arange(n))


class _Stream(IterableDataset):
    def __iter__(self):
        for i in range(12):
            yield torch.full((2,), float(i))


def test_plain_dataloader_and_list_are_not_resumable():
    reason = why_not_resumable(DataLoader(_data(), batch_size=4))
    assert reason is not None and reason.startswith("a DataLoader has no state_dict()/load_state_dict()")
    assert "StatefulDataLoader" in reason and "SourceLoader" in reason
    reason = why_not_resumable([1, 2, 3])
    assert reason is not None and reason.startswith("a list has no state_dict()")
    assert "\n" not in reason


def test_half_a_protocol_is_not_resumable():
    class SaveOnly:
        def __iter__(self):
            return iter([])

        def state_dict(self):
            return {}

    reason = why_not_resumable(SaveOnly())
    assert reason is not None and reason.startswith("a SaveOnly has no load_state_dict()")


def test_a_state_dict_that_raises_is_not_resumable_and_is_called_once():
    class Broken:
        calls = 0

        def __iter__(self):
            return iter([torch.ones(2)])

        def state_dict(self):
            Broken.calls += 1
            raise RuntimeError("no position before the first batch\nsecond line")

        def load_state_dict(self, state):
            pass

    reason = why_not_resumable(Broken())
    assert reason == ("the Broken's state_dict() raised RuntimeError (no position before the first batch): "
                      "wrap a torchdata StatefulDataLoader (pip install 'gpufeed[resume]') or a "
                      "gpufeed.SourceLoader to save and resume the position")
    assert Broken.calls == 1


def test_a_working_custom_loader_is_resumable():
    class Counter:
        def __init__(self):
            self.pos = 0

        def __iter__(self):
            return iter([])

        def state_dict(self):
            return {"pos": self.pos}

        def load_state_dict(self, state):
            self.pos = state["pos"]

    assert why_not_resumable(Counter()) is None


def test_source_loader_is_resumable(tmp_path):
    import numpy as np

    from gpufeed import RawSource, SourceLoader

    np.save(tmp_path / "x.npy", np.arange(64, dtype=np.float32).reshape(16, 4))
    source = RawSource(tmp_path / "x.npy")
    assert why_not_resumable(SourceLoader(source, batch_size=4)) is None


@pytest.mark.parametrize("workers", [0, 2])
def test_torchdata_stateful_dataloader_is_resumable_without_starting_workers(workers):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    loader = sdl.StatefulDataLoader(_data(), batch_size=4, num_workers=workers)
    assert why_not_resumable(loader) is None
    assert loader._iterator is None  # not probed: state_dict() now would build the iterator (and workers)


# accelerate's loaders: prepared with and without its stateful mode, and skip_first_batches.


def _prepare(loader, dispatch_batches=False, **kw):
    """accelerate's loader for ``loader``, without device placement where accelerate allows it: a
    DataLoaderDispatcher places its batches itself (``dispatch_batches=True`` requires ``put_on_device``)."""
    data_loader = pytest.importorskip("accelerate.data_loader")
    return data_loader.prepare_data_loader(loader, put_on_device=dispatch_batches,
                                           dispatch_batches=dispatch_batches, **kw)


@pytest.mark.parametrize("dispatch", [False, True], ids=["DataLoaderShard", "DataLoaderDispatcher"])
def test_accelerate_loaders_without_stateful_mode_say_what_to_do(dispatch):
    plain = DataLoader(_data(), batch_size=4)
    prepared = _prepare(plain, dispatch_batches=dispatch)
    name = "DataLoaderDispatcher" if dispatch else "DataLoaderShard"
    assert type(prepared).__name__ == name
    # The trap: both methods are there, and the loader passes as a DataLoader.
    assert callable(prepared.state_dict) and callable(prepared.load_state_dict)
    assert isinstance(prepared, DataLoader)
    with pytest.raises(AttributeError, match="dl_state_dict"):
        prepared.state_dict()
    reason = why_not_resumable(prepared)
    assert reason is not None and reason.startswith(
        f"accelerate's {name} takes its state only with use_stateful_dataloader=True")
    assert "DataLoaderConfiguration" in reason and "\n" not in reason


@pytest.mark.parametrize("dispatch", [False, True], ids=["DataLoaderShard", "DataLoaderDispatcher"])
def test_accelerate_loaders_in_stateful_mode_are_resumable(dispatch):
    pytest.importorskip("torchdata.stateful_dataloader")
    prepared = _prepare(DataLoader(_data(), batch_size=4), dispatch_batches=dispatch,
                        use_stateful_dataloader=True)
    assert why_not_resumable(prepared) is None


@pytest.mark.parametrize("stateful", [False, True])
def test_accelerate_skip_dataloader(stateful):
    data_loader = pytest.importorskip("accelerate.data_loader")
    if stateful:
        pytest.importorskip("torchdata.stateful_dataloader")
    skip = data_loader.SkipDataLoader(_data(), skip_batches=2, batch_size=4, use_stateful_dataloader=stateful)
    reason = why_not_resumable(skip)
    if stateful:
        assert reason is None
    else:
        assert reason is not None and reason.startswith("accelerate's SkipDataLoader takes its state only")
    # skip_first_batches over a plain loader of an IterableDataset makes one, never stateful.
    skipped = data_loader.skip_first_batches(DataLoader(_Stream(), batch_size=4), num_batches=1)
    assert type(skipped).__name__ == "SkipDataLoader"
    assert why_not_resumable(skipped).startswith("accelerate's SkipDataLoader takes its state only")


def test_accelerate_skip_first_batches_of_a_prepared_loader():
    data_loader = pytest.importorskip("accelerate.data_loader")
    prepared = _prepare(DataLoader(_data(), batch_size=4))
    skipped = data_loader.skip_first_batches(prepared, num_batches=2)
    assert type(skipped).__name__ == "DataLoaderShard"
    assert why_not_resumable(skipped).startswith("accelerate's DataLoaderShard takes its state only")


# What the prefetcher makes of it (the current core, patched to ask why_not_resumable).


def test_prefetcher_over_a_non_resumable_accelerate_loader_delivers_and_says_why_on_state_dict():
    prepared = _prepare(DataLoader(_data(), batch_size=4))
    pf = CudaPrefetcher(prepared, device="cpu")
    batches = list(pf)
    assert len(batches) == 6
    with pytest.raises(TypeError, match="accelerate's DataLoaderShard takes its state only with "
                                        "use_stateful_dataloader=True"):
        pf.state_dict()
    pf.close()


def test_prefetcher_state_dict_of_a_plain_dataloader_names_it():
    pf = CudaPrefetcher(DataLoader(_data(), batch_size=4), device="cpu")
    with pytest.raises(TypeError, match="a DataLoader has no state_dict"):
        pf.state_dict()
    pf.close()
