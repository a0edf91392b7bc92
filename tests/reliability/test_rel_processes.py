"""Fork and processes: sources inside DataLoader workers (fork and spawn), a fork mid-epoch and while a
reader thread is inside a read, interpreter exit with live prefetchers, and two prefetchers over one file
at once.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _rel import BY_OFFSET, KINDS, FaultySource, OnDisk, check_epoch, checked, keep, note
from _rel_datasets import SourceRows, TwoSourceRows
from torch.utils.data import DataLoader

from conftest import wait_no_threads
from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.sources import plan_batches

HERE = Path(__file__).resolve().parent


def _needs(kind):
    if kind not in ("raw", "raw-multi"):
        pytest.importorskip("h5py")


def check_loader_batches(batches, data):
    """DataLoader batches of ``SourceRows``: each row's bytes equal the source; every row exactly once."""
    bad, seen, pids = 0, [], set()
    for b in batches:
        rows = b["y"].cpu().numpy()
        seen += rows.tolist()
        pids |= set(b["pid"].tolist())
        for name, arr in data.items():
            bad += b[name].cpu().numpy().tobytes() != arr[rows].tobytes()
    checked(len(batches), bad, sum(b["x"].numel() for b in batches))
    assert bad == 0
    assert sorted(seen) == list(range(len(data["y"])))
    return pids


# -- sources inside DataLoader workers -------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_source_in_forked_dataloader_workers(kind, device, tmp_path):
    """A source read in DataLoader workers started by fork, after the parent read (handles open), two
    epochs with persistent workers, through a prefetcher."""
    _needs(kind)
    disk = OnDisk(kind, tmp_path)
    src = disk.open()
    out = {k: torch.empty((4, *f.shape), dtype=f.dtype) for k, f in src.fields.items()}
    src.read(range(4), out)  # descriptors / h5py files open in the parent before the fork
    loader = DataLoader(SourceRows(src), batch_size=16, shuffle=True, num_workers=2,
                        multiprocessing_context="fork", persistent_workers=True,
                        generator=torch.Generator().manual_seed(0))
    with CudaPrefetcher(loader, device=device, depth=2) as pf:
        for _ in range(2):
            pids = check_loader_batches([keep(b) for b in pf], disk.data)
            assert len(pids) == 2 and os.getpid() not in pids
    loader._iterator._shutdown_workers()
    src.close()
    wait_no_threads()
    note("2 epochs through 2 forked workers: every row once, every byte equal")


@pytest.mark.timeout(90)
def test_sources_in_spawned_dataloader_workers(tmp_path, device):
    """RawSource (several files) and H5Source (lzf, through h5py) in DataLoader workers started by
    spawn: the sources are pickled (paths only) and each worker opens its own files."""
    pytest.importorskip("h5py")
    raw, h5 = OnDisk("raw-multi", tmp_path / "raw"), OnDisk("h5-lzf", tmp_path / "h5")
    assert np.array_equal(raw.data["x"], h5.data["x"])  # the same rows: one dataset serves both
    loader = DataLoader(TwoSourceRows(raw.open(), h5.open()), batch_size=16, shuffle=True, num_workers=2,
                        multiprocessing_context="spawn", persistent_workers=True)
    with CudaPrefetcher(loader, device=device, depth=2) as pf:
        for _ in range(2):
            got = [keep(b) for b in pf]
            pids = check_loader_batches(got, raw.data)
            check_loader_batches([{k[2:]: v for k, v in b.items() if k.startswith("b_")} for b in got],
                                 h5.data)
            assert len(pids) == 2 and os.getpid() not in pids
    loader._iterator._shutdown_workers()
    wait_no_threads()
    note("RawSource and H5Source (gzip) pickled into 2 spawned workers: every row once, every byte equal")


# -- os.fork mid-epoch, and while a reader thread reads --------------------------------------------

def _digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _child(src, data, w):
    """In the forked child: read everything through the inherited source and through a prefetcher of its
    own (on the CPU: CUDA cannot be used after fork), write a digest, and leave without cleanup."""
    code = 1
    try:
        out = {k: torch.empty((len(src), *f.shape), dtype=f.dtype) for k, f in src.fields.items()}
        src.read(range(len(src)), out)
        direct = _digest(out[k].numpy() for k in data)
        with CudaPrefetcher(SourceLoader(src, batch_size=32, shuffle=True, seed=7), device="cpu") as pf:
            batches = list(pf)
        plan = plan_batches(len(src), 32, shuffle=True, seed=7)
        ok = all(np.array_equal(b["y"].numpy(), r) for b, r in zip(batches, plan, strict=True))
        via_pf = _digest(b[k].numpy() for b in batches for k in data)
        want = _digest(data[k][r] for r in plan for k in data)
        os.write(w, f"{direct}:{via_pf == want and ok}".encode())
        code = 0
    except BaseException as exc:
        os.write(w, f"error: {exc!r}".encode()[:2000])
    finally:
        os._exit(code)


def _fork_and_wait_child(src, data, timeout=30.0):
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads alive (Python >= 3.12)
        pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(src, data, w)
    os.close(w)
    return pid, r


def _collect_child(pid, r, timeout=30.0):
    deadline = time.monotonic() + timeout
    chunks = []
    os.set_blocking(r, False)
    while True:
        try:
            chunk = os.read(r, 4096)
        except BlockingIOError:
            chunk = None
        if chunk == b"":
            break
        if chunk:
            chunks.append(chunk)
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            raise AssertionError("the forked child hung")
        else:
            time.sleep(0.01)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return b"".join(chunks).decode(), os.waitstatus_to_exitcode(status)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_fork_while_prefetcher_thread_alive(kind, device, tmp_path):
    """os.fork while a prefetcher is mid-epoch (batches taken ahead, reads started ahead, waiting for the
    consumer): the child reads the source and runs a prefetcher of its own; the parent's epoch continues
    exactly."""
    _needs(kind)
    disk = OnDisk(kind, tmp_path)
    src = disk.open()
    plan = plan_batches(disk.n, 16, shuffle=True)
    with CudaPrefetcher(SourceLoader(src, batch_size=16, shuffle=True), device=device, depth=2) as pf:
        it = iter(pf)
        got = [keep(next(it)) for _ in range(3)]
        time.sleep(0.1)  # the epoch has taken its batches ahead and waits for the consumer
        pid, r = _fork_and_wait_child(src, disk.data)
        got += [keep(b) for b in it]
        check_epoch(got, disk.data, plan)
    text, code = _collect_child(pid, r)
    assert code == 0 and text.endswith(":True"), text
    assert text.split(":")[0] == _digest(disk.data[k] for k in disk.data)
    checked(len(plan) + 1)
    wait_no_threads()
    note("child: whole-source read and its own shuffled epoch exact, exit 0; parent's epoch exact")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", BY_OFFSET)
def test_fork_while_a_read_is_in_flight(kind, tmp_path, monkeypatch):
    """os.fork while the prefetcher's reader thread is inside a read (by-offset sources): the child still
    reads. (The h5py path has its own case below.)"""
    import gpufeed.loaders._read_plan as rp
    from gpufeed.loaders._reads import READS_AHEAD

    _needs(kind)
    disk = OnDisk(kind, tmp_path)
    # Each batch is cut into two reads, rows 0-7 on the loop's thread and rows 8-15 on a reader thread. The
    # third next() takes batch 2 + depth (4) and starts the reads of the batch READS_AHEAD after it: the
    # reader thread's half of that batch is held for 1 s.
    monkeypatch.setattr(rp, "MIN_READ_BYTES", 0)
    held = 2 + 4 + READS_AHEAD
    src = FaultySource(disk.open(), block_row=held * 16 + 8, block_s=1.0)
    t0 = time.monotonic()  # (before that read starts)
    with CudaPrefetcher(SourceLoader(src, batch_size=16, num_threads=2), device="cpu", depth=4) as pf:
        it = iter(pf)
        got = [keep(next(it)) for _ in range(3)]
        time.sleep(0.1)  # the read of that batch's second half is in flight on a reader thread
        reading = [t for t in threading.enumerate() if t.name.startswith("gpufeed-read")]
        pid, r = _fork_and_wait_child(src.inner, disk.data)
        assert time.monotonic() - t0 < 1.0 and reading  # forked while the held read was in flight
        got += [keep(b) for b in it]
        check_epoch(got, disk.data, plan_batches(disk.n, 16))
    text, code = _collect_child(pid, r)
    assert code == 0 and text.endswith(":True"), text
    checked(16)
    wait_no_threads()
    note("child exact and exit 0; the parent's epoch exact")


@pytest.mark.timeout(60)
def test_fork_while_an_h5py_read_holds_its_lock(tmp_path):
    """os.fork while another thread is inside an h5py-path read (lzf), holding H5Source's h5py lock: the
    child's reads of the same file must not wait for a lock no thread of the child will release
    (regression: finding 3)."""
    pytest.importorskip("h5py")
    from gpufeed.sources import h5 as h5mod

    disk = OnDisk("h5-lzf", tmp_path)
    src = disk.open()
    held, release = threading.Event(), threading.Event()

    def reader_inside_read():  # stands for a reader thread caught inside read_direct at the fork
        with h5mod._H5PY_LOCK:
            held.set()
            release.wait(30)

    t = threading.Thread(target=reader_inside_read)
    t.start()
    held.wait(10)
    try:
        pid, r = _fork_and_wait_child(src, disk.data)
    finally:
        release.set()
        t.join()
    text, code = _collect_child(pid, r, timeout=20)
    assert code == 0 and text.endswith(":True"), text
    src.close()
    checked(16)
    note("the child reads the gzip source and runs its own epoch, exact, exit 0")


@pytest.mark.timeout(120)
def test_interpreter_exit_after_fork_with_live_prefetchers(tmp_path):
    """A script forks mid-epoch; the child exits normally (atexit closes the inherited prefetchers), the
    parent exits with an unfinished epoch: both end promptly and say OK."""
    pytest.importorskip("h5py")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(HERE / "_rel_fork_exit.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=100)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CHILD OK" in proc.stdout and "PARENT OK" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    note(f"child and parent exit 0, no traceback; the whole script (with Python and torch startup) "
         f"{took:.1f} s")


# -- two prefetchers over one file -----------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared", [False, True], ids=["own sources", "one shared source"])
@pytest.mark.parametrize("kind", KINDS)
def test_two_prefetchers_over_one_file(kind, shared, device, tmp_path):
    """Two prefetchers read the same files at once (each its own source, or one source object shared),
    shuffled differently, two epochs each, each closed as soon as it is done; every byte exact."""
    _needs(kind)
    disk = OnDisk(kind, tmp_path)
    one = disk.open()
    errors = []

    def run(seed, epochs):
        try:
            src = one if shared else disk.open()
            with CudaPrefetcher(SourceLoader(src, batch_size=16 + seed, shuffle=True, seed=seed),
                                device=device, depth=3) as pf:
                for epoch in range(epochs):
                    got = [keep(b) for b in pf]
                    check_epoch(got, disk.data, plan_batches(disk.n, 16 + seed, shuffle=True, seed=seed,
                                                             epoch=epoch))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s, e)) for s, e in ((1, 1), (2, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    one.close()
    wait_no_threads()
    note("both prefetchers exact; the first closed while the other still read")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["raw-multi", "h5-contiguous", "h5-gzip"])
def test_closing_one_prefetcher_leaves_a_shared_source_readable(kind, tmp_path):
    """A long prefetcher reads a source while short prefetchers over the same source object are created,
    used and closed again and again, and unrelated files are opened in between (descriptor numbers get
    reused): the long one's bytes stay exact, no EBADF (regression: finding 2)."""
    _needs(kind)
    disk = OnDisk(kind, tmp_path)
    src = disk.open()
    errors, done = [], threading.Event()

    def long_running():
        try:
            with CudaPrefetcher(SourceLoader(src, batch_size=8), depth=3, device="cpu") as pf:
                for epoch in range(6):
                    check_epoch([keep(b) for b in pf], disk.data, plan_batches(disk.n, 8, epoch=epoch))
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=long_running)
    t.start()
    rounds = 0
    while not done.is_set():
        with CudaPrefetcher(SourceLoader(src, batch_size=8, shuffle=True, seed=rounds),
                            device="cpu") as short:
            next(iter(short))
        with open(disk.early_file, "rb"):  # an unrelated open() may take a descriptor number just freed
            pass
        rounds += 1
    t.join(30)
    assert not errors, errors
    src.close()
    wait_no_threads()
    note(f"6 epochs exact while {rounds} short prefetchers over the same source were opened and closed")
