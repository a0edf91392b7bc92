"""Each trainer's own way of moving batches to the GPU against gpufeed's recipe (docs/integrations.md).

Run it on the GPU machine, in one process (a few minutes)::

    PYTHONPATH=src python benchmarks/bench_trainers.py     # benchmarks/results/trainers-<card>.{json,md}
    python benchmarks/bench_trainers.py --smoke            # tiny, on the CPU, seconds (the smoke test)
    accelerate launch --num_processes 2 benchmarks/bench_trainers.py --trainers accelerate
        # each process times its own shard: benchmarks/results/trainers-launch-2x-<card>.{json,md}
    python benchmarks/bench_trainers.py --loops mlp,token,cnn,resnet
        # the loops benchmark's steps in each trainer: benchmarks/results/trainers-loops-<card>.{json,md}

The loop, the same for every trainer: an MLP (``--features`` -> ``--hidden`` x 2 -> 10, float32, SGD) over a
map-style dataset of random float32 rows (``--batch`` rows a batch: 8 MiB at the defaults), ``--workers``
DataLoader workers. Each row: a fresh loader and trainer, ``--warmup`` untimed steps (the workers start
there), then ``--steps`` timed ones, the device synchronized before the clock starts and stops;
``--rounds`` rounds, a trainer's methods interleaved, and the row reports the median steps/s with the min
and max, its ratio to the trainer's own row (``vs_own``, of the medians), and that ratio round by round
(``vs_own_paired``: median, min, max), where the machine's drift between rounds cancels out.

Rows (trainer / method):

* accelerate / ``own``: ``accelerator.prepare_data_loader(loader)`` (accelerate places the batches;
  ``pin_memory=True``, ``non_blocking=True``); ``gpufeed``: the recipe, ``device_placement=False`` and
  ``CudaPrefetcher`` over the prepared loader.
* lightning / ``own``: ``train_dataloader`` returns the DataLoader (``pin_memory=True``; Lightning's
  ``transfer_batch_to_device``); ``gpufeed``: it returns a ``CudaPrefetcher``.
* lightning_dm: the same, through a ``LightningDataModule``: ``own`` returns the DataLoader
  (``pin_memory=True``), ``gpufeed`` is the recipe's ``GpufeedData`` (its prefetcher closed at teardown).
* hf_trainer / ``own``: ``Trainer`` (``dataloader_pin_memory=True``, its ``_prepare_inputs``);
  ``gpufeed``: the ``GpufeedTrainer`` subclass. Dict batches ``{"x", "labels"}``.
* timm / ``own``: ``create_loader(..., use_prefetcher=True)`` (uint8 images, timm's ``PrefetchLoader``
  normalizes on the GPU); ``gpufeed``: ``create_loader(..., use_prefetcher=False)`` wrapped (float32
  normalized on the CPU); ``gpufeed_uint8``: the DataLoader inside timm's ``PrefetchLoader`` (uint8)
  wrapped, normalized by ``CudaPrefetcher(transform=...)`` on the GPU. Images: ``--image`` px PIL images
  made from random bytes, evaluation transforms; the MLP reads the flattened image.

* torchtitan (a torchtitan-style loop): an ``IterableDataset`` yields whole batches (``batch_size=None``,
  each worker its share, as the ``tokens`` recipe); ``own``: the DataLoader's ``pin_memory=True`` and
  ``.to(device, non_blocking=True)`` in the loop; ``gpufeed``: ``CudaPrefetcher`` over the DataLoader.

A trainer that is not installed gets rows with an ``error``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, bench_loops; also when loaded by a test
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import card_name, paired, parser, pick_device, run_info, save_results
from bench_loops import classify

from gpufeed import CudaPrefetcher

TRAINERS = ("accelerate", "lightning", "lightning_dm", "hf_trainer", "timm", "torchtitan")
#: Processes of an ``accelerate launch`` (1 when run plainly): each times its own shard.
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
METHODS = {"accelerate": ("own", "gpufeed"), "lightning": ("own", "gpufeed"),
           "lightning_dm": ("own", "gpufeed"), "hf_trainer": ("own", "gpufeed"),
           "timm": ("own", "gpufeed", "gpufeed_uint8"), "torchtitan": ("own", "gpufeed")}


@dataclass
class Config:
    device: torch.device
    smoke: bool
    out: Path
    trainers: tuple[str, ...]
    features: int
    hidden: int
    batch: int
    image: int
    workers: int
    warmup: int
    steps: int
    rounds: int
    loops: tuple[str, ...] = ()  # the loops benchmark's steps to train (empty: the MLP over rows)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def parse_args(argv: list[str] | None) -> Config:
    p = parser(__doc__, "trainers", "tiny sizes on the CPU: checks the script runs")
    p.add_argument("--trainers", default=",".join(TRAINERS), help="comma-separated subset of " +
                   ",".join(TRAINERS))
    p.add_argument("--features", type=int, help="floats a row (default 2048; smoke 32)")
    p.add_argument("--hidden", type=int, help="the MLP's hidden width (default 1024; smoke 32)")
    p.add_argument("--batch", type=int, help="rows a batch (default 1024; smoke 8)")
    p.add_argument("--image", type=int, help="timm's image side in px (default 64; smoke 16)")
    p.add_argument("--workers", type=int, help="DataLoader workers (default 4; smoke 0)")
    p.add_argument("--warmup", type=int, help="untimed steps a round (default 20; smoke 2)")
    p.add_argument("--steps", type=int, help="timed steps a round (default 100; smoke 3)")
    p.add_argument("--rounds", type=int, help="rounds a row, reported as median/min/max (default 3; smoke 1)")
    p.add_argument("--loops", default="",
                   help="train the loops benchmark's steps instead of the MLP over rows: a comma-separated "
                        "subset of mlp,token,cnn,resnet (bench_loops.py: their models, batches and losses), "
                        "in every trainer but timm")
    a = p.parse_args(argv)
    trainers = tuple(t for t in a.trainers.split(",") if t)
    unknown = set(trainers) - set(TRAINERS)
    if unknown:
        p.error(f"unknown trainers {sorted(unknown)}; choose from {','.join(TRAINERS)}")
    loops = tuple(x for x in a.loops.split(",") if x)
    if loops:
        from bench_loops import STEPS

        if set(loops) - set(STEPS):
            p.error(f"--loops: unknown {sorted(set(loops) - set(STEPS))}; choose from {','.join(STEPS)}")
        if "timm" in trainers:
            if a.trainers != ",".join(TRAINERS):
                p.error("--loops: timm trains its own image loop only; leave it out of --trainers")
            trainers = tuple(t for t in trainers if t != "timm")

    def pick(value: int | None, full: int, smoke: int) -> int:
        return value if value is not None else (smoke if a.smoke else full)

    if a.rounds is not None and a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")

    return Config(device=pick_device(a.device, a.smoke), smoke=a.smoke, out=a.out, trainers=trainers,
                  features=pick(a.features, 2048, 32), hidden=pick(a.hidden, 1024, 32),
                  batch=pick(a.batch, 1024, 8),
                  image=pick(a.image, 64, 16), workers=pick(a.workers, 4, 0),
                  warmup=pick(a.warmup, 20, 2), steps=pick(a.steps, 100, 3), rounds=pick(a.rounds, 3, 1),
                  loops=loops)


# -- the workload ----------------------------------------------------------------------------------------


class Rows(Dataset):
    """``(x, y)`` float32 rows over a bank made once (before any worker forks)."""

    def __init__(self, n: int, features: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.bank = torch.randn(256, features, generator=g)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.bank[i % 256].clone(), i % 10


class Images(Dataset):
    """PIL images from random bytes (timm's loader sets ``transform``)."""

    def __init__(self, n: int, side: int) -> None:
        import numpy as np

        self.arrays = np.random.default_rng(0).integers(0, 256, (64, side, side, 3), dtype=np.uint8)
        self.n = n
        self.transform: Callable[[Any], Any] | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        from PIL import Image

        img = Image.fromarray(self.arrays[i % 64])
        return (self.transform(img) if self.transform is not None else img), i % 10


class MLP(nn.Module):
    def __init__(self, features: int, hidden: int = 1024) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True)
class Work:
    """What the trainers train: a model, a data set of ``n`` samples (each a ``[x, y]`` list or a tensor),
    its batch size, and the loss of a batch."""

    name: str
    build: Callable[[], nn.Module]
    dataset: Callable[[int], Dataset]
    batch: int
    batch_bytes: int
    loss: Callable[[nn.Module, Any], torch.Tensor]


def works(cfg: Config) -> list[Work]:
    """The MLP over float32 rows; or, with ``--loops``, the loops benchmark's steps."""
    if not cfg.loops:
        return [Work("rows", lambda: MLP(cfg.features, cfg.hidden), lambda n: Rows(n, cfg.features),
                     cfg.batch, cfg.batch * cfg.features * 4, classify)]
    from bench_loops import BankDataset, make_bank, step_specs

    out = []
    for name in cfg.loops:
        spec = step_specs(cfg.smoke)[name]
        bank = make_bank(spec, spec.bank_rows or max(spec.batch, 64))
        out.append(Work(name, spec.build, lambda n, bank=bank: BankDataset(bank, n), spec.batch,
                        spec.batch * spec.sample_bytes, spec.loss))
    return out


class Clock:
    """Starts after ``warmup`` steps and stops after ``warmup + steps``, the device synchronized."""

    def __init__(self, cfg: Config) -> None:
        self.cfg, self.done, self.t0, self.t1 = cfg, 0, 0.0, 0.0

    def step(self) -> bool:
        """Count a finished step; True once the timed steps are done."""
        self.done += 1
        if self.done in (self.cfg.warmup, self.cfg.warmup + self.cfg.steps):
            if self.cfg.cuda:
                torch.cuda.synchronize(self.cfg.device)
            if self.done == self.cfg.warmup:
                self.t0 = time.perf_counter()
            else:
                self.t1 = time.perf_counter()
        return self.done >= self.cfg.warmup + self.cfg.steps

    def steps_per_s(self) -> float:
        if self.done < self.cfg.warmup + self.cfg.steps:
            raise RuntimeError(f"the loader ran out after {self.done} steps")
        return self.cfg.steps / (self.t1 - self.t0)


def _n(cfg: Config, batch: int) -> int:
    """Samples enough for every process's warm-up and timed steps (a launched run shards them)."""
    return (cfg.warmup + cfg.steps) * batch * WORLD


def _loop(batches: Any, model: nn.Module, opt: torch.optim.Optimizer, clock: Clock,
          backward: Callable[[torch.Tensor], None] | None = None,
          loss_of: Callable[[nn.Module, Any], torch.Tensor] = classify) -> None:
    for batch in batches:
        loss = loss_of(model, batch)
        (backward or torch.Tensor.backward)(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if clock.step():
            break


# -- the trainers -----------------------------------------------------------------------------------------


def run_accelerate(method: str, cfg: Config, work: Work) -> float:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=not cfg.cuda, dataloader_config=DataLoaderConfiguration(non_blocking=cfg.cuda))
    model = work.build()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    loader = _loader(cfg, work, method)
    clock = Clock(cfg)
    if method == "own":
        _loop(acc.prepare_data_loader(loader), model, opt, clock, acc.backward, work.loss)
    else:
        prepared = acc.prepare_data_loader(loader, device_placement=False)
        with CudaPrefetcher(prepared, device=acc.device) as batches:
            _loop(batches, model, opt, clock, acc.backward, work.loss)
    return clock.steps_per_s()


def _lightning(cfg: Config, work: Work, clock: Clock, loader: Callable[[Any], Any] | None) -> tuple[Any, Any]:
    """A Lightning Trainer for ``cfg``, and a module training ``work`` that counts its steps on ``clock``;
    with ``loader``, the module's ``train_dataloader`` is ``loader(module)``."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = work.build()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return work.loss(self.model, batch)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            clock.step()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    if loader is not None:
        Module.train_dataloader = loader  # type: ignore[method-assign]
    trainer = L.Trainer(accelerator="gpu" if cfg.cuda else "cpu", devices=1,
                        max_steps=cfg.warmup + cfg.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    return trainer, Module()


def _loader(cfg: Config, work: Work, method: str, shuffle: bool = False) -> DataLoader:
    return DataLoader(work.dataset(_n(cfg, work.batch)), batch_size=work.batch, shuffle=shuffle,
                      num_workers=cfg.workers, pin_memory=cfg.cuda and method == "own")


def run_lightning(method: str, cfg: Config, work: Work) -> float:
    clock = Clock(cfg)

    def train_dataloader(module: Any) -> Any:
        loader = _loader(cfg, work, method)
        if method == "own":
            return loader
        return CudaPrefetcher(loader, device=module.trainer.strategy.root_device)

    trainer, module = _lightning(cfg, work, clock, train_dataloader)
    trainer.fit(module)
    loader = trainer.train_dataloader
    if isinstance(loader, CudaPrefetcher):
        loader.close()
    return clock.steps_per_s()


def run_lightning_dm(method: str, cfg: Config, work: Work) -> float:
    import lightning as L

    clock = Clock(cfg)

    class Data(L.LightningDataModule):  # docs/integrations.md's recipe (lightning-datamodule) for gpufeed
        def __init__(self) -> None:
            super().__init__()
            self.prefetcher: CudaPrefetcher | None = None

        def train_dataloader(self) -> Any:
            loader = _loader(cfg, work, method, shuffle=True)
            if method == "own":
                return loader
            self.prefetcher = CudaPrefetcher(loader, device=self.trainer.strategy.root_device)
            return self.prefetcher

        def teardown(self, stage: str) -> None:
            if self.prefetcher is not None:
                self.prefetcher.close()

    trainer, module = _lightning(cfg, work, clock, None)
    trainer.fit(module, datamodule=Data())
    return clock.steps_per_s()


class WholeBatches(torch.utils.data.IterableDataset):
    """A map-style data set read as a stream of whole batches, each worker its share (the ``tokens``
    recipe's shape: a DataLoader with ``batch_size=None`` hands them on as they are)."""

    def __init__(self, dataset: Dataset, batch: int) -> None:
        self.dataset, self.batch = dataset, batch

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        starts = range(0, len(self.dataset) - self.batch + 1, self.batch)  # type: ignore[arg-type]
        for i, start in enumerate(starts):
            if i % workers == worker:
                samples = [self.dataset[j] for j in range(start, start + self.batch)]
                yield torch.utils.data.default_collate(samples)


def run_torchtitan(method: str, cfg: Config, work: Work) -> float:
    from bench_loops import to_device

    model = work.build().to(cfg.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = Clock(cfg)
    loader = DataLoader(WholeBatches(work.dataset(_n(cfg, work.batch)), work.batch), batch_size=None,
                        num_workers=cfg.workers, pin_memory=cfg.cuda and method == "own")
    if method == "own":
        moved = (to_device(b, cfg.device, non_blocking=True) for b in loader)
        _loop(moved, model, opt, clock, loss_of=work.loss)
    else:
        with CudaPrefetcher(loader, device=cfg.device) as batches:
            _loop(batches, model, opt, clock, loss_of=work.loss)
    return clock.steps_per_s()


def run_hf_trainer(method: str, cfg: Config, work: Work) -> float:
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments

    clock = Clock(cfg)

    class Timing(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.step()

    class GpufeedTrainer(Trainer):  # docs/integrations.md's recipe
        def get_train_dataloader(self) -> Any:
            placement = self.accelerator.device_placement
            self.accelerator.device_placement = False
            try:
                loader = super().get_train_dataloader()
            finally:
                self.accelerator.device_placement = placement
            return CudaPrefetcher(loader, device=self.args.device)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=work.batch, max_steps=cfg.warmup + cfg.steps,
            use_cpu=not cfg.cuda, report_to=[], save_strategy="no", logging_strategy="no",
            dataloader_num_workers=cfg.workers, dataloader_pin_memory=cfg.cuda and method == "own",
            disable_tqdm=True, learning_rate=0.01, optim="sgd", seed=0)
        cls = Trainer if method == "own" else GpufeedTrainer
        trainer = cls(model=LossModel(work), args=args, train_dataset=work.dataset(_n(cfg, work.batch)),
                      data_collator=_named, callbacks=[Timing()])
        trainer.train()
    return clock.steps_per_s()


class LossModel(nn.Module):
    """A work's model as HF ``Trainer`` takes one: named inputs (``x``, and ``labels`` where the work has
    them) in, ``{"loss": ...}`` out."""

    def __init__(self, work: Work) -> None:
        super().__init__()
        self.inner, self.loss = work.build(), work.loss

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"loss": self.loss(self.inner, x if labels is None else [x, labels])}


def _named(samples: list[Any]) -> dict[str, torch.Tensor]:
    """``default_collate``, then the batch's tensors named as :class:`LossModel` takes them."""
    batch = torch.utils.data.default_collate(samples)
    return {"x": batch} if isinstance(batch, torch.Tensor) else {"x": batch[0], "labels": batch[1]}


def run_timm(method: str, cfg: Config, work: Work) -> float:
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_loader

    dataset = Images(_n(cfg, cfg.batch), cfg.image)
    model = MLP(3 * cfg.image * cfg.image, cfg.hidden).to(cfg.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = Clock(cfg)
    common = {"input_size": (3, cfg.image, cfg.image), "batch_size": cfg.batch, "is_training": False,
              "num_workers": cfg.workers, "crop_pct": 1.0, "persistent_workers": False}
    if method == "own":
        loader = create_loader(dataset, use_prefetcher=True, device=cfg.device, pin_memory=cfg.cuda, **common)
        _loop(loader, model, opt, clock)
    elif method == "gpufeed":
        loader = create_loader(dataset, use_prefetcher=False, **common)
        with CudaPrefetcher(loader, device=cfg.device) as batches:
            _loop(batches, model, opt, clock)
    else:  # gpufeed_uint8: the uint8 DataLoader inside timm's PrefetchLoader, normalized on the device
        inner = create_loader(dataset, use_prefetcher=True, device=cfg.device, **common).loader
        mean = torch.tensor(IMAGENET_DEFAULT_MEAN, device=cfg.device).view(1, 3, 1, 1) * 255
        std = torch.tensor(IMAGENET_DEFAULT_STD, device=cfg.device).view(1, 3, 1, 1) * 255

        def normalize(batch: Any) -> Any:
            x, y = batch
            return (x.float() - mean) / std, y

        with CudaPrefetcher(inner, device=cfg.device, transform=normalize) as batches:
            _loop(batches, model, opt, clock)
    return clock.steps_per_s()


RUNNERS: dict[str, Callable[[str, Config, Work], float]] = {
    "accelerate": run_accelerate, "lightning": run_lightning, "lightning_dm": run_lightning_dm,
    "hf_trainer": run_hf_trainer, "timm": run_timm, "torchtitan": run_torchtitan}


def run_trainer(trainer: str, cfg: Config, work: Work) -> list[dict[str, Any]]:
    """The trainer's rows for ``work``: its methods interleaved, a round of each in turn, so that a
    machine's drift falls on every method alike."""
    rates: dict[str, list[float]] = {m: [] for m in METHODS[trainer]}
    errors: dict[str, str] = {}
    for _ in range(cfg.rounds):
        for method in rates:
            if method in errors:
                continue
            try:
                rates[method].append(RUNNERS[trainer](method, cfg, work))
            except ImportError as e:
                errors[method] = f"not installed: {e}"
            except Exception as e:  # a row that fails is reported, the others still run
                traceback.print_exc()
                errors[method] = f"{type(e).__name__}: {e}"
    rows = []
    for method, got in rates.items():
        row: dict[str, Any] = {"trainer": trainer, "method": method, "loop": work.name}
        if method in errors:
            row["error"] = errors[method]
        else:
            row.update(steps_per_s=statistics.median(got), min=min(got), max=max(got), rounds=got)
        rows.append(row)
    return rows


def run(cfg: Config) -> dict[str, Any]:
    rows = []
    for work in works(cfg):
        for trainer in cfg.trainers:
            for row in run_trainer(trainer, cfg, work):
                rows.append(row)
                print(_progress(row), flush=True)
    add_vs_own(rows)
    return {
        **run_info(cfg.device, cfg.smoke),
        "config": {"features": cfg.features, "hidden": cfg.hidden, "batch": cfg.batch, "image": cfg.image,
                   "workers": cfg.workers, "warmup": cfg.warmup, "steps": cfg.steps, "rounds": cfg.rounds,
                   "batch_bytes": cfg.batch * cfg.features * 4, "loops": list(cfg.loops)},
        "versions": _versions(),
        "rows": rows,
    }


def add_vs_own(rows: list[dict[str, Any]]) -> None:
    """Each row's ratio to its trainer's own row (same loop): ``vs_own``, of the medians, and
    ``vs_own_paired``, round by round against the own row's window of the same round, where the drift
    between rounds cancels out (rows without an error ran every round)."""
    own = {(r["loop"], r["trainer"]): r for r in rows if r["method"] == "own" and "error" not in r}
    for r in rows:
        mine = own.get((r["loop"], r["trainer"]))
        if "error" not in r and mine is not None:
            r["vs_own"] = r["steps_per_s"] / mine["steps_per_s"]
            r["vs_own_paired"] = paired(r, mine)


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("accelerate", "lightning", "transformers", "timm"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _progress(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"  {row['trainer']:>10} {row['method']:>13}  ERROR {row['error']}"
    return (f"  {row['trainer']:>10} {row['method']:>13} {row['steps_per_s']:9.2f} steps/s "
            f"(min {row['min']:.2f}, max {row['max']:.2f})")


def markdown(doc: dict[str, Any]) -> str:
    c = doc["config"]
    lines = [
        f"# Trainers' own transfer vs gpufeed: {doc['card']}", "",
        f"torch {doc['torch']}; "
        + (f"the loops benchmark's steps ({', '.join(c['loops'])}; bench_loops.py), " if c.get("loops") else
           f"an MLP over float32 rows ({c['features']} floats, batch {c['batch']}: "
           f"{c['batch_bytes'] / 2**20:.1f} MiB), timm over {c['image']} px images; ")
        + f"{c['workers']} workers; "
        f"{c['warmup']} warm-up + {c['steps']} timed steps, median of {c['rounds']} interleaved rounds."
        + (" Smoke run: sizes too small to mean anything." if doc["smoke"] else ""), "",
        "| trainer | method | steps/s | min | max | vs own | vs own, round by round (range) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    if "processes" in doc:
        lines[2] += f" Under accelerate launch: {doc['processes']} processes, each timing its own shard."
    for r in doc["rows"]:
        trainer = f"{r['trainer']} (rank {r['rank']})" if "rank" in r else r["trainer"]
        if doc["config"].get("loops"):
            trainer = f"{r['loop']}: {trainer}"
        if "error" in r:
            error = r["error"].replace("|", "\\|")  # (a bar would end the cell)
            lines.append(f"| {trainer} | {r['method']} | error: {error} | | | | |")
        else:
            p = r.get("vs_own_paired")
            cell = (f"{p['median']:.2f}x ({p['min']:.2f}-{p['max']:.2f})" if p and r["method"] != "own"
                    else "")
            lines.append(f"| {trainer} | {r['method']} | {r['steps_per_s']:.2f} | {r['min']:.2f} | "
                         f"{r['max']:.2f} | {r.get('vs_own', float('nan')):.2f}x | {cell} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if WORLD > 1:  # under accelerate launch: each process on its own device, the rows gathered on rank 0
        if cfg.trainers != ("accelerate",):
            raise SystemExit("under accelerate launch only the accelerate rows run: --trainers accelerate")
        if cfg.cuda:
            cfg.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(cfg.device)
    cfg.out.mkdir(parents=True, exist_ok=True)
    print(f"trainers benchmark on {cfg.device} ({card_name(cfg.device)}), torch {torch.__version__}",
          flush=True)
    with contextlib.suppress(Exception):
        torch.backends.cudnn.benchmark = cfg.cuda
    doc = run(cfg)
    name = "trainers-loops" if cfg.loops else "trainers"
    if WORLD > 1:
        doc, name = _gathered(doc), f"{name}-launch-{WORLD}x"
        if doc is None:
            return 0
    md = markdown(doc)
    stem = save_results(cfg.out, name, doc, md)
    print(f"\n{md}\nwrote {stem}.json and {stem}.md", flush=True)
    return 0 if all("error" not in r for r in doc["rows"]) else 1


def _gathered(doc: dict[str, Any]) -> dict[str, Any] | None:
    """On rank 0, ``doc`` with every process's rows (each with its ``rank``); None on the others."""
    import torch.distributed as dist

    parts: list[Any] = [None] * WORLD
    dist.all_gather_object(parts, doc["rows"])
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()  # (every process leaves the group together: none exits while it is used)
    if rank != 0:
        return None
    doc["rows"] = [{**row, "rank": rank} for rank, rows in enumerate(parts) for row in rows]
    doc["processes"] = WORLD
    return doc


if __name__ == "__main__":
    sys.exit(main())
