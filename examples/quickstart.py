"""Quickstart: wrap the DataLoader you already have; every batch arrives already on the GPU.

    python examples/quickstart.py              # a few epochs of a small synthetic data set
    python examples/quickstart.py --smoke      # tiny, on the CPU, a couple of seconds

Without CUDA, ``CudaPrefetcher`` runs the same loop on the CPU (no streams).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from gpufeed import CudaPrefetcher


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--features", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="DataLoader num_workers")
    p.add_argument("--depth", type=int, default=2, help="batches prefetched ahead of the training step")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--smoke", action="store_true", help="tiny and quick, on the CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.samples, args.features, args.epochs, args.workers = 512, 16, 3, 0
        args.device = args.device or "cpu"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    torch.manual_seed(0)
    x = torch.randn(args.samples, args.features)
    y = (x @ torch.randn(args.features, 10)).argmax(dim=1)  # learnable labels: the loss goes down
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers)
    model = torch.nn.Linear(args.features, 10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    seen = 0
    with CudaPrefetcher(loader, device=device, depth=args.depth) as batches:
        for epoch in range(args.epochs):
            batches.set_epoch(epoch)  # like DataLoader: forwarded to the sampler
            total = torch.zeros((), device=device)
            for xb, yb in batches:  # already on `device`: no .to() in the loop
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += loss.detach() * len(yb)
                seen += len(yb)
            print(f"epoch {epoch}: loss {total.item() / args.samples:.3f}", flush=True)
        print(batches.stats.summary())  # is the loop input-bound?
    expected = args.samples * args.epochs
    if seen != expected:
        print(f"error: trained on {seen} samples, expected {expected}", file=sys.stderr)
        return 1
    print(f"trained on {seen} samples on {device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
