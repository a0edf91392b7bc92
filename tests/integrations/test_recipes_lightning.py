"""docs/integrations.md's Lightning recipes (a LightningModule's train_dataloader, a LightningDataModule)."""

from __future__ import annotations

import math

import pytest
import torch
from _recipes import load, rows
from torch.utils.data import TensorDataset

L = pytest.importorskip("lightning")

N = 48


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 6, generator=g), torch.arange(N) % 10)


def _recording(ns):
    class Recording(ns["Classifier"]):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            self.seen.append((batch[0].detach().clone(), batch[1].detach().clone()))
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.item())
            return loss

    return Recording


def _fit(model, datamodule=None, epochs=2):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=datamodule)
    return trainer


def _check(model, data, epochs=2, batch_size=8):
    per_epoch = N // batch_size
    assert len(model.seen) == epochs * per_epoch
    index = {r: i for i, r in enumerate(rows(data.tensors[0]))}
    for e in range(epochs):
        delivered = []
        for x, y in model.seen[e * per_epoch:(e + 1) * per_epoch]:
            assert x.dtype == torch.float32 and x.shape == (batch_size, 6)
            for r, label in zip(rows(x), y.tolist(), strict=True):
                delivered.append(index[r])  # the row's bytes are exactly a sample's
                assert label == data.tensors[1][index[r]].item()
        assert sorted(delivered) == list(range(N))
    assert all(math.isfinite(v) for v in model.losses)


@pytest.mark.parametrize("workers", [0, 2])
def test_train_dataloader_returns_a_prefetcher(workers):
    ns = load("lightning")
    data = _data()
    model = _recording(ns)(data, batch_size=8, num_workers=workers)
    _fit(model)
    _check(model, data)


def test_datamodule(tmp_path):
    from gpufeed import CudaPrefetcher

    ns = load("lightning", "lightning-datamodule")
    data = _data()
    model = _recording(ns)(data)
    dm = ns["GpufeedData"](data, batch_size=8, num_workers=2)
    _fit(model, datamodule=dm)
    _check(model, data)
    assert isinstance(dm.prefetcher, CudaPrefetcher)
    with pytest.raises(RuntimeError, match="closed"):
        iter(dm.prefetcher)  # teardown closed it
