"""TraceRecorder: Chrome trace format, thread tracks, bounded memory, thread safety."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from gpufeed._tracing import TraceRecorder


def _written(rec, tmp_path):
    return json.loads(Path(rec.write(tmp_path / "trace.json")).read_text())


def _spans(doc):
    return [e for e in doc["traceEvents"] if e["ph"] != "M"]


def _thread_names(doc):
    return {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}


def test_write_produces_chrome_trace_json(tmp_path):
    rec = TraceRecorder()
    t0 = time.perf_counter_ns()
    rec.add("fetch", t0, t0 + 2_500_000, "gpufeed-fetch", batch=3)
    rec.add("wait", t0, t0 + 1000, "consumer")
    doc = _written(rec, tmp_path)
    assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"}
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    pid = meta[0]["pid"]
    assert {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "gpufeed"}} in meta
    assert sorted(_thread_names(doc).values()) == ["consumer", "gpufeed-fetch"]
    fetch, wait = _spans(doc)
    assert (fetch["name"], fetch["ph"], fetch["dur"], fetch["args"]) == ("fetch", "X", 2500.0, {"batch": 3})
    assert fetch["ts"] >= 0
    assert set(wait) == {"name", "ph", "ts", "dur", "pid", "tid"}  # no args: no "args" key
    assert doc["otherData"]["dropped_events"] == 0
    assert not list(tmp_path.glob("*.tmp-*"))


def test_default_track_is_the_recording_thread_name(tmp_path):
    rec = TraceRecorder()
    t = threading.Thread(target=lambda: rec.add("fill", 0, 1), name="gpufeed-fill_0")
    t.start()
    t.join()
    doc = _written(rec, tmp_path)
    (ev,) = _spans(doc)
    assert _thread_names(doc)[ev["tid"]] == "gpufeed-fill_0"


def test_a_span_that_ends_before_it_begins_is_rejected():
    with pytest.raises(ValueError, match="ends before it begins"):
        TraceRecorder().add("bad", 10, 9)


def test_memory_is_bounded_to_the_most_recent_events(tmp_path):
    rec = TraceRecorder(max_events=10)
    for i in range(25):
        rec.add(f"b{i}", i, i + 1, "t")
    assert rec.dropped == 15
    doc = _written(rec, tmp_path)
    assert [e["name"] for e in _spans(doc)] == [f"b{i}" for i in range(15, 25)]
    assert doc["otherData"]["dropped_events"] == 15


def test_events_are_sorted_by_start_time(tmp_path):
    rec = TraceRecorder()
    base = time.perf_counter_ns()
    rec.add("late", base + 2000, base + 3000, "a")
    rec.add("early", base + 1000, base + 5000, "b")
    assert [e["name"] for e in _spans(_written(rec, tmp_path))] == ["early", "late"]


def test_concurrent_recording_loses_nothing_under_the_cap(tmp_path):
    rec = TraceRecorder(max_events=100_000)
    n_threads, per = 8, 500

    def work(i):
        for j in range(per):
            t0 = time.perf_counter_ns()
            rec.add("s", t0, time.perf_counter_ns(), f"worker-{i}", j=j)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    doc = _written(rec, tmp_path)
    spans = _spans(doc)
    assert len(spans) == n_threads * per
    names = _thread_names(doc)
    assert sorted(names.values()) == sorted(f"worker-{i}" for i in range(n_threads))
    assert len(set(names)) == n_threads  # one tid per track
    for i in range(n_threads):
        tid = next(t for t, n in names.items() if n == f"worker-{i}")
        assert sorted(e["args"]["j"] for e in spans if e["tid"] == tid) == list(range(per))


def test_bad_arguments_are_rejected_with_the_value(tmp_path):
    with pytest.raises(ValueError, match="max_events must be an int >= 1, got 0"):
        TraceRecorder(max_events=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TraceRecorder().write(tmp_path / "missing" / "t.json")
