"""Run the reliability suite N times and write its results table into ``docs/reliability.md``.

Usage (from the repository root)::

    python tests/reliability/report.py --runs 3              # CPU CI machine: the CPU block
    python tests/reliability/report.py --runs 1              # GPU machine: the GPU block (cuda cases run)

Each run is ``python -m pytest tests/reliability -p _rel_plugin``; the plugin writes one JSON per run
(``tests/reliability/last_run_<i>.json``, git-ignored). The table replaces the text between
``<!-- BEGIN <kind> results -->`` and ``<!-- END <kind> results -->`` in the page (``kind``: cpu or gpu, by
whether CUDA is available), so the hand-written parts of the page stay as they are.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SECTIONS = {
    "test_rel_faults": "1. Fault injection",
    "test_rel_stress": "2. Stress",
    "test_rel_memory": "3. Memory and resources",
    "test_rel_processes": "4. Fork and processes",
    "test_rel_limits": "5. Limits",
    "test_rel_bad_input": "6. Bad input",
    "test_rel_gpu": "7. GPU only (GDSSource, slow kernels, CUDA sanitizer, pinned budget)",
}
NUM = re.compile(r"\d+(?:\.\d+)?")


def run_suite(i: int, extra: list[str]) -> dict:
    out = HERE / f"last_run_{i}.json"
    env = {**os.environ, "RELIABILITY_JSON": str(out),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "pytest", "tests/reliability", "-p", "_rel_plugin", "-q", "-p",
           "no:cacheprovider", *extra]
    print(f"run {i + 1}: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    (HERE / f"last_run_{i}.log").write_text(proc.stdout + proc.stderr)  # the whole output, failures included
    tail = proc.stdout.strip().splitlines()[-1:] or [proc.stderr[-500:]]
    print("  " + tail[0], flush=True)
    doc = json.loads(out.read_text())
    doc["summary"] = tail[0]
    out.write_text(json.dumps(doc, indent=1))  # keep the summary for --reuse
    return doc


def merge_notes(notes: list[str], limit: int = 4) -> str:
    """Distinct notes; notes that differ only in their numbers are merged, numbers shown as ranges."""
    groups: dict[str, list[list[str]]] = {}
    for n in notes:
        groups.setdefault(NUM.sub("#", n), []).append(NUM.findall(n))
    out = []
    for pattern, rows in groups.items():
        parts = pattern.split("#")
        text = parts[0]
        for k, col in enumerate(zip(*rows, strict=True)):
            vals = sorted(set(col), key=float)
            text += vals[0] if len(vals) == 1 else f"{vals[0]}-{vals[-1]}"
            text += parts[k + 1]
        out.append(text)
    shown = out[:limit] + ([f"... ({len(out) - limit} more)"] if len(out) > limit else [])
    return "; ".join(shown).replace("|", "\\|")


HEADER = ["| scenario | cases run | passed | GPU cases | batches checked | mismatches | what happened |",
          "| --- | ---: | --- | ---: | ---: | ---: | --- |"]


def _order(tests: dict) -> list[str]:
    """Sections in SECTIONS order; tests in the order they ran."""
    names, seen = list(SECTIONS), list(tests)

    def key(k: str) -> tuple[int, int]:
        module = tests[k]["module"]
        return (names.index(module) if module in names else len(names), seen.index(k))

    return sorted(tests, key=key)


def _span(values: list[int]) -> str:
    values = sorted(set(values))
    if values == [0]:
        return "-"
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def row(key: str, runs: list[dict]) -> str:
    t = runs[-1]["tests"][key]
    per_run = [r["tests"][key] for r in runs if key in r["tests"]]
    outcome = [p["outcomes"] for p in per_run]
    passed = [o.get("passed", 0) for o in outcome]
    failed = sum(o.get("failed", 0) for o in outcome)
    ran = max(p + o.get("failed", 0) for p, o in zip(passed, outcome, strict=True))
    if failed:
        result = f"**{failed} failed** ({', '.join(map(str, passed))} passed)"
    else:
        result = f"{min(passed)}/{ran} x {len(per_run)} runs" if ran else "skipped here"
    mismatches = sum(p["mismatches"] for p in per_run)
    gpu = t["gpu_cases"]
    notes = [n for p in per_run for n in p["notes"]]  # every run's: numbers merge into ranges
    what = merge_notes(notes) or ("needs a GPU (run with -m cuda)" if gpu == t["cases"] else "")
    cells = [t["scenario"].replace("|", "/"), str(ran), result, str(gpu or "-"),
             _span([p["batches"] for p in per_run]), str(mismatches), what]
    return "| " + " | ".join(cells) + " |"


def table(runs: list[dict]) -> str:
    tests = runs[-1]["tests"]
    lines, section = [], None
    for key in _order(tests):
        if tests[key]["module"] != section:
            section = tests[key]["module"]
            lines += ["", f"### {SECTIONS.get(section, section)}", "", *HEADER]
        lines.append(row(key, runs))
    return "\n".join(lines)


def block(runs: list[dict], kind: str) -> str:
    first = runs[0]
    tests = [t for r in runs for t in r["tests"].values()]
    cases = sum(t["cases"] for t in runs[-1]["tests"].values())
    gpu = sum(t["gpu_cases"] for t in runs[-1]["tests"].values())
    passed = sum(t["outcomes"].get("passed", 0) for t in tests)
    failed = sum(t["outcomes"].get("failed", 0) for t in tests)
    batches = sum(t["batches"] for t in tests)
    mism = sum(t["mismatches"] for t in tests)
    walls = ", ".join(f"{r['wall_s']:.0f} s" for r in runs)
    machine = first["gpu"] or f"CPU only, {first['cpus']} cores"
    head = [
        f"Generated by `python tests/reliability/report.py --runs {len(runs)}` on "
        f"{datetime.date.today().isoformat()}: {machine}, Python {first['python']}, torch {first['torch']}.",
        "",
        f"* **{len(runs)} runs** of {cases} collected cases each ({gpu} of them CUDA-only"
        f"{', skipped here' if kind == 'cpu' else ''}); wall time per run: {walls}.",
        f"* **{passed} case runs passed, {failed} failed**; **{batches:,} batches checked** byte for byte "
        f"over the {len(runs)} runs; **mismatches: {mism}**.",
        "* Last pytest line of each run: " + "; ".join(f"`{r['summary']}`" for r in runs),
    ]
    fails = [f for r in runs for t in r["tests"].values() for f in t.get("failures", [])]
    if fails:
        head += ["* Failures, as pytest reported them:", *(f"  * `{f.splitlines()[0][:400]}`" for f in fails)]
    return "\n".join(head) + "\n" + table(runs) + "\n"


def write(page: Path, kind: str, text: str) -> None:
    begin, end = f"<!-- BEGIN {kind} results -->", f"<!-- END {kind} results -->"
    doc = page.read_text() if page.exists() else ""
    if begin in doc and end in doc:
        doc = doc[: doc.index(begin) + len(begin)] + "\n" + text + doc[doc.index(end) :]
    else:
        doc += f"\n{begin}\n{text}{end}\n"
    page.write_text(doc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="how many times to run the suite")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability.md",
                        help="the page to update")
    parser.add_argument("--kind", choices=["cpu", "gpu"], default=None,
                        help="which block of the page (default: gpu when CUDA is available)")
    parser.add_argument("--reuse", action="store_true",
                        help="render the last_run_<i>.json files of an earlier call instead of running")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    import torch

    kind = args.kind or ("gpu" if torch.cuda.is_available() else "cpu")
    if args.reuse:
        runs = [json.loads((HERE / f"last_run_{i}.json").read_text()) for i in range(args.runs)]
        for r in runs:
            r.setdefault("summary", f"exit status {r['exitstatus']}")
    else:
        runs = [run_suite(i, args.pytest_args) for i in range(args.runs)]
    write(args.out, kind, block(runs, kind))
    print(f"wrote the {kind} block of {args.out}")
    return 0 if all(r["exitstatus"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
