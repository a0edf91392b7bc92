"""docs/integrations.md's timm recipe: ``create_loader(..., use_prefetcher=False)`` wrapped, on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
from _recipes import assert_same_batches, load

timm = pytest.importorskip("timm")
Image = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """A folder of 24 tiny PNGs in 3 classes, read by timm's ImageDataset."""
    import numpy as np
    from timm.data import ImageDataset

    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(24):
        d = root / f"class{i % 3}"
        d.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(d / f"{i}.png")
    return lambda: ImageDataset(str(root))


@pytest.mark.parametrize("workers", [0, 2])
def test_timm_loader_delivers_exactly_and_trains(images, workers):
    ns = load("timm")
    # Evaluation transforms (deterministic): the same loader iterated plainly is the reference.
    batches = ns["timm_loader"](images(), torch.device("cpu"), batch_size=8, num_workers=workers,
                                is_training=False, input_size=(3, 32, 32))
    plain = list(batches.source)
    got = list(batches)
    assert got[0][0].dtype == torch.float32 and got[0][0].shape == (8, 3, 32, 32)
    assert_same_batches(got, plain)
    batches.close()
    # Training transforms, a few steps of a tiny timm model.
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", num_classes=3, pretrained=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ns["timm_loader"](images(), torch.device("cpu"), batch_size=8, num_workers=workers,
                           input_size=(3, 32, 32)) as batches:
        for x, y in batches:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            assert math.isfinite(loss.item())
