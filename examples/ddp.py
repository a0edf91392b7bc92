"""Distributed data parallel training with gpufeed: every rank reads its own share of a BatchSource.

    torchrun --nproc_per_node=2 examples/ddp.py            # NCCL, a GPU per process (else gloo on CPU)
    torchrun --nproc_per_node=2 examples/ddp.py --smoke    # tiny and quick
    python examples/ddp.py --smoke                         # a single process (world size 1)

Rank 0 writes a small synthetic data set (``.npy`` files: features ``x``, class ``label`` and the sample
index ``y``) to a temporary directory; every rank opens it as a :class:`~gpufeed.sources.RawSource` and
wraps it in ``CudaPrefetcher(SourceLoader(source, batch_size=...))``. Under an initialised process group the
SourceLoader shards by itself (rank and world size come from ``torch.distributed``):

* each rank reads only its own batches (global batch ``g`` goes to rank ``g % world_size``);
* every rank gets the same number of batches, so no rank waits in DDP's all-reduce for one that ran out;
* the union over ranks covers every sample exactly once per epoch (``drop_last=True`` or ``pad=True``
  trade that for equal batch sizes or equal sample counts);
* ``set_epoch(epoch)`` reshuffles, and every rank derives the same permutation from ``(seed, epoch)``.

``torch.cuda.set_device(local_rank)`` comes first, and ``CudaPrefetcher(device=None)`` then picks that
device: each rank's batches land on its own GPU, not on ``cuda:0``. Every epoch the example gathers the
``y`` field from all ranks and checks the coverage; rank 0 prints ``PASS`` at the end (a rank that finds a
problem prints ``FAIL``).
All ranks must see the same file system (one node, or a shared ``--data-dir``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.sources import RawSource

CLASSES = 10


def write_dataset(directory: Path, samples: int, features: int) -> None:
    """Features, a learnable label (argmax of a fixed linear map), and ``y``: each sample's index."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, features), dtype=np.float32)
    label = (x @ rng.standard_normal((features, CLASSES), dtype=np.float32)).argmax(1).astype(np.int64)
    np.save(directory / "x.npy", x)
    np.save(directory / "label.npy", label)
    np.save(directory / "y.npy", np.arange(samples, dtype=np.int64))


def init_process_group(cuda: bool) -> tuple[int, int, torch.device]:
    """Join the torchrun job (or make a group of one), on this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu")
    if cuda:
        torch.cuda.set_device(local_rank)  # before anything touches CUDA: gpufeed's device=None picks it
        device = torch.device("cuda", local_rank)
    kw: dict = {"device_id": device} if cuda else {}
    if "RANK" not in os.environ:  # started without torchrun: a process group of one
        kw.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    dist.init_process_group("nccl" if cuda else "gloo", **kw)
    return dist.get_rank(), dist.get_world_size(), device


def gather_ids(ids: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's sample ids (ranks may hold one sample more or less: pad to the longest, then trim)."""
    count = torch.tensor([ids.numel()], device=ids.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    longest = int(torch.stack(counts).max().item())
    padded = torch.full((longest,), -1, dtype=ids.dtype, device=ids.device)
    padded[: ids.numel()] = ids
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[: int(c.item())] for g, c in zip(gathered, counts, strict=True)])


def agree(ok: bool, device: torch.device) -> bool:
    """True on every rank only when ``ok`` is true on every rank (so that all ranks stop together)."""
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def check_epoch(ids: torch.Tensor, batches: int, samples: int, world: int) -> str | None:
    """What is wrong with this epoch's sharding (the same answer on every rank), or None."""
    counts = [torch.zeros(1, dtype=torch.int64, device=ids.device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([batches], device=ids.device))
    counts_list = [int(c.item()) for c in counts]
    if len(set(counts_list)) != 1:
        return f"ranks got different numbers of batches: {counts_list}"
    everything = gather_ids(ids, world).sort().values
    if not torch.equal(everything, torch.arange(samples, device=everything.device)):
        n_unique = everything.unique().numel()
        return f"ranks saw {everything.numel()} samples, {n_unique} distinct, expected each of {samples} once"
    return None


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device, data: Path) -> int:
    source = RawSource(fields={k: data / f"{k}.npy" for k in ("x", "label", "y")})
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = torch.nn.Sequential(torch.nn.Linear(args.features, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, CLASSES)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    previous = None
    # device=None: gpufeed takes the rank's current CUDA device (set by init_process_group); --cpu: cpu.
    want = None if device.type == "cuda" else "cpu"
    with CudaPrefetcher(SourceLoader(source, batch_size=args.batch_size, shuffle=True, seed=0),
                        device=want) as pf:
        if not agree(pf.device == device, device):
            print(f"FAIL: rank {rank}: gpufeed picked {pf.device}, the rank's device is {device}", flush=True)
            return 1
        for epoch in range(args.epochs):
            pf.set_epoch(epoch)  # every rank: the same permutation, its own share of it
            ids, total = [], torch.zeros((), device=device)
            for batch in pf:  # already on this rank's device
                loss = torch.nn.functional.cross_entropy(ddp(batch["x"]), batch["label"])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                ids.append(batch["y"])
                total += loss.detach() * len(batch["y"])
            mine = torch.cat(ids)
            print(f"rank {rank}/{world}: epoch {epoch}: {len(ids)} batches, {mine.numel()} samples on "
                  f"{mine.device}, mean loss {total.item() / mine.numel():.4f}", flush=True)
            problem = check_epoch(mine, len(ids), len(source), world)
            if problem is None and previous is not None and torch.equal(previous, mine):
                problem = f"the order of epoch {epoch - 1} came again: set_epoch did not reshuffle"
            if not agree(problem is None, device):
                print(f"FAIL: rank {rank}: epoch {epoch}: {problem or 'another rank failed'}", flush=True)
                return 1
            previous = mine
        final = total / mine.numel()
        dist.all_reduce(final)  # SUM (gloo has no AVG)
    if rank == 0:
        print(f"PASS: {world} rank(s) x {args.epochs} epochs on {device.type} ({dist.get_backend()}): "
              f"every epoch the ranks' shares were disjoint, equal in batches and covered all "
              f"{len(source)} samples exactly once; final loss {final.item() / world:.4f}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=512, help="per rank")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--data-dir", type=Path, default=None, help="where rank 0 writes the data (default: temp)")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU even when CUDA is available")
    p.add_argument("--smoke", action="store_true", help="tiny and quick")
    args = p.parse_args(argv)
    if args.smoke:
        args.samples, args.features, args.batch_size, args.epochs = 1000, 16, 32, 2
    cuda = torch.cuda.is_available() and not args.cpu
    rank, world, device = init_process_group(cuda)
    made = None
    try:
        if rank == 0:
            made = args.data_dir is None
            data = Path(tempfile.mkdtemp(prefix="gpufeed-ddp-")) if made else args.data_dir
            data.mkdir(parents=True, exist_ok=True)
            write_dataset(data, args.samples, args.features)
        where = [str(data) if rank == 0 else None]
        dist.broadcast_object_list(where, src=0)
        dist.barrier()  # the files are complete before any rank opens them
        code = train(args, rank, world, device, Path(where[0]))
        dist.barrier()  # every rank closed its files before rank 0 deletes them
        return code
    finally:
        if made:
            shutil.rmtree(data, ignore_errors=True)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
