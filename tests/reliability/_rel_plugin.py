"""pytest plugin used by ``report.py`` (``-p _rel_plugin``): per test function of the suite, its cases and
outcomes, the batches it checked and what it noted; written as JSON to ``$RELIABILITY_JSON`` at the end.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import time

import _rel
import pytest
import torch

_RESULTS: dict[str, dict] = {}
_OUTCOME: dict[str, str] = {}
_ITEM_KEY: dict[str, str] = {}
_T0 = time.time()


def _key(item: pytest.Item) -> str:
    return f"{item.module.__name__}::{getattr(item, 'originalname', item.name)}"


def _doc(obj: object) -> str:
    text = (getattr(obj, "__doc__", None) or "").strip()
    return " ".join(text.split("\n\n")[0].split())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    key = _key(item)
    _ITEM_KEY[item.nodeid] = key
    entry = _RESULTS.setdefault(key, {
        "module": item.module.__name__, "test": getattr(item, "originalname", item.name),
        "scenario": _doc(item.function), "cases": 0, "gpu_cases": 0,
        "outcomes": collections.Counter(), "batches": 0, "mismatches": 0, "bytes": 0, "seconds": 0.0,
        "notes": [], "failures": [],
    })
    entry["cases"] += 1
    entry["gpu_cases"] += "cuda" in item.keywords
    counts, notes, t0 = dict(_rel.COUNTS), len(_rel.NOTES), time.monotonic()
    yield
    entry["seconds"] += time.monotonic() - t0
    for k in ("batches", "mismatches", "bytes"):
        entry[k] += _rel.COUNTS[k] - counts[k]
    entry["notes"] += _rel.NOTES[notes:]
    entry["outcomes"][_OUTCOME.get(item.nodeid, "unknown")] += 1


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    old = _OUTCOME.get(report.nodeid)
    if report.failed:
        _OUTCOME[report.nodeid] = "failed"
        key = _ITEM_KEY.get(report.nodeid)
        if key in _RESULTS:  # keep why it failed: a GPU run's output is often all that comes back
            crash = getattr(report.longrepr, "reprcrash", None)
            why = crash.message if crash is not None else str(report.longrepr)[-2000:]
            _RESULTS[key]["failures"].append(f"{report.nodeid} ({report.when}): {why}")
    elif report.skipped and old != "failed":
        _OUTCOME[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed and old is None:
        _OUTCOME[report.nodeid] = "passed"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("RELIABILITY_JSON")
    if not path:
        return
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    doc = {
        "wall_s": time.time() - _T0, "exitstatus": int(exitstatus), "python": platform.python_version(),
        "torch": torch.__version__, "cpus": os.cpu_count(), "gpu": gpu, "platform": platform.platform(),
        "tests": {k: {**v, "outcomes": dict(v["outcomes"])} for k, v in _RESULTS.items()},
    }
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
