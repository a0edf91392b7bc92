"""TraceRecorder: Chrome trace format, thread tracks, bounded memory, thread safety."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from gpufeed._tracing import TraceRecorder


def _spans(doc_or_events):
    events = doc_or_events["traceEvents"] if isinstance(doc_or_events, dict) else doc_or_events
    return [e for e in events if e["ph"] != "M"]


def _thread_names(events):
    return {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}


def test_span_records_complete_event_with_duration_in_microseconds():
    rec = TraceRecorder()
    with rec.span("fetch", "gpufeed-fetch", batch=3):
        time.sleep(0.01)
    (ev,) = _spans(rec.events())
    assert ev["name"] == "fetch"
    assert ev["ph"] == "X"
    assert ev["args"] == {"batch": 3}
    assert 9_000 <= ev["dur"] < 1_000_000  # slept 10 ms; written in microseconds
    assert ev["ts"] >= 0
    assert _thread_names(rec.events())[ev["tid"]] == "gpufeed-fetch"


def test_write_produces_chrome_trace_json(tmp_path):
    rec = TraceRecorder(process_name="bench")
    with rec.span("stage", "fill"):
        pass
    rec.instant("epoch end", "consumer", epoch=0)
    path = rec.write(tmp_path / "trace.json")
    doc = json.loads(Path(path).read_text())
    assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"}
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    pid = meta[0]["pid"]
    assert {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "bench"}} in meta
    assert sorted(_thread_names(doc["traceEvents"]).values()) == ["consumer", "fill"]
    span, instant = _spans(doc)
    assert set(span) == {"name", "ph", "ts", "dur", "pid", "tid"}
    assert (instant["name"], instant["ph"], instant["s"]) == ("epoch end", "i", "t")
    assert instant["args"] == {"epoch": 0}
    assert doc["otherData"]["dropped_events"] == 0
    assert not list(tmp_path.glob("*.tmp-*"))


def test_default_track_is_the_recording_thread_name():
    rec = TraceRecorder()

    def work():
        with rec.span("read"):
            pass

    t = threading.Thread(target=work, name="gpufeed-fill_0")
    t.start()
    t.join()
    (ev,) = _spans(rec.events())
    assert _thread_names(rec.events())[ev["tid"]] == "gpufeed-fill_0"


def test_add_records_a_span_measured_elsewhere():
    rec = TraceRecorder()
    t0 = time.perf_counter_ns()
    rec.add("consumer wait", t0, t0 + 2_500_000, "consumer", batch=7)
    (ev,) = _spans(rec.events())
    assert ev["dur"] == 2500.0
    assert ev["args"] == {"batch": 7}
    with pytest.raises(ValueError, match="ends before it begins"):
        rec.add("bad", t0, t0 - 1)


def test_exception_inside_span_is_recorded_and_propagates():
    rec = TraceRecorder()
    with pytest.raises(KeyError), rec.span("read", "fill"):
        raise KeyError("x")
    (ev,) = _spans(rec.events())
    assert ev["args"] == {"error": "KeyError"}


def test_memory_is_bounded_to_the_most_recent_events(tmp_path):
    rec = TraceRecorder(max_events=10)
    for i in range(25):
        with rec.span(f"b{i}", "t"):
            pass
    assert len(rec) == 10
    assert rec.dropped == 15
    assert [e["name"] for e in _spans(rec.events())] == [f"b{i}" for i in range(15, 25)]
    doc = json.loads(Path(rec.write(tmp_path / "t.json")).read_text())
    assert doc["otherData"]["dropped_events"] == 15
    rec.clear()
    assert len(rec) == 0 and rec.dropped == 0


def test_events_are_sorted_by_start_time():
    rec = TraceRecorder()
    base = time.perf_counter_ns()
    rec.add("late", base + 2000, base + 3000, "a")
    rec.add("early", base + 1000, base + 5000, "b")
    assert [e["name"] for e in _spans(rec.events())] == ["early", "late"]


def test_concurrent_recording_loses_nothing_under_the_cap():
    rec = TraceRecorder(max_events=100_000)
    n_threads, per = 8, 500

    def work(i):
        for j in range(per):
            with rec.span("s", f"worker-{i}", j=j):
                pass

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = rec.events()
    spans = _spans(events)
    assert len(spans) == n_threads * per
    names = _thread_names(events)
    assert sorted(names.values()) == sorted(f"worker-{i}" for i in range(n_threads))
    assert len(set(names)) == n_threads  # one tid per track
    for i in range(n_threads):
        tid = next(t for t, n in names.items() if n == f"worker-{i}")
        assert sorted(e["args"]["j"] for e in spans if e["tid"] == tid) == list(range(per))


def test_disabled_recorder_records_nothing():
    rec = TraceRecorder(enabled=False)
    with rec.span("x", "t"):
        pass
    rec.instant("y")
    rec.add("z", 0, 1)
    assert len(rec) == 0
    assert _spans(rec.events()) == []


def test_bad_arguments_are_rejected_with_the_value(tmp_path):
    with pytest.raises(ValueError, match="max_events must be an int >= 1, got 0"):
        TraceRecorder(max_events=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TraceRecorder().write(tmp_path / "missing" / "t.json")


def test_span_overhead_is_small():
    rec = TraceRecorder()
    n = 20_000
    t0 = time.perf_counter()
    for _ in range(n):
        with rec.span("s", "t"):
            pass
    per_span_us = (time.perf_counter() - t0) / n * 1e6
    assert per_span_us < 50  # generous bound for a loaded 2-core CI machine; typically ~1-2 us
