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
