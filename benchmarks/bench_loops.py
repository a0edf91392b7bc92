"""Realistic training loops, each fed every way users feed a GPU, every peer and gpufeed in one run.

Run it on the GPU machine, in one process (on an H200, each step takes about 3 to 5.5 minutes with every
feed: mlp 270 s, token 175 s, cnn 290 s, resnet 330 s; results are saved after each feed)::

    python3 benchmarks/bench_loops.py --out benchmarks/results   # loops-<card>.{json,md,png}
    python3 benchmarks/bench_loops.py --steps mlp,token --feeds 'dl2-*' --methods to,gpufeed
    python3 benchmarks/bench_loops.py --smoke                     # tiny, on the CPU, seconds (CI)

What it measures: training steps per second (forward, loss, backward, Adam) after a warm-up, for

* steps (``--steps``): ``mlp`` (4 layers of width 1024, float32 batches of 512 x 256 and int64 labels,
  0.5 MiB), ``token`` (embedding + 2 transformer encoder layers (d 256) + LM head, bf16 autocast on CUDA,
  int64 batches of 8 x 2048 tokens, 128 KiB), ``cnn`` (4 conv-BN-ReLU blocks, float32 64 x 3 x 128 x 128
  images + labels, 12 MiB), ``resnet`` (torchvision's ResNet-18, 512 px, batch 64 float32, 192 MiB;
  skipped, with a note, where torchvision is absent);
* feeds (``--feeds``, fnmatch patterns): ``list-pageable`` and ``list-pinned`` (a plain list of distinct
  host batches, ``--pool-mib`` of them, cycled), and ``dl{W}-pin{0,1}-pers{0,1}``: a DataLoader with W
  workers (``--workers``, 2 and 8), ``pin_memory`` and ``persistent_workers`` off or on, shuffled, over a
  TensorDataset-like map dataset (item i: row i % rows of a preallocated bank, collated by
  ``default_collate``; ResNet's bank is one batch of 64 images, so its workers keep up); and, where
  torchdata >= 0.10 is installed, ``nodes{W}``: a torchdata ``nodes`` pipeline over the same data set
  (``IterableWrapper`` over its shuffled indices -> ``ParallelMapper``, W threads, fetching samples ->
  ``Batcher`` -> ``Mapper(default_collate)``), made iterable by a ``Loader``;
* methods (``--methods``): ``to`` (``.to(device)``), ``pin_nb`` (``pin_memory()`` +
  ``.to(non_blocking=True)``; on a ``pin_memory=True`` DataLoader just the non-blocking copy, called
  ``dl_pin_nb``), ``torchtnt`` (torchtnt's ``CudaDataPrefetcher``: the next batch copied one ahead on a
  side stream, ``record_stream``), ``spdl`` (SPDL's transfer thread: pins and copies on its own stream,
  2 batches queued), ``gpufeed`` (``for b in CudaPrefetcher(loader)``, one prefetcher per (step, feed),
  iterated again every round as across epochs) and ``ideal`` (feed ``resident``: one batch already in
  VRAM, reused; always measured: first in each step, then a window in every round of every feed). The
  ``nodes`` feeds run their own methods, each ending the pipeline as torchdata's docs do: ``nodes_pin_nb``
  (``PinMemory`` -> ``Prefetcher``, then ``.to(non_blocking=True)`` after the ``Loader``) and ``nodes_to``
  (``Prefetcher``, then ``.to()``); gpufeed's row is ``todevice_pc``, docs/nodes.md's recipe (the batches
  collated by ``gpufeed.nodes.pinned_collate`` straight into pinned memory -> ``Prefetcher`` -> gpufeed's
  ``ToDevice``: collation stays off the loop's thread, as in the other two), one ``Loader`` per (step,
  feed) iterated again every round; beside them ``todevice`` (the same over ``default_collate``: ``ToDevice``
  pins on the loop's thread) and ``pin_todevice`` (``PinMemory`` -> ``Prefetcher`` -> ``ToDevice``: the
  pinning on ``PinMemory``'s thread), shown but neither a peer nor gpufeed's row.

Timing: the ideal's windows last ``--seconds`` (at least the step's minimum of steps, 20; ResNet's 6); its
median rate sizes every other window: an epoch of ``warm-up + N`` batches, ``N = --seconds x ideal rate``
(at most 2000), so that each epoch ends as a real one does (persistent workers and gpufeed see whole epochs);
the window of a method under half the ideal's rate is cut after 2 x ``--seconds``. The warm-up
(``--warmup`` steps, at least a tenth of N) is untimed; a device synchronize starts and ends each timed
window. ``--rounds`` rounds (3) run round-robin over the methods inside each (step, feed), each round
starting with the next method, so machine drift hits every method alike; each row records the median
steps/s, and min and max. Each round starts with a window of the ideal, so the ideal row (the median of
all its windows) spans the same minutes as the rows it is compared with (on a drifting machine the
token step's list feeds once read 1.3x an ideal measured only at the start). Without CUDA (``--smoke``)
gpufeed runs its CPU path and the peers' streams degrade to plain loops.

Results: ``loops-<card>.json`` (``rows``: step, feed, method, steps_per_s, min, max, ...; gpufeed's rows
also ``paired``, its ratio to the best peer round by round, steadier where the machine drifts, with an
interval that holds the median of such ratios at 90% or more; ``CudaPrefetcher``'s rows ``loop_stream_share``
too, the share of its batches copied on the loop's stream rather than the copy stream), ``.md`` (a table per
step, then the targets: gpufeed (``todevice_pc`` in the nodes feeds) >= 0.98x the best peer in every feed,
a miss whose interval reaches 0.98 said unresolved by the rounds; >= 0.95x the ideal wherever a peer
reaches 0.9x of it; ResNet >= 0.97x the ideal with 8 workers) and ``.png`` (each row's steps/s over the
ideal's). On CUDA the ideal's row also has ``gpu_us``, the step's time on the GPU alone (steps queued
behind a sleep kernel): set against the ideal's period, it says whether the step is bound by the GPU or by
the thread that launches it, where the copy's time on the GPU is free and what a method costs that thread
decides.
"""

from __future__ import annotations

import fnmatch
import gc
import itertools
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common and bench_grid, also when loaded by a test
from _common import card_name, paired, parser, pick_device, run_info, save_results, targets_table
from bench_grid import SpdlTransfer, TntPrefetcher, free_host_cache, to_device

try:
    import gpufeed  # noqa: F401  (installed; else the checkout's src/ below)
except ImportError:  # a checkout without an install: run the working tree's src/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gpufeed import CudaPrefetcher

MiB = 1 << 20
STEPS = ("mlp", "token", "cnn", "resnet")
METHODS = ("to", "pin_nb", "dl_pin_nb", "torchtnt", "spdl", "nodes_to", "nodes_pin_nb", "gpufeed", "todevice",
           "pin_todevice", "todevice_pc", "ideal")
PEERS = ("to", "pin_nb", "dl_pin_nb", "torchtnt", "spdl", "nodes_to", "nodes_pin_nb")
# gpufeed's row of a feed: CudaPrefetcher, or in a nodes pipeline docs/nodes.md's recipe (ToDevice over
# batches collated by pinned_collate)
GPUFEED = ("gpufeed", "todevice_pc")
# the methods of the nodes feeds (and only theirs); todevice (ToDevice over default_collate) and pin_todevice
# (PinMemory before ToDevice) are shown beside them: not peers, not gpufeed's row
NODES_METHODS = ("nodes_to", "nodes_pin_nb", "todevice", "pin_todevice", "todevice_pc")
_END = object()
SLOW_CAP = 2.0  # a window is cut after this many --seconds (a method under half the ideal's rate)
MAX_STEPS = 2000  # timed steps an epoch at most
FULL = {"rounds": 3, "seconds": 0.6, "warmup": 3, "workers": "2,8", "pool_mib": 128.0}
SMOKE = {"rounds": 1, "seconds": 0.02, "warmup": 1, "workers": "1", "pool_mib": 1.0}


# -- configuration -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    device: torch.device
    steps: tuple[str, ...]
    feeds: tuple[str, ...]  # fnmatch patterns
    methods: tuple[str, ...]
    workers: tuple[int, ...]
    rounds: int
    seconds: float
    warmup: int
    pool_bytes: int
    out: Path
    smoke: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def parse_args(argv: list[str] | None) -> Config:
    p = parser(__doc__, "loops", "tiny models and batches, 1 worker, 1 short round, 1 CPU thread; CPU by "
                                 "default: checks it runs")
    p.add_argument("--steps", default=",".join(STEPS), help=f"training steps (default {','.join(STEPS)})")
    p.add_argument("--feeds", default="*",
                   help="comma-separated feed names or fnmatch patterns, e.g. 'list-*,dl8-pin1-*' "
                        "(default: all)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (default: all; ideal always runs)")
    p.add_argument("--workers", help=f"DataLoader worker counts of the dl feeds (default {FULL['workers']})")
    p.add_argument("--rounds", type=int,
                   help=f"interleaved rounds per row, median kept (default {FULL['rounds']})")
    p.add_argument("--seconds", type=float,
                   help=f"timed seconds of a window at the ideal's rate (default {FULL['seconds']:g})")
    p.add_argument("--warmup", type=int,
                   help=f"untimed steps before a window, at least (default {FULL['warmup']})")
    p.add_argument("--pool-mib", type=float,
                   help=f"host bytes of distinct samples per step, MiB (default {FULL['pool_mib']:g})")
    a = p.parse_args(argv)
    base = SMOKE if a.smoke else FULL
    pick = {k: base[k] if getattr(a, k) is None else getattr(a, k) for k in base}
    for k in ("rounds", "seconds", "pool_mib"):
        if pick[k] <= 0:
            raise SystemExit(f"--{k.replace('_', '-')} must be > 0, got {pick[k]}")
    if pick["warmup"] < 1:
        raise SystemExit(f"--warmup must be >= 1 (the first batch is never timed), got {pick['warmup']}")
    workers = tuple(int(w) for w in _split(str(pick["workers"])))
    if not workers or min(workers) < 1:
        raise SystemExit(f"--workers: comma-separated counts >= 1, got {pick['workers']!r}")
    methods = {*_subset("methods", a.methods, METHODS), "ideal"}
    feeds = tuple(_split(a.feeds)) or ("*",)
    names = feed_table(workers)
    unknown = [pat for pat in feeds if not any(fnmatch.fnmatchcase(n, pat) for n in names)]
    if unknown:
        raise SystemExit(f"--feeds: {','.join(unknown)} matches none of {','.join(names)}")
    return Config(device=pick_device(a.device, a.smoke), steps=_subset("steps", a.steps, STEPS),
                  feeds=feeds, methods=tuple(m for m in METHODS if m in methods),
                  workers=workers, rounds=pick["rounds"], seconds=pick["seconds"], warmup=pick["warmup"],
                  pool_bytes=int(pick["pool_mib"] * MiB), out=a.out, smoke=a.smoke)


def _split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _subset(name: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    picked = _split(text)
    if not picked or set(picked) - set(allowed):
        raise SystemExit(f"--{name}: a comma-separated subset of {','.join(allowed)}, got {text!r}")
    return tuple(x for x in allowed if x in picked)


# -- the training steps ------------------------------------------------------------------------------------


def mlp(inputs: int, width: int, classes: int) -> nn.Module:
    """4 linear layers (3 hidden of ``width``), ReLU between."""
    return nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))


class TokenModel(nn.Module):
    """Token and position embeddings, ``layers`` transformer encoder layers, a linear LM head."""

    def __init__(self, vocab: int, seq: int, d: int, layers: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.encoder(self.embed(tokens) + self.pos(pos)))


def cnn(classes: int, width: int) -> nn.Module:
    """4 stride-2 conv + BatchNorm + ReLU blocks, global pooling, a linear classifier."""
    chans = [3, width, 2 * width, 4 * width, 8 * width]
    blocks: list[nn.Module] = []
    for c_in, c_out in itertools.pairwise(chans):
        blocks += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1), nn.BatchNorm2d(c_out),
                   nn.ReLU(inplace=True)]
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(chans[-1], classes))


def resnet18(classes: int) -> nn.Module:
    from torchvision.models import resnet18 as tv_resnet18  # the step is skipped where this fails

    return tv_resnet18(num_classes=classes)


def classify(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def next_token(model: nn.Module, batch: Any) -> torch.Tensor:
    """Next-token cross-entropy, under bf16 autocast on CUDA as language models train (flash attention):
    in float32 the attention over 2048 tokens alone would make the step 10x dearer than its input."""
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=batch.is_cuda):
        logits = model(batch)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@dataclass(frozen=True)
class StepSpec:
    """One training step and its data: a batch is ``[samples, labels]`` (``labels`` classes), or the
    int64 samples alone (``labels == 0``, values below ``vocab``)."""

    name: str
    model: str
    batch: int
    sample: tuple[int, ...]
    dtype: torch.dtype
    labels: int
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    min_steps: int  # least timed steps a window
    vocab: int = 0
    bank_rows: int | None = None  # samples in the bank (None: --pool-mib of them)

    @property
    def sample_bytes(self) -> int:
        return math.prod(self.sample) * self.dtype.itemsize + (8 if self.labels else 0)

    @property
    def what(self) -> str:
        shape = " x ".join(map(str, (self.batch, *self.sample)))
        size = self.batch * self.sample_bytes
        size_text = f"{size / MiB:.3g} MiB" if size >= MiB else f"{size / 1024:.3g} KiB"
        return (f"{self.model}; {str(self.dtype).removeprefix('torch.')} batches of {shape}"
                + (" + int64 labels" if self.labels else "") + f" ({size_text})")


def step_specs(smoke: bool) -> dict[str, StepSpec]:
    """The four steps, full size or tiny (``--smoke``: the same code at sizes a CPU runs in seconds)."""
    s = smoke
    features, width = (16, 32) if s else (256, 1024)
    vocab, seq, d = (128, 32, 32) if s else (4096, 2048, 256)
    side, px = (16, 32) if s else (128, 512)
    few = 1 if s else 20
    f32, i64 = torch.float32, torch.int64
    return {
        "mlp": StepSpec("mlp", f"MLP, 4 layers of width {width}", batch=32 if s else 512, sample=(features,),
                        dtype=f32, labels=10, build=partial(mlp, features, width, 10), loss=classify,
                        min_steps=few),
        "token": StepSpec("token", f"embedding + 2 encoder layers (d {d}) + LM head, bf16 autocast on CUDA",
                          batch=2 if s else 8, sample=(seq,), dtype=i64, labels=0,
                          build=partial(TokenModel, vocab, seq, d, 2), loss=next_token, min_steps=few,
                          vocab=vocab),
        "cnn": StepSpec("cnn", "4 conv-BN-ReLU blocks + linear", batch=4 if s else 64, sample=(3, side, side),
                        dtype=f32, labels=100, build=partial(cnn, 100, 8 if s else 32), loss=classify,
                        min_steps=few),
        "resnet": StepSpec("resnet", "torchvision ResNet-18", batch=2 if s else 64, sample=(3, px, px),
                           dtype=f32, labels=1000, build=partial(resnet18, 1000), loss=classify,
                           min_steps=1 if s else 6, bank_rows=2 if s else 64),
    }


class Trainer:
    """One step: the loss, backward, Adam; the loss stays on the device."""

    def __init__(self, spec: StepSpec, device: torch.device) -> None:
        torch.manual_seed(0)
        self.spec = spec
        self.model = spec.build().to(device).train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def __call__(self, batch: Any) -> torch.Tensor:
        loss = self.spec.loss(self.model, batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.detach()


# -- the data and the feeds --------------------------------------------------------------------------------


class BankDataset(Dataset):
    """TensorDataset-like: item ``i`` is row ``i % rows`` of each bank tensor (views), for any length."""

    def __init__(self, bank: list[torch.Tensor], length: int) -> None:
        self.bank, self.rows, self.length = bank, len(bank[0]), length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        j = i % self.rows
        return [t[j] for t in self.bank] if len(self.bank) > 1 else self.bank[0][j]


def make_bank(spec: StepSpec, rows: int) -> list[torch.Tensor]:
    """``rows`` random samples of ``spec`` (and their labels, where it has them), made once: the bank a
    step's batches are cut from."""
    g = torch.Generator().manual_seed(0)
    if spec.dtype.is_floating_point:
        bank = [torch.rand(rows, *spec.sample, generator=g, dtype=spec.dtype)]
    else:
        bank = [torch.randint(0, spec.vocab, (rows, *spec.sample), generator=g, dtype=spec.dtype)]
    if spec.labels:
        bank.append(torch.randint(0, spec.labels, (rows,), generator=g))
    return bank


class StepData:
    """One step's host data: the bank (made before any worker forks) and distinct batches for the lists.

    ``warm`` and ``epoch`` (batches an epoch: warm-up + timed) are set once the ideal sized the windows;
    ``resident`` is the ideal's batch, in VRAM."""

    def __init__(self, spec: StepSpec, cfg: Config) -> None:
        self.bank = make_bank(spec, spec.bank_rows or max(spec.batch, cfg.pool_bytes // spec.sample_bytes))
        self.spec, self.cuda, self.warm, self.epoch = spec, cfg.cuda, cfg.warmup, 0
        n = max(2, cfg.pool_bytes // (spec.batch * spec.sample_bytes))
        self.pool = [self._batch(k) for k in range(n)]
        self._pinned: list[Any] | None = None
        self.resident: Any = None

    def _batch(self, k: int) -> Any:
        rows = (torch.arange(self.spec.batch) + k * self.spec.batch) % len(self.bank[0])
        parts = [t[rows] for t in self.bank]  # a new tensor each, as default_collate's
        return parts if len(parts) > 1 else parts[0]

    def listed(self, pinned: bool) -> list[Any]:
        """An epoch as a plain list cycling the distinct batches (pinned ones where CUDA is)."""
        pool = self.pool
        if pinned and self.cuda:
            if self._pinned is None:
                self._pinned = [to_device(b, torch.device("cpu"), pin=True) for b in self.pool]
            pool = self._pinned
        return [pool[k % len(pool)] for k in range(self.epoch)]

    def dataset(self) -> BankDataset:
        return BankDataset(self.bank, self.epoch * self.spec.batch)

    def drop_pinned(self) -> None:
        self._pinned = None


def dataloader(data: StepData, workers: int, pin: bool, persistent: bool) -> DataLoader:
    """A shuffled DataLoader over the bank; ``default_collate``; forked workers share the bank."""
    ctx = "fork" if sys.platform.startswith("linux") else None
    return DataLoader(data.dataset(), batch_size=data.spec.batch, shuffle=True, num_workers=workers,
                      pin_memory=pin and data.cuda, persistent_workers=persistent,
                      multiprocessing_context=ctx)


@dataclass(frozen=True)
class Feed:
    """How one feed makes a fresh source of a step's batches (one per method)."""

    make: Callable[[StepData], Any]  # an iterable of batches; for a nodes feed, a function making its head
    loader_pins: bool = False  # its batches come pinned from a pin_memory=True loader: pin_nb is dl_pin_nb
    nodes: bool = False  # a torchdata nodes pipeline: its own methods (NODES_METHODS) end it


def feed_table(workers: tuple[int, ...]) -> dict[str, Feed]:
    """Every feed by name. A later feed is one more entry, for example::

        feeds["nodes8"] = Feed(lambda d: torchdata_nodes_loader(d.dataset(), d.spec.batch, workers=8))
        feeds["accel8"] = Feed(lambda d: accelerator.prepare_data_loader(dataloader(d, 8, True, True)),
                               loader_pins=True)
    """
    feeds = {"list-pageable": Feed(partial(StepData.listed, pinned=False)),
             "list-pinned": Feed(partial(StepData.listed, pinned=True))}
    for w, pin, pers in itertools.product(workers, (0, 1), (0, 1)):
        feeds[f"dl{w}-pin{pin}-pers{pers}"] = Feed(
            partial(dataloader, workers=w, pin=bool(pin), persistent=bool(pers)), loader_pins=bool(pin))
    if _has_torchdata_nodes():
        for w in workers:
            feeds[f"nodes{w}"] = Feed(partial(nodes_head, workers=w), nodes=True)
    return feeds


def nodes_head(data: StepData, workers: int) -> Callable[..., Any]:
    """A function making the head of a torchdata nodes pipeline over the step's data set: its shuffled
    indices -> ``ParallelMapper`` (``workers`` threads fetch the samples) -> ``Batcher`` -> collate (by the
    function it is given, ``default_collate`` when none). Each method ends it its own way (``Runner``)."""
    from torchdata import nodes

    dataset = data.dataset()
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()

    def head(collate: Callable[[Any], Any] = default_collate) -> Any:
        node = nodes.ParallelMapper(nodes.IterableWrapper(order), dataset.__getitem__, num_workers=workers,
                                    method="thread")
        node = nodes.Batcher(node, batch_size=data.spec.batch, drop_last=True)
        return nodes.Mapper(node, collate)

    return head


def methods_for(feed: Feed, cfg: Config) -> list[str]:
    """The methods a feed runs: ``dl_pin_nb`` replaces ``pin_nb`` where the loader pins; a nodes feed runs
    the nodes methods, and only it does."""
    if feed.nodes:
        return [m for m in cfg.methods if m in NODES_METHODS]
    skip = "pin_nb" if feed.loader_pins else "dl_pin_nb"
    return [m for m in cfg.methods if m not in ("ideal", skip, *NODES_METHODS)]


# -- the methods -------------------------------------------------------------------------------------------


class Runner:
    """One method over one feed's source: made once per (step, feed), one epoch per round."""

    def __init__(self, method: str, source: Any, device: torch.device) -> None:
        self.method, self.source, self.device = method, source, device
        self.keep: Any = None  # what a user makes once and iterates every epoch
        if method == "gpufeed":
            self.keep = CudaPrefetcher(source, device=device)
        elif method == "spdl":
            self.keep = SpdlTransfer(source, device, pin=True)
        elif method in NODES_METHODS:
            self.keep = nodes_loader(method, source, device)

    def epoch(self) -> Iterator[Any]:
        dev, src, cuda = self.device, self.source, self.device.type == "cuda"
        if self.method == "to":
            return (to_device(b, dev) for b in src)
        if self.method == "pin_nb":  # (no pinned memory without CUDA)
            return (to_device(b, dev, non_blocking=True, pin=cuda) for b in src)
        if self.method == "dl_pin_nb":
            return (to_device(b, dev, non_blocking=True) for b in src)
        if self.method == "torchtnt":  # it makes a new side stream at every iter(), as torchtnt's does
            return iter(TntPrefetcher(src, dev, num_prefetch_batches=1))
        if self.method == "nodes_to":
            return (to_device(b, dev) for b in self.keep)
        if self.method == "nodes_pin_nb":
            return (to_device(b, dev, non_blocking=True) for b in self.keep)
        return iter(self.keep)

    def end(self, it: Iterator[Any]) -> None:
        """Stop what an epoch cut short still runs (a transfer thread, a generator's loader iterator)."""
        if self.method == "spdl":
            self.keep.close()
        close = getattr(it, "close", None)
        if self.method != "gpufeed" and close is not None:
            close()

    def loop_stream_share(self) -> float | None:
        """The share of gpufeed's batches copied on the loop's stream over its rounds (None for others)."""
        if self.method != "gpufeed" or not self.keep.stats.batches:
            return None
        return self.keep.stats.loop_stream_batches / self.keep.stats.batches

    def close(self) -> None:
        if self.method in NODES_METHODS:  # (a Loader has no close: its nodes' threads end once collected)
            self.keep = None
        elif self.keep is not None:
            self.keep.close()


def nodes_loader(method: str, make_head: Callable[..., Any], device: torch.device) -> Any:
    """The ``Loader`` of a nodes method: the pipeline's head ended as torchdata's docs end one (a
    ``Prefetcher`` last, after ``PinMemory`` where the loop copies with ``non_blocking``), or by
    ``ToDevice`` behind the same ``Prefetcher``."""
    from torchdata import nodes

    from gpufeed.nodes import pinned_collate

    head = make_head(pinned_collate) if method == "todevice_pc" else make_head()
    if method in ("nodes_pin_nb", "pin_todevice") and device.type == "cuda":  # (PinMemory needs CUDA)
        head = nodes.PinMemory(head)
    node = nodes.Prefetcher(head, prefetch_factor=2)
    if method in ("todevice", "pin_todevice", "todevice_pc"):
        from gpufeed.nodes import ToDevice

        node = ToDevice(node, device=device)
    return nodes.Loader(node)


# -- timing ------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_window(trainer: Trainer, it: Iterator[Any], warm: int, min_steps: int, stop_s: float,
                device: torch.device) -> tuple[float, float]:
    """Steps/s of the steps after ``warm`` untimed ones, to the epoch's end or the first step past
    ``stop_s`` seconds (once ``min_steps`` ran), a device synchronize at both ends; and the loop thread's
    time in ``next()`` a timed step, in microseconds (what a method costs the thread that launches the
    step: steadier than steps/s where the step is bound by that thread)."""
    loss = None
    for _ in range(warm):
        loss = trainer(next(it))
    sync(device)
    t0 = time.perf_counter()
    n = 0
    inside = 0.0
    # next(), not a for loop: iter() of the peers' prefetchers (as of torchtnt's) starts a new epoch
    while True:
        t = time.perf_counter()
        batch = next(it, _END)
        inside += time.perf_counter() - t
        if batch is _END:
            break
        loss = trainer(batch)
        n += 1
        if n >= min_steps and time.perf_counter() - t0 > stop_s:
            break
    sync(device)
    seconds = time.perf_counter() - t0
    if n == 0:
        raise RuntimeError("the epoch ended during the warm-up")
    if loss is not None and not math.isfinite(float(loss)):
        raise RuntimeError(f"the loss is {float(loss)}")
    return n / seconds, inside / n * 1e6


def summarize(rates: list[float]) -> dict[str, float]:
    return {"steps_per_s": statistics.median(rates), "min": min(rates), "max": max(rates)}


def measure_ideal(trainer: Trainer, data: StepData, cfg: Config) -> dict[str, Any]:
    """The step over one batch resident in VRAM, ``--rounds`` windows of ``--seconds``; sizes the epochs.
    More of its windows run in every feed's rounds (:func:`run_feed`): the ideal row is all of them."""
    data.resident = to_device(data.pool[0], cfg.device)
    spec = data.spec
    rates = [time_window(trainer, itertools.repeat(data.resident), cfg.warmup, spec.min_steps, cfg.seconds,
                         cfg.device)[0] for _ in range(cfg.rounds)]
    row = {"step": spec.name, "feed": "resident", "method": "ideal", **summarize(rates), "rounds": rates}
    if cfg.device.type == "cuda":
        row["gpu_us"] = gpu_step_us(trainer, data.resident, max(10, spec.min_steps), 1 / row["steps_per_s"])
    timed = min(MAX_STEPS, max(spec.min_steps, round(cfg.seconds * row["steps_per_s"])))
    data.warm = max(cfg.warmup, timed // 10)
    data.epoch = data.warm + timed
    row["epoch_batches"] = data.epoch
    return row


def gpu_step_us(trainer: Trainer, batch: Any, steps: int, period_s: float) -> float | None:
    """The step's time on the GPU alone, in microseconds: ``steps`` steps queued behind a sleep kernel that
    outlasts their launching, timed with events. Against the ideal's period it says whether the step is
    bound by the thread that launches it (the GPU idles part of each step) or by the GPU. None where the
    sleep ran out before the steps were queued (the GPU may have waited for them)."""
    probe = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    probe[0].record()
    torch.cuda._sleep(1 << 20)
    probe[1].record()
    torch.cuda.synchronize()
    cycles_a_s = (1 << 20) / (probe[0].elapsed_time(probe[1]) / 1e3)
    torch.cuda._sleep(int(cycles_a_s * (2 * steps * period_s + 0.01)))
    probe[2].record()
    for _ in range(steps):
        trainer(batch)
    probe[3].record()
    caught_up = probe[2].query()
    torch.cuda.synchronize()
    return None if caught_up else probe[2].elapsed_time(probe[3]) / steps * 1e3


def run_feed(name: str, feed: Feed, trainer: Trainer, data: StepData, cfg: Config,
             ideal: dict[str, Any]) -> list[dict[str, Any]]:
    """Every method over one feed, ``--rounds`` rounds round-robin; a row per method (or its error). Each
    round runs a window of the ideal too, added to ``ideal``'s: the machine's speed drifts over a run
    (clocks, other tenants), and a ratio to the ideal compares windows of the same minutes."""
    methods = methods_for(feed, cfg)
    runners: dict[str, Runner] = {}
    rates: dict[str, list[float]] = {m: [] for m in methods}
    inside: dict[str, list[float]] = {m: [] for m in methods}  # the loop thread's us in next() a step
    errors: dict[str, str] = {}
    inline: dict[str, float] = {}  # gpufeed's share of batches on the loop's stream
    try:
        for r in range(cfg.rounds):
            ideal["rounds"].append(time_window(trainer, itertools.repeat(data.resident), data.warm,
                                               data.spec.min_steps, cfg.seconds, cfg.device)[0])
            for m in methods[r % len(methods):] + methods[:r % len(methods)]:
                if m in errors:
                    continue
                try:
                    if m not in runners:
                        runners[m] = Runner(m, feed.make(data), cfg.device)
                    rate, next_us = _window(runners[m], trainer, data, cfg)
                    rates[m].append(rate)
                    inside[m].append(next_us)
                except Exception as exc:  # keep the other rows of a scarce GPU run; the row says what failed
                    traceback.print_exc()
                    errors[m] = f"{type(exc).__name__}: {exc}"
    finally:
        for m, runner in runners.items():
            share = runner.loop_stream_share()
            if share is not None:
                inline[m] = share
            try:
                runner.close()
            except Exception:
                traceback.print_exc()
        runners.clear()
        gc.collect()  # the loaders' persistent workers shut down here
    return [{"step": data.spec.name, "feed": name, "method": m,
             **({"error": errors[m]} if m in errors else {**summarize(rates[m]), "rounds": rates[m],
                                                         "next_us": statistics.median(inside[m]),
                                                         **({"loop_stream_share": inline[m]}
                                                            if m in inline else {})})}
            for m in methods]


def _window(runner: Runner, trainer: Trainer, data: StepData, cfg: Config) -> tuple[float, float]:
    it = runner.epoch()
    try:
        return time_window(trainer, it, data.warm, data.spec.min_steps, SLOW_CAP * cfg.seconds, cfg.device)
    finally:
        runner.end(it)


# -- the run -----------------------------------------------------------------------------------------------


def run_step(spec: StepSpec, cfg: Config, log: Callable[[str], None]) -> Iterator[list[dict[str, Any]]]:
    """The ideal, then every selected feed; yields the step's rows so far after each feed (the same list,
    grown), so that a run cut short by a time limit keeps the feeds it finished."""
    trainer = Trainer(spec, cfg.device)
    data = StepData(spec, cfg)  # before any worker forks
    ideal = measure_ideal(trainer, data, cfg)
    log(f"{spec.name}: ideal {ideal['steps_per_s']:.1f} steps/s; epochs of {data.epoch} batches")
    rows = [ideal]
    for name, feed in feed_table(cfg.workers).items():
        if not any(fnmatch.fnmatchcase(name, pat) for pat in cfg.feeds):
            continue
        t0 = time.perf_counter()
        feed_rows = run_feed(name, feed, trainer, data, cfg, ideal)
        ideal.update(summarize(ideal["rounds"]))
        rows += feed_rows
        for row in rows[1:]:  # (against every window of the ideal so far)
            _ratios(row, ideal["steps_per_s"])
        for row in feed_rows:
            log(_progress(row))
        log(f"  {spec.name} {name}: {time.perf_counter() - t0:.1f} s")
        if name == "list-pinned":
            data.drop_pinned()
        yield rows
    log(f"{spec.name}: ideal over the whole run {ideal['steps_per_s']:.1f} steps/s "
        f"(min {ideal['min']:.1f}, max {ideal['max']:.1f})")
    del trainer, data
    free_host_cache()


def _ratios(row: dict[str, Any], ideal: float) -> None:
    if "error" not in row:
        row["of_ideal"] = row["steps_per_s"] / ideal


def _progress(row: dict[str, Any]) -> str:
    head = f"  {row['step']:>6} {row['feed']:>15} {row['method']:>9}"
    if "error" in row:
        return f"{head}  ERROR {row['error']}"
    return (f"{head} {row['steps_per_s']:9.1f} steps/s (min {row['min']:.1f}, max {row['max']:.1f})"
            f"  {row['of_ideal']:6.1%} of ideal")


def compare(rows: list[dict[str, Any]]) -> None:
    """Adds ``best_peer`` and ``vs_best_peer`` (its steps/s over the best peer's) to each gpufeed row, and
    ``paired``: round by round, its window over the best peer's window of the same round (the median,
    min and max of those ratios), where the machine's drift between rounds cancels out. Against the best
    peer, not the fastest of each round: where peers tie, the fastest window of several noisy ones runs
    ahead of each of them, and the ratio would favour the peers."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["step"], r["feed"]), []).append(r)
    for group in groups.values():
        peers = [r for r in group if r["method"] in PEERS and "error" not in r]
        best = max(peers, key=lambda r: r["steps_per_s"], default=None)
        for r in group:
            if r["method"] in GPUFEED and "error" not in r and best is not None:
                r["best_peer"], r["vs_best_peer"] = best["method"], r["steps_per_s"] / best["steps_per_s"]
                r["best_peer_of_ideal"] = best["of_ideal"]
                pair = paired(r, best)
                if pair is not None:
                    r["paired"] = pair


def run(cfg: Config, log: Callable[[str], None]) -> Iterator[dict[str, Any]]:
    """Every selected step; yields the results document after each feed, the whole run's last."""
    if cfg.cuda:
        torch.backends.cudnn.benchmark = True
    specs = step_specs(cfg.smoke)
    rows: list[dict[str, Any]] = []
    notes: list[str] = [] if cfg.cuda else [
        "no CUDA: list-pinned and the pin1 loaders hold pageable memory; gpufeed runs its CPU path, the "
        "peers' side streams are plain loops, and nodes_pin_nb has no PinMemory (it needs CUDA)"]
    t0 = time.perf_counter()
    for name in cfg.steps:
        if name == "resnet" and not _has_torchvision():
            notes.append("resnet skipped: torchvision is not importable here")
            log(notes[-1])
            continue
        done = list(rows)  # the earlier steps' rows
        try:
            for step_rows in run_step(specs[name], cfg, log):
                rows = done + step_rows
                yield _document(cfg, specs, rows, notes, time.perf_counter() - t0)
        except Exception as exc:  # keep the other steps of a scarce GPU run; the notes say what failed
            traceback.print_exc()
            notes.append(f"{name} failed: {type(exc).__name__}: {exc}")
            free_host_cache()
        log(f"{name} done at {time.perf_counter() - t0:.0f} s")
    yield _document(cfg, specs, rows, notes, time.perf_counter() - t0)


def _document(cfg: Config, specs: dict[str, StepSpec], rows: list[dict[str, Any]], notes: list[str],
              seconds: float) -> dict[str, Any]:
    """The results document of ``rows``: the run's settings, the rows compared, the targets checked."""
    rows = [dict(r) for r in rows]  # (compare adds keys: a row still growing its ideal is compared anew)
    compare(rows)
    doc = {**run_info(cfg.device, cfg.smoke),
           "config": {"steps": list(cfg.steps), "feeds": list(cfg.feeds), "methods": list(cfg.methods),
                      "workers": list(cfg.workers), "rounds": cfg.rounds, "seconds": cfg.seconds,
                      "warmup": cfg.warmup, "pool_bytes": cfg.pool_bytes, "slow_cap": SLOW_CAP,
                      "max_steps": MAX_STEPS,
                      "what": {n: specs[n].what for n in cfg.steps}},
           "seconds": seconds, "notes": list(notes), "rows": rows}
    doc["targets"] = check_targets(rows, max(cfg.workers))
    return doc


def _has_torchdata_nodes() -> bool:
    try:
        import torchdata.nodes  # noqa: F401
    except ImportError:
        return False
    return True


def _has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


# -- targets and reporting ---------------------------------------------------------------------------------


def check_targets(rows: list[dict[str, Any]], most_workers: int) -> list[dict[str, Any]]:
    """Per step: gpufeed >= 0.98x the best peer in every feed; >= 0.95x the ideal where a peer reaches
    0.9x of it; for ResNet, >= 0.97x the ideal in the feeds with the most workers."""
    targets = []
    for step in dict.fromkeys(r["step"] for r in rows):
        feeds = [r for r in rows if r["step"] == step and r["method"] in GPUFEED]
        near = [r for r in feeds if r.get("best_peer_of_ideal", 0.0) >= 0.9 or "error" in r]
        targets.append(_target(f"{step}: gpufeed >= 0.98x the best peer in every feed", feeds,
                               "vs_best_peer", 0.98, paired=True))
        targets.append(_target(f"{step}: gpufeed >= 0.95x the ideal where a peer reaches 0.9x "
                               f"({len(near)} feeds)", near, "of_ideal", 0.95))
        if step == "resnet":
            dl = [r for r in feeds if r["feed"].startswith(f"dl{most_workers}-")]
            targets.append(_target(f"resnet: gpufeed >= 0.97x the ideal with {most_workers} workers", dl,
                                   "of_ideal", 0.97))
    return targets


def _target(what: str, rows: list[dict[str, Any]], key: str, bound: float,
            paired: bool = False) -> dict[str, Any]:
    """A target over ``rows``. ``paired``: ``key`` is the ratio a row's ``paired`` gives round by round (the
    ratio to the best peer), so each miss keeps that median's interval (``_common.median_interval``):
    where it reaches ``bound``, the rounds leave the miss unresolved."""
    values = [(r["feed"], r.get(key), r.get("paired") if paired else None) for r in rows]
    misses = sorted(((f, v, p) for f, v, p in values if v is None or v < bound), key=lambda x: x[1] or 0.0)
    known = [v for _, v, _ in values if v is not None]
    return {"target": what, "key": key, "bound": bound, "feeds": len(values),
            "value": min(known, default=None), "met": (not misses) if values else None,
            "misses": [{"feed": f, "value": v, **({"interval": [p["lo"], p["hi"]], "coverage": p["coverage"],
                                                   "resolved": p["hi"] < bound} if p else {})}
                       for f, v, p in misses]}


def _miss(m: dict[str, Any]) -> str:
    if "interval" not in m:
        return f"{m['feed']} ({_f(m['value'], '.3f')})"
    lo, hi = m["interval"]
    return (f"{m['feed']} ({_f(m['value'], '.3f')}; paired, the median within {lo:.3f}-{hi:.3f} at "
            f"{m['coverage']:.0%}{'' if m['resolved'] else ': not resolved by the rounds'})")


def _f(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(doc: dict[str, Any]) -> str:
    c = doc["config"]
    lines = [f"# Training loops: {doc['card']}", "",
             f"torch {doc['torch']}, gpufeed {doc['gpufeed']}; steps/s, median of {c['rounds']} "
             f"interleaved rounds (min and max in the JSON); windows of about {c['seconds']:g} s at the "
             f"ideal's rate, after a warm-up; DataLoaders shuffled, forked workers, default_collate; "
             f"{doc['seconds']:.0f} s in all."
             + (" Smoke run: sizes too small to mean anything." if doc["smoke"] else ""), ""]
    lines += [f"Note: {n}." for n in doc["notes"]] + ([""] if doc["notes"] else [])
    for step in dict.fromkeys(r["step"] for r in doc["rows"]):
        lines += _step_table(step, c["what"].get(step, ""), [r for r in doc["rows"] if r["step"] == step])
    lines += ["## targets", "", *targets_table(doc["targets"]), ""]
    for t in doc["targets"]:
        if t["misses"]:
            lines.append(f"- {t['target']}: missed in " + ", ".join(_miss(m) for m in t["misses"]))
    return "\n".join(lines) + "\n"


def _busy(ideal: dict[str, Any]) -> str:
    gpu_us = ideal.get("gpu_us")
    if gpu_us is None:
        return ""
    period_us = 1e6 / ideal["steps_per_s"]
    bound = "the GPU" if gpu_us >= 0.9 * period_us else "the thread that launches it"
    return (f" The step keeps the GPU busy {gpu_us:.0f} us of the {period_us:.0f} us it takes with the batch "
            f"resident ({gpu_us / period_us:.0%}): it is bound by {bound}.")


def _step_table(step: str, what: str, rows: list[dict[str, Any]]) -> list[str]:
    ideal = next(r for r in rows if r["method"] == "ideal")
    methods = [m for m in METHODS if m != "ideal" and any(r["method"] == m for r in rows)]
    lines = [f"## {step}: {what}", "",
             f"ideal (one batch resident in VRAM): {ideal['steps_per_s']:.1f} steps/s "
             f"(min {ideal['min']:.1f}, max {ideal['max']:.1f}); epochs of {ideal['epoch_batches']} "
             f"batches.{_busy(ideal)}", "",
             "| feed | " + " | ".join(methods)
             + " | best peer | gpufeed/best peer"
               " | gpufeed/best peer, round by round (range; the median's interval)"
               " | gpufeed/ideal | best peer/ideal |",
             "| --- | " + " | ".join("---:" for _ in methods) + " | --- | ---: | ---: | ---: | ---: |"]
    for feed in dict.fromkeys(r["feed"] for r in rows if r["method"] != "ideal"):
        by = {r["method"]: r for r in rows if r["feed"] == feed}
        cells = ["err" if "error" in by.get(m, {}) else _f(by.get(m, {}).get("steps_per_s"), ".1f")
                 for m in methods]
        gf = next((by[m] for m in GPUFEED if m in by), {})
        pair = gf.get("paired")
        paired = (f"{pair['median']:.3f} ({pair['min']:.3f}-{pair['max']:.3f}; "
                  f"{pair['lo']:.3f}-{pair['hi']:.3f} at {pair['coverage']:.0%})" if pair else "-")
        lines.append(f"| {feed} | " + " | ".join(cells) + f" | {gf.get('best_peer', '-')} | "
                     f"{_f(gf.get('vs_best_peer'), '.3f')} | {paired} | {_f(gf.get('of_ideal'), '.3f')} | "
                     f"{_f(gf.get('best_peer_of_ideal'), '.3f')} |")
    lines += ["", "The loop thread's time in `next()` a step, us (median of the rounds):", "",
              "| feed | " + " | ".join(methods) + " |",
              "| --- | " + " | ".join("---:" for _ in methods) + " |"]
    for feed in dict.fromkeys(r["feed"] for r in rows if r["method"] != "ideal"):
        by = {r["method"]: r for r in rows if r["feed"] == feed}
        lines.append(f"| {feed} | " + " | ".join(_f(by.get(m, {}).get("next_us"), ".1f") for m in methods)
                     + " |")
    shares = [f"{r['feed']} {r['loop_stream_share']:.1%}" for r in rows if "loop_stream_share" in r]
    if shares:
        lines += ["", "gpufeed's batches copied on the loop's stream (the stream choice, `DeviceStage`): "
                  + ", ".join(shares) + "."]
    return [*lines, ""]


def plot(doc: dict[str, Any], path: Path) -> None:
    """One panel per step: per feed, a bar per method of its steps/s over the ideal's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(dict.fromkeys(r["step"] for r in doc["rows"]))
    fig, axes = plt.subplots(max(1, len(steps)), 1, figsize=(13, 3.4 * max(1, len(steps))), squeeze=False)
    series = {"to / nodes_to": ("to", "nodes_to"),
              "pin_nb / dl_pin_nb / nodes_pin_nb": ("pin_nb", "dl_pin_nb", "nodes_pin_nb"),
              "torchtnt": ("torchtnt",), "spdl": ("spdl",),
              "gpufeed / todevice_pc": ("gpufeed", "todevice_pc")}
    colors = ("tab:gray", "tab:blue", "tab:orange", "tab:purple", "tab:green")
    for ax, step in zip(axes[:, 0], steps, strict=False):
        rows = [r for r in doc["rows"] if r["step"] == step and r["method"] != "ideal" and "error" not in r]
        feeds = list(dict.fromkeys(r["feed"] for r in rows))
        width = 0.8 / len(series)
        for k, ((label, names), color) in enumerate(zip(series.items(), colors, strict=True)):
            vals = [next((r["of_ideal"] for r in rows if r["feed"] == f and r["method"] in names), 0.0)
                    for f in feeds]
            ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(feeds))], vals, width,
                   label=label, color=color)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(0.95, color="tab:red", lw=0.8, ls="--")
        ax.set_xticks(range(len(feeds)), feeds, fontsize=8)
        ax.set_ylabel("steps/s over ideal")
        ax.set_title(f"{step} ({doc['card']}): steps/s over the ideal's (dashed: 0.95)", fontsize=9)
    axes[0, 0].legend(fontsize=7, ncol=len(series), loc="lower left", bbox_to_anchor=(0.0, 1.08))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    cfg.out.mkdir(parents=True, exist_ok=True)
    if cfg.smoke and not cfg.cuda:  # on a shared CI box, torch's intra-op threads spin against each other
        torch.set_num_threads(1)

    def log(line: str) -> None:
        print(line, flush=True)

    log(f"training-loop benchmark on {cfg.device} ({card_name(cfg.device)}), torch {torch.__version__}: "
        f"steps {','.join(cfg.steps)}, feeds {','.join(cfg.feeds)}, methods {','.join(cfg.methods)}, "
        f"{cfg.rounds} rounds of {cfg.seconds:g} s")
    for doc in run(cfg, log):  # (saved after each feed: a run cut short keeps what it measured)
        md = markdown(doc)
        stem = save_results(cfg.out, "loops", doc, md)
    plot(doc, stem.with_suffix(".png"))
    print(f"\n{md}\nwrote {stem}.json, .md and .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
