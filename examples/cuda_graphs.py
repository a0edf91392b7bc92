"""Capture a training step as a CUDA graph and replay it over batches gpufeed prefetches.

A captured graph reads its inputs from fixed addresses: ``CudaPrefetcher(..., static=True)`` delivers
every batch into the same device tensors (a short last batch zero-padded, its real row count in
``valid``), refilled on the consumer's stream after the previous replay has read them.

    python examples/cuda_graphs.py            # captures and replays a graph on a CUDA GPU
    python examples/cuda_graphs.py --smoke    # tiny; on a CPU, the same step run eagerly (see below)

Without a GPU there is no graph to capture: the example then runs the same step eagerly on the CPU over
the static batches, and checks what a replay relies on: every batch arrives in the same tensors, and
those hold exactly that batch's rows when the step reads them.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from gpufeed import CudaPrefetcher


def digest(x: torch.Tensor) -> torch.Tensor:
    """An exact per-row checksum (int64 arithmetic), so a replay proves which batch it read."""
    b = x.view(x.shape[0], -1).view(torch.int32).to(torch.int64)
    w = torch.arange(1, b.shape[1] + 1, device=b.device, dtype=torch.int64)
    return (b * w).sum(dim=1)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    """One training step on ``x`` (what the graph captures)."""
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss


def count_mismatches(results: list[tuple[torch.Tensor, int]], loader: list[torch.Tensor]) -> int:
    """Steps whose ``(digest of what they read, valid rows)`` differ from the loader's batch."""
    mismatches = 0
    for (got, valid), src in zip(results, loader, strict=False):
        want = digest(src.to(got.device))
        mismatches += int(valid != len(src) or not torch.equal(got[:valid], want))
    return mismatches + abs(len(results) - len(loader))


def eager_on_cpu(loader: list[torch.Tensor], model: torch.nn.Module, opt: torch.optim.Optimizer
                 ) -> dict[str, int]:
    """The same step, run eagerly on the static batches of a CPU prefetcher (no graph to capture)."""
    results, moved = [], 0
    with CudaPrefetcher(loader, static=True, depth=2, device="cpu") as batches:
        static_x = None
        for item in batches:
            static_x = item.batch if static_x is None else static_x
            moved += int(item.batch.data_ptr() != static_x.data_ptr())  # a replay would read stale data
            opt.zero_grad(set_to_none=False)
            loss = step(model, opt, static_x)
            results.append((digest(static_x), item.valid))
    out = {"replays": 0, "steps": len(results), "mismatches": count_mismatches(results, loader) + moved}
    print(f"no CUDA GPU: no graph captured; {out['steps']} eager steps over static batches (one set of "
          f"tensors, refilled each step), {out['mismatches']} mismatches; final loss {loss.item():.4f}")
    return out


def main(argv: list[str] | None = None) -> dict[str, int]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--smoke", action="store_true", help="tiny and quick")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.batch_size, args.features = 6, 64, 32

    g = torch.Generator().manual_seed(0)
    n_rows = args.batches * args.batch_size - args.batch_size // 3  # a short last batch
    x_all = torch.randn(n_rows, args.features, generator=g)
    loader = [x_all[i : i + args.batch_size] for i in range(0, n_rows, args.batch_size)]
    cuda = torch.cuda.is_available()
    model = torch.nn.Linear(args.features, 1).to("cuda" if cuda else "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if not cuda:
        return eager_on_cpu(loader, model, opt)

    with CudaPrefetcher(loader, static=True, depth=2) as batches:
        it = iter(batches)
        first = next(it)
        static_x = first.batch
        # Warm up on a side stream, then capture one step that reads static_x.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                opt.zero_grad(set_to_none=False)
                step(model, opt, static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=False)
        with torch.cuda.graph(graph):
            loss = step(model, opt, static_x)
            seen = digest(static_x)  # what this replay read, row by row
        results = []
        for item in itertools.chain([first], it):  # lazily: each next() refills static_x
            assert item.batch.data_ptr() == static_x.data_ptr()
            graph.replay()
            results.append((seen.clone(), item.valid))
    torch.cuda.synchronize()
    mismatches = count_mismatches(results, loader)
    out = {"replays": len(results), "mismatches": mismatches}
    print(f"{out['replays']} graph replays over prefetched batches, {mismatches} mismatches; "
          f"final loss {loss.item():.4f}")
    return out


if __name__ == "__main__":
    main()
