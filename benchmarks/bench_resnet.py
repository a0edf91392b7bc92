"""A real training loop: ResNet-18 on 512 px images, batch 64, each way of feeding the GPU beside the ideal.

Run it on the GPU machine, in one process (about a minute on an H100)::

    PYTHONPATH=src python benchmarks/bench_resnet.py        # benchmarks/results/resnet-<card>.{json,md}
    python benchmarks/bench_resnet.py --smoke               # tiny, on the CPU, seconds (CI)

The data: a map-style dataset over a bank of 64 random float32 images (3 x ``--image`` x ``--image``), made
once in the main process before the workers fork; item ``i`` is ``(bank[i % 64].clone(), i % 1000)``.
The model: torchvision's ``resnet18(num_classes=1000)`` (a small stand-in CNN where torchvision is absent,
said in the output and in the JSON's ``model``), float32, Adam (lr 1e-3), cross-entropy,
``cudnn.benchmark``. Each step: forward, loss, backward, ``optimizer.step()``; the loss is read back once,
at the end (a device synchronize stops the clock).

Rows (``--methods``), each with a fresh DataLoader (``--batch``, ``persistent_workers=False``), ``--warmup``
untimed steps, then ``--steps`` timed ones:

* ``ideal``: one batch resident in VRAM, reused every step (measured first).
* ``workers0``: ``num_workers=0``, ``.to(device)`` in the loop.
* ``workers8``: ``--workers`` workers, ``.to(device)``.
* ``pin_nb``: ``pin_memory=True``, ``.to(device, non_blocking=True)``.
* ``streams``: pinned loader; the next batch is copied on a side stream while this one computes.
* ``data_prefetcher``: NVIDIA apex's one-ahead ``data_prefetcher`` over the pinned loader.
* ``tnt``: torchtnt's ``CudaDataPrefetcher`` over the pinned loader, 2 batches ahead.
* ``spdl``: SPDL's transfer thread over the unpinned loader (pin + copy on its own stream).
* ``gpufeed_unpinned`` / ``gpufeed_pinned``: ``CudaPrefetcher`` over the loader with ``pin_memory`` off / on
  (its workers collate into gpufeed's pinned slots, ``worker_slots``'s default on CUDA).

Each row: ``steps_per_s`` and ``share_of_ideal`` (its steps/s over the ideal's).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common and bench_grid, also when loaded by a test
from _common import card_name, pick_device, run_info, save_results, targets_table
from bench_grid import SideOne, SpdlTransfer, TntPrefetcher, record, to_device

try:
    import gpufeed  # noqa: F401  (installed; else the checkout's src/ below)
except ImportError:  # a checkout without an install: run the working tree's src/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gpufeed import CudaPrefetcher

METHODS = ("ideal", "workers0", "workers8", "pin_nb", "streams", "data_prefetcher", "tnt", "spdl",
           "gpufeed_unpinned", "gpufeed_pinned")
GPUFEED = ("gpufeed_unpinned", "gpufeed_pinned")
BANK = 64
CLASSES = 1000
SMOKE = {"image": 32, "batch": 4, "warmup": 2, "steps": 3, "workers": 1}


# -- configuration -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    device: torch.device
    steps: int
    warmup: int
    workers: int
    image: int
    batch: int
    methods: tuple[str, ...]
    out: Path
    smoke: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def parse_args(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="folder for resnet-<card>.json/.md (default: benchmarks/results)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available; cpu with --smoke)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny (image 32, batch 4, 2 + 3 steps, 1 worker), CPU by default: checks it runs")
    p.add_argument("--steps", type=int, help="timed steps per row (default 40)")
    p.add_argument("--warmup", type=int, help="untimed steps per row first (default 10)")
    p.add_argument("--workers", type=int, help="DataLoader workers of the multi-worker rows (default 8)")
    p.add_argument("--image", type=int, help="image side in pixels (default 512)")
    p.add_argument("--batch", type=int, help="batch size (default 64)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {', '.join(METHODS)} (default: all; ideal always runs)")
    a = p.parse_args(argv)
    picked = set(a.methods.split(","))
    if picked - set(METHODS):
        raise SystemExit(f"--methods: a comma-separated subset of {', '.join(METHODS)}, got {a.methods!r}")
    base = SMOKE if a.smoke else {"image": 512, "batch": 64, "warmup": 10, "steps": 40, "workers": 8}
    pick = {k: base[k] if getattr(a, k) is None else getattr(a, k) for k in base}
    for k in ("image", "batch", "steps", "workers"):
        if pick[k] < 1:
            raise SystemExit(f"--{k} must be >= 1, got {pick[k]}")
    if pick["warmup"] < 0:
        raise SystemExit(f"--warmup must be >= 0, got {pick['warmup']}")
    return Config(device=pick_device(a.device, a.smoke), steps=pick["steps"], warmup=pick["warmup"],
                  workers=pick["workers"], image=pick["image"], batch=pick["batch"],
                  methods=tuple(m for m in METHODS if m in picked | {"ideal"}), out=a.out, smoke=a.smoke)


# -- data and model ----------------------------------------------------------------------------------------


class ImageBank(Dataset):
    """Item ``i``: a clone of image ``i % 64`` of a bank made once in the main process, label ``i % 1000``."""

    def __init__(self, length: int, image: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.bank = torch.rand(BANK, 3, image, image, generator=g)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.bank[i % BANK].clone(), i % CLASSES


def make_model(device: torch.device) -> tuple[nn.Module, str]:
    """torchvision's ResNet-18 (1000 classes), else a small stand-in CNN; and which one it is."""
    try:
        from torchvision.models import resnet18
    except ImportError:
        model: nn.Module = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, CLASSES))
        name = "stand-in CNN (torchvision is not importable)"
    else:
        model = resnet18(num_classes=CLASSES)
        name = "torchvision resnet18"
    return model.to(device), name


class Trainer:
    """One step: forward, cross-entropy, backward, Adam; the loss stays on the device."""

    def __init__(self, device: torch.device) -> None:
        torch.manual_seed(0)
        self.model, self.name = make_model(device)
        self.model.train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.detach()


# -- the feeds ---------------------------------------------------------------------------------------------


def _loader(dataset: ImageBank, cfg: Config, workers: int, pin: bool) -> DataLoader:
    kw: dict[str, Any] = {}
    if workers > 0 and sys.platform.startswith("linux"):
        kw["multiprocessing_context"] = "fork"  # the workers share the bank made here, copy-on-write
    return DataLoader(dataset, batch_size=cfg.batch, shuffle=False, num_workers=workers,
                      pin_memory=pin and cfg.cuda, persistent_workers=False, **kw)


def streams_feed(loader: DataLoader, device: torch.device) -> Iterator[Any]:
    """The copy/compute streams recipe: the step's kernels are queued, then the next batch's copy is
    issued on a side stream, so it overlaps the step; the consumer's stream waits for it before use."""
    it = iter(loader)
    if device.type != "cuda":
        for batch in it:
            yield to_device(batch, device)
        return
    side = torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)
    host = next(it, None)
    with torch.cuda.stream(side):
        nxt = None if host is None else to_device(host, device, non_blocking=True)
    while nxt is not None:
        current.wait_stream(side)
        record(nxt, current)
        batch = nxt
        yield batch  # the step is queued when the loop asks for the next batch
        host = next(it, None)
        with torch.cuda.stream(side):
            nxt = None if host is None else to_device(host, device, non_blocking=True)


class Feed:
    """One row's batches on the device, and what to close after it."""

    def __init__(self, method: str, dataset: ImageBank, cfg: Config) -> None:
        self.closers: list[Callable[[], None]] = []
        dev, many = cfg.device, cfg.workers

        def make_loader(workers: int, pin: bool) -> DataLoader:
            return _loader(dataset, cfg, workers, pin)

        if method == "workers0":
            self.it = (to_device(b, dev) for b in make_loader(0, pin=False))
        elif method == "workers8":
            self.it = (to_device(b, dev) for b in make_loader(many, pin=False))
        elif method == "pin_nb":
            self.it = (to_device(b, dev, non_blocking=True) for b in make_loader(many, pin=True))
        elif method == "streams":
            self.it = streams_feed(make_loader(many, pin=True), dev)
        elif method == "data_prefetcher":
            self.it = SideOne(make_loader(many, pin=True), dev)
        elif method == "tnt":
            self.it = iter(TntPrefetcher(make_loader(many, pin=True), dev, num_prefetch_batches=2))
        elif method == "spdl":
            spdl = SpdlTransfer(make_loader(many, pin=False), dev, pin=True)
            self.closers.append(spdl.close)
            self.it = iter(spdl)
        elif method in GPUFEED:
            pf = CudaPrefetcher(make_loader(many, pin=method == "gpufeed_pinned"), device=dev)
            self.closers.append(pf.close)
            self.it = iter(pf)
        else:
            raise ValueError(method)

    def close(self) -> None:
        for close in self.closers:
            close()
        self.it = iter(())  # drops the loader's iterator: its workers shut down


def sync(cfg: Config) -> None:
    if cfg.cuda:
        torch.cuda.synchronize(cfg.device)


def time_steps(trainer: Trainer, it: Iterator[Any], cfg: Config) -> tuple[float, float]:
    """Steps/s over ``cfg.steps`` steps after ``cfg.warmup`` untimed ones, and the last loss."""
    loss = None
    for _ in range(cfg.warmup):
        x, y = next(it)
        loss = trainer(x, y)
    sync(cfg)
    t0 = time.perf_counter()
    for _ in range(cfg.steps):
        x, y = next(it)
        loss = trainer(x, y)
    sync(cfg)
    seconds = time.perf_counter() - t0
    assert loss is not None
    return cfg.steps / seconds, float(loss)


def run_row(method: str, trainer: Trainer, dataset: ImageBank, cfg: Config) -> dict[str, Any]:
    feed = None
    try:
        if method == "ideal":
            x, y = next(iter(_loader(dataset, cfg, 0, pin=False)))
            resident = (x.to(cfg.device), y.to(cfg.device))
            rate, loss = time_steps(trainer, itertools.repeat(resident), cfg)
        else:
            feed = Feed(method, dataset, cfg)
            rate, loss = time_steps(trainer, feed.it, cfg)
        return {"method": method, "steps_per_s": rate, "loss": loss}
    except Exception as exc:  # keep the other rows of a scarce GPU run; the row says what failed
        traceback.print_exc()
        return {"method": method, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        if feed is not None:
            with contextlib.suppress(Exception):
                feed.close()


def run(cfg: Config) -> dict[str, Any]:
    if cfg.cuda:
        torch.backends.cudnn.benchmark = True
    trainer = Trainer(cfg.device)
    dataset = ImageBank((cfg.warmup + cfg.steps) * cfg.batch, cfg.image)  # before any worker forks
    print(f"model: {trainer.name}", flush=True)
    rows = []
    ideal = None
    for method in cfg.methods:  # ideal first
        row = run_row(method, trainer, dataset, cfg)
        if method == "ideal":
            ideal = row.get("steps_per_s")
        if "error" not in row:
            row["share_of_ideal"] = row["steps_per_s"] / ideal if ideal else None
        rows.append(row)
        print(_progress(row), flush=True)
    doc = {
        **run_info(cfg.device, cfg.smoke),
        "model": trainer.name,
        "config": {"image": cfg.image, "batch": cfg.batch, "steps": cfg.steps, "warmup": cfg.warmup,
                   "workers": cfg.workers, "batch_bytes": cfg.batch * 3 * cfg.image * cfg.image * 4},
        "rows": rows,
    }
    doc["targets"], doc["verdict"] = check(rows)
    return doc


def _progress(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"  {row['method']:>17}  ERROR {row['error']}"
    share = row.get("share_of_ideal")
    return (f"  {row['method']:>17} {row['steps_per_s']:8.2f} steps/s"
            + ("" if share is None else f"  {share:6.1%} of ideal"))


def check(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """gpufeed's best row >= 0.97x the ideal, and ahead of every other non-ideal row; and a sentence."""
    ok = [r for r in rows if "error" not in r and r.get("share_of_ideal") is not None]
    gf = max((r for r in ok if r["method"] in GPUFEED), key=lambda r: r["steps_per_s"], default=None)
    others = max((r for r in ok if r["method"] not in (*GPUFEED, "ideal")), key=lambda r: r["steps_per_s"],
                 default=None)
    if gf is None:
        return [], "no gpufeed row ran."
    near = gf["share_of_ideal"] >= 0.97
    ahead = others is None or gf["steps_per_s"] > others["steps_per_s"]
    vs_other = None if others is None else gf["steps_per_s"] / others["steps_per_s"]
    targets = [{"target": "gpufeed's best row >= 0.97x the ideal", "value": gf["share_of_ideal"],
                "met": near},
               {"target": "gpufeed's best row ahead of every other non-ideal row", "value": vs_other,
                "met": ahead}]
    best_other = ("" if others is None
                  else f"; the best other, {others['method']}, {others['share_of_ideal']:.1%}")
    verdict = (f"gpufeed's best row ({gf['method']}, {gf['share_of_ideal']:.1%} of the ideal) is "
               f"{'' if near else 'NOT '}>= 0.97x the ideal and {'' if ahead else 'NOT '}ahead of every "
               f"other non-ideal row{best_other}.")
    return targets, verdict


def markdown(doc: dict[str, Any]) -> str:
    c = doc["config"]
    lines = [
        f"# ResNet-18 training loop: {doc['card']}", "",
        f"torch {doc['torch']}, {doc['model']}, {c['image']} px float32 images, batch {c['batch']} "
        f"({c['batch_bytes'] / 2**20:.0f} MiB), {c['workers']} workers where a row uses workers, "
        f"{c['warmup']} warm-up + {c['steps']} timed steps, Adam, loss read once at the end."
        + (" Smoke run: sizes too small to mean anything." if doc["smoke"] else ""), "",
        "| method | steps/s | share of ideal |", "| --- | ---: | ---: |",
    ]
    for r in doc["rows"]:
        if "error" in r:
            lines.append(f"| {r['method']} | error: {r['error']} | |")
        else:
            share = r.get("share_of_ideal")
            lines.append(f"| {r['method']} | {r['steps_per_s']:.2f} | "
                         f"{'-' if share is None else format(share, '.1%')} |")
    lines += ["", doc["verdict"], "", *targets_table(doc["targets"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    cfg.out.mkdir(parents=True, exist_ok=True)
    print(f"ResNet training-loop benchmark on {cfg.device} ({card_name(cfg.device)}), torch "
          f"{torch.__version__}: {cfg.image} px, batch {cfg.batch}, {cfg.warmup} + {cfg.steps} steps, "
          f"{cfg.workers} workers", flush=True)
    doc = run(cfg)
    md = markdown(doc)
    stem = save_results(cfg.out, "resnet", doc, md)
    print(f"\n{md}\nwrote {stem}.json and {stem}.md")
    print(doc["verdict"] + (" (smoke run: not meaningful)" if cfg.smoke else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
