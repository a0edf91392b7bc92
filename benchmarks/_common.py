"""What every benchmark script shares: the device from ``--device`` and the card's name for result files."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
from pathlib import Path
from typing import Any

import torch


def parser(doc: str | None, name: str, smoke_help: str = "tiny sizes, CPU by default: checks it runs"
           ) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes: ``--out``, ``--device``, ``--smoke``."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                   help=f"folder for {name}-<card>.* (default: benchmarks/results)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available; cpu with --smoke)")
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    return p


def pick_device(name: str | None, smoke: bool) -> torch.device:
    """``--device`` (default: CUDA when present, the CPU for ``--smoke``), made current when CUDA."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {name}: CUDA is not available here; use --device cpu or --smoke")
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    elif dev.type != "cpu":
        raise SystemExit(f"--device must be cuda, cuda:N or cpu, got {name}")
    return dev


def card_name(device: torch.device) -> str:
    """The slug of the GPU's name (``nvidia-h100-80gb-hbm3``), or ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def paired(row: dict[str, Any], other: dict[str, Any]) -> dict[str, float] | None:
    """``row``'s window over ``other``'s, round by round (the rounds both ran), as its median, min and max:
    the machine's drift between rounds cancels out. ``lo`` and ``hi`` bound the median of such ratios
    (:func:`median_interval`, ``coverage`` its confidence): where they straddle a target, the rounds do not
    say on which side of it the row lies. None where they share no round (a row of an older run, which
    kept none)."""
    ratios = [a / b for a, b in zip(row.get("rounds") or [], other.get("rounds") or [], strict=False)]
    if not ratios:
        return None
    lo, hi, coverage = median_interval(ratios)
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "lo": lo, "hi": hi,
            "coverage": coverage}


def median_interval(values: list[float], level: float = 0.9) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of what ``values`` sample: their ``k``-th
    smallest and ``k``-th largest, which hold the median with probability ``1 - 2 P[Binomial(n, 1/2) < k]``;
    the largest ``k`` whose probability is at least ``level``, or the whole range where the values are too
    few (5 values: 94%; 3: 75%). Returns (lo, hi, that probability)."""
    xs, n = sorted(values), len(values)

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k < n // 2 and coverage(k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def targets_table(targets: list[dict], digits: int = 3) -> list[str]:
    """The markdown lines of the targets table (``target``, ``value``, ``met``) every benchmark ends with."""
    lines = ["| target | value | met |", "| --- | ---: | --- |"]
    for t in targets:
        value = "-" if t["value"] is None else f"{t['value']:.{digits}f}"
        met = "not measured" if t["met"] is None else "yes" if t["met"] else "NO"
        lines.append(f"| {t['target']} | {value} | {met} |")
    return lines


def save_results(out: Path, name: str, doc: dict, md: str) -> Path:
    """``<name>-<card>.json`` and ``.md`` in ``out``; returns the path without suffix."""
    stem = out / f"{name}-{doc['card']}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    stem.with_suffix(".md").write_text(md)
    return stem


def print_results(doc: dict, stem: Path, md: str, note: str = "") -> None:
    """Each target met or missed, where the files went, and the markdown table."""
    print("\ntargets" + note + ":")
    for t in doc.get("targets", []):
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        print(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {value}")
    print(f"\nwrote {stem}.json and {stem}.md\n\n{md}", end="")


def run_info(device: torch.device, smoke: bool) -> dict:
    """The keys every result file starts with: the card, the versions and the machine's CPUs."""
    import gpufeed

    return {"card": card_name(device), "device": device.type, "torch": torch.__version__,
            "gpufeed": getattr(gpufeed, "__version__", None), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "smoke": smoke}
