"""TraceRecorder: a bounded, thread-safe recorder of timed spans, written as a Chrome/Perfetto trace.

The prefetcher's threads (fetch, fill workers, the consumer) record one span per stage of every batch;
:meth:`TraceRecorder.write` produces the Chrome trace-event JSON that ``chrome://tracing`` and
https://ui.perfetto.dev open, one row per thread name.

Invariant: the recorder holds at most ``max_events`` events, the most recent ones (older ones are
dropped and counted in ``dropped``), so a recorder left on for a long run has bounded memory.
Appending takes one short lock; callers read ``time.perf_counter_ns`` outside it, so the lock never
stretches a span.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from typing import Any

DEFAULT_MAX_EVENTS = 100_000

# One recorded span: (name, tid, begin_ns, end_ns, args). Tuples, not dicts: a fraction of the memory.
_Event = tuple[str, int, int, int, "dict[str, Any] | None"]


class TraceRecorder:
    """Record spans from any thread; write them as a Chrome trace (Perfetto, chrome://tracing).

    Each span lands on a *track* named by ``tid_name`` (default: the recording thread's name), so the
    loop's fetching, the reader threads and the consumer each get a row. Times are ``perf_counter_ns``
    relative to the recorder's creation, written in microseconds.

    Args:
        max_events: keep at most this many events, the most recent (>= 1).

    Example:
        >>> rec = TraceRecorder()
        >>> t0 = time.perf_counter_ns()
        >>> rec.add("fetch", t0, time.perf_counter_ns(), "gpufeed-fetch", batch=0)
        >>> rec.write("trace.json")                       # doctest: +SKIP
        'trace.json'
    """

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if not isinstance(max_events, int) or max_events < 1:
            raise ValueError(f"max_events must be an int >= 1, got {max_events!r}")
        self.max_events = max_events
        self.origin_ns = time.perf_counter_ns()
        self.dropped = 0
        self._events: collections.deque[_Event] = collections.deque(maxlen=max_events)
        self._tids: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, name: str, begin_ns: int, end_ns: int, tid_name: str | None = None, **args: Any) -> None:
        """Record a span from two ``time.perf_counter_ns()`` readings, on track ``tid_name``.

        Keyword arguments become the event's ``args`` (shown when the span is selected).
        """
        if end_ns < begin_ns:
            raise ValueError(f"span {name!r} ends before it begins ({end_ns} < {begin_ns} ns)")
        event = (name, self._tid(tid_name), int(begin_ns), int(end_ns), args or None)
        with self._lock:
            if len(self._events) == self.max_events:
                self.dropped += 1
            self._events.append(event)

    def _tid(self, tid_name: str | None) -> int:
        if tid_name is None:
            tid_name = threading.current_thread().name
        tid = self._tids.get(tid_name)
        if tid is None:
            with self._lock:
                tid = self._tids.setdefault(tid_name, len(self._tids) + 1)
        return tid

    def write(self, path: str | os.PathLike[str]) -> str:
        """Write the trace as JSON to ``path`` (atomically: through a temporary file) and return the path.

        Open the file in https://ui.perfetto.dev or ``chrome://tracing``.
        """
        path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"cannot write the trace to {path}: folder {parent} does not exist")
        doc = {
            "traceEvents": self._trace_events(),
            "displayTimeUnit": "ms",
            "otherData": {"producer": "gpufeed", "max_events": self.max_events,
                          "dropped_events": self.dropped},
        }
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as fh:
                json.dump(doc, fh, default=str)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return path

    def _trace_events(self) -> list[dict[str, Any]]:
        """Metadata (process and thread names) first, then the spans by start time."""
        with self._lock:
            recorded = list(self._events)
            tids = dict(self._tids)
        pid = os.getpid()
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "gpufeed"}}
        ]
        for tid_name, tid in sorted(tids.items(), key=lambda kv: kv[1]):
            meta = {"ph": "M", "pid": pid, "tid": tid}
            out.append({"name": "thread_name", **meta, "args": {"name": tid_name}})
            out.append({"name": "thread_sort_index", **meta, "args": {"sort_index": tid}})
        origin = self.origin_ns
        for name, tid, begin, end, args in sorted(recorded, key=lambda e: e[2]):
            event: dict[str, Any] = {"name": name, "ph": "X", "ts": (begin - origin) / 1000.0,
                                     "dur": (end - begin) / 1000.0, "pid": pid, "tid": tid}
            if args:
                event["args"] = args
            out.append(event)
        return out
