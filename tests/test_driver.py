"""gpufeed._driver without a CUDA driver: every call says it did nothing, so the caller asks torch.

(With a driver, tests/test_cuda.py checks each call against torch's own.)
"""

import ctypes

import pytest

from gpufeed import _driver


def _has_driver() -> bool:
    try:
        ctypes.PyDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_has_driver(), reason="a CUDA driver is installed: tests/test_cuda.py covers it")
def test_without_a_driver_each_call_leaves_the_work_to_torch():
    assert _driver.query(0x1234) is None
    assert _driver.wait_event(0, 0x1234) is False
    assert _driver.record(0x1234, 0) is False
    assert _driver.elapsed_ms(0x1234, 0x5678) is None
    assert _driver.is_pinned(0x1234) is None
    assert _driver.addresses() is None and _driver.error_name(700) == "unknown"


def test_a_handle_never_created_is_not_passed_to_the_driver(monkeypatch):
    """torch gives an event never recorded the handle 0: no driver call may be made with it."""
    calls = []

    class Recorder:
        def __getattr__(self, name):
            return lambda *a: calls.append(name) or 0

    monkeypatch.setattr(_driver, "_lib", Recorder())
    assert _driver.query(0) is None and _driver.wait_event(7, 0) is False and _driver.record(0, 7) is False
    assert _driver.elapsed_ms(0, 5) is None and _driver.is_pinned(0) is None
    assert calls == []
    assert _driver.query(5) is True and _driver.wait_event(7, 5) is True and _driver.record(5, 7) is True
    assert calls == ["cuEventQuery", "cuStreamWaitEvent", "cuEventRecord"]


class _Event:
    """A stand-in for a torch CUDA event: its handle, and what torch's own query() would say."""

    def __init__(self, handle: int, torch_says: bool) -> None:
        self.cuda_event, self.torch_says, self.asked_torch = handle, torch_says, 0

    def query(self) -> bool:
        self.asked_torch += 1
        return self.torch_says


def test_done_takes_the_drivers_answer_and_asks_torch_only_without_one(monkeypatch):
    answers = {5: 0, 6: _driver.CUDA_ERROR_NOT_READY, 7: 999}  # done, not yet, an error

    class Driver:
        def cuEventQuery(self, handle):
            return answers[handle]

    monkeypatch.setattr(_driver, "_lib", Driver())
    done, busy, failed, never = _Event(5, False), _Event(6, True), _Event(7, True), _Event(0, True)
    assert _driver.done(done) is True and _driver.done(busy) is False
    assert done.asked_torch == busy.asked_torch == 0
    assert _driver.done(failed) is True and failed.asked_torch == 1  # torch raises a real error itself
    assert _driver.done(never) is True and never.asked_torch == 1  # never recorded: torch says done
