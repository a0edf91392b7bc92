"""Exact mid-epoch resume under PyTorch Lightning: Lightning checkpoints gpufeed's position by itself.

    python examples/lightning_resume.py            # train, get preempted, resume; compare with no preemption
    python examples/lightning_resume.py --smoke    # tiny, on the CPU

Lightning (2.x) stores the state of every training dataloader that has ``state_dict`` and
``load_state_dict`` in each checkpoint (``FitLoop.on_save_checkpoint`` puts
``CombinedLoader._state_dicts()`` under ``loops.fit_loop.state_dict.combined_loader``), and on
``fit(ckpt_path=...)`` hands it back to ``load_state_dict`` before the first ``iter()``. ``CudaPrefetcher``
has both: over a BatchSource its state is (epoch, batches handed out, configuration), so the resumed run
reads exactly the batches the interrupted one had not trained on, in the same order, then the same
following epochs. No callback or custom code is needed.

The example trains three times on the same synthetic RawSource:

1. without interruption, recording the sample ids (field ``y``) of every step;
2. with a checkpoint every ``--every`` steps, "preempted" (an exception) during step ``--stop``;
3. with a fresh Trainer, model and prefetcher, from the last checkpoint.

It checks that run 3 trains on exactly the batches run 1 trained on after the checkpoint's step, and ends
with the same weights. Needs ``lightning`` (``pip install lightning``); without it the example says so.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.sources import RawSource

try:
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
except ImportError:  # the example explains itself below instead of failing at import
    L = None

MISSING = "this example needs PyTorch Lightning: pip install lightning"
CLASSES = 10


class Preempted(Exception):
    """What a killed job looks like to this script."""


def write_dataset(directory: Path, samples: int, features: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, features), dtype=np.float32)
    label = (x @ rng.standard_normal((features, CLASSES), dtype=np.float32)).argmax(1).astype(np.int64)
    np.save(directory / "x.npy", x)
    np.save(directory / "label.npy", label)
    np.save(directory / "y.npy", np.arange(samples, dtype=np.int64))


def build(args: argparse.Namespace, data: Path) -> tuple[Any, Any]:
    """The LightningModule and the preempting Callback (here, so the module imports without Lightning)."""

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(args.features, 64), torch.nn.ReLU(),
                                           torch.nn.Linear(64, CLASSES))
            self.seen: list[list[int]] = []  # sample ids of every step, in order
            self.prefetchers: list[CudaPrefetcher] = []

        def train_dataloader(self) -> CudaPrefetcher:
            source = RawSource(fields={k: data / f"{k}.npy" for k in ("x", "label", "y")})
            pf = CudaPrefetcher(SourceLoader(source, batch_size=args.batch_size, shuffle=True, seed=0),
                                device=self.trainer.strategy.root_device)
            self.prefetchers.append(pf)
            return pf  # has state_dict/load_state_dict: Lightning checkpoints and restores it

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            self.seen.append(batch["y"].tolist())
            return torch.nn.functional.cross_entropy(self.net(batch["x"]), batch["label"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def teardown(self, stage: str) -> None:
            for pf in self.prefetchers:
                pf.close()

    class PreemptAt(Callback):
        """Raise when step ``step + 1`` starts (ModelCheckpoint has run at the end of step ``step``)."""

        def __init__(self, step: int) -> None:
            self.step = step

        def on_train_batch_start(self, trainer: Any, *rest: Any) -> None:
            if trainer.global_step >= self.step:
                raise Preempted(f"preempted during step {self.step + 1}")

    return Classifier, PreemptAt


def fit(args: argparse.Namespace, model: Any, callbacks: list[Any], ckpt_path: Path | None = None) -> Any:
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, max_epochs=args.epochs, logger=False,
                        callbacks=callbacks, enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def run(args: argparse.Namespace, tmp: Path) -> int:
    write_dataset(tmp, args.samples, args.features)
    Classifier, PreemptAt = build(args, tmp)

    full = Classifier()
    fit(args, full, [])
    print(f"uninterrupted: {len(full.seen)} steps over {args.epochs} epochs")

    checkpoints = ModelCheckpoint(dirpath=tmp / "ckpt", filename="{step}", every_n_train_steps=args.every,
                                  save_top_k=-1, save_last=True)
    preempted = Classifier()
    try:
        fit(args, preempted, [PreemptAt(args.stop), checkpoints])
    except Preempted as exc:
        print(f"interrupted: {exc}")
    else:
        print(f"error: run 2 was not preempted (--stop {args.stop}, {len(full.seen)} steps)", file=sys.stderr)
        return 1
    finally:
        preempted.teardown("fit")  # Lightning skips the module's teardown hook when fit raises
    last = tmp / "ckpt" / "last.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    step, (state,) = ckpt["global_step"], ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    loader = state["loader"]  # the SourceLoader's position after the last batch handed out
    print(f"last checkpoint: step {step}; the gpufeed state Lightning saved in it: {loader['batch']} batches "
          f"into the epoch, batch_size={loader['config']['batch_size']}, seed={loader['config']['seed']}")

    resumed = Classifier()
    fit(args, resumed, [], ckpt_path=last)
    same_batches = resumed.seen == full.seen[step:]
    pairs = zip(resumed.parameters(), full.parameters(), strict=True)
    diff = max((a - b).abs().max().item() for a, b in pairs)
    print(f"resumed from step {step}: {len(resumed.seen)} steps; same batches as the uninterrupted run from "
          f"step {step} on: {same_batches}; largest weight difference at the end: {diff:.2e}")
    if not same_batches or diff > 1e-5:
        print("FAIL: the resumed run differs from the uninterrupted one", file=sys.stderr)
        return 1
    print("PASS: Lightning checkpointed gpufeed mid-epoch and resumed it exactly")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    p.add_argument("--stop", type=int, default=130, help="preempt run 2 during step N + 1")
    p.add_argument("--accelerator", default="auto", help="auto, gpu or cpu")
    p.add_argument("--smoke", action="store_true", help="tiny and quick, on the CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.samples, args.features, args.batch_size, args.epochs = 500, 8, 32, 3
        args.every, args.stop, args.accelerator = 5, 23, "cpu"  # 16 steps an epoch: resume mid epoch 1
    if L is None:
        print(MISSING)
        return 0
    with tempfile.TemporaryDirectory(prefix="gpufeed-lightning-") as tmp:
        return run(args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
