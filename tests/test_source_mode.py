"""CudaPrefetcher over a BatchSource: sampling, sharding, exact bytes, and exact resume."""

import time

import numpy as np
import pytest
import torch

from gpufeed import CudaPrefetcher, Field, SourceLoader
from gpufeed.sources import RawSource, plan_batches


class ArraySource:
    """A BatchSource over in-memory arrays, counting reads (a minimal third-party source)."""

    def __init__(self, n=103, fail_at=None):
        rng = np.random.default_rng(0)
        self.arrays = {"x": rng.standard_normal((n, 3, 4)).astype(np.float32),
                       "y": np.arange(n, dtype=np.int64)}
        self.fields = {k: Field(k, a.shape[1:], torch.from_numpy(a).dtype) for k, a in self.arrays.items()}
        self.reads_to = "host"
        self.fail_at = fail_at
        self.closed = False

    def __len__(self):
        return len(self.arrays["y"])

    def read(self, rows, out):
        idx = np.arange(rows.start, rows.stop) if isinstance(rows, range) else rows
        if self.fail_at is not None and self.fail_at in idx:
            raise OSError(f"read failed at row {self.fail_at}")
        for k, a in self.arrays.items():
            out[k].copy_(torch.from_numpy(a[idx]))

    def close(self):
        self.closed = True


def collect(pf, limit=None):
    out = []
    for i, b in enumerate(pf):
        if limit is not None and i >= limit:
            break
        out.append({k: v.cpu().clone() for k, v in b.items()})
    return out


@pytest.mark.parametrize("shuffle", [False, True, "blocks"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_source_batches_equal_the_plan(device, shuffle, depth):
    src = ArraySource()
    with CudaPrefetcher(SourceLoader(src, batch_size=10, shuffle=shuffle, seed=4),
                        device=device, depth=depth) as pf:
        for epoch in range(2):
            got = collect(pf)
            plan = plan_batches(len(src), 10, shuffle=shuffle, seed=4, epoch=epoch)
            assert len(got) == len(plan) == len(pf)
            for b, rows in zip(got, plan, strict=True):
                idx = np.arange(rows.start, rows.stop) if isinstance(rows, range) else rows
                assert np.array_equal(b["y"].numpy(), idx)
                assert np.array_equal(b["x"].numpy(), src.arrays["x"][idx])
                assert b["x"].shape == (len(idx), 3, 4) and b["x"].dtype == torch.float32
    assert not src.closed  # the user's source: another prefetcher may still be reading it


def test_shuffle_changes_per_epoch_and_set_epoch_repeats_it():
    with CudaPrefetcher(SourceLoader(ArraySource(), batch_size=20, shuffle=True, seed=1), device="cpu") as pf:
        e0 = [b["y"] for b in collect(pf)]
        e1 = [b["y"] for b in collect(pf)]
        pf.set_epoch(0)
        again = [b["y"] for b in collect(pf)]
    assert not all(torch.equal(a, b) for a, b in zip(e0, e1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(e0, again, strict=True))
    assert sorted(torch.cat(e0).tolist()) == list(range(103))


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_share_the_data_disjointly(drop_last):
    seen, counts = [], []
    for rank in range(3):
        with CudaPrefetcher(SourceLoader(ArraySource(), batch_size=8, shuffle=True, drop_last=drop_last,
                                         rank=rank, world_size=3),
                            device="cpu") as pf:
            ys = [b["y"] for b in collect(pf)]
        counts.append(len(ys))
        seen += torch.cat(ys).tolist()
    assert len(set(counts)) == 1
    assert len(seen) == len(set(seen))  # disjoint
    if not drop_last:
        assert sorted(seen) == list(range(103))


def test_a_read_error_arrives_after_the_batches_before_it(device):
    got = []
    with (
        CudaPrefetcher(SourceLoader(ArraySource(fail_at=45), batch_size=10), device=device) as pf,
        pytest.raises(OSError, match="row 45"),
    ):
        for b in pf:
            got.append(b["y"][0].item())
    assert got == [0, 10, 20, 30]


def test_raw_files_through_the_prefetcher(tmp_path, device):
    x = np.random.default_rng(1).integers(0, 255, (257, 16, 3), dtype=np.uint8)
    np.save(tmp_path / "x.npy", x)
    np.arange(257, dtype=np.int32).tofile(tmp_path / "y.bin")
    src = RawSource(fields={"x": tmp_path / "x.npy", "y": {"paths": tmp_path / "y.bin", "dtype": "int32"}})
    with CudaPrefetcher(SourceLoader(src, batch_size=32, shuffle=True),
                        device=device) as pf:
        got = collect(pf)
    ys = torch.cat([b["y"] for b in got]).numpy()
    assert sorted(ys) == list(range(257))
    assert np.array_equal(torch.cat([b["x"] for b in got]).numpy(), x[ys])


# -- exact resume --------------------------------------------------------------------------------

def run_sequence(pf, epochs):
    return [[b["y"].tolist() for b in collect(pf)] for _ in range(epochs)]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("stop_at", [(0, 0), (0, 1), (0, 5), (0, 11), (1, 3)])
def test_resume_yields_exactly_the_rest(shuffle, depth, stop_at):
    def make():
        loader = SourceLoader(ArraySource(), batch_size=9, shuffle=shuffle, seed=3)
        return CudaPrefetcher(loader, device="cpu", depth=depth)

    full = [y for epoch in run_sequence(make(), 3) for y in epoch]
    epoch, k = stop_at
    pf = make()
    got = []
    for _ in range(epoch):
        got += [b["y"].tolist() for b in pf]
    it = iter(pf)
    for _ in range(k):
        got.append(next(it)["y"].tolist())
    state = pf.state_dict()
    pf.close()
    resumed = make()
    resumed.load_state_dict(state)
    while len(got) < len(full):
        got += [b["y"].tolist() for b in resumed]
    assert got == full


def test_resume_with_another_configuration_is_refused():
    pf = CudaPrefetcher(SourceLoader(ArraySource(), batch_size=9), device="cpu")
    state = pf.state_dict()
    other = CudaPrefetcher(SourceLoader(ArraySource(), batch_size=10), device="cpu")
    with pytest.raises(ValueError, match="batch_size: saved 9, now 10"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="not a gpufeed state_dict"):
        other.load_state_dict({"epoch": 1})
    loader_pf = CudaPrefetcher([torch.zeros(1)], device="cpu")
    with pytest.raises(TypeError, match="StatefulDataLoader"):
        loader_pf.state_dict()


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop_at", [0, 1, 4, 8])
def test_resume_over_a_stateful_dataloader(num_workers, stop_at):
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = torch.utils.data.TensorDataset(torch.arange(50))

    def loader():
        g = torch.Generator().manual_seed(0)
        return StatefulDataLoader(ds, batch_size=6, shuffle=True, generator=g, num_workers=num_workers)

    # The reference: the loader itself, interrupted after `stop_at` batches and resumed. (torchdata does
    # not restore a user generator for the epochs after the resumed one with num_workers=0, so an
    # uninterrupted run is the reference only for the rest of the interrupted epoch.)
    plain = loader()
    it = iter(plain)
    expected = [next(it)[0].tolist() for _ in range(stop_at)]
    plain2 = loader()
    plain2.load_state_dict(plain.state_dict())
    expected += [b[0].tolist() for b in plain2] + [b[0].tolist() for b in plain2]
    uninterrupted = [b[0].tolist() for b in loader()]

    got = []
    with CudaPrefetcher(loader(), device="cpu", depth=3) as pf:
        it = iter(pf)
        for _ in range(stop_at):
            got.append(next(it)[0].tolist())
        time.sleep(0.05)  # the background thread has fetched batches beyond those handed out
        state = pf.state_dict()
    with CudaPrefetcher(loader(), device="cpu", depth=3) as pf:
        pf.load_state_dict(state)
        got += [b[0].tolist() for b in pf]  # the rest of the interrupted epoch
        got += [b[0].tolist() for b in pf]
    assert got == expected
    assert got[: len(uninterrupted)] == uninterrupted


def test_an_iter_that_is_never_advanced_does_not_count_as_an_epoch():
    # Lightning calls iter() once to check a loader is iterable; that must not shift the epochs.
    with CudaPrefetcher(SourceLoader(ArraySource(), batch_size=10, shuffle=True, seed=2), device="cpu") as pf:
        iter(pf)
        first = [b["y"] for b in collect(pf)]
        assert pf.epoch == 0
    assert all(torch.equal(a, torch.from_numpy(np.asarray(r)))
               for a, r in zip(first, plan_batches(103, 10, shuffle=True, seed=2, epoch=0), strict=True))


class OddSource(ArraySource):
    """Fields whose row sizes (3 bytes, 8 bytes) misalign a naive packing of the staging buffer."""

    def __init__(self, n=77):
        rng = np.random.default_rng(5)
        self.arrays = {"a": rng.integers(0, 255, (n, 3), dtype=np.uint8),
                       "y": np.arange(n, dtype=np.int64), "h": rng.standard_normal((n, 1)).astype(np.float16)}
        self.fields = {k: Field(k, a.shape[1:], torch.from_numpy(a).dtype) for k, a in self.arrays.items()}
        self.reads_to = "host"
        self.fail_at = None
        self.closed = False


@pytest.mark.parametrize("chunk_bytes", [4096, 32 << 20])
def test_fields_of_odd_row_sizes(device, chunk_bytes):
    src = OddSource()
    with CudaPrefetcher(SourceLoader(src, batch_size=13, shuffle=True),
                        device=device) as pf:
        got = collect(pf)
    ys = torch.cat([b["y"] for b in got]).numpy()
    assert sorted(ys) == list(range(77))
    for k in ("a", "h"):
        assert np.array_equal(torch.cat([b[k] for b in got]).numpy(), src.arrays[k][ys])


def test_a_transform_may_change_the_structure_of_source_batches(device):
    # The tensors to fence are taken from the transform's output, whatever its structure (a tuple here).
    with CudaPrefetcher(SourceLoader(ArraySource(), batch_size=10),
                        device=device, transform=lambda b: (b["x"] * 2, b["y"] + 1)) as pf:
        got = [(x.cpu(), y.cpu()) for x, y in pf]
    assert torch.equal(torch.cat([y for _, y in got]), torch.arange(1, 104))
    assert torch.equal(torch.cat([x for x, _ in got]), torch.from_numpy(ArraySource().arrays["x"]) * 2)


def test_a_source_loader_yields_the_rows_of_its_plan_and_advances_its_epoch():
    loader = SourceLoader(ArraySource(), batch_size=25, shuffle=True, seed=8)
    assert len(loader) == 5 and loader.batch_size == 25
    arrays = ArraySource().arrays
    for epoch in range(2):
        got = [b["y"].clone() for b in loader]  # (direct iteration: host tensors reused once let go of)
        plan = plan_batches(103, 25, shuffle=True, seed=8, epoch=epoch)
        assert [t.tolist() for t in got] == [arrays["y"][np.asarray(list(p))].tolist() for p in plan]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batch"] == 5


def test_a_source_loader_resumes_after_the_last_batch_yielded():
    loader = SourceLoader(ArraySource(), batch_size=25, shuffle=True, seed=8)
    it = iter(loader)
    head = [next(it)["y"].tolist() for _ in range(2)]
    state = loader.state_dict()
    again = SourceLoader(ArraySource(), batch_size=25, shuffle=True, seed=8)
    again.load_state_dict(state)
    rest = [b["y"].tolist() for b in again]
    plan = plan_batches(103, 25, shuffle=True, seed=8, epoch=0)
    assert head + rest == [np.asarray(list(p)).tolist() for p in plan]
    with pytest.raises(ValueError, match="batch_size: saved 25, now 26"):
        SourceLoader(ArraySource(), batch_size=26).load_state_dict(state)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"batch_size": 0}, ValueError, "batch_size must be an int >= 1, got 0"),
    ({"batch_size": 4, "shuffle": "rows"}, ValueError, "shuffle must be False, True or 'blocks'"),
    ({"batch_size": 4, "num_threads": 0}, ValueError, "num_threads must be an int >= 1, got 0"),
    ({"batch_size": 4, "rank": 2, "world_size": 2}, ValueError, r"rank must be in \[0, world_size=2\)"),
])
def test_source_loader_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        SourceLoader(ArraySource(), **kwargs)


def test_a_source_loader_reads_only_a_batch_source():
    with pytest.raises(TypeError, match=r"SourceLoader reads a BatchSource.*got list"):
        SourceLoader([1, 2, 3], batch_size=2)


def _ys(pf):
    return [b["y"].tolist() for b in collect(pf)]


def _plan(epoch, n=100, bs=10):
    return [np.asarray(list(r)).tolist() for r in plan_batches(n, bs, shuffle=True, seed=1, epoch=epoch)]


def test_a_new_prefetcher_each_epoch_continues_the_source_loaders_epochs():
    """The SourceLoader keeps the epochs: wrapping it anew each epoch reshuffles, and its set_epoch holds."""
    loader = SourceLoader(ArraySource(n=100), batch_size=10, shuffle=True, seed=1)
    assert _ys(CudaPrefetcher(loader, device="cpu")) == _plan(0)
    assert _ys(CudaPrefetcher(loader, device="cpu")) == _plan(1)
    loader.set_epoch(5)
    assert _ys(CudaPrefetcher(loader, device="cpu")) == _plan(5)


def test_a_probing_iter_after_load_state_dict_keeps_the_resume_point():
    make = lambda: CudaPrefetcher(SourceLoader(ArraySource(n=100), batch_size=10, shuffle=True, seed=1),  # noqa: E731
                                  device="cpu")
    pf = make()
    it = iter(pf)
    head = [next(it)["y"].tolist() for _ in range(3)]
    state = pf.state_dict()
    pf.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.state_dict()["loader"]["batch"] == 3
    probe = iter(resumed)
    time.sleep(0.05)  # the probe's fetch thread reads ahead
    del probe
    assert resumed.state_dict()["loader"]["batch"] == 3
    assert head + _ys(resumed) == _plan(0)
    assert _ys(resumed) == _plan(1)


def test_state_taken_before_the_first_batch_of_an_epoch_resumes_that_epoch():
    pf = CudaPrefetcher(SourceLoader(ArraySource(n=100), batch_size=10, shuffle=True, seed=1), device="cpu")
    for i, _ in enumerate(pf):
        if i == 1:
            break  # epoch 0 counted (batches were handed out)
    it = iter(pf)  # epoch 1, nothing handed out yet
    state = pf.state_dict()
    del it
    assert (state["loader"]["epoch"], state["loader"]["batch"]) == (1, 0)
    resumed = CudaPrefetcher(SourceLoader(ArraySource(n=100), batch_size=10, shuffle=True, seed=1),
                             device="cpu")
    resumed.load_state_dict(state)
    assert _ys(resumed) == _plan(1)


def test_a_probing_iter_after_an_epoch_does_not_skip_one():
    pf = CudaPrefetcher(SourceLoader(ArraySource(n=100), batch_size=10, shuffle=True, seed=1), device="cpu")
    assert _ys(pf) == _plan(0)
    iter(pf)
    assert _ys(pf) == _plan(1) and pf.epoch == 1


def test_a_source_s_reads_count_as_fetching():
    """Waiting for a batch's reads is taking it from the loader: ``fetch_s`` holds them (20 ms or more
    each); nothing is staged (the reads land in the memory the batch is copied from)."""
    class Slow(ArraySource):
        def read(self, rows, out):
            time.sleep(0.02)
            super().read(rows, out)

    with CudaPrefetcher(SourceLoader(Slow(n=40), batch_size=10), device="cpu") as pf:
        assert [b["y"].tolist() for b in pf] == [list(range(i, i + 10)) for i in range(0, 40, 10)]
    assert pf.stats.bytes == 40 * (3 * 4 * 4 + 8) and pf.stats.staged_bytes == 0
    assert pf.stats.fetch_s >= 4 * 0.02
