"""gpufeed.nodes.ToDevice in torchdata ``nodes`` pipelines, on the CPU (and CUDA, by the device fixture)."""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tn = pytest.importorskip("torchdata.nodes",
                         reason="torchdata >= 0.10 is not installed (pip install 'gpufeed[nodes]')")

from gpufeed import host_memory  # noqa: E402
from gpufeed.nodes import ToDevice  # noqa: E402

# torchdata's ParallelMapper iterator joins its threads in __del__, which fails ("cannot join current
# thread") when the collector happens to run on one of those threads (any test here that drops one); the
# batches delivered are unaffected. Only that warning is ignored.
pytestmark = pytest.mark.filterwarnings("ignore:Exception ignored in.*_ParallelMapperIter.__del__"
                                        ":pytest.PytestUnraisableExceptionWarning")


class Boom(Exception):
    """An error of the data set's own type (one message argument, as torch's ExceptionWrapper re-raises)."""


def sample(i: int, fail_at: int | None = None) -> dict:
    """Sample ``i``: deterministic bytes of a size that varies with ``i``."""
    if i == fail_at:
        raise Boom(f"sample {i} is corrupt")
    g = torch.Generator().manual_seed(i)
    return {"x": torch.randn(1 + i % 5, 3, generator=g), "y": torch.randint(0, 255, (4,), generator=g,
                                                                            dtype=torch.uint8), "i": i}


def pipeline(n: int, batch_size: int, workers: int = 2, fail_at: int | None = None):
    """IterableWrapper -> ParallelMapper (threads) -> Batcher: a batch is a list of sample dicts."""
    def fetch(i: int) -> dict:
        return sample(i, fail_at)

    node = tn.ParallelMapper(tn.IterableWrapper(range(n)), fetch, num_workers=workers, method="thread")
    return tn.Batcher(node, batch_size=batch_size, drop_last=False)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def on(batch, device: torch.device) -> bool:
    return all(s["x"].device.type == device.type and s["y"].device.type == device.type for s in batch)


def take(it, k: int) -> list:
    return [next(it) for _ in range(k)]


# -- every byte, every epoch -----------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_pipeline_delivers_every_byte_over_three_epochs(device, depth):
    reference = tn.Loader(pipeline(37, 4))
    loader = tn.Loader(ToDevice(pipeline(37, 4), device=device, depth=depth))
    for epoch in range(3):
        want = list(reference)
        got = list(loader)
        assert len(got) == len(want) == 10, epoch
        assert all(on(b, device) for b in got)
        assert same(want, got), epoch
    assert loader.root.stats.batches == 30


def test_collated_batches_and_a_transform(device):
    node = tn.Mapper(pipeline(20, 8), lambda samples: torch.utils.data.default_collate(
        [{"y": s["y"], "i": s["i"]} for s in samples]))
    loader = tn.Loader(ToDevice(node, device=device, transform=lambda b: {**b, "y": b["y"].float() / 255}))
    got = list(loader)
    assert [len(b["i"]) for b in got] == [8, 8, 4]
    assert got[0]["y"].dtype == torch.float32 and got[0]["y"].device.type == device.type
    # (the division on the device: CUDA divides by a scalar as a multiplication by its reciprocal)
    want = torch.stack([sample(i)["y"] for i in range(20)]).to(device).float() / 255
    assert torch.equal(torch.cat([b["y"] for b in got]), want)


def test_depth_batches_are_taken_ahead_of_the_one_the_loop_holds():
    taken = []

    def numbers():
        for i in range(10):
            taken.append(i)
            yield {"x": torch.full((2,), i)}

    for depth in (1, 2, 4):
        taken.clear()
        it = iter(tn.Loader(ToDevice(tn.IterableWrapper(_Reiterable(numbers)), device="cpu", depth=depth)))
        assert next(it)["x"][0].item() == 0
        assert len(taken) == depth + 1
        assert [b["x"][0].item() for b in it] == list(range(1, 10))


class _Reiterable:
    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return self.make()


def test_an_empty_upstream_ends_the_epoch(device):
    assert list(tn.Loader(ToDevice(pipeline(0, 4), device=device))) == []


# -- resume ----------------------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 30), batch_size=st.integers(1, 5), depth=st.integers(1, 4), data=st.data())
def test_state_saved_at_any_point_resumes_exactly(device, n, batch_size, depth, data):
    want = list(tn.Loader(pipeline(n, batch_size)))
    k = data.draw(st.integers(0, len(want)), label="batches received before the state is saved")
    loader = tn.Loader(ToDevice(pipeline(n, batch_size), device=device, depth=depth))
    it = iter(loader)
    got = take(it, k)
    state = loader.state_dict()
    json.dumps(state)  # plain data, as a checkpoint holds it
    resumed = tn.Loader(ToDevice(pipeline(n, batch_size), device=device, depth=depth))
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert same(want[:k], got)
    # The Loader starts a fresh epoch where the saved one had ended (restart_on_stop_iteration).
    assert same(want[k:] if k < len(want) else want, rest)
    assert same(want, list(resumed))  # and the epoch after is whole


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_the_same_loader_resumes_dropping_what_was_in_flight(device, depth):
    want = list(tn.Loader(pipeline(40, 3)))
    loader = tn.Loader(ToDevice(pipeline(40, 3), device=device, depth=depth))
    it = iter(loader)
    first = take(it, 5)
    state = loader.state_dict()
    take(it, 3)  # received, then forgotten: the resume goes back to the state
    loader.load_state_dict(state)
    assert same(want, first + list(loader))
    assert loader.root.stats.batches == 5 + 3 + len(want) - 5


def test_state_before_the_first_batch_is_the_beginning(device):
    loader = tn.Loader(ToDevice(pipeline(10, 3), device=device))
    state = loader.state_dict()
    resumed = tn.Loader(ToDevice(pipeline(10, 3), device=device))
    resumed.load_state_dict(state)
    assert same(list(tn.Loader(pipeline(10, 3))), list(resumed))


# -- errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_an_upstream_error_keeps_its_type_and_comes_after_the_batches_before_it(device, depth):
    loader = tn.Loader(ToDevice(pipeline(30, 2, fail_at=7), device=device, depth=depth))
    got = []
    with pytest.raises(Boom, match="sample 7 is corrupt"):
        for batch in loader:
            got.append(batch)
    assert [[s["i"] for s in b] for b in got] == [[0, 1], [2, 3], [4, 5]]
    assert same(got, list(tn.Loader(pipeline(6, 2))))


def test_an_error_raised_on_the_loop_thread_keeps_its_traceback():
    def rows():
        yield {"x": torch.ones(2)}
        raise Boom("the file ended early")

    loader = tn.Loader(ToDevice(tn.IterableWrapper(_Reiterable(rows)), device="cpu", depth=3))
    it = iter(loader)
    assert next(it)["x"].sum().item() == 2
    with pytest.raises(Boom) as info:
        next(it)
    assert "rows" in [entry.name for entry in info.traceback]  # the generator's own frame
    with pytest.raises(StopIteration):
        next(it)


def test_a_transform_error_keeps_its_type(device):
    def transform(batch):
        if batch[0]["i"] == 4:
            raise Boom("bad batch")
        return batch

    loader = tn.Loader(ToDevice(pipeline(10, 2), device=device, transform=transform))
    got = []
    with pytest.raises(Boom, match="bad batch"):
        for batch in loader:
            got.append(batch)
    assert len(got) == 2


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        ToDevice(tn.IterableWrapper([]), depth=0)
    with pytest.raises(TypeError, match="IterableWrapper"):
        ToDevice([{"x": torch.ones(1)}])
    with pytest.raises(ValueError, match="transform must be callable"):
        ToDevice(tn.IterableWrapper([]), transform=3)


# -- threads ---------------------------------------------------------------------------------------------


def _new_threads(before: set[threading.Thread], timeout: float = 0.0) -> list[threading.Thread]:
    """The threads started since ``before`` still alive after ``timeout`` seconds (collecting garbage)."""
    t0 = time.monotonic()
    while True:
        alive = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not alive or time.monotonic() - t0 >= timeout:
            return alive
        gc.collect()
        time.sleep(0.02)


def test_threads_end_after_the_loop_breaks(device):
    before = set(threading.enumerate())
    loader = tn.Loader(ToDevice(pipeline(200, 2, workers=3), device=device, depth=3))
    peak = 0
    for _ in range(4):  # each broken epoch's threads end when the next one starts (reset)
        for i, _batch in enumerate(loader):
            if i == 3:
                break
        peak = max(peak, len(_new_threads(before)))
    assert 0 < peak <= 3 + 2 + 3  # one ParallelMapper's workers, reader and sorter; the last epoch's ending
    del loader, _batch
    assert _new_threads(before, timeout=10) == []


def test_threads_end_after_an_upstream_error():
    before = set(threading.enumerate())
    loader = tn.Loader(ToDevice(pipeline(50, 2, fail_at=3), device="cpu"))
    with pytest.raises(Boom):
        list(loader)
    del loader
    assert _new_threads(before, timeout=10) == []


# -- host memory -----------------------------------------------------------------------------------------


def _count_pins(monkeypatch) -> dict[str, int]:
    """Count gpufeed's pinning and ``Tensor.pin_memory`` on this (the loop's) thread."""
    calls = {"pin": 0, "pinned_empty": 0, "pin_memory": 0}
    loop = threading.get_ident()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            if threading.get_ident() == loop:
                calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(host_memory, "pin", counted("pin", host_memory.pin))
    monkeypatch.setattr(host_memory, "pinned_empty", counted("pinned_empty", host_memory.pinned_empty))
    monkeypatch.setattr(torch.Tensor, "pin_memory", counted("pin_memory", torch.Tensor.pin_memory))
    return calls


def test_batches_pinned_upstream_are_not_pinned_again_on_the_cpu(monkeypatch):
    # PinMemory needs CUDA; upstream of it, batches that say they are pinned are what ToDevice sees.
    calls = _count_pins(monkeypatch)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
    got = list(tn.Loader(ToDevice(pipeline(12, 4), device="cpu")))
    assert same(got, list(tn.Loader(pipeline(12, 4))))
    assert calls == {"pin": 0, "pinned_empty": 0, "pin_memory": 0}


@pytest.mark.cuda
def test_to_device_after_pin_memory_does_not_pin_twice(monkeypatch):
    collate = torch.utils.data.default_collate
    big = tn.Mapper(tn.Batcher(tn.IterableWrapper(range(64)), 16), lambda ix: collate(
        [{"x": torch.full((4096,), float(i))} for i in ix]))  # 256 KiB a batch: copied, not packed
    node = ToDevice(tn.PinMemory(big), device="cuda")  # (made first: it measures the link once a process)
    calls = _count_pins(monkeypatch)
    got = [b["x"][:, 0].cpu() for b in tn.Loader(node)]
    assert torch.equal(torch.cat(got), torch.arange(64.0))
    assert calls == {"pin": 0, "pinned_empty": 0, "pin_memory": 0}
    assert node.stats.staged_bytes == 0 and node.stats.bytes == 64 * 4096 * 4
    # The control: the same batches from pageable memory are pinned on the way (so the counters count).
    pageable = ToDevice(tn.Mapper(tn.Batcher(tn.IterableWrapper(range(64)), 16), lambda ix: collate(
        [{"x": torch.full((4096,), float(i))} for i in ix])), device="cuda")
    list(tn.Loader(pageable))
    assert calls["pin"] + calls["pinned_empty"] > 0 and pageable.stats.staged_bytes > 0


@pytest.mark.cuda
def test_batches_collated_by_pinned_collate_are_not_pinned_again(monkeypatch):
    from gpufeed.nodes import pinned_collate

    def head(collate):
        node = tn.Batcher(tn.IterableWrapper(range(64)), 16)  # 256 KiB a batch: copied, not packed
        return tn.Prefetcher(tn.Mapper(node, lambda ix: collate([{"x": torch.full((4096,), float(i))}
                                                                  for i in ix])), prefetch_factor=2)

    node = ToDevice(head(pinned_collate), device="cuda")
    calls = _count_pins(monkeypatch)
    got = [b["x"][:, 0].cpu() for b in tn.Loader(node)]
    assert torch.equal(torch.cat(got), torch.arange(64.0))
    assert calls == {"pin": 0, "pinned_empty": 0, "pin_memory": 0}  # (the collate's blocks: another thread's)
    assert node.stats.staged_bytes == 0 and node.stats.bytes == 64 * 4096 * 4
    # The control: default_collate's pageable batches are pinned on the way.
    pageable = ToDevice(head(torch.utils.data.default_collate), device="cuda")
    list(tn.Loader(pageable))
    assert pageable.stats.staged_bytes > 0


@pytest.mark.cuda
def test_pageable_batches_are_pinned_by_one_thread_and_arrive_exact(monkeypatch):
    """ToDevice pins pageable tensors with one thread's copy (its thread runs beside the pipeline's), never
    torch's parallel pin_memory(), except a tensor numpy cannot read (here one requiring grad)."""
    g = torch.Generator().manual_seed(0)
    rows = [{"x": torch.randn(4096, generator=g), "b": torch.randn(4096, generator=g).to(torch.bfloat16),
             "m": torch.rand(8192, generator=g) > 0.5, "i": torch.randint(-9, 9, (2, 4096), generator=g)}
            for _ in range(64)]
    collate = torch.utils.data.default_collate

    def head():  # 16 rows a batch: each field 128 KiB - 1 MiB, copied alone (not packed)
        node = tn.Batcher(tn.IterableWrapper(range(64)), 16)
        return tn.Mapper(node, lambda ix: collate([rows[i] for i in ix]))

    node = ToDevice(head(), device="cuda")  # (made first: it measures the link once a process)
    calls = _count_pins(monkeypatch)
    got = list(tn.Loader(node))
    assert same([{k: v.cpu() for k, v in b.items()} for b in got], list(tn.Loader(head())))
    assert all(v.is_cuda for b in got for v in b.values())
    assert calls["pin"] == calls["pin_memory"] == 0 and calls["pinned_empty"] >= 4 * 4
    assert node.stats.staged_bytes == node.stats.bytes > 0
    grad = ToDevice(tn.Mapper(head(), lambda b: {**b, "x": b["x"].requires_grad_()}), device="cuda")
    got = [b["x"].detach().cpu() for b in tn.Loader(grad)]
    assert torch.equal(torch.cat(got), torch.stack([r["x"] for r in rows]))
    assert calls["pin"] == 4  # (one a batch: the field that requires grad)


@pytest.mark.cuda
def test_batches_arrive_on_the_loop_stream_in_order_under_a_slow_consumer():
    stream = torch.cuda.Stream()
    loader = tn.Loader(ToDevice(pipeline(40, 4), device="cuda", depth=3))
    want = list(tn.Loader(pipeline(40, 4)))
    with torch.cuda.stream(stream):
        got = []
        for batch in loader:
            torch.cuda._sleep(1_000_000)  # the GPU busy while the next copies are in flight
            got.append([{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                        for s in batch])
    torch.cuda.synchronize()
    assert same(want, got)


# -- the recipe of docs/nodes.md -------------------------------------------------------------------------


def _recipe() -> dict:
    page = (Path(__file__).resolve().parents[1] / "docs" / "nodes.md").read_text()
    (code,) = re.findall(r"```python\n# recipe: nodes\n(.*?)```", page, re.S)
    ns: dict = {"__name__": "recipe_nodes"}
    exec(compile(code, "docs/nodes.md", "exec"), ns)
    return ns


def test_the_docs_recipe_delivers_every_byte_and_resumes(device):
    dataset = torch.utils.data.TensorDataset(torch.randn(50, 3), torch.arange(50))
    nodes_loader = _recipe()["nodes_loader"]
    loader = nodes_loader(dataset, 8, workers=2, device=device)
    epochs = [list(loader) for _ in range(2)]
    for batches in epochs:
        assert [len(y) for _, y in batches] == [8] * 6 + [2]
        assert all(x.device.type == device.type for x, _ in batches)
        y = torch.cat([y for _, y in batches]).cpu()
        assert sorted(y.tolist()) == list(range(50))  # every sample once
        assert torch.equal(torch.cat([x for x, _ in batches]).cpu(), dataset.tensors[0][y])
    assert not torch.equal(*(torch.cat([y for _, y in b]).cpu() for b in epochs))  # reshuffled each epoch
    it = iter(loader)
    head = take(it, 3)
    state = loader.state_dict()
    resumed = nodes_loader(dataset, 8, workers=2, device=device)
    resumed.load_state_dict(state)
    rest = list(resumed)
    ys = [y.cpu() for _, y in head + rest]
    assert sorted(torch.cat(ys).tolist()) == list(range(50)) and len(rest) == 4


# -- the optional extra ----------------------------------------------------------------------------------


def test_import_gpufeed_does_not_import_torchdata():
    code = "import sys, gpufeed; print('torchdata' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_without_torchdata_the_import_error_names_the_extra():
    code = ("import sys; sys.modules['torchdata'] = None\n"
            "try:\n    import gpufeed.nodes\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'gpufeed[nodes]'" in out.stdout, out.stdout + out.stderr
