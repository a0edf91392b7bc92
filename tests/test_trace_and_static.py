"""export_trace and static (CUDA-graph) delivery, on the CPU path and, with the device fixture, on CUDA."""

import json

import pytest
import torch

from gpufeed import CudaPrefetcher, StaticBatch


def test_export_trace_has_every_batch_and_the_consumer_waits(tmp_path):
    data = [{"x": torch.full((4,), i)} for i in range(6)]
    with CudaPrefetcher(data, device="cpu", trace=True) as pf:
        list(pf)
        path = pf.export_trace(tmp_path / "t.json")
    with open(path) as f:
        events = json.loads(f.read())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert sorted(e["args"]["batch"] for e in spans if e["name"] == "fetch") == list(range(7))  # + the end
    assert sorted(e["args"]["batch"] for e in spans if e["name"] == "copy") == list(range(6))
    assert len([e for e in spans if e["name"] == "wait"]) == 7
    assert all(e["dur"] >= 0 for e in spans)


def test_export_trace_needs_tracing_on(tmp_path):
    with (
        CudaPrefetcher([torch.zeros(1)], device="cpu") as pf,
        pytest.raises(RuntimeError, match="trace=True"),
    ):
        pf.export_trace(tmp_path / "t.json")


def test_static_batches_share_storage_and_pad_the_last(device):
    data = [{"x": torch.arange(i * 12, i * 12 + 12).view(4, 3), "n": i} for i in range(3)]
    data.append({"x": torch.arange(100, 106).view(2, 3), "n": 3})
    with CudaPrefetcher(data, device=device, static=True) as pf:
        ptrs, seen = set(), []
        for item in pf:
            assert isinstance(item, StaticBatch)
            ptrs.add(item.batch["x"].data_ptr())
            seen.append((item.batch["x"].cpu().clone(), item.valid, item.batch["n"]))
    assert len(ptrs) == 1  # the same tensor every time
    for (x, valid, n), d in zip(seen, data, strict=True):
        assert valid == d["x"].shape[0] and n == d["n"]
        assert torch.equal(x[:valid], d["x"])
        assert not x[valid:].any()


def test_static_rejects_a_batch_larger_than_the_first():
    data = [torch.zeros(2, 3), torch.zeros(5, 3)]
    with (
        CudaPrefetcher(data, device="cpu", static=True) as pf,
        pytest.raises(ValueError, match="first batch"),
    ):
        list(pf)


@pytest.mark.cuda
def test_every_graph_replay_sees_exactly_its_batch():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "cuda_graphs.py"
    spec = importlib.util.spec_from_file_location("cuda_graphs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.main(["--batches", "40", "--batch-size", "512"])
    assert result["replays"] == 40 and result["mismatches"] == 0
