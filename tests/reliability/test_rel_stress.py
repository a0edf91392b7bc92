"""Stress: thousands of batches of random structures, dtypes and sizes through several prefetchers at
once (one thread each), depth 1..4, consumers of random speed; every byte checked against its source.

Hypothesis draws the structures and settings; the tensors are generated from ``(seed, batch index)``
so that the consumer recomputes what it must receive, independently of the prefetcher.
"""

from __future__ import annotations

import random
import sys
import tempfile
import threading
import time
from collections import OrderedDict, namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from _rel import checked, note, plan_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.sources import RawSource, plan_batches

Pair = namedtuple("Pair", "a b")

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool, torch.complex64]
SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


# -- random structures -----------------------------------------------------------------------------

leaf = st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 9), max_size=3),
                 st.booleans())  # (dtype, shape, non-contiguous)


def _containers(children):
    keys = st.text("abcdefgh", min_size=1, max_size=3)
    return st.one_of(
        st.dictionaries(keys, children, min_size=1, max_size=4),
        st.lists(children, min_size=1, max_size=3),
        st.tuples(children, children),
        st.tuples(children, children).map(lambda t: ("pair", *t)),
        st.dictionaries(keys, children, min_size=1, max_size=3).map(lambda d: ("odict", d)),
    )


structure = st.recursive(leaf, _containers, max_leaves=10)


def make_tensor(spec, g):
    dtype, shape, noncontig = spec
    if dtype is torch.bool:
        t = torch.randint(0, 2, shape, generator=g, dtype=torch.bool)
    else:  # random bytes: every bit pattern, NaNs included (compared as bytes)
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        t = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype).view(shape)
    if noncontig and t.dim() >= 2:
        t = t.transpose(0, 1)
    return t


def build(spec, g):
    """A batch of the drawn structure (dict, list, tuple, namedtuple, OrderedDict) with fresh tensors."""
    if isinstance(spec, dict):
        return {k: build(v, g) for k, v in spec.items()}
    if isinstance(spec, list):
        return [build(v, g) for v in spec]
    if isinstance(spec, tuple) and spec and spec[0] == "pair":
        return Pair(build(spec[1], g), build(spec[2], g))
    if isinstance(spec, tuple) and spec and spec[0] == "odict":
        return OrderedDict((k, build(v, g)) for k, v in spec[1].items())
    if isinstance(spec, tuple) and len(spec) == 3 and isinstance(spec[0], torch.dtype):
        return make_tensor(spec, g)
    return tuple(build(v, g) for v in spec)


def batch_of(spec, seed, i):
    g = torch.Generator().manual_seed(seed * 100_003 + i)
    return {"i": i, "data": build(spec, g)}


def mismatch(want, got):
    """A description of the first difference, or ''."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"tensor became {type(got).__name__}"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{want.dtype}{tuple(want.shape)} became {got.dtype}{tuple(got.shape)}"
        a = want.contiguous().reshape(-1).view(torch.uint8)
        b = got.cpu().contiguous().reshape(-1).view(torch.uint8)
        return "" if torch.equal(a, b) else "bytes differ"
    if type(want) is not type(got):
        return f"{type(want).__name__} became {type(got).__name__}"
    if isinstance(want, dict):
        if list(want) != list(got):
            return "keys differ"
        return next((m for k in want if (m := mismatch(want[k], got[k]))), "")
    if isinstance(want, (list, tuple)):
        if len(want) != len(got):
            return "length differs"
        return next((m for a, b in zip(want, got, strict=True) if (m := mismatch(a, b))), "")
    return "" if want == got else f"{want!r} became {got!r}"


def nbytes_of(obj):
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes_of(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes_of(v) for v in obj)
    return 0


def consume(make_pf, expected_fn, n, delays, errors, counts):
    """One consumer thread: iterate, sleep a random little, check every batch against a recomputation."""
    rng = random.Random(n)
    try:
        with make_pf() as pf:
            k = 0
            for got in pf:
                want = expected_fn(k)
                m = mismatch(want, got)
                counts.append((1, int(bool(m)), nbytes_of(want)))
                if m:
                    errors.append(f"batch {k}: {m}")
                if delays and rng.random() < 0.3:
                    time.sleep(rng.choice(delays))
                k += 1
            if k != n:
                errors.append(f"{k} batches, expected {n}")
    except BaseException as exc:  # reported by the main thread
        errors.append(repr(exc))


@pytest.fixture(autouse=True)
def frequent_thread_switches():
    """Switch threads every 0.1 ms instead of 5 ms: more interleavings per second, faster hand-overs."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(old)


def run_concurrently(jobs, timeout=60):
    errors, counts = [], []
    threads = [threading.Thread(target=consume, args=(*job, errors, counts), name=f"consumer-{i}")
               for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a consumer hung"
    b, m, nb = (sum(c[i] for c in counts) for i in range(3))
    checked(b, m, nb)
    assert not errors, errors[:5]
    return b


# -- iterable mode: random structures ------------------------------------------------------------

job = st.tuples(structure, st.integers(0, 2**31), st.integers(85, 120), st.integers(1, 4))


@pytest.mark.timeout(120)
@settings(SETTINGS, max_examples=40)
@given(jobs=st.lists(job, min_size=3, max_size=4), delays=st.lists(st.floats(0, 0.0005), max_size=3))
def test_random_structures_many_prefetchers(jobs, delays, device):
    """Random nested dict/list/tuple/namedtuple/OrderedDict batches, 3-4 prefetchers at once (at least
    40 x 3 x 85 = 10,200 batches)."""
    work = []
    for spec, seed, n, depth in jobs:
        def loader(spec=spec, seed=seed, n=n):
            return (batch_of(spec, seed, i) for i in range(n))

        def make(loader=loader, depth=depth):
            return CudaPrefetcher(loader, device=device, depth=depth)

        work.append((make, lambda k, spec=spec, seed=seed: batch_of(spec, seed, k), n, delays))
    run_concurrently(work)
    note("every byte, dtype, shape and container type equal, in order, exactly once; no consumer hung")


# -- source mode: random fields on disk ----------------------------------------------------------

FIELD_DTYPES = [np.uint8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64]
field = st.tuples(st.sampled_from(FIELD_DTYPES), st.lists(st.integers(1, 6), max_size=2))
storage = st.sampled_from(["npy", "raw-multi", "h5-contiguous", "h5-chunked", "h5-gzip"])


def write_source(root, kind, n, fields, seed):
    """Files of ``kind`` holding ``fields`` (plus a row-number field ``_row``); returns (open, data)."""
    rng = np.random.default_rng(seed)
    data = {"_row": np.arange(n, dtype=np.int64)}
    for k, (dt, shape) in enumerate(fields):
        raw = rng.integers(0, 256, size=n * int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize,
                           dtype=np.uint8)
        data[f"f{k}"] = raw.view(dt).reshape(n, *shape)
    if kind == "npy":
        for name, arr in data.items():
            np.save(root / f"{name}.npy", arr)
        return (lambda: RawSource(fields={name: root / f"{name}.npy" for name in data})), data
    if kind == "raw-multi":
        cut = int(rng.integers(1, n))
        spec = {}
        for name, arr in data.items():
            paths = [root / f"{name}.{i}.bin" for i in range(2)]
            arr[:cut].tofile(paths[0])
            arr[cut:].tofile(paths[1])
            spec[name] = {"paths": paths, "dtype": arr.dtype.str, "shape": arr.shape[1:]}
        return (lambda: RawSource(fields=spec)), data
    import h5py

    from gpufeed.sources import H5Source

    path = root / "d.h5"
    with h5py.File(path, "w") as f:
        for name, arr in data.items():
            kw = {}
            if kind != "h5-contiguous":
                kw["chunks"] = (int(rng.integers(1, 9)), *arr.shape[1:])
            if kind == "h5-gzip":
                kw["compression"] = "gzip"
            f.create_dataset(name, data=arr, **kw)
    return (lambda: H5Source(path, fields=list(data))), data


def source_expected(data, batch_size, shuffle, drop_last, seed):
    """The batch the consumer must get at position k of the run (epochs 0 and 1 back to back)."""
    n = len(data["_row"])
    plans = [plan_batches(n, batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed, epoch=e)
             for e in (0, 1)]
    flat = [plan_rows(r) for p in plans for r in p]

    def expected(k):
        rows = flat[k]
        return {name: torch.from_numpy(np.ascontiguousarray(arr[rows])) for name, arr in data.items()}

    return expected, len(flat)


class TwoEpochs:
    """Iterates a prefetcher for two epochs as one stream, so one consumer thread checks both."""

    def __init__(self, pf):
        self.pf = pf

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.pf.close()

    def __iter__(self):
        for _ in range(2):
            yield from self.pf


src_job = st.tuples(st.integers(1, 40), st.sampled_from([False, True, "blocks"]), st.booleans(),
                    st.integers(1, 4), st.integers(0, 1000), st.booleans())


@pytest.mark.timeout(120)
@settings(SETTINGS, max_examples=25)
@given(kind=storage, n=st.integers(20, 300), fields=st.lists(field, min_size=1, max_size=3),
       jobs=st.lists(src_job, min_size=2, max_size=3), data_seed=st.integers(0, 1000),
       delays=st.lists(st.floats(0, 0.0005), max_size=2))
def test_random_sources_many_prefetchers(kind, n, fields, jobs, data_seed, delays, device):
    """Random fields on disk (.npy, raw files, HDF5 contiguous/chunked/gzip), 2-3 prefetchers over the
    same files at once, random batch size, shuffle, drop_last and depth; two epochs each."""
    if kind.startswith("h5"):
        pytest.importorskip("h5py")
    with tempfile.TemporaryDirectory() as tmp:
        opener, data = write_source(Path(tmp), kind, n, fields, data_seed)
        shared = opener()  # the prefetchers with share=True read through this one object
        work = []
        for bs, shuffle, drop_last, depth, seed, share in jobs:
            if drop_last and bs > n:
                drop_last = False
            expected, total = source_expected(data, bs, shuffle, drop_last, seed)

            def make(bs=bs, shuffle=shuffle, drop_last=drop_last, depth=depth, seed=seed, share=share):
                src = shared if share else opener()
                # On CUDA a small pinned budget: the reads wait for buffers that copies still read.
                budget = 64 << 10 if device.type == "cuda" else None
                pf = CudaPrefetcher(SourceLoader(src, batch_size=bs, shuffle=shuffle, drop_last=drop_last,
                                                 seed=seed, pinned_budget=budget),
                                    device=device, depth=depth)
                return TwoEpochs(pf)

            work.append((make, expected, total, delays))
        run_concurrently(work)
        shared.close()
    note("every byte equal to the plan's rows, two epochs, in order, exactly once; no consumer hung")


# -- the pooled read path that feeds the GPU, driven on the CPU -----------------------------------

def pooled_epoch(src, plan, budget, threads, stop):
    """Read an epoch as a SourceLoader does for a CUDA device (private: ``loaders._reads.EpochReads``): each
    batch whole into a buffer of the pinned pool (host memory here), reads on reader threads, each batch
    starting the reads of those after it. Each batch's buffer goes back (its lease) once the consumer has
    checked it. On the GPU machine this path runs for real, the lease called with the copy's event."""
    from gpufeed.host_memory.cpu_buffers import CpuBuffers
    from gpufeed.host_memory.pinned_pool import PinnedPool
    from gpufeed.loaders._reads import EpochReads

    pool = PinnedPool(budget, pin=False)
    reads = EpochReads(src, plan, threads, pool, CpuBuffers(slots=8), torch.device("cpu"), stop)
    try:
        for i in range(len(plan)):
            hb = reads.take(i)
            yield hb.batch
            if hb.lease is not None:
                hb.lease(None)
    finally:
        reads.cancel()
    assert sum(b.nbytes for b in pool._free) == pool.allocated  # every buffer came back
    assert pool.allocated <= max(pool.budget, max((b.nbytes for b in pool._free), default=0))


@pytest.mark.timeout(60)
@settings(SETTINGS, max_examples=30)
@given(n=st.integers(1, 300), fields=st.lists(field, min_size=1, max_size=3), seed=st.integers(0, 1000),
       grain=st.sampled_from([4096, 8192, 65536]), budget_grains=st.integers(0, 6), threads=st.integers(1, 4),
       bs=st.integers(1, 64), shuffle=st.sampled_from([False, True, "blocks"]))
def test_pooled_read_path_every_byte(n, fields, seed, grain, budget_grains, threads, bs, shuffle):
    """The CUDA path's source reads (pinned pool, parallel reads, read-ahead of the next batches), with host
    memory standing in for pinned memory: random fields, batches, and pool budgets from 0 (pageable
    reads) and 4 KiB (smaller than many a batch: one oversized buffer) to 320 KiB."""
    with tempfile.TemporaryDirectory() as tmp:
        opener, data = write_source(Path(tmp), "npy", n, fields, seed)
        src = opener()
        plan = plan_batches(n, bs, shuffle=shuffle, seed=seed)
        bad = nb = 0
        budget = 0 if budget_grains == 0 else max(4096, (budget_grains - 1) * grain)
        epoch = pooled_epoch(src, plan, budget, threads, threading.Event())
        for out, rows in zip(epoch, plan, strict=True):
            r = plan_rows(rows)
            for name, arr in data.items():
                got = out[name].numpy()
                bad += got.tobytes() != np.ascontiguousarray(arr[r]).tobytes()
                nb += got.nbytes
        src.close()
    checked(len(plan), bad, nb)
    assert bad == 0
    note("every byte equal; every pool buffer back; the pool within its budget (or one oversized buffer)")
