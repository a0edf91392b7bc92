import threading
import time

import pytest
import torch

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m cuda on the GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    """The same test on the CPU path and, on the GPU machine, the CUDA path."""
    return torch.device(request.param)


def staging(device, **settings):
    """``settings`` of the pinned staging (``chunk_bytes``, ``pinned_budget``) on CUDA; on the CPU, where
    nothing is staged and they raise, none."""
    return settings if torch.device(device).type == "cuda" else {}


def gpufeed_threads():
    return [t for t in threading.enumerate() if t.name.startswith("gpufeed") and t.is_alive()]


def wait_no_threads(timeout=5.0):
    """Seconds until no gpufeed thread is alive; fails the test after ``timeout``."""
    t0 = time.monotonic()
    while gpufeed_threads():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"gpufeed threads still alive: {gpufeed_threads()}")
        time.sleep(0.01)
    return time.monotonic() - t0


@pytest.fixture(autouse=True)
def no_leaked_threads():
    yield
    wait_no_threads()


@pytest.fixture(autouse=True)
def reads_move_to_a_thread(monkeypatch):
    """The suite runs every epoch of three batches or more through both ways of fetching: its first
    batches on the loop's thread, the rest on the background thread (as though a thread always paid),
    also on a CI machine whose cores torch's threads already take. ``test_cpu_inline.py`` and
    ``test_fetch_thread.py`` test the choice itself."""
    import gpufeed.prefetcher

    monkeypatch.setattr(gpufeed.prefetcher, "_cpu_core_to_spare", lambda: True)
    monkeypatch.setattr(gpufeed.prefetcher, "THREAD_COST_S", -1.0)


@pytest.fixture
def inline(monkeypatch):
    """A CPU prefetcher's epochs stay on the loop's thread, as on a machine with no core to spare."""
    import gpufeed.prefetcher

    monkeypatch.setattr(gpufeed.prefetcher, "_cpu_core_to_spare", lambda: False)
