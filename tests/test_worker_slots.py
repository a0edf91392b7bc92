"""DataLoader workers collating into the prefetcher's shared slots (``worker_slots``), on the CPU path: the
same protocol as on CUDA, where the batch is copied out of its slot instead of to the device."""

import collections
import itertools
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from gpufeed import CudaPrefetcher
from gpufeed.host_memory.worker_arena import SLOT_GRAIN, SlotBatch, SlotCollate, WorkerArena

Pair = collections.namedtuple("Pair", "a b")
ROW = 1 << 16  # float32 elements of ``x`` a sample: 256 KiB, so that batch sizes cross slot sizes


class Items(Dataset):
    """Item ``i``: tensors whose every element says ``i`` (float32, int64 in a namedtuple, bool, float16, a
    non-contiguous view), an int and a str."""

    def __init__(self, n, fail_at=None):
        self.n, self.fail_at = n, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"item {i} is broken")
        return {"x": torch.full((ROW,), float(i)),
                "pair": Pair(torch.arange(i, i + 3), torch.tensor(i % 2 == 0)),
                "half": torch.full((2, 2), i, dtype=torch.float16),
                "t": torch.arange(6).reshape(2, 3).t() + i,
                "i": i, "name": f"s{i}"}


def assert_same(got, want):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want) and got.is_contiguous()
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want)
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_same(a, b)
    else:
        assert got == want


def uneven_batches(n):
    """Index lists of 1 to 9 rows (256 KiB to 2.3 MiB of ``x``), so slots are outgrown and replaced."""
    out, i, size = [], 0, 1
    while i < n:
        out.append(list(range(i, min(n, i + size))))
        i += size
        size = size % 9 + 4
    return out


def test_every_batch_is_exact_and_crosses_in_a_slot_over_epochs():
    ds = Items(120)
    sampler = uneven_batches(len(ds))
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2)
    pf = CudaPrefetcher(loader, device="cpu", worker_slots=True)
    per_worker = loader.prefetch_factor + 2
    largest = max(len(b) for b in sampler) * (ROW * 4 + 4 * 64)
    for epoch in range(3):
        for batch, idx in zip(pf, sampler, strict=True):
            assert_same(batch, default_collate([ds[i] for i in idx]))
        assert pf.stats.slot_batches == (epoch + 1) * len(sampler)
        slots = pf._arena._slots
        assert 0 < len(slots) <= loader.num_workers * per_worker
        assert sum(s.nbytes for s in slots.values()) <= len(slots) * (largest + SLOT_GRAIN)  # bounded
    assert loader.collate_fn is default_collate  # the user's loader is left as it was
    pf.close()
    assert not pf._arena._slots


def test_new_workers_are_handed_the_slots_of_the_epoch_before():
    """A factory makes a new DataLoader (new workers) every epoch; its workers reuse the slots (each is pinned
    once), and make a new one only when all theirs are busy."""
    ds = Items(48)
    pf = CudaPrefetcher(lambda: DataLoader(ds, batch_size=4, num_workers=2), device="cpu", worker_slots=True)
    seen = []
    for _ in range(3):
        for b, start in zip(pf, range(0, 48, 4), strict=True):
            assert b["i"].tolist() == list(range(start, start + 4))
        seen.append({i: s.data_ptr() for i, s in pf._arena._slots.items()})
    assert seen[0].items() <= seen[1].items() <= seen[2].items()  # none replaced: every batch fits
    assert pf.stats.slot_batches == 36
    pf.close()


def test_each_worker_s_slots_are_installed_with_its_first_batch():
    ds = Items(72)
    pf = CudaPrefetcher(DataLoader(ds, batch_size=4, num_workers=3), device="cpu", depth=1, worker_slots=True)
    it = iter(pf)
    firsts = [next(it) for _ in range(3)]  # one from each worker
    assert [b["i"].tolist()[0] for b in firsts] == [0, 4, 8]
    assert len(pf._arena._slots) == 3 * 3  # 2 queued a worker, and its share of the prefetcher's 3
    assert [b["i"].tolist()[0] for b in it] == list(range(12, 72, 4))
    assert pf.stats.slot_batches == 18
    pf.close()


def test_the_persistent_workers_of_two_loaders_taken_in_turn_never_share_the_slots():
    """Persistent workers keep their own record of the slots, and may still collate a batch of a
    broken-off epoch: the slots stay the first loader's while it lives, and the other's batches cross as
    the DataLoader sends them."""
    ds = Items(48)
    loaders = [DataLoader(ds, batch_size=4 + 6 * k, num_workers=2, persistent_workers=True) for k in range(2)]
    turn = itertools.cycle(loaders)
    pf = CudaPrefetcher(lambda: next(turn), device="cpu", worker_slots=True)
    for epoch in range(6):
        loader = loaders[epoch % 2]
        want = list(loader.batch_sampler)
        before = pf.stats.slot_batches
        got = list(pf)
        assert len(got) == len(want), epoch
        for batch, idx in zip(got, want, strict=True):
            assert_same(batch, default_collate([ds[i] for i in idx]))
        assert pf.stats.slot_batches - before == (len(want) if epoch % 2 == 0 else 0), epoch
    pf.close()


def test_persistent_workers_send_plain_batches_when_the_loader_is_iterated_without_the_prefetcher():
    ds = Items(24)
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    pf = CudaPrefetcher(loader, device="cpu", worker_slots=True)
    assert [b["i"].tolist()[0] for b in pf] == list(range(0, 24, 4))
    direct = list(loader)  # the same workers, started by the prefetcher with its collate function
    assert all(type(b) is dict for b in direct)
    for got, start in zip(direct, range(0, 24, 4), strict=True):
        assert_same(got, default_collate([ds[i] for i in range(start, start + 4)]))
    assert [b["i"].tolist()[0] for b in pf] == list(range(0, 24, 4))
    assert pf.stats.slot_batches == 12
    pf.close()


class Calls(Dataset):
    """Item ``i`` of each worker's ``k``-th call: bytes that all say ``k``, of a size that outgrows the slots
    made before it, so the batches queued when an epoch is broken off carry new and replaced slots."""

    def __init__(self):
        self.calls = 0

    def __len__(self):
        return 8

    def __getitem__(self, i):
        self.calls += 1  # in the worker, across epochs (persistent)
        time.sleep(0.05)
        n = [1, 3, 5, 7, 9][i] * SLOT_GRAIN // 2 if i < 5 and (i or self.calls == 1) else SLOT_GRAIN // 4
        return {"x": torch.full((n,), self.calls % 256, dtype=torch.uint8), "calls": self.calls}


def test_persistent_workers_resend_a_slot_whose_batch_a_broken_off_epoch_dropped():
    loader = DataLoader(Calls(), batch_size=1, num_workers=1, persistent_workers=True)
    pf = CudaPrefetcher(loader, device="cpu", worker_slots=True)
    for k, _ in enumerate(pf):
        time.sleep(0.4)  # the worker runs ahead: its queued batches made a new slot and replaced one
        if k == 2:
            break
    for epoch in range(2):
        got = [(int(b["x"][0, 0]), int(b["calls"][0]), b["x"].numel()) for b in pf]
        assert len(got) == 8 and all(x == calls % 256 for x, calls, _ in got), (epoch, got)
    pf.close()


def test_a_stateful_dataloader_collates_into_slots_from_its_first_epoch_and_resumes():
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    for persistent in (False, True):
        loader = stateful.StatefulDataLoader(Items(40), batch_size=4, num_workers=2,
                                             persistent_workers=persistent)
        pf = CudaPrefetcher(loader, device="cpu", worker_slots=True)
        it = iter(pf)
        assert [next(it)["i"][0].item() for _ in range(4)] == [0, 4, 8, 12]
        state = pf.state_dict()
        assert pf.stats.slot_batches == 4 + pf.depth  # those taken, and depth ahead
        pf.close()
        resumed = stateful.StatefulDataLoader(Items(40), batch_size=4, num_workers=2,
                                              persistent_workers=persistent)
        pf = CudaPrefetcher(resumed, device="cpu", worker_slots=True)
        pf.load_state_dict(state)
        assert [b["i"][0].item() for b in pf] == list(range(16, 40, 4))
        assert pf.stats.slot_batches == 6
        pf.close()


class Boxes(torch.Tensor):
    pass


def test_a_batch_with_a_tensor_subclass_or_a_nested_tensor_crosses_as_the_dataloader_sends_it():
    def collate(rows):
        return {"boxes": torch.stack(rows).as_subclass(Boxes),
                "ragged": torch.nested.nested_tensor([r[: i + 1] for i, r in enumerate(rows)])}

    loader = DataLoader([torch.arange(3.0) + i for i in range(4)], batch_size=2, num_workers=1,
                        collate_fn=collate)
    pf = CudaPrefetcher(loader, device="cpu", worker_slots=True)
    got = list(pf)
    assert [type(b["boxes"]) for b in got] == [Boxes, Boxes] and got[1]["boxes"][0].tolist() == [2, 3, 4]
    assert got[1]["ragged"].is_nested and pf.stats.slot_batches == 0
    pf.close()


def test_a_worker_error_arrives_at_its_batch_and_the_next_epoch_is_exact():
    ds = Items(40, fail_at=13)
    pf = CudaPrefetcher(DataLoader(ds, batch_size=4, num_workers=2), device="cpu", worker_slots=True)
    got = []
    with pytest.raises(KeyError, match="item 13 is broken"):
        for b in pf:
            got.append(b["i"].tolist()[0])
    assert got == [0, 4, 8]
    ds.fail_at = None  # (the next epoch's workers fork from this process)
    assert [b["i"].tolist()[0] for b in pf] == list(range(0, 40, 4))
    pf.close()


def test_a_broken_off_epoch_frees_its_slots_for_the_next():
    ds = Items(64)
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    pf = CudaPrefetcher(loader, device="cpu", worker_slots=True)
    for _ in range(3):
        for k, _ in enumerate(pf):
            if k == 1:
                break
    before = pf.stats.slot_batches
    assert [b["i"].tolist()[0] for b in pf] == list(range(0, 64, 4))
    assert pf.stats.slot_batches - before == 16  # none of the slots the broken-off batches held is lost
    assert len(pf._arena._slots) <= loader.num_workers * (loader.prefetch_factor + 2)
    pf.close()


class Shards(torch.utils.data.IterableDataset):
    """Rows 0..39, each worker yielding every ``num_workers``-th."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id, 40, info.num_workers):
            yield torch.full((1000,), float(i)), i


def test_an_iterable_dataset_s_workers_collate_into_slots():
    pf = CudaPrefetcher(DataLoader(Shards(), batch_size=5, num_workers=2), device="cpu", worker_slots=True)
    for _ in range(2):
        got = [(x, i) for x, i in pf]
        assert sorted(int(v) for _, i in got for v in i) == list(range(40))
        assert all(torch.equal(x, i[:, None].float().expand(-1, 1000)) for x, i in got)
    assert pf.stats.slot_batches == 16
    pf.close()


def test_numpy_samples_and_a_collate_fn_of_ones_own_cross_in_slots():
    arrays = [np.full((3, 4), i, dtype=np.int16) for i in range(12)]
    pf = CudaPrefetcher(DataLoader(arrays, batch_size=4, num_workers=2), device="cpu", worker_slots=True)
    got = list(pf)
    assert [b.dtype for b in got] == [torch.int16] * 3 and [int(b[0, 0, 0]) for b in got] == [0, 4, 8]
    assert torch.equal(got[2], torch.from_numpy(np.stack(arrays[8:])))
    pf.close()
    twice = DataLoader(list(range(12)), batch_size=4, num_workers=2, collate_fn=lambda r: torch.tensor(r) * 2)
    pf = CudaPrefetcher(twice, device="cpu", worker_slots=True)
    assert [b.tolist() for b in pf] == [[0, 2, 4, 6], [8, 10, 12, 14], [16, 18, 20, 22]]
    assert pf.stats.slot_batches == 3
    pf.close()


class Ragged(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.zeros(3 if i == 5 else 2)


def test_samples_of_two_shapes_raise_what_the_dataloader_raises():
    def error(worker_slots):
        pf = CudaPrefetcher(DataLoader(Ragged(), batch_size=4, num_workers=1), device="cpu",
                            worker_slots=worker_slots)
        got = []
        with pytest.raises(RuntimeError) as caught:
            got.extend(b.shape for b in pf)
        pf.close()
        return got, str(caught.value).splitlines()[-1]

    assert error(True) == error(False) == ([torch.Size([4, 2])], error(False)[1])
    assert "stack expects each tensor to be equal size" in error(True)[1]


class Odd(Dataset):
    """Samples default_collate collates in ways a slot must follow: an empty first field and a ragged one
    (must raise), a deque (a container the prefetcher does not look into), a ChainMap."""

    def __init__(self, kind):
        self.kind = kind

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if self.kind == "empty first":
            return torch.zeros(0 if i == 0 else 2, 4)
        if self.kind == "deque":
            return collections.deque([torch.full((2,), float(i)), i])
        return collections.ChainMap({"a": torch.full((2,), float(i))}, {"b": i})


@pytest.mark.parametrize("kind", ["empty first", "deque", "chain"])
def test_a_slot_s_batch_is_what_the_dataloader_gives_or_raises(kind):
    def outcome(worker_slots):
        pf = CudaPrefetcher(DataLoader(Odd(kind), batch_size=4, num_workers=1), device="cpu",
                            worker_slots=worker_slots)
        try:
            (b,) = list(pf)
        except RuntimeError as exc:
            return "raised", str(exc).splitlines()[-1]
        finally:
            pf.close()
        if isinstance(b, collections.deque):
            return type(b), [t.tolist() for t in b]
        return type(b), {k: b[k].tolist() for k in sorted(b)}

    assert outcome(True) == outcome(False)


def test_worker_slots_needs_a_dataloader_with_workers():
    with pytest.raises(ValueError, match=r"worker_slots=True.*list"):
        CudaPrefetcher([torch.ones(2)], device="cpu", worker_slots=True)
    with pytest.raises(ValueError, match=r"worker_slots=True.*num_workers=0"):
        CudaPrefetcher(DataLoader(Items(4), batch_size=2), device="cpu", worker_slots=True)
    # off on the CPU unless asked for; and asked off, batches cross as the DataLoader hands them over
    for asked in (None, False):
        loader = DataLoader(Items(8), batch_size=4, num_workers=1)
        pf = CudaPrefetcher(loader, device="cpu", worker_slots=asked)
        assert [b["i"].tolist()[0] for b in pf] == [0, 4] and pf.stats.slot_batches == 0
        pf.close()


def test_worker_slots_over_a_factory_needs_workers_in_each_loader_it_returns():
    """A factory's loader is known only when an epoch starts: one without workers, which would leave
    worker_slots=True without effect, raises then, as a loader without workers does at construction."""
    for returned, what in ((lambda: [torch.ones(2)], "list"),
                           (lambda: DataLoader(Items(4), batch_size=2), "DataLoader")):
        pf = CudaPrefetcher(returned, device="cpu", worker_slots=True)
        with pytest.raises(ValueError, match=rf"worker_slots=True: .*slots, and the {what} the factory "
                                             "returned has none; leave worker_slots unset"):
            iter(pf)
        pf.close()
    # unset (or off), a factory's loader without workers is iterated as it is
    for asked in (None, False):
        factory = lambda: DataLoader(Items(4), batch_size=2)  # noqa: E731
        with CudaPrefetcher(factory, device="cpu", worker_slots=asked) as pf:
            assert [b["i"].tolist() for b in pf] == [[0, 1], [2, 3]]


# -- the protocol, in one process ----------------------------------------------------------------------


@pytest.fixture
def in_worker(monkeypatch):
    """Collate as DataLoader worker 0 would."""
    info = types.SimpleNamespace(id=0, num_workers=1)
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: info)


class Loader(types.SimpleNamespace):
    """What ``WorkerArena.begin`` reads of a DataLoader (and, as a DataLoader, weakly referable)."""


def slot_collate(per_worker=1):
    slots = WorkerArena(pin=False)
    loader = Loader(prefetch_factor=per_worker - 2, num_workers=1, collate_fn=default_collate)
    return slots, slots.begin(loader)


def opened(slots, sb):
    """The batch of ``sb`` as the main process rebuilds it from its slot, and what releases the slot."""
    views, rebuild, release = slots.open(sb)
    return rebuild(views), release


def test_a_worker_without_a_free_slot_sends_the_batch_as_it_is_and_reuses_a_released_one(in_worker):
    slots, collate = slot_collate(per_worker=1)
    rows = [{"x": torch.full((4,), 1.0)}, {"x": torch.full((4,), 2.0)}]
    first = collate(rows)
    assert isinstance(first, SlotBatch) and list(first.new) == [first.sid]  # a new slot crosses once
    batch, release = opened(slots, first)
    assert batch["x"].tolist() == [[1.0] * 4, [2.0] * 4]
    plain = collate(rows[::-1])  # the only slot is leased: the batch goes as the DataLoader would send it
    assert type(plain) is dict and plain["x"][0].tolist() == [2.0] * 4
    release(None)
    release(None)  # a second call does nothing
    again = collate(rows[::-1])
    assert isinstance(again, SlotBatch) and again.new == {} and again.sid == first.sid
    assert opened(slots, again)[0]["x"][0].tolist() == [2.0] * 4
    assert batch["x"][0].tolist() == [2.0] * 4  # the same memory: why a slot is released only after its copy


def test_a_free_slot_too_small_is_replaced(in_worker):
    slots, collate = slot_collate(per_worker=1)
    small = collate([torch.zeros(8)])
    _, release = opened(slots, small)
    release(None)
    big = collate([torch.arange(SLOT_GRAIN // 4 + 1, dtype=torch.float32)])  # more than the slot holds
    assert big.sid == small.sid and list(big.new) == [big.sid]
    gen, slot = big.new[big.sid]
    assert gen == small.gen + 1 and slot.nbytes == 2 * SLOT_GRAIN
    batch, _ = opened(slots, big)
    assert torch.equal(batch[0], torch.arange(SLOT_GRAIN // 4 + 1, dtype=torch.float32))
    assert slots._slots[big.sid] is slot


def test_a_worker_makes_the_slots_the_pipeline_holds_at_its_first_batch(in_worker):
    """Made with the first batch and installed with it (each is registered with CUDA there), so none is
    made mid-epoch; a batch that brings slots the main process already has installs nothing."""
    slots = WorkerArena(pin=False, depth=2)
    loader = Loader(prefetch_factor=2, num_workers=4, collate_fn=default_collate)
    collate = slots.begin(loader)
    assert collate.ahead == 3  # 2 queued, and its share of the 4 batches the prefetcher holds (depth + 2)
    first = collate([torch.full((4,), 1.0)])
    assert sorted(first.new) == [0, 1, 2] and first.sid == 0
    assert opened(slots, first)[0][0].tolist() == [1.0] * 4
    assert sorted(slots._slots) == [0, 1, 2]
    made = {i: s for i, s in slots._slots.items()}
    second = collate([torch.full((4,), 2.0)])  # slot 0 is leased: the next one, made already
    assert second.sid == 1 and second.new == {}
    assert opened(slots, second)[0][0].tolist() == [2.0] * 4
    other = torch.zeros(SLOT_GRAIN, dtype=torch.uint8)
    stale = SlotBatch(1, second.gen, second.batch, {0: (first.gen - 1, other), 2: (first.new[2][0], other)})
    assert opened(slots, stale)[0][0].tolist() == [2.0] * 4
    assert all(slots._slots[i] is s for i, s in made.items())  # an older generation, or the one installed,
    # changes nothing (on CUDA, installing again would unregister a slot a copy may read)


def test_slots_go_to_the_workers_of_one_iteration_at_a_time():
    """An earlier iteration not ended (its fetch thread outlived its stop, so its workers may still write):
    the next iteration's workers get no slots, and send plain batches."""
    slots, collate = slot_collate(per_worker=3)
    loader = Loader(prefetch_factor=1, num_workers=1, collate_fn=default_collate)
    assert collate is not None and slots.begin(loader) is None
    slots.end()
    assert slots.begin(loader) is not None


def test_outside_a_worker_the_collate_function_is_the_loaders_own():
    _, collate = slot_collate(per_worker=3)
    assert isinstance(collate, SlotCollate)
    assert type(collate([{"x": torch.ones(2)}])) is dict


def test_a_second_prefetcher_gets_every_batch_of_a_persistent_loader_another_left_open():
    """The persistent workers collate with the first prefetcher's slots; the second gets the batches as the
    DataLoader sends them (a peeked first prefetcher is left behind, as a DataLoader's own iterator is)."""
    loader = DataLoader([torch.full((1000,), float(i)) for i in range(32)], batch_size=4, num_workers=2,
                        persistent_workers=True)
    first = CudaPrefetcher(loader, device="cpu", worker_slots=True)
    peeked = iter(first)  # (kept: its iteration stays open)
    assert next(peeked)[0, 0].item() == 0
    second = CudaPrefetcher(loader, device="cpu", worker_slots=True)
    batches = [[float(i + k) for k in range(4)] for i in range(0, 32, 4)]
    for _ in range(2):
        assert [b[:, 0].tolist() for b in second] == batches
    assert second.stats.slot_batches == 0
    first.close()
    second.close()


class Slow(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        time.sleep(0.5)
        return torch.full((1 << 18,), float(i))


def test_a_slot_batch_arriving_after_another_thread_closed_is_dropped_and_installs_nothing():
    # inline: the loop's thread itself waits for the batch when the close() lands
    pf = CudaPrefetcher(DataLoader(Slow(), batch_size=2, num_workers=1), device="cpu", worker_slots=True)
    it = iter(pf)
    closer = threading.Timer(0.3, pf.close)  # while the loop waits for batch 0 (1 s to make)
    closer.start()
    with pytest.raises(RuntimeError, match="stopped: the CudaPrefetcher was closed"):
        next(it)
    closer.join()
    assert pf._arena._slots == {} and pf.stats.slot_batches == 0


def _mapped_mib(pid, mib):
    """How many shared-memory mappings of ``mib`` MiB process ``pid`` holds."""
    with open(f"/proc/{pid}/maps") as f:
        spans = [line.split()[0].split("-") for line in f if "torch_" in line or "/dev/shm" in line]
    return sum((int(b, 16) - int(a, 16)) == mib << 20 for a, b in spans)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/<pid>/maps")
def test_a_closed_prefetcher_s_persistent_workers_let_go_of_its_slots():
    loader = DataLoader([torch.full((3 << 17,), float(i)) for i in range(32)], batch_size=4, num_workers=2,
                        persistent_workers=True)  # 6 MiB batches: slots of 6 MiB
    with CudaPrefetcher(loader, device="cpu", worker_slots=True) as pf:
        assert sum(1 for _ in pf) == 8 and pf.stats.slot_batches == 8
        workers = [w.pid for w in loader._iterator._workers]
        assert sum(_mapped_mib(pid, 6) for pid in workers) >= 2
    assert [b[0, 0].item() for b in loader] == [float(i) for i in range(0, 32, 4)]  # (the workers collate)
    assert sum(_mapped_mib(pid, 6) for pid in workers) == 0
