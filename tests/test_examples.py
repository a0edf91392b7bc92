"""Every example runs end to end, small, on the CPU (``main(["--smoke"])``) and checks its own result."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from gpufeed import StaticBatch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"gpufeed_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_example_is_tested():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == [
        "accelerate_launch", "cuda_graphs", "ddp", "gds_raw", "hdf5_to_gpu", "lightning_datamodule",
        "lightning_resume", "quickstart", "torchdata_nodes"]
    # ddp.py runs under torchrun in tests/test_distributed.py; lightning_resume.py in tests/test_lightning.py;
    # accelerate_launch.py in tests/integrations/test_accelerate_launch.py.


def test_cuda_graphs_smoke_on_the_cpu_checks_the_static_batches(capsys, monkeypatch):
    # The replay check itself runs on the GPU machine: tests/test_trace_and_static.py (cuda marker).
    if torch.cuda.is_available():
        pytest.skip("on a GPU the cuda-marked test runs the example in full")
    module = _load("cuda_graphs")
    assert module.main(["--smoke"]) == {"replays": 0, "steps": 6, "mismatches": 0}
    out = capsys.readouterr().out
    assert out.startswith("no CUDA GPU: no graph captured; 6 eager steps over static batches (one set of "
                          "tensors, refilled each step), 0 mismatches; final loss ")

    class Fresh:  # every batch in new tensors: a captured graph would read stale ones
        def __init__(self, loader, **kwargs):
            self.loader = loader

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def __iter__(self):
            return (StaticBatch(b.clone(), len(b)) for b in self.loader)

    monkeypatch.setattr(module, "CudaPrefetcher", Fresh)
    assert module.main(["--smoke"])["mismatches"] == 10  # 5 steps read the first batch, 5 moved tensors


def test_quickstart(capsys):
    assert _load("quickstart").main(["--smoke"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:3]] == ["epoch 0", "epoch 1", "epoch 2"] and len(out) == 5
    losses = [float(line.rsplit(" ", 1)[1]) for line in out[:3]]
    assert losses[0] > losses[1] > losses[2], losses  # the labels are learnable: the loss goes down
    assert out[3].startswith("[no verdict: fewer than 10 batches timed after start-up]")  # 6 batches in all
    assert " 6 batches, " in out[3]
    assert out[4] == "trained on 1536 samples on cpu"


def test_torchdata_nodes(capsys):
    pytest.importorskip("torchdata.nodes", reason="torchdata >= 0.10 is not installed")
    assert _load("torchdata_nodes").main(["--smoke"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("epoch 0: loss ") and out[0].endswith(", each sample once: True")
    assert out[1].startswith("epoch 1: loss ") and out[1].endswith(", each sample once: True")
    assert out[2].startswith(("[ok]", "[INPUT-BOUND]", "[no verdict")) and " 25 batches" in out[2]  # 2x10+5
    assert out[3] == "epoch 2: checkpointed after 5 batches, resumed: each sample once: True"
    assert out[4] == "trained on 1800 samples on cpu"


def test_torchdata_nodes_without_torchdata_says_so(capsys, monkeypatch):
    module = _load("torchdata_nodes")
    monkeypatch.setattr(module, "nodes", None)
    assert module.main(["--smoke"]) == 0
    assert capsys.readouterr().out == "this example needs torchdata >= 0.10: pip install 'gpufeed[nodes]'\n"


def test_hdf5_to_gpu(capsys):
    pytest.importorskip("h5py")
    assert _load("hdf5_to_gpu").main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "field 'x' (8,) torch.float32, 1000 samples\n  train.h5: contiguous (read by byte offset" in out
    assert "epoch 0: 1000 samples in " in out and "epoch 1: 1000 samples in " in out
    assert " 16 batches, " in out  # 2 epochs x ceil(1000 / 128)


def test_gds_raw_falls_back_to_rawsource_on_cpu(capsys):
    pytest.importorskip("h5py")
    assert _load("gds_raw").main(["--smoke"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("converted: ") and lines[0].endswith("s")
    assert lines[1].startswith("cached: ")
    assert lines[2] == "reading with RawSource (no CUDA device, so no GPUDirect Storage)"
    assert " 10 batches, " in lines[3]
    assert lines[4] == "read 1000 samples to cpu"


def test_lightning_datamodule(capsys):
    pytest.importorskip("lightning", reason="lightning is not installed (pip install lightning)")
    assert _load("lightning_datamodule").main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "gpufeed: [" in out and " 4 batches, " in out  # one prefetcher, re-iterated for 2 epochs
    assert out.rstrip().endswith("trained on 1024 samples on cpu")


def test_lightning_example_without_lightning_says_so(capsys, monkeypatch):
    module = _load("lightning_datamodule")
    monkeypatch.setattr(module, "L", None)
    assert module.main(["--smoke"]) == 0
    assert capsys.readouterr().out == "this example needs PyTorch Lightning: pip install lightning\n"
