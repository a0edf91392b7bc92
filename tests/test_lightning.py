"""PyTorch Lightning checkpoints a CudaPrefetcher and resumes it exactly, mid-epoch, with no extra code.

Lightning's fit loop saves ``state_dict()`` of every training dataloader that is ``_Stateful`` (has
``state_dict`` and ``load_state_dict``) under ``loops.fit_loop.state_dict.combined_loader``, and on
``fit(ckpt_path=...)`` calls ``load_state_dict`` before the first ``iter()``. Batches are already on the
device the prefetcher was given, so these tests run with ``accelerator="cpu"``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from gpufeed import CudaPrefetcher, Field, SourceLoader

L = pytest.importorskip("lightning", reason="lightning is not installed (pip install 'gpufeed[dev]')")
from lightning.fabric.utilities.types import _Stateful  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),  # we resume without callbacks
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),  # in Lightning
]

N, BATCH, EPOCHS = 50, 8, 3
STEPS_PER_EPOCH = -(-N // BATCH)  # 7
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class ArraySource:
    """A small in-memory BatchSource; ``y`` is the sample index."""

    def __init__(self) -> None:
        self.arrays = {"x": np.random.default_rng(0).standard_normal((N, 4)).astype(np.float32),
                       "y": np.arange(N, dtype=np.int64)}
        self.fields = {k: Field(k, a.shape[1:], torch.from_numpy(a).dtype) for k, a in self.arrays.items()}
        self.reads_to = "host"

    def __len__(self) -> int:
        return N

    def read(self, rows, out) -> None:
        idx = np.arange(rows.start, rows.stop) if isinstance(rows, range) else rows
        for k, a in self.arrays.items():
            out[k].copy_(torch.from_numpy(a[idx]))

    def close(self) -> None:
        pass


def source_loader() -> CudaPrefetcher:
    return CudaPrefetcher(SourceLoader(ArraySource(), batch_size=BATCH, shuffle=True, seed=1), device="cpu")


def stateful_loader() -> CudaPrefetcher:
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = TensorDataset(torch.from_numpy(ArraySource().arrays["x"]), torch.arange(N))
    generator = torch.Generator().manual_seed(0)
    loader = StatefulDataLoader(data, batch_size=BATCH, shuffle=True, generator=generator)
    return CudaPrefetcher(loader, device="cpu")


class Recorder(L.LightningModule):
    """Trains a linear model on the prefetcher's batches and records the sample ids of every step."""

    def __init__(self, make_loader=source_loader) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.make_loader = make_loader
        self.seen: list[list[int]] = []
        self.prefetchers: list[CudaPrefetcher] = []

    def train_dataloader(self) -> CudaPrefetcher:
        self.prefetchers.append(self.make_loader())
        return self.prefetchers[-1]

    def training_step(self, batch, batch_idx):
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
        self.seen.append(y.tolist())
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def teardown(self, stage: str) -> None:
        for pf in self.prefetchers:
            pf.close()


def fit(model: Recorder, ckpt_path=None, callbacks=(), epochs=EPOCHS) -> Recorder:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        callbacks=list(callbacks), enable_checkpointing=bool(callbacks),
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One run with a checkpoint after every step: (the model, {step: checkpoint path})."""
    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    every_step = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    model = fit(Recorder(), callbacks=[every_step])
    assert len(model.seen) == EPOCHS * STEPS_PER_EPOCH
    return model, {int(p.stem.split("=")[1]): p for p in ckpt_dir.glob("step=*.ckpt")}


def test_lightning_sees_the_prefetcher_as_resumable():
    with source_loader() as pf:
        assert isinstance(pf, _Stateful)


def test_every_checkpoint_holds_the_prefetchers_position(uninterrupted):
    _, ckpts = uninterrupted
    assert sorted(ckpts) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    for step, path in ckpts.items():
        loops = torch.load(path, map_location="cpu", weights_only=False)["loops"]
        (state,) = loops["fit_loop"]["state_dict"]["combined_loader"]
        loader = state["loader"]  # the SourceLoader's state after the last batch handed out
        assert state["mode"] == "loader" and loader["config"]["batch_size"] == BATCH
        assert loader["batch"] == (step - 1) % STEPS_PER_EPOCH + 1  # batches handed out in the current epoch


@pytest.mark.parametrize("step", [1, 4, 7, 8, 13, 14, 19])  # 7 and 14 end an epoch
def test_resumed_run_trains_on_exactly_the_batches_that_were_left(uninterrupted, step):
    full, ckpts = uninterrupted
    resumed = fit(Recorder(), ckpt_path=ckpts[step])
    assert resumed.seen == full.seen[step:]
    for a, b in zip(resumed.parameters(), full.parameters(), strict=True):
        assert torch.equal(a, b)


def test_without_the_saved_position_the_resumed_run_differs(uninterrupted, tmp_path):
    """The control: the comparison above fails when the checkpoint lacks gpufeed's state."""
    full, ckpts = uninterrupted
    ckpt = torch.load(ckpts[4], map_location="cpu", weights_only=False)
    del ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    torch.save(ckpt, tmp_path / "stripped.ckpt")
    resumed = fit(Recorder(), ckpt_path=tmp_path / "stripped.ckpt")
    assert resumed.seen != full.seen[4:]


@pytest.mark.parametrize("step", [2, 9, 12])
def test_over_a_stateful_dataloader_the_interrupted_epoch_resumes_exactly(tmp_path, step):
    """A CudaPrefetcher over torchdata's StatefulDataLoader: Lightning saves the loader's own state.

    Only the rest of the interrupted epoch is compared (2 epochs, the checkpoint in the last one, or
    epoch 0 cut at the epoch's end): torchdata 0.11's ``StatefulDataLoader(shuffle=True, generator=g)``
    itself, without gpufeed or Lightning, shuffles the epochs after a resume differently from an
    uninterrupted run. A BatchSource has no such limit (the tests above span epochs).
    """
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    full = fit(Recorder(stateful_loader), callbacks=[ckpt], epochs=2)
    resumed = fit(Recorder(stateful_loader), ckpt_path=tmp_path / f"step={step}.ckpt", epochs=2)
    end = STEPS_PER_EPOCH if step < STEPS_PER_EPOCH else len(full.seen)
    assert resumed.seen[: end - step] == full.seen[step:end]


def test_lightning_resume_example(capsys):
    spec = importlib.util.spec_from_file_location("gpufeed_example_lightning_resume",
                                                  EXAMPLES / "lightning_resume.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "uninterrupted: 48 steps over 3 epochs\ninterrupted: preempted during step 24\n" in out
    assert "last checkpoint: step 20; the gpufeed state Lightning saved in it: 4 batches into the" in out
    assert "28 steps; same batches as the uninterrupted run from step 20 on: True; largest weight" in out
    assert out.rstrip().endswith("PASS: Lightning checkpointed gpufeed mid-epoch and resumed it exactly")
