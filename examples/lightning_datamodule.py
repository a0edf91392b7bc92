"""gpufeed inside PyTorch Lightning: the DataModule hands the Trainer a ``CudaPrefetcher``.

    python examples/lightning_datamodule.py               # a short fit on synthetic data
    python examples/lightning_datamodule.py --smoke       # tiny, on the CPU

The DataModule wraps its DataLoader in ``CudaPrefetcher`` on the device the Trainer chose
(``trainer.strategy.root_device``). Batches arrive already there, so Lightning's own
``transfer_batch_to_device`` finds nothing to move. Lightning accepts any iterable with a ``len`` as a
dataloader; ``set_epoch`` reaches the sampler through the prefetcher. ``teardown`` closes the prefetchers
(stops their threads, frees their pinned and device buffers).

Needs ``lightning`` (``pip install lightning``); without it the example says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from gpufeed import CudaPrefetcher

try:
    import lightning as L
except ImportError:  # the example explains itself below instead of failing at import
    L = None

MISSING = "this example needs PyTorch Lightning: pip install lightning"


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """The LightningModule and LightningDataModule (defined here so the module imports without Lightning)."""

    class Classifier(L.LightningModule):
        def __init__(self, features: int) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(features, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
            self.samples_seen = 0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            assert x.device == self.device, "gpufeed delivers batches on the module's device"
            self.samples_seen += len(y)
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class GpufeedData(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.prefetchers: list[CudaPrefetcher] = []

        def setup(self, stage: str) -> None:
            g = torch.Generator().manual_seed(0)
            self.data = TensorDataset(torch.randn(args.samples, args.features, generator=g),
                                      torch.randint(0, 10, (args.samples,), generator=g))

        def train_dataloader(self) -> CudaPrefetcher:
            loader = DataLoader(self.data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
            pf = CudaPrefetcher(loader, device=self.trainer.strategy.root_device, depth=2)
            self.prefetchers.append(pf)
            return pf

        def teardown(self, stage: str) -> None:
            for pf in self.prefetchers:
                print(f"gpufeed: {pf.stats.summary()}", flush=True)
                pf.close()
            self.prefetchers.clear()

    return Classifier(args.features), GpufeedData()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--accelerator", default="auto", help="auto, gpu or cpu")
    p.add_argument("--smoke", action="store_true", help="tiny and quick, on the CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.samples, args.features, args.epochs, args.workers, args.accelerator = 512, 16, 2, 0, "cpu"
    if L is None:
        print(MISSING)
        return 0
    model, data = build(args)
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    expected = args.samples * args.epochs
    if model.samples_seen != expected:
        print(f"error: trained on {model.samples_seen} samples, expected {expected}", file=sys.stderr)
        return 1
    print(f"trained on {model.samples_seen} samples on {trainer.strategy.root_device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
