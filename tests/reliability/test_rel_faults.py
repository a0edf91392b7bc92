"""Fault injection: every failure reaches the consumer, after the batches before it, with no hang and
no leaked thread, and the next epoch works where it can.

Two halves: a prefetcher over every source kind (RawSource on .npy/raw/several files/a manifest, H5Source
contiguous/chunked/gzip), and a prefetcher wrapping a loader (a generator, a torch DataLoader with and
without worker processes). The ``device`` fixture runs the same cases on CUDA on the GPU machine.
"""

from __future__ import annotations

import _thread
import gc
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from _rel import (
    KINDS,
    RAW_BYTES,
    FaultySource,
    Injected,
    OnDisk,
    check_epoch,
    checked,
    failing_preadv,
    failing_read_direct,
    keep,
    note,
    shut_down_loader_workers,
)
from _rel_datasets import RaisingSampler, Rows
from torch.utils.data import DataLoader

from conftest import wait_no_threads
from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.sources import FileChangedError, _gather, _pread, plan_batches

BS = 16  # 240 rows: 15 batches an epoch


@pytest.fixture(params=KINDS)
def disk(request, tmp_path):
    if request.param != "raw" and request.param != "raw-multi":
        pytest.importorskip("h5py")
    return OnDisk(request.param, tmp_path)


def plan(n=240, epoch=0):
    return plan_batches(n, BS, epoch=epoch)


def full_epoch(pf, disk, epoch=0):
    got = [keep(b) for b in pf]
    check_epoch(got, disk.data, plan(disk.n, epoch))
    return got


def stopped():
    """Seconds until no gpufeed thread is alive (fails after 5 s)."""
    return wait_no_threads(5.0)


# -- sources ---------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["first batch", "mid-epoch"])
def test_source_read_raises(disk, device, where):
    """A source read raises (first batch / mid-epoch): the same exception object reaches the consumer."""
    row = 0 if where == "first batch" else 5 * BS + 3
    src = FaultySource(disk.open(), fail_row=row)
    got = []
    with CudaPrefetcher(SourceLoader(src, batch_size=BS), device=device, depth=3) as pf:
        with pytest.raises(Injected) as info:
            for b in pf:
                got.append(keep(b))
        assert info.value is src.exc
        assert "read" in [f.name for f in info.traceback]  # raised through the source's frame
        check_epoch(got, disk.data, plan()[: row // BS])  # exactly the batches before it
        full_epoch(pf, disk, epoch=1)  # the next epoch works
    t = stopped()
    note(f"original exception after the {row // BS} batches before it; next epoch complete; "
         f"thread gone in {t:.2f} s")


@pytest.mark.timeout(30)
def test_source_low_level_eio(disk, device):
    """os.preadv (or h5py's read_direct for lzf) fails with EIO mid-epoch."""
    src = disk.open()
    got = []
    failing = failing_read_direct if disk.kind == "h5-lzf" else failing_preadv
    with CudaPrefetcher(SourceLoader(src, batch_size=BS), device=device, depth=2) as pf:
        with failing(after=10**9) as calls:  # count the calls of a clean epoch (they depend on the path)
            full_epoch(pf, disk)
        with failing(after=calls["calls"] // 3), pytest.raises(OSError) as info:  # a third into the epoch
            for b in pf:
                got.append(keep(b))
        assert info.value.errno == 5 and "injected" in str(info.value)
        assert len(got) < 15  # (0 too: a source that reads several batches at once may fail in the first)
        check_epoch(got, disk.data, plan(), complete=False)
        full_epoch(pf, disk, epoch=2)
    stopped()
    note("OSError(EIO) reaches the consumer after an exact prefix of the epoch; next epoch complete")


@pytest.mark.timeout(30)
def test_source_file_truncated_mid_epoch(disk, device):
    """A file is truncated while an epoch is read: FileChangedError (an OSError), after exact batches,
    naming the file."""
    src = disk.open()
    got = []
    with CudaPrefetcher(SourceLoader(src, batch_size=BS), device=device, depth=2) as pf:
        it = iter(pf)
        got += [keep(next(it)) for _ in range(2)]
        os.truncate(disk.late_file, os.path.getsize(disk.late_file) // 2)
        with pytest.raises(OSError) as info:
            for b in it:
                got.append(keep(b))
        check_epoch(got, disk.data, plan(), complete=False)
        assert len(got) < 15
        msg = str(info.value)
        assert isinstance(info.value, FileChangedError), msg
        assert f"{disk.late_file} changed after the source was made" in msg and "recreate the source" in msg
        with pytest.raises(FileChangedError):  # the file stays short: every later epoch fails too, clearly
            for _ in pf:
                pass
    stopped()
    note("FileChangedError '<file> changed after the source was made' after an exact prefix; the next "
         "epoch fails the same way")


def _child_status(fn, timeout=30.0):
    """Run ``fn`` in a forked child (a SIGBUS there cannot kill pytest); its exit code or signal name."""
    import warnings

    # Earlier cases' garbage (e.g. CUDA events in an exception's traceback) must not be collected in the
    # child: freeing a CUDA object there aborts it ("CUDA error: initialization error"). Collect here, and
    # freeze what is left so the child's collector never looks at the parent's objects.
    gc.collect()
    gc.freeze()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid != 0:
        gc.unfreeze()
    if pid == 0:
        code = 99
        try:
            code = fn()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return signal.Signals(os.WTERMSIG(status)).name
            return os.WEXITSTATUS(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


def _wait_read_ahead(it, depth, timeout=10.0):
    """Until ``depth`` batches wait in the epoch's queue: the thread then waits for the consumer to take
    one, so no read is in flight. (Reads the iterator's private queue; falls back to a pause.)"""
    q = getattr(it, "_queue", None)
    if q is None or not hasattr(q, "qsize"):
        time.sleep(0.5)
        return
    deadline = time.monotonic() + timeout
    while q.qsize() < depth and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.01)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("gather", [False, None, True], ids=["pread", "default", "mmap gather"])
@pytest.mark.parametrize("kind", RAW_BYTES)
def test_source_file_truncated_between_shuffled_batches(kind, gather, tmp_path):
    """Shuffled batches, read with positional reads (``mmap_gather=False``), as by default (rows in the page
    cache gathered from a memory map) or always gathered (``mmap_gather=True``): a file truncated while no
    read is in flight gives a clean OSError naming the file. (Truncated *during* a gather: the native
    gather turns the SIGBUS into the same OSError, finding 1 of docs/reliability.md; each case runs in a
    forked child so that a SIGBUS could not take pytest down.)"""
    if kind not in ("raw", "raw-multi"):
        pytest.importorskip("h5py")
    disk = OnDisk(kind, tmp_path)
    plan = plan_batches(disk.n, BS, shuffle=True)

    seen = tmp_path / "child-saw.txt"  # what the child saw, for the failure message
    gathers = tmp_path / "child-gathers.txt"

    def child():
        got = []
        real = _gather._gather_file

        def counted(*args):
            with open(gathers, "a") as f:
                f.write("1")
            return real(*args)

        _gather._gather_file = counted  # (this forked child's copy of the module)
        with CudaPrefetcher(SourceLoader(disk.open(mmap_gather=gather), batch_size=BS, shuffle=True),
                            device="cpu", depth=2) as pf:
            it = iter(pf)
            got += [keep(next(it)) for _ in range(3)]
            _wait_read_ahead(it, 2)  # the thread has read its 2 batches ahead and waits: no read in flight
            os.truncate(disk.late_file, os.path.getsize(disk.late_file) // 2)
            try:
                for b in it:
                    got.append(keep(b))
            except OSError as exc:
                seen.write_text(f"{type(exc).__name__}: {exc} after {len(got)} batches")
                check_epoch(got, disk.data, plan, complete=False)
                return 3 if f"{disk.late_file} changed after the source was made" in str(exc) else 4
            except BaseException as exc:
                seen.write_text(f"{type(exc).__name__}: {exc} after {len(got)} batches")
                raise
        seen.write_text(f"no error after {len(got)} batches")
        return 0

    status = _child_status(child)
    saw = seen.read_text() if seen.exists() else "nothing written"
    assert status == 3, f"child ended with {status} (3: the OSError naming the file); it saw: {saw}"
    gathered = gathers.exists()
    if gather is False or (gather is None and _pread.GATHER is None):
        assert not gathered
    else:
        assert gathered, "the rows were never gathered from a memory map"
    checked(3)
    note("FileChangedError naming the file after exact batches (in a forked child)")


@pytest.mark.timeout(30)
def test_source_file_deleted_mid_epoch(disk, device):
    """A file is deleted while an epoch is read: the open descriptor keeps it; reopening names it."""
    src = disk.open()
    with CudaPrefetcher(SourceLoader(src, batch_size=BS), device=device, depth=2) as pf:
        it = iter(pf)
        got = [keep(next(it))]
        os.remove(disk.early_file)
        got += [keep(b) for b in it]
        check_epoch(got, disk.data, plan())  # the epoch completes with exact bytes
        full_epoch(pf, disk, epoch=1)  # so does the next: descriptors stay open until close()
    src.close()
    with CudaPrefetcher(SourceLoader(src, batch_size=BS),
                        device=device) as pf, pytest.raises(FileNotFoundError) as info:
        next(iter(pf))  # the source was closed: reopening fails
    assert str(disk.early_file) in str(info.value)
    stopped()
    note("epoch and next epoch complete (open descriptors); after source.close(), FileNotFoundError names "
         "the file")


@pytest.mark.timeout(30)
def test_source_unopened_file_deleted_mid_epoch(tmp_path, device):
    """A file is deleted mid-epoch. Where the source has not opened it yet: FileNotFoundError naming it,
    after exact batches. The native reader opens every file of the source at its first read (to check
    each file's identity at every read): the deleted file's bytes, still those the source was made over,
    are then read exactly."""
    from gpufeed.sources import _pread

    disk = OnDisk("raw-multi", tmp_path)
    got = []
    with CudaPrefetcher(SourceLoader(disk.open(), batch_size=BS), device=device, depth=1) as pf:
        it = iter(pf)
        got.append(keep(next(it)))
        os.remove(disk.late_file)
        if _pread.backend() == "native":
            got += [keep(b) for b in it]
            check_epoch(got, disk.data, plan())
            return
        with pytest.raises(FileNotFoundError) as info:
            for b in it:
                got.append(keep(b))
    assert str(disk.late_file) in str(info.value)
    check_epoch(got, disk.data, plan()[: 120 // BS])  # every batch before the file's first row
    stopped()
    note("FileNotFoundError naming the file, after every batch before its rows")


@pytest.mark.timeout(30)
def test_source_transform_raises(disk, device):
    """The transform raises on the third batch (once): its exception, then a working next epoch."""
    calls = {"n": 0}

    def transform(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ArithmeticError("transform failed on batch 2")
        return batch

    got = []
    with CudaPrefetcher(SourceLoader(disk.open(), batch_size=BS), device=device, transform=transform) as pf:
        with pytest.raises(ArithmeticError, match="batch 2"):
            for b in pf:
                got.append(keep(b))
        check_epoch(got, disk.data, plan()[:2])
        full_epoch(pf, disk, epoch=1)
    stopped()
    note("the transform's exception after the 2 batches before it; next epoch complete")


def _consume_and_raise(pf, at):
    for i, _ in enumerate(pf):
        if i == at:
            raise KeyError("consumer failed")


@pytest.mark.timeout(30)
def test_source_consumer_raises(disk, device):
    """The consumer raises while batches are in flight: the thread stops, the next epoch is complete."""
    with CudaPrefetcher(SourceLoader(disk.open(), batch_size=BS), device=device, depth=4) as pf:
        with pytest.raises(KeyError):
            _consume_and_raise(pf, 3)
        t = stopped()  # the for loop's iterator died with the frame: its reader threads stopped
        full_epoch(pf, disk, epoch=1)
    note(f"thread gone {t:.2f} s after the consumer's exception; next epoch complete")


def _interrupt(how):
    if how == "interrupt_main":
        _thread.interrupt_main()
    else:
        signal.raise_signal(signal.SIGINT)


@pytest.mark.timeout(30)
def _interrupted_next(it, after, how):
    """``next(it)`` with a SIGINT ``after`` seconds into it: asserts KeyboardInterrupt; seconds waited."""
    timer = threading.Timer(after, _interrupt, args=(how,))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            next(it)
        return time.monotonic() - t0
    finally:
        timer.join()


@pytest.mark.parametrize("how", ["interrupt_main", "raise_signal"])
def test_source_ctrl_c_during_next(disk, device, how):
    """SIGINT while the consumer waits in next(): KeyboardInterrupt, threads stop, next epoch works."""
    from gpufeed.loaders._reads import READS_AHEAD

    # The sixth next() hands out batch 5, takes batch 5 + depth (2) from the loader, which starts the read
    # of the batch READS_AHEAD after that: a small read, on the loop's thread. That read takes 0.6 s.
    src = FaultySource(disk.open(), block_row=(5 + 2 + READS_AHEAD) * BS, block_s=0.6)
    with CudaPrefetcher(SourceLoader(src, batch_size=BS), device=device, depth=2) as pf:
        it = iter(pf)
        got = [keep(next(it)) for _ in range(5)]
        waited = _interrupted_next(it, 0.15, how)
        t = stopped()  # the epoch's reader threads
        check_epoch(got, disk.data, plan()[:5])
        with pytest.raises(StopIteration):
            next(it)  # the interrupted iterator ends; it never hands out a stale batch
        src.block_row = None
        full_epoch(pf, disk, epoch=1)
    note(f"KeyboardInterrupt {waited:.2f} s after next() began (signal at 0.15 s, the read in flight "
         f"ends by 0.6 s); thread gone {t:.2f} s later; next epoch complete")


# -- loaders (iterable mode) -----------------------------------------------------------------------

N = 64


def expected_x(i):
    return torch.full((4,), i, dtype=torch.int64)


def check_rows_batches(got, start=0, bs=4):
    """Batches of a ``Rows`` DataLoader: batch k holds indices k*bs .. k*bs+bs-1, every byte checked."""
    bad = 0
    for k, b in enumerate(got, start):
        idx = torch.arange(k * bs, k * bs + bs)
        ok = torch.equal(b["i"].cpu(), idx) and torch.equal(b["x"].cpu(), idx[:, None].expand(-1, 4))
        bad += not ok
    checked(len(got), bad, sum(b["x"].numel() * 8 for b in got))
    assert bad == 0


class Gen:
    """A loader (re-iterable) that raises once: at ``at`` (a batch index) or in ``__iter__`` (``at=-1``)."""

    def __init__(self, at):
        self.at, self.failed = at, False

    def __iter__(self):
        if self.at == -1 and not self.failed:
            self.failed = True
            raise LookupError("loader cannot start")
        return self._gen()

    def _gen(self):
        for i in range(N // 4):
            if i == self.at and not self.failed:
                self.failed = True
                raise LookupError(f"loader failed at batch {i}")
            idx = torch.arange(i * 4, i * 4 + 4)
            yield {"x": idx[:, None].expand(-1, 4).clone(), "i": idx}


def make_loader(kind, at, tmp_path):
    flag = str(tmp_path / "once")
    if kind == "generator":
        return Gen(at)
    workers = 2 if kind == "DataLoader, 2 workers" else 0
    if at == -1:  # raising as the DataLoader's iterator starts: its sampler raises
        return DataLoader(Rows(N), batch_size=4, sampler=RaisingSampler(N, flag), num_workers=workers)
    return DataLoader(Rows(N, at=at * 4 + 1, flag=flag, what="raise"), batch_size=4, num_workers=workers)


LOADERS = ["generator", "DataLoader, 0 workers", "DataLoader, 2 workers"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", LOADERS)
@pytest.mark.parametrize("at", [0, 5, -1], ids=["first batch", "mid-epoch", "in __iter__"])
def test_loader_raises(kind, at, device, tmp_path):
    """The loader raises (first batch, mid-epoch, in ``__iter__``): its exception reaches the consumer."""
    loader = make_loader(kind, at, tmp_path)
    want = LookupError if at == -1 else (ValueError if kind != "generator" else LookupError)
    got = []
    with CudaPrefetcher(loader, device=device, depth=3) as pf:
        with pytest.raises(want) as info:
            for b in pf:
                got.append(keep(b))
        if kind != "DataLoader, 2 workers":  # across processes torch rebuilds the exception (same type)
            frames = [f.name for f in info.traceback]
            assert {"_gen", "__iter__", "__getitem__"} & set(frames), frames
        shut_down_loader_workers(info.value)
        del info
        check_rows_batches(got)
        assert len(got) == max(at, 0)
        again = [keep(b) for b in pf]  # the next epoch works
        check_rows_batches(again)
        assert len(again) == N // 4
    t = stopped()
    _workers_gone()
    note(f"{want.__name__} after the {max(at, 0)} batches before it; next epoch complete; "
         f"thread gone in {t:.2f} s")


def _workers_gone(timeout=10.0):
    t0 = time.monotonic()
    while multiprocessing.active_children():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"DataLoader workers still alive: {multiprocessing.active_children()}")
        time.sleep(0.02)
    return time.monotonic() - t0


WORKER_DIED = r"DataLoader worker \(pid"


def _raised_at_worker_death(run):
    """What ``run()`` raises once a DataLoader worker died. torch's SIGCHLD handler raises its RuntimeError
    at whichever line the main thread is on when the signal is handled: where that is while the error
    before it (a broken pipe's) is being caught, the handler's error is the one that arrives."""
    try:
        try:
            run()
        except (RuntimeError, ConnectionError, EOFError) as exc:
            return exc
    except RuntimeError as late:  # (the handler's, raised while the first error was caught)
        return late
    raise AssertionError("no error after the worker died")


def _worker_death(exc):
    """The error a DataLoader gives when a worker dies: torch's RuntimeError (its SIGCHLD handler, or its
    5 s liveness check), or, from a thread without that handler, the broken pipe's error."""
    if isinstance(exc, RuntimeError):
        import re

        assert re.search(WORKER_DIED, str(exc)), exc
        return "RuntimeError 'DataLoader worker (pid ...) ...'"
    assert isinstance(exc, (ConnectionError, EOFError)), repr(exc)
    return type(exc).__name__


@pytest.mark.timeout(60)
def test_dataloader_worker_killed_in_getitem(tmp_path, device):
    """A DataLoader worker is killed (SIGKILL from its own __getitem__): an error reaches the consumer."""
    loader = DataLoader(Rows(N, at=21, flag=str(tmp_path / "once"), what="kill"), batch_size=4, num_workers=2)
    got = []
    t0 = time.monotonic()
    with CudaPrefetcher(loader, device=device, depth=2) as pf:
        error = _raised_at_worker_death(lambda: got.extend(keep(b) for b in pf))
        took = time.monotonic() - t0
        what = _worker_death(error)
        shut_down_loader_workers(error)  # the surviving worker: see shut_down_loader_workers
        del error
        check_rows_batches(got)
        assert len(got) < N // 4
        again = [keep(b) for b in pf]  # fresh workers: the next epoch works
        check_rows_batches(again)
        assert len(again) == N // 4
    stopped()
    w = _workers_gone()
    note(f"{what} in the consumer after {took:.1f} s; next epoch complete; workers gone {w:.1f} s later")


@pytest.mark.timeout(60)
def test_dataloader_persistent_worker_killed_from_outside(device):
    """A persistent worker is killed through ``loader._iterator._workers``: error, no hang, ever.
    (``timeout=2``: torch polls its workers' liveness every 2 s instead of every 5.)"""
    loader = DataLoader(Rows(N), batch_size=4, num_workers=2, persistent_workers=True, timeout=2)
    got = []
    t0 = time.monotonic()
    def epoch():
        nonlocal t0
        for k, b in enumerate(pf):
            got.append(keep(b))
            if k == 1:
                os.kill(loader._iterator._workers[0].pid, signal.SIGKILL)
                t0 = time.monotonic()

    try:
        with CudaPrefetcher(loader, device=device, depth=2) as pf:
            error = _raised_at_worker_death(epoch)
            took = time.monotonic() - t0
            what = _worker_death(error)
            del error
            check_rows_batches(got)
            # torch cannot revive persistent workers: the next epoch fails too, quickly and clearly.
            t1 = time.monotonic()
            with pytest.raises(RuntimeError, match=WORKER_DIED):
                list(pf)
            took2 = time.monotonic() - t1
    finally:  # (the surviving worker, whatever failed: the tests after this one count live workers)
        loader._iterator._shutdown_workers()
    stopped()
    _workers_gone()
    note(f"{what} {took:.1f} s after the kill; next epoch: RuntimeError 'DataLoader worker (pid(s) ...) "
         f"exited unexpectedly' after {took2:.1f} s (persistent workers cannot be revived)")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", LOADERS)
def test_loader_transform_raises(kind, device, tmp_path):
    """The transform raises on a loader's batch (once): its exception, then a complete next epoch."""
    calls = {"n": 0}

    def transform(b):
        calls["n"] += 1
        if calls["n"] == 4:
            raise ZeroDivisionError("transform failed")
        return b

    got = []
    with CudaPrefetcher(make_loader(kind, 99, tmp_path), device=device, transform=transform) as pf:
        with pytest.raises(ZeroDivisionError):
            for b in pf:
                got.append(keep(b))
        check_rows_batches(got)
        assert len(got) == 3
        again = [keep(b) for b in pf]
        check_rows_batches(again)
        assert len(again) == N // 4
    stopped()
    _workers_gone()
    note("the transform's exception after the 3 batches before it; next epoch complete")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", LOADERS)
def test_loader_consumer_raises(kind, device, tmp_path):
    """The consumer raises with batches in flight: thread and DataLoader workers stop; next epoch works."""
    with CudaPrefetcher(make_loader(kind, 99, tmp_path), device=device, depth=4) as pf:
        with pytest.raises(KeyError):
            _consume_and_raise(pf, 2)
        t = stopped()
        w = _workers_gone()
        again = [keep(b) for b in pf]
        check_rows_batches(again)
        assert len(again) == N // 4
    stopped()
    _workers_gone()
    note(f"thread gone {t:.2f} s, DataLoader workers gone {w:.2f} s after the exception; next epoch complete")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["interrupt_main", "raise_signal"])
@pytest.mark.parametrize("kind", ["generator", "DataLoader, 2 workers"])
def test_loader_ctrl_c_during_next(kind, how, device, tmp_path):
    """SIGINT while the consumer waits in next() on a slow loader: KeyboardInterrupt, clean stop, next
    epoch complete."""
    if kind == "generator":
        def slow():
            for i in range(N // 4):
                if i == 7:  # taken by the sixth next(), depth (2) ahead of batch 5, which it hands out
                    time.sleep(0.6)
                idx = torch.arange(i * 4, i * 4 + 4)
                yield {"x": idx[:, None].expand(-1, 4).clone(), "i": idx}
        loader = slow
    else:
        loader = DataLoader(Rows(N, at=7 * 4 + 1, what="slow", delay=0.6), batch_size=4, num_workers=2)
    with CudaPrefetcher(loader, device=device, depth=2) as pf:
        it = iter(pf)
        got = [keep(next(it)) for _ in range(5)]
        waited = _interrupted_next(it, 0.1, how)
        del it
        t = stopped()
        w = _workers_gone()
        check_rows_batches(got)
        again = [keep(b) for b in pf]
        check_rows_batches(again)
        assert len(again) == N // 4
    stopped()
    note(f"KeyboardInterrupt {waited:.2f} s after next() began (signal at 0.1 s, the loader's batch in "
         f"flight ends by 0.6 s); thread gone {t:.2f} s, workers {w:.2f} s later; next epoch complete")


@pytest.mark.timeout(30)
def test_loader_error_keeps_no_stale_batch(device):
    """After a loader error the same iterator ends (StopIteration), never a stale or repeated batch."""
    loader = Gen(at=2)
    with CudaPrefetcher(loader, device=device, depth=4) as pf:
        it = iter(pf)
        got = [keep(next(it)), keep(next(it))]
        with pytest.raises(LookupError):
            next(it)
        for _ in range(3):
            with pytest.raises(StopIteration):
                next(it)
        check_rows_batches(got)
    stopped()
    note("StopIteration on every later next(); no batch repeated")


def test_failed_epoch_frees_its_loader_iterator():
    """The failed epoch's loader iterator (a class-based one, like a DataLoader's) is released as soon as
    the consumer has handled the error, without a GC pass (regression: finding 4)."""
    import weakref

    refs = []

    class Batches:
        def __init__(self):
            self.i = 0

        def __iter__(self):
            return self

        def __next__(self):
            self.i += 1
            if self.i == 3:
                raise LookupError("loader failed")
            return torch.zeros(1)

    class Loader:
        def __iter__(self):
            it = Batches()
            refs.append(weakref.ref(it))
            return it

    gc.disable()
    try:
        with CudaPrefetcher(Loader(), device="cpu") as pf:
            with pytest.raises(LookupError):
                for _ in pf:
                    pass
            assert refs[0]() is None, "alive until a GC pass: a reference cycle holds the failed iterator"
    finally:
        gc.enable()
    stopped()
    note("released as soon as the error was handled, with the GC disabled")
