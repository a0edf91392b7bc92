"""docs/integrations.md's token-stream loop (an IterableDataset of whole token batches), and its resume."""

from __future__ import annotations

import math

import pytest
import torch
from _recipes import assert_same_batches, load
from torch.utils.data import DataLoader

VOCAB = 50


def _tokens():
    return torch.randint(0, VOCAB, (2000,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("workers", [0, 2])
def test_token_batches_arrive_exactly_and_train(workers):
    from gpufeed import CudaPrefetcher

    ns = load("tokens")
    dataset = ns["TokenBatches"](_tokens(), batch_size=4, seq_len=16)
    plain = list(DataLoader(dataset, batch_size=None, num_workers=workers))
    assert len(plain) == 31 and plain[0]["input"].dtype == torch.int64
    with CudaPrefetcher(DataLoader(dataset, batch_size=None, num_workers=workers), device="cpu") as pf:
        assert_same_batches(list(pf), plain)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
    losses = ns["train_tokens"](model, torch.optim.SGD(model.parameters(), lr=0.1), dataset, "cpu",
                                num_workers=workers)
    assert len(losses) == 31 and all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_after_the_last_batch_received(workers):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    from gpufeed import CudaPrefetcher

    ns = load("tokens")
    dataset = ns["TokenBatches"](_tokens(), batch_size=4, seq_len=16)
    plain = list(DataLoader(dataset, batch_size=None, num_workers=workers))
    pf = CudaPrefetcher(sdl.StatefulDataLoader(dataset, batch_size=None, num_workers=workers), device="cpu")
    it = iter(pf)
    got = [next(it) for _ in range(7)]
    state = pf.state_dict()
    pf.close()
    resumed = CudaPrefetcher(sdl.StatefulDataLoader(dataset, batch_size=None, num_workers=workers),
                             device="cpu")
    resumed.load_state_dict(state)
    assert_same_batches(got + list(resumed), plain)
    resumed.close()
