"""What every benchmark script shares: the device from ``--device`` and the card's name for result files."""

from __future__ import annotations

import re

import torch


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


def targets_table(targets: list[dict], digits: int = 3) -> list[str]:
    """The markdown lines of the targets table (``target``, ``value``, ``met``) every benchmark ends with."""
    lines = ["| target | value | met |", "| --- | ---: | --- |"]
    for t in targets:
        value = "-" if t["value"] is None else f"{t['value']:.{digits}f}"
        lines.append(f"| {t['target']} | {value} | {'yes' if t['met'] else 'NO'} |")
    return lines
