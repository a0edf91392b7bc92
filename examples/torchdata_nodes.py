"""torchdata nodes: composable stages, the last of them gpufeed's ToDevice: batches arrive on the GPU.

    python examples/torchdata_nodes.py              # a few epochs of a small synthetic data set
    python examples/torchdata_nodes.py --smoke      # tiny, on the CPU, a few seconds

The pipeline: shuffled indices -> ParallelMapper (threads read the samples) -> Batcher -> pinned_collate ->
Prefetcher (collation off the training thread) -> gpufeed's ToDevice -> Loader. The last epoch is cut
in the middle, checkpointed with ``loader.state_dict()``, and finished by a fresh pipeline resumed from
it, as after a preemption: every sample is seen once. Needs ``pip install 'gpufeed[nodes]'``.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils.data import DistributedSampler, TensorDataset

try:
    from torchdata import nodes
except ImportError:  # torchdata < 0.10, or none: the example says what to install
    nodes = None


def pipeline(dataset: TensorDataset, batch_size: int, workers: int, device: torch.device, depth: int):
    """The data pipeline, as a torchdata Loader; each batch is ``[x, y, index]`` on ``device``."""
    from gpufeed.nodes import ToDevice, pinned_collate

    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)  # set_epoch-able
    node = nodes.SamplerWrapper(sampler)  # one epoch of shuffled indices, resumable
    node = nodes.ParallelMapper(node, lambda i: (*dataset[i], i), num_workers=workers, method="thread")
    node = nodes.Batcher(node, batch_size=batch_size, drop_last=False)
    node = nodes.Mapper(node, pinned_collate)  # default_collate, stacked into pinned memory on CUDA
    node = nodes.Prefetcher(node, prefetch_factor=2)  # collation runs on its thread, not the loop's
    return nodes.Loader(ToDevice(node, device=device, depth=depth))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--features", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3, help="the last one is cut, checkpointed and resumed")
    p.add_argument("--workers", type=int, default=4, help="ParallelMapper threads")
    p.add_argument("--depth", type=int, default=2, help="batches copied ahead of the training step")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--smoke", action="store_true", help="tiny and quick, on the CPU")
    args = p.parse_args(argv)
    if nodes is None:
        print("this example needs torchdata >= 0.10: pip install 'gpufeed[nodes]'")
        return 0
    if args.smoke:
        args.samples, args.features, args.batch_size, args.epochs, args.workers = 600, 16, 64, 3, 2
        args.device = args.device or "cpu"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    torch.manual_seed(0)
    x = torch.randn(args.samples, args.features)
    y = (x @ torch.randn(args.features, 10)).argmax(dim=1)  # learnable labels: the loss goes down
    dataset = TensorDataset(x, y)
    model = torch.nn.Linear(args.features, 10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach() * len(yb)

    loader = pipeline(dataset, args.batch_size, args.workers, device, args.depth)
    seen = 0
    for epoch in range(args.epochs - 1):
        total, count = torch.zeros((), device=device), torch.zeros(args.samples, dtype=torch.int64)
        for xb, yb, index in loader:  # already on `device`: no .to() in the loop
            total += step(xb, yb)
            count[index.cpu()] += 1
        seen += int(count.sum())
        print(f"epoch {epoch}: loss {total.item() / args.samples:.3f}, each sample once: "
              f"{bool((count == 1).all())}", flush=True)

    # The last epoch: cut after half its batches, checkpoint, resume in a fresh pipeline (a new process
    # would do the same: the state is plain data, for torch.save).
    count = torch.zeros(args.samples, dtype=torch.int64)
    half = -(-args.samples // args.batch_size) // 2
    for k, (xb, yb, index) in enumerate(loader):
        step(xb, yb)
        count[index.cpu()] += 1
        if k + 1 == half:
            break
    state = loader.state_dict()
    print(loader.root.stats.summary())  # ToDevice's PrefetchStats: did the loop wait for data?
    del loader
    resumed = pipeline(dataset, args.batch_size, args.workers, device, args.depth)
    resumed.load_state_dict(state)
    for xb, yb, index in resumed:
        step(xb, yb)
        count[index.cpu()] += 1
    seen += int(count.sum())
    once = bool((count == 1).all())
    print(f"epoch {args.epochs - 1}: checkpointed after {half} batches, resumed: each sample once: {once}")
    expected = args.samples * args.epochs
    if seen != expected or not once:
        print(f"error: trained on {seen} samples, expected {expected}, each once", file=sys.stderr)
        return 1
    print(f"trained on {seen} samples on {device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
