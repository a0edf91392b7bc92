"""gpufeed under ``accelerate launch``: each process wraps its own shard of the prepared loader.

    accelerate launch --num_processes 2 examples/accelerate_launch.py --check   # every rank's shard exact
    accelerate launch --num_processes 2 examples/accelerate_launch.py           # a short training run
    python examples/accelerate_launch.py --check                                # one process (CPU or GPU)

The recipe of docs/integrations.md: ``accelerator.prepare_data_loader(loader, device_placement=False)``
shards the DataLoader for this process, and ``CudaPrefetcher(prepared, device=accelerator.device)`` moves
its batches to this process's device. ``--check`` iterates the prepared loader plainly and through the
prefetcher, compares every batch's checksum and bytes on each rank, checks that the ranks' shards together
cover the dataset, and prints ``PASS`` (exit 0) or ``FAIL`` (exit 1). Needs ``accelerate``
(``pip install 'gpufeed[integrations]'``); without it the example says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import zlib

import torch
from torch.utils.data import DataLoader, TensorDataset

from gpufeed import CudaPrefetcher

MISSING = "this example needs accelerate: pip install 'gpufeed[integrations]'"


def dataset(n: int, features: int) -> TensorDataset:
    """Rows whose first column is the sample's index (so each rank can say which samples it saw)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    return TensorDataset(x, torch.arange(n) % 10)


def checksum(batch: tuple[torch.Tensor, ...]) -> int:
    """crc32 of every byte of the batch, read back to the host."""
    crc = 0
    for t in batch:
        crc = zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc


def check(accelerator, args: argparse.Namespace) -> bool:
    data = dataset(args.samples, args.features)
    loader = DataLoader(data, batch_size=args.batch, num_workers=args.workers)
    plain = [(checksum(b), b) for b in accelerator.prepare_data_loader(loader, device_placement=False)]
    prepared = accelerator.prepare_data_loader(loader, device_placement=False)
    with CudaPrefetcher(prepared, device=accelerator.device) as batches:
        got = []
        for b in batches:
            assert all(t.device.type == accelerator.device.type for t in b), "a batch is not on the device"
            got.append((checksum(b), [t.cpu() for t in b]))
    ok = len(got) == len(plain) and all(
        c1 == c2 and all(torch.equal(a, b.cpu()) for a, b in zip(t1, t2, strict=True))
        for (c1, t1), (c2, t2) in zip(got, plain, strict=False))
    seen = sorted({int(i) for _, b in got for i in b[0][:, 0].tolist()})
    everyone = accelerator.gather_for_metrics([seen], use_gather_object=True)  # one list from each rank
    covered = sorted({i for part in everyone for i in part}) == list(range(args.samples))
    rank = accelerator.process_index
    print(f"rank {rank}/{accelerator.num_processes}: {len(got)} batches on {accelerator.device}, "
          f"{'exact' if ok else 'DIFFERENT'} (samples {seen[:3]}...), the ranks together "
          f"{'cover' if covered else 'do NOT cover'} the {args.samples} samples", flush=True)
    return ok and covered


def train(accelerator, args: argparse.Namespace) -> float:
    data = dataset(args.samples, args.features)
    model = torch.nn.Sequential(torch.nn.Linear(args.features, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    prepared = accelerator.prepare_data_loader(
        DataLoader(data, batch_size=args.batch, shuffle=True, num_workers=args.workers),
        device_placement=False)
    loss = torch.zeros(())
    with CudaPrefetcher(prepared, device=accelerator.device) as batches:
        for epoch in range(args.epochs):
            batches.set_epoch(epoch)
            for x, y in batches:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}")
    return float(loss.item())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="check every rank's shard arrives exactly; PASS/FAIL")
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args(argv)
    try:
        from accelerate import Accelerator
    except ImportError:
        print(MISSING)
        return 0
    accelerator = Accelerator()
    if not args.check:
        loss = train(accelerator, args)
        return 0 if loss == loss else 1  # a NaN loss fails
    ok = check(accelerator, args)
    every = accelerator.gather_for_metrics([ok], use_gather_object=True)
    passed = all(every)
    accelerator.print("PASS" if passed else "FAIL")
    accelerator.end_training()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
