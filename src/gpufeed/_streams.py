"""The stream calls an epoch makes on every batch, one C call each.

``torch.cuda.current_stream()`` builds a new ``Stream`` object at every call, and ``torch.cuda.set_stream``
and ``current_device`` pass through Python lookups: together they cost a small batch more than its copy
(docs/design.md, "The inline hot path"). These wrappers make the same calls into ``torch._C`` that
``torch.cuda`` makes, and keep the loop's stream object while it stays current.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


class StreamSwitch:
    """The loop's current stream on ``device``, and switches between it and the ``copy`` stream.

    Invariant: :meth:`current` returns the same object for as long as the loop's current stream on
    ``device`` is the same stream, so a caller may compare streams with ``is``.
    """

    def __init__(self, device: torch.device, copy: torch.cuda.Stream) -> None:
        self.index = device.index  # (a prefetcher's CUDA device always names its index)
        self._get = torch._C._cuda_getCurrentStream
        self._get_device = torch._C._cuda_getDevice
        self._key: Any = None
        self._current: torch.cuda.Stream | None = None
        self._make_current: Callable[[], None] = lambda: None
        self._make_copy_current = _setter(copy)

    def current(self) -> torch.cuda.Stream:
        """The loop's current stream on the device."""
        key = self._get(self.index)
        if key != self._key:
            self._current = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self._make_current = _setter(self._current)
            self._key = key
        return self._current

    def enter_copy(self) -> int:
        """Make the copy stream (and its device) current; returns the device that was current."""
        device = self._get_device()
        self._make_copy_current()
        return device

    def leave_copy(self, device: int) -> None:
        """Make the stream :meth:`current` last returned current again, then ``device``."""
        self._make_current()
        if device != self.index:
            torch._C._cuda_setDevice(device)


def _setter(stream: torch.cuda.Stream) -> Callable[[], None]:
    return functools.partial(torch._C._cuda_setStream, stream_id=stream.stream_id,
                             device_index=stream.device_index, device_type=stream.device_type)
