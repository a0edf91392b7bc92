"""CudaPrefetcher on its CPU path (and the CUDA path on the GPU machine, through the device fixture)."""

import collections
import dataclasses
import gc
import os
import random
import threading
import time
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import wait_no_threads
from gpufeed import CudaPrefetcher, PrefetchStats, RawSource, SourceLoader

Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    label: str
    meta: dict


class Opaque:
    pass


def batches(n, seed=0, rows=None):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rows or rng.randint(1, 17)
        out.append({"x": torch.randn(r, 5, generator=g), "y": torch.randint(0, 1000, (r,), generator=g),
                    "i": i})
    return out


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, np.ndarray):
        return isinstance(b, torch.Tensor) and torch.equal(torch.from_numpy(a), b.cpu())
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    return a is b or a == b


# -- structures ----------------------------------------------------------------------------------

def test_every_structure_is_rebuilt_with_its_types(device):
    obj = Opaque()
    batch = {
        "t": torch.arange(6).view(2, 3),
        "tuple": (torch.ones(2), 3, None),
        "list": [torch.zeros(1, dtype=torch.bool), "s"],
        "od": OrderedDict(b=torch.tensor([1.5]), a=np.arange(3, dtype=np.int16)),
        "nt": Pair(torch.tensor([7]), Pair(np.float32([1, 2]), "x")),
        "dc": Sample(torch.ones(2, 2, dtype=torch.float64), "lab", {"deep": [(torch.tensor(9),)]}),
        "obj": obj,
        "bf16": torch.randn(4).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "noncontig": torch.arange(12).view(3, 4).t(),
    }
    with CudaPrefetcher([batch], device=device) as pf:
        (got,) = list(pf)
    assert same(batch, got)
    assert got["obj"] is obj
    assert type(got["od"]) is OrderedDict and list(got["od"]) == ["b", "a"]
    assert type(got["nt"]) is Pair and type(got["nt"].b) is Pair
    assert isinstance(got["od"]["a"], torch.Tensor) and got["od"]["a"].dtype == torch.int16
    for t in (got["t"], got["dc"].x, got["nt"].b.a, got["bf16"], got["noncontig"]):
        assert t.device.type == device.type
    assert got["noncontig"].shape == (4, 3)


def test_mutable_mappings_keep_what_they_hold_beside_their_items(device):
    """A copy of the mapping with its values moved, as torch's pin_memory and default_collate rebuild it."""
    dd = collections.defaultdict(list, x=torch.ones(2))
    chain = collections.ChainMap({"a": torch.zeros(1)}, {"b": torch.ones(1), "a": torch.ones(3)})
    counts = collections.Counter(z=torch.tensor(3))
    with CudaPrefetcher([{"dd": dd, "chain": chain, "counts": counts}], device=device) as pf:
        (got,) = list(pf)
    assert type(got["dd"]) is collections.defaultdict and got["dd"].default_factory is list
    assert got["dd"]["x"].device.type == device.type and got["dd"]["missing"] == []
    assert type(got["chain"]) is collections.ChainMap and sorted(got["chain"]) == ["a", "b"]
    assert got["chain"]["a"].shape == (1,) and got["chain"]["b"].device.type == device.type
    assert type(got["counts"]) is collections.Counter and int(got["counts"]["z"]) == 3
    assert dd["x"].device.type == "cpu"  # the loader's own mapping is left as it was


def test_plain_tensors_and_scalars_pass(device):
    data = [torch.arange(3), 5, "text", None]
    with CudaPrefetcher(data, device=device) as pf:
        got = list(pf)
    assert torch.equal(got[0].cpu(), torch.arange(3)) and got[1:] == [5, "text", None]


# -- exact delivery ------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 12), depth=st.integers(1, 4), seed=st.integers(0, 10_000),
       delays=st.lists(st.floats(0, 0.003), min_size=1, max_size=5))
def test_every_batch_exactly_once_in_order(n, depth, seed, delays):
    data = batches(n, seed)
    with CudaPrefetcher(data, device="cpu", depth=depth) as pf:
        got = []
        for k, b in enumerate(pf):
            time.sleep(delays[k % len(delays)])  # a consumer of random speed
            got.append(b)
    assert len(got) == n
    assert [b["i"] for b in got] == list(range(n))
    assert all(same(a, b) for a, b in zip(data, got, strict=True))
    assert pf.stats.batches == n


def test_exact_bytes_through_a_dataloader_with_workers(device):
    ds = torch.utils.data.TensorDataset(torch.arange(1000 * 3).view(1000, 3), torch.arange(1000))
    loader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=2)
    with CudaPrefetcher(loader, device=device, depth=3) as pf:
        assert len(pf) == 16
        for _ in range(2):  # re-iterable per epoch
            xs = [x.cpu() for x, _ in pf]
            assert torch.equal(torch.cat(xs), ds.tensors[0])


def test_depth_bounds_batches_ahead_of_the_consumer():
    pulled = []

    def loader():
        for i in range(20):
            pulled.append(i)
            yield torch.tensor([i])

    for depth in (1, 2, 4):
        pulled.clear()
        with CudaPrefetcher(loader, device="cpu", depth=depth) as pf:
            it = iter(pf)
            taken = [next(it).item() for _ in range(3)]
            assert taken == [0, 1, 2]
            assert len(pulled) == 3 + depth, (depth, pulled)


def _slow(n, seconds):
    """A loader factory: ``n`` one-element batches, each ``seconds`` in the making."""
    def batches():
        for i in range(n):
            time.sleep(seconds)
            yield torch.tensor([i])
    return batches


def test_consumer_wait_is_counted():
    with CudaPrefetcher(_slow(12, 0.02), device="cpu") as pf:
        for _ in pf:
            time.sleep(0.002)  # the training step
    s = pf.stats
    assert s.batches == 12 and s.bytes == 12 * 8
    assert 0.5 < s.stall_fraction <= 1.0
    assert s.input_bound and s.summary().startswith("[INPUT-BOUND] the loop waited for data")


def test_a_loop_of_few_batches_gets_no_verdict():
    with CudaPrefetcher([torch.zeros(1)], device="cpu") as pf:
        list(pf)
    assert pf.stats.summary().startswith("[no verdict: fewer than 10 batches timed after start-up]")


def test_a_loop_that_does_nothing_is_not_judged_input_bound():
    """An empty loop body waits for every batch by construction: the summary says it timed the input
    alone, without a verdict."""
    with CudaPrefetcher(_slow(40, 0.005), device="cpu") as pf:
        for _ in pf:
            pass
    s = pf.stats
    assert s.stall_fraction > 0.9 and not s.loop_did_work and not s.input_bound
    assert s.summary().startswith("[no verdict: the loop did no work (")


def test_start_up_is_not_counted_as_the_loop_waiting_for_data():
    """A loader slow to start (workers spawning) and fast after: the verdict is the loop's, not start-up's."""
    def slow_start():
        time.sleep(0.3)
        for i in range(20):
            yield torch.tensor([i])

    with CudaPrefetcher(slow_start, device="cpu") as pf:
        for _ in pf:
            time.sleep(0.02)  # the training step: 0.4 s in all, so a scheduling hiccup is not 5% of it
    s = pf.stats
    assert s.startup_s >= 0.3 and s.wall_s < 0.6 and not s.input_bound  # (0.7 with the start-up in it)
    assert s.summary().startswith("[ok] the loop waited") and "start-up 0.3" in s.summary()


# -- errors --------------------------------------------------------------------------------------

class Boom(Exception):
    pass


def failing(at):
    def gen():
        for i in range(10):
            if i == at:
                raise Boom(f"at {i}")
            yield torch.tensor([i])

    return gen


@pytest.mark.parametrize("at", [0, 1, 5])
def test_loader_error_arrives_after_the_batches_before_it(device, at):
    got = []
    with CudaPrefetcher(failing(at), device=device, depth=3) as pf:
        with pytest.raises(Boom, match=f"at {at}") as info:
            for b in pf:
                got.append(b.item())
        assert [f.name for f in info.traceback][-1] == "gen"  # the loader's frame, not ours
        assert got == list(range(at))
        it = iter(pf)  # the next epoch works again
        assert next(it).item() == 0 if at else True


def test_no_stale_batch_after_an_error():
    pf = CudaPrefetcher(failing(2), device="cpu")
    it = iter(pf)
    assert [next(it).item(), next(it).item()] == [0, 1]
    with pytest.raises(Boom):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    pf.close()


def test_error_in_dunder_iter_arrives_in_the_consumer():
    class BadLoader:
        def __iter__(self):
            raise ValueError("cannot start")

    with CudaPrefetcher(BadLoader(), device="cpu") as pf, pytest.raises(ValueError, match="cannot start"):
        next(iter(pf))


def test_transform_error_arrives_with_its_type(device):
    def transform(b):
        if b.item() == 3:
            raise ZeroDivisionError("bad batch 3")
        return b * 2

    got = []
    with (
        CudaPrefetcher([torch.tensor([i]) for i in range(6)], device=device, transform=transform) as pf,
        pytest.raises(ZeroDivisionError),
    ):
        for b in pf:
            got.append(b.item())
    assert got == [0, 2, 4]


def test_transform_runs_on_each_batch(device):
    data = [torch.arange(4, dtype=torch.uint8) + i for i in range(3)]
    with CudaPrefetcher(data, device=device, transform=lambda t: t.float() * 0.5 - 1) as pf:
        got = [b.cpu() for b in pf]
    # exact in float32
    assert all(torch.equal(g, d.float() * 0.5 - 1) for g, d in zip(got, data, strict=True))


# -- shutdown ------------------------------------------------------------------------------------

def endless():
    i = 0
    while True:
        yield torch.full((4,), i)
        i += 1


def test_close_ends_the_loader_s_iteration():
    ended = []

    def loader():
        try:
            yield from endless()
        finally:
            ended.append(True)

    pf = CudaPrefetcher(loader, device="cpu")
    it = iter(pf)
    for _ in range(3):
        next(it)
    assert not ended
    pf.close()
    assert ended == [True]
    with pytest.raises(RuntimeError, match="closed"):
        next(it)
    with pytest.raises(RuntimeError, match="closed"):
        iter(pf)


def test_break_stops_the_thread():
    pf = CudaPrefetcher(endless, device="cpu", depth=2)
    for b in pf:
        if b[0] == 3:
            break
    assert wait_no_threads() < 5  # the fill pool is only created for pinned staging, never on the CPU
    pf.close()


def test_del_and_gc_stop_the_thread():
    pf = CudaPrefetcher(endless, device="cpu")
    it = iter(pf)
    next(it)
    del it, pf
    gc.collect()
    assert wait_no_threads() < 5


def test_context_manager_stops_the_thread():
    with CudaPrefetcher(endless, device="cpu") as pf:
        next(iter(pf))
    assert wait_no_threads() < 5


def test_ctrl_c_during_next_ends_the_epoch():
    ended = []

    def stuck():
        try:
            for i in range(3):
                yield torch.full((1,), i)
            time.sleep(0.5)
            yield torch.ones(1)
        finally:
            ended.append(True)

    import _thread

    pf = CudaPrefetcher(stuck, device="cpu", depth=1)
    it = iter(pf)
    next(it)
    threading.Timer(0.1, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        next(it)
        next(it)
    assert ended == [True]
    with pytest.raises(StopIteration):
        next(it)
    pf.close()


def test_new_epoch_supersedes_the_unfinished_one():
    pf = CudaPrefetcher(endless, device="cpu")
    it1 = iter(pf)
    next(it1)
    it2 = iter(pf)
    assert next(it2)[0] == 0
    with pytest.raises(RuntimeError, match="new iteration"):
        next(it1)
    pf.close()


# -- drop-in surface -----------------------------------------------------------------------------

class Recorder:
    def __init__(self):
        self.epochs = []

    def set_epoch(self, e):
        self.epochs.append(e)


def test_set_epoch_is_forwarded_to_loader_sampler_and_batch_sampler():
    loader = collections.namedtuple("L", "")()  # placeholder replaced below
    sampler, inner = Recorder(), Recorder()

    class BatchSampler(Recorder):
        sampler = inner

    class Loader(Recorder):
        dataset = "the dataset"
        batch_size = 8

        def __init__(self):
            super().__init__()
            self.sampler = sampler
            self.batch_sampler = BatchSampler()

        def __iter__(self):
            return iter([torch.zeros(1)])

        def __len__(self):
            return 1

    loader = Loader()
    with CudaPrefetcher(loader, device="cpu") as pf:
        pf.set_epoch(3)
        assert loader.epochs == [3] and sampler.epochs == [3] and inner.epochs == [3]
        assert loader.batch_sampler.epochs == [3]
        assert pf.dataset == "the dataset" and pf.batch_size == 8 and pf.sampler is sampler
        assert len(pf) == 1 and pf.epoch == 3
        list(pf)
        list(pf)  # iterating again does not call set_epoch by itself, like a DataLoader
        assert loader.epochs == [3]


def test_len_without_len_is_a_type_error():
    with CudaPrefetcher(endless, device="cpu") as pf, pytest.raises(TypeError, match="no len"):
        len(pf)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"depth": 0}, "depth must be an int >= 1.*got 0"),
        ({"depth": -2}, "depth must be an int >= 1.*got -2"),
        ({"device": "tpu:0"}, "device"),
        ({"device": "bogus"}, "device"),
        ({"transform": 5}, "transform must be callable"),
        ({"static": "no"}, "static must be True or False, got 'no'"),
        ({"trace": 1}, "trace must be True, False or None, got 1"),
        ({"worker_slots": "auto"}, "worker_slots must be True, False or None, got 'auto'"),
    ],
)
def test_invalid_arguments_say_what_and_how(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CudaPrefetcher([torch.zeros(1)], **{"device": "cpu", **kwargs})


@pytest.mark.parametrize("kwargs", [{"rank": 1, "world_size": 2}, {"drop_last": True}, {"seed": 7},
                                    {"pad": True}, {"shuffle": True}, {"num_threads": 4}, {"batch_size": 4}])
def test_batching_arguments_raise_and_name_where_they_belong(kwargs):
    """Batching, shuffling, sharding and reading belong to the loader: an argument that would do it is never
    silently ignored (a user who believes they sharded would train every rank on all the data)."""
    given = ", ".join(kwargs)
    with pytest.raises(TypeError, match=rf"CudaPrefetcher\(\) got {given}: batching belongs to the loader it "
                                        r"wraps: CudaPrefetcher\(SourceLoader\(source, .*DistributedSampler"):
        CudaPrefetcher([torch.zeros(1)], device="cpu", **kwargs)


def test_pinned_budget_belongs_to_a_source_loader_and_chunk_bytes_is_gone():
    """A prefetcher's staging has no budget (torch's caching host allocator pins pageable batches); the
    pinned memory a SourceLoader's reads hold is the SourceLoader's to bound."""
    with pytest.raises(TypeError, match=r"got pinned_budget: batching belongs to the loader it wraps: "
                                        r"CudaPrefetcher\(SourceLoader\(source, pinned_budget=...\)\)"):
        CudaPrefetcher([torch.zeros(1)], device="cpu", pinned_budget=2 << 20)
    with pytest.raises(TypeError, match="no longer takes chunk_bytes"):
        CudaPrefetcher([torch.zeros(1)], device="cpu", chunk_bytes=4096)


def test_a_source_loader_s_pinned_budget_on_the_cpu_warns_and_reads_pageable(tmp_path):
    """As torch does with pin_memory=True and no accelerator: a script tuned on a GPU runs in CPU-only CI."""
    np.save(tmp_path / "x.npy", np.arange(8, dtype=np.float32).reshape(4, 2))
    loader = SourceLoader(RawSource(tmp_path / "x.npy"), batch_size=2, pinned_budget=2 << 20)
    with CudaPrefetcher(loader, device="cpu") as pf, pytest.warns(RuntimeWarning, match="pageable memory"):
        got = [b["x"].clone() for b in pf]
    assert torch.equal(torch.cat(got), torch.arange(8, dtype=torch.float32).reshape(4, 2))
    with pytest.raises(ValueError, match=r"pinned_budget must be an int >= 0"):
        SourceLoader(RawSource(tmp_path / "x.npy"), batch_size=2, pinned_budget=-1)


def test_a_misspelled_argument_says_which_was_meant():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'dept'; did you mean 'depth'\?"):
        CudaPrefetcher([torch.zeros(1)], device="cpu", dept=3)


def test_an_unknown_argument_is_a_type_error_that_names_it():
    with pytest.raises(TypeError, match="unexpected keyword argument 'devcie'"):
        CudaPrefetcher([torch.zeros(1)], devcie="cpu")


def test_a_source_without_a_source_loader_says_how_to_batch_it(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match=r"CudaPrefetcher\(SourceLoader\(source, batch_size=N\)\)"):
        CudaPrefetcher(RawSource(tmp_path / "x.npy"), device="cpu")


def test_cuda_without_cuda_is_a_value_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="CUDA is not available"):
        CudaPrefetcher([], device="cuda")


def test_not_iterable_is_a_value_error():
    with pytest.raises(ValueError, match="needs an iterable"):
        CudaPrefetcher(42, device="cpu")


def test_stats_counters_lose_no_update_between_threads():
    """A stopped epoch's thread may still count beside the next epoch's: every addition lands."""
    s = PrefetchStats()

    def count():
        for _ in range(20_000):
            s.add(bytes=3, staged_bytes=1, stage_s=0.5)
            s.add(fetch_s=0.25)
            s.add(bytes=1)

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (s.bytes, s.staged_bytes, s.stage_s, s.fetch_s) == (4 * 20_000 * 4, 80_000, 40_000.0, 20_000.0)


def test_stats_dict_and_summary():
    s = PrefetchStats(batches=2, bytes=4_000_000_000, wait_s=0.5, wall_s=2.0, copy_s=0.1,
                      timed_bytes=2_000_000_000)
    assert s.as_dict()["h2d_GBps"] == pytest.approx(20.0)
    assert s.stall_fraction == 0.25 and "H2D 20.0 GB/s" in str(s)


def test_a_typo_raises_an_attribute_error_that_names_the_prefetcher_and_loader_attributes_read_through():
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4)
    pf = CudaPrefetcher(loader, device="cpu")
    assert pf.batch_size == 4 and pf.dataset is loader.dataset  # read through to the loader
    with pytest.raises(AttributeError, match="'CudaPrefetcher' object has no attribute 'stat' nor has the "
                                             "wrapped DataLoader"):
        pf.stat  # noqa: B018
    assert not hasattr(pf, "_private")


def test_version_is_the_installed_package_metadata():
    from importlib.metadata import version

    import gpufeed

    assert gpufeed.__version__ == version("gpufeed")


def test_a_generator_warns_once_when_its_second_epoch_would_be_empty():
    gen = (torch.full((2,), i) for i in range(3))
    pf = CudaPrefetcher(gen, device="cpu")
    assert [int(b[0]) for b in pf] == [0, 1, 2]
    with pytest.warns(RuntimeWarning, match="iterator, used up by the first epoch.*zero-argument callable"):
        assert list(pf) == []
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(pf) == []  # said once
    fresh = CudaPrefetcher(lambda: (torch.full((2,), i) for i in range(3)), device="cpu")
    assert [[int(b[0]) for b in fresh] for _ in range(2)] == [[0, 1, 2], [0, 1, 2]]


class Moves:
    """A custom batch type that moves itself (as torch's pin-memory loop honours ``pin_memory``)."""

    def __init__(self, x, moved_to=None):
        self.x, self.moved_to = x, moved_to

    def pin_memory(self):
        return Moves(self.x.pin_memory(), self.moved_to)

    def to(self, device, non_blocking=False):
        return Moves(self.x.to(device, non_blocking=non_blocking), torch.device(device))


def test_a_batch_type_that_moves_itself_is_moved(device):
    data = [{"m": Moves(torch.full((3,), i)), "t": torch.full((2,), i)} for i in range(4)]
    with CudaPrefetcher(data, device=device) as pf:
        got = list(pf)
    assert [b["m"].moved_to.type for b in got] == [device.type] * 4
    assert all(b["m"].x.device.type == device.type for b in got)
    assert [b["m"].x.tolist() for b in got] == [[i] * 3 for i in range(4)]
    assert [b["t"].tolist() for b in got] == [[i, i] for i in range(4)]


def test_a_forked_worker_never_collects_this_process_s_cycles(tmp_path):
    """Collected in a worker, a cycle's CUDA objects (an event, a tensor a stream used) would make a CUDA
    call and abort it: while a DataLoader forks its workers, the collector's objects are frozen, so the
    worker never frees them; this process does, later. The freeze ends with the first batch."""
    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            (tmp_path / f"freed-in-{os.getpid()}").touch()

    class Collects(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            gc.collect()  # what a worker's own allocations may set off at any time
            return torch.tensor([i])

    def loader():
        return torch.utils.data.DataLoader(Collects(), batch_size=2, num_workers=1,
                                           multiprocessing_context="fork")

    for wrapped in (loader(), loader):  # a DataLoader, and a callable that makes one each epoch
        for p in tmp_path.iterdir():
            p.unlink()
        gc.disable()  # only explicit collections: the cycle survives until something collects it
        try:
            Cycle()
            with CudaPrefetcher(wrapped, device="cpu") as pf:
                it = iter(pf)
                first = next(it)
                assert gc.get_freeze_count() == 0 and not gc.isenabled()  # (as the program left them)
                assert [first.tolist(), *(b.tolist() for b in it)] == [[[0], [1]], [[2], [3]]]
            assert not list(tmp_path.iterdir())  # not freed in the worker
            gc.collect()
        finally:
            gc.enable()
        assert [p.name for p in tmp_path.iterdir()] == [f"freed-in-{os.getpid()}"], wrapped


def test_a_state_saved_at_an_epoch_s_end_resumes_at_the_next_epoch():
    """The loader's state is taken once more when its epoch ends: taken after the last batch only, it says
    the epoch is not done, and a resumed run would start with an empty rest of it."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    loader = stateful.StatefulDataLoader(list(range(12)), batch_size=4)
    with CudaPrefetcher(loader, device="cpu") as pf:
        assert [b.tolist() for b in pf] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        state = pf.state_dict()
    resumed = CudaPrefetcher(stateful.StatefulDataLoader(list(range(12)), batch_size=4), device="cpu")
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert resumed.epoch == 1
    resumed.close()


def test_a_stop_iteration_raised_by_the_transform_is_an_error_at_its_batch():
    def transform(b):
        if int(b[0]) == 3:
            next(iter([]))
        return b

    got = []
    data = [torch.tensor([i]) for i in range(8)]
    with CudaPrefetcher(data, device="cpu", transform=transform) as pf, \
            pytest.raises(RuntimeError, match="StopIteration"):
        for b in pf:
            got.append(int(b[0]))
    assert got == [0, 1, 2]


def test_break_and_collection_drop_the_batches_taken_ahead(monkeypatch):
    """An epoch broken off and collected hands the batches it took ahead to the device stage's drop(), which
    fences their memory behind their copies (on CUDA)."""
    import gpufeed._device as device_stage

    dropped = []
    monkeypatch.setattr(device_stage.DeviceStage, "drop", lambda self, items: dropped.extend(items))
    pf = CudaPrefetcher([torch.tensor([i]) for i in range(10)], device="cpu", depth=3)
    for b in pf:
        if int(b[0]) == 2:
            break
    gc.collect()
    assert [int(d.batch[0]) for d in dropped] == [3, 4, 5]
    pf.close()


def test_the_collector_is_on_again_after_workers_fork():
    """The collector is off across a worker's fork (no collection in the child before it freezes what it
    inherited), and on again after it in both processes."""
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork", worker_init_fn=_assert_collecting)
    assert gc.isenabled()
    with CudaPrefetcher(loader, device="cpu") as pf:
        assert [b.tolist() for b in pf] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gc.isenabled()


def test_once_gpufeed_made_cuda_objects_every_forked_worker_freezes_what_it_inherits(monkeypatch):
    """A plain DataLoader, not wrapped by gpufeed, forks its workers after a prefetcher ran on CUDA (the
    flag that run sets, set here): each worker freezes every object it inherited, and collects again;
    without the flag, a plain DataLoader's workers are left as torch makes them."""
    from gpufeed import _forks

    def freeze_counts(guarded):
        monkeypatch.setattr(_forks, "_guard_all", guarded)
        loader = torch.utils.data.DataLoader(_FreezeCount(), batch_size=2, num_workers=2,
                                             multiprocessing_context="fork")
        return [int(n) for b in loader for n in b]

    mine = gc.get_freeze_count()  # (what the program froze itself, inherited as it is)
    assert min(freeze_counts(True)) > mine + 1000 and gc.isenabled()
    assert freeze_counts(False) == [mine] * 4


def test_two_threads_forking_at_once_leave_the_collector_on(monkeypatch):
    """Each fork's handlers run outside any lock, so two threads' forks may interleave: the collector is
    off from the first fork's start to the last one's end, and on again after, as it was."""
    from gpufeed import _forks

    monkeypatch.setattr(_forks, "_guard_all", True)
    assert gc.isenabled()
    _forks._before()  # (a thread starts forking)
    _forks._before()  # (another one, before the first has finished)
    _forks._after(False)
    assert not gc.isenabled()
    _forks._after(False)
    assert gc.isenabled()
    gc.disable()  # a program that runs with the collector off keeps it off
    try:
        _forks._before()
        _forks._after(False)
        assert not gc.isenabled()
    finally:
        gc.enable()


class _FreezeCount(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if not gc.isenabled():
            os._exit(3)  # (the DataLoader reports the worker's exit)
        return gc.get_freeze_count()


def _assert_collecting(worker_id):
    if not gc.isenabled() or gc.get_freeze_count() == 0:
        os._exit(3)  # (the DataLoader reports the worker's exit)


def test_a_program_s_own_frozen_objects_stay_frozen(monkeypatch):
    """The main process's collector is never thawed by gpufeed (only its forked workers freeze): a
    program's own frozen objects stay frozen. (Frozen objects are still freed when no longer referenced, so
    the count may fall a little; thawed, it would fall to nothing.)"""
    thaw = gc.unfreeze
    thawed = []
    monkeypatch.setattr(gc, "unfreeze", lambda: thawed.append(True))
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=1,
                                         multiprocessing_context="fork")
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with CudaPrefetcher(loader, device="cpu") as pf:
            assert len(list(pf)) == 4
        assert not thawed and gc.get_freeze_count() > 0.9 * frozen
    finally:
        thaw()


def test_close_from_another_thread_while_next_reads_leaves_the_epochs_end_to_the_reading_thread():
    """``close()`` from another thread while the loop's thread is inside ``next()`` (the loader blocked),
    then a ``next()`` there too: both raise RuntimeError naming the close, and once the reading thread
    returns, the loader's iteration is closed and no batch is left taken ahead (the thread that reads ends
    the epoch; the other never runs its end under it)."""
    inside, release, closed = threading.Event(), threading.Event(), []

    def batches():
        try:
            for i in range(10):
                if i == 2:
                    inside.set()
                    release.wait(5)
                yield {"x": torch.full((3,), i)}
        finally:
            closed.append(True)

    pf = CudaPrefetcher(batches, device="cpu", depth=1)
    it = iter(pf)
    assert next(it)["x"].tolist() == [0, 0, 0]
    errors: list[str] = []

    def read() -> None:
        try:
            next(it)
        except RuntimeError as exc:
            errors.append(str(exc))

    reader = threading.Thread(target=read)
    reader.start()
    assert inside.wait(5)
    pf.close()
    with pytest.raises(RuntimeError, match="the CudaPrefetcher was closed"):
        next(it)
    assert closed == []  # (the reading thread is still in the loader)
    release.set()
    reader.join(5)
    assert errors and "the CudaPrefetcher was closed" in errors[0]
    assert closed == [True] and len(it._ahead) == 0


def _closing_loader(log, n=10):
    def batches():
        try:
            for i in range(n):
                yield {"x": torch.full((2,), i)}
        finally:
            log.append("closed")
    return batches


def test_a_close_from_another_thread_while_next_hands_over_ends_the_epoch_at_once():
    """close() arriving while the loop's thread is past its last check (handing a batch over): that
    thread ends the epoch as it leaves next(), so the loader closes then, not when the iterator is
    collected; its later next() says why it stopped."""
    log = []
    pf = CudaPrefetcher(_closing_loader(log), device="cpu", depth=2)
    it = iter(pf)
    next(it)
    hand_over = pf._stage.hand_over

    def closed_meanwhile(item):
        done = threading.Event()

        def close():
            it.close("closed by another thread")
            done.set()

        threading.Thread(target=close).start()
        assert done.wait(5)  # (the other thread's close() found this one in next(), and returned)
        return hand_over(item)

    pf._stage.hand_over = closed_meanwhile
    assert next(it)["x"].tolist() == [1, 1]
    assert log == ["closed"]
    with pytest.raises(RuntimeError, match="closed by another thread"):
        next(it)
    pf.close()


def test_a_thread_waiting_in_next_when_the_epoch_is_closed_gets_why():
    log, release, reached = [], threading.Event(), threading.Event()

    def slow():
        try:
            for i in range(100):
                if i == 3:
                    reached.set()
                    release.wait(5)
                yield torch.full((1,), i)
        finally:
            log.append("closed")

    pf = CudaPrefetcher(slow, device="cpu", depth=1)
    it = iter(pf)
    got = {}

    def take(name, n):
        try:
            for _ in range(n):
                next(it)
            got[name] = "batch"
        except BaseException as exc:
            got[name] = exc

    a = threading.Thread(target=take, args=("a", 3))
    a.start()
    reached.wait(5)
    b = threading.Thread(target=take, args=("b", 1))  # waits for a, which waits in the loader
    b.start()
    time.sleep(0.1)
    it.close("closed by a third")
    release.set()
    a.join(5)
    b.join(5)
    for name in "ab":
        assert isinstance(got[name], RuntimeError) and "closed by a third" in str(got[name]), got
    assert log == ["closed"]
    pf.close()


def test_a_batch_that_cannot_be_handed_over_raises_in_its_place_and_the_epoch_goes_on():
    """A batch of another structure than the static buffers': ValueError at its turn; the batches after
    it still arrive, and the epoch ends as any other."""
    data = [{"x": torch.zeros(2)}, {"x": torch.zeros(2), "y": torch.ones(1)}, {"x": torch.ones(2)},
            {"x": torch.full((2,), 2.0)}]
    pf = CudaPrefetcher(data, device="cpu", static=True)
    it = iter(pf)
    got = []
    while True:
        try:
            batch, _ = next(it)
            got.append(batch["x"][0].item())
        except ValueError:
            got.append("ValueError")
        except StopIteration:
            break
    assert got == [0.0, "ValueError", 1.0, 2.0]
    assert not it._finalizer.alive  # (the loader's iteration ended with the epoch)
    pf.close()


def test_a_stop_iteration_while_handing_over_is_an_error_not_the_epoch_s_end():
    pf = CudaPrefetcher([torch.full((1,), i) for i in range(4)], device="cpu")
    hand_over = pf._stage.hand_over
    calls = []

    def second_raises(item):
        calls.append(1)
        if len(calls) == 2:
            raise StopIteration
        return hand_over(item)

    pf._stage.hand_over = second_raises
    it = iter(pf)
    assert next(it).item() == 0
    with pytest.raises(RuntimeError, match="StopIteration"):
        next(it)
    assert [b.item() for b in it] == [2, 3]  # (batch 1 lost in its place; the epoch went on)
    pf.close()


def test_an_error_before_a_batch_is_taken_ends_the_epoch_once():
    """An error in next() outside a batch's hand-over (here the verdict's ask) cannot repeat forever:
    raised once, and the epoch ends."""
    pf = CudaPrefetcher([torch.full((1,), i) for i in range(4)], device="cpu")

    def broken(mark):
        raise OSError("broken")

    pf._stage.asked = broken
    it = iter(pf)
    assert next(it).item() == 0
    with pytest.raises(OSError):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert not it._finalizer.alive
    pf.close()
