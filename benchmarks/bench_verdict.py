"""Does ``stats.summary()`` tell the truth? Each case's verdict beside the truth, measured in the same run.

Run it on the GPU machine (a minute or two)::

    PYTHONPATH=src python benchmarks/bench_verdict.py      # benchmarks/results/verdict-<card>.{json,md}
    python benchmarks/bench_verdict.py --smoke             # tiny, on the CPU, seconds (CI)

The truth: each case's loop runs twice, through ``CudaPrefetcher`` and with one batch resident on the
device, reused every step (the same step, no input at all). ``ratio`` is the prefetcher's steps/s over the
resident's: the share of its speed the loop keeps with its input. ``expected`` is ``INPUT-BOUND`` where
``ratio < 0.9`` (the input costs the loop more than a tenth of its speed: the verdict's threshold, docs/
design.md "The verdict"), ``ok`` where it is at least 0.9, and ``no verdict`` for the empty loop; ``verdict``
is what the summary said, ``match`` whether they agree. Cases, chosen far from the threshold:

* ``gpu_bound``: a step of matmuls (about ``--step-ms`` on the GPU) over a DataLoader that keeps up.
* ``slow_loader``: each sample sleeps ``--sample-ms`` in 2 DataLoader workers; the same step.
* ``h2d_bound``: large pageable batches (``--h2d-mib``), a trivial step (one pass over the batch).
* ``cpu_step``: 20 ms of Python a batch (a sleep), a loader that keeps up.
* ``empty``: an empty loop over a DataLoader: no verdict expected.

``measure_cost_us``: what measuring costs the loop's thread a batch: an empty loop over small pinned
batches through one prefetcher with ``measure=True`` and one with ``measure=False``, an epoch of each a
round, the difference of their median time a batch over ``--cost-rounds`` rounds.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when loaded by a test
from _common import card_name, parser, pick_device, run_info, save_results

try:
    import gpufeed  # noqa: F401  (installed; else the checkout's src/ below)
except ImportError:  # a checkout without an install: run the working tree's src/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gpufeed import CudaPrefetcher

CASES = ("gpu_bound", "slow_loader", "h2d_bound", "cpu_step", "empty")
#: The truth's threshold: the prefetcher's steps/s under this share of the resident's is input-bound.
TRUTH_RATIO = 0.9


@dataclass
class Config:
    device: torch.device
    smoke: bool
    out: Path
    batches: int
    epochs: int
    batch: int
    features: int
    step_ms: float
    sample_ms: float
    h2d_mib: int
    cpu_step_ms: float
    cost_batches: int
    cost_rounds: int
    cases: tuple[str, ...]


class Samples(Dataset):
    """``n`` random samples of ``features`` floats; each takes ``sleep_s`` to make (in a worker)."""

    def __init__(self, n: int, features: int, sleep_s: float = 0.0) -> None:
        self.bank = torch.randn(64, features)
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.bank[i % 64].clone()


@dataclass
class Case:
    """A loop: its loader (made fresh for each run), its step, a batch of its shape for the resident run."""

    name: str
    loader: Callable[[], Any]
    step: Callable[[torch.Tensor], None]
    sample: torch.Tensor
    expected_override: str | None = None


def _matmul_step(cfg: Config) -> Callable[[torch.Tensor], None]:
    """A step of about ``cfg.step_ms`` on the device: square matmuls, then a read of the batch."""
    n = 256 if cfg.smoke else 4096
    w = torch.randn(n, n, device=cfg.device) / n**0.5
    reps = _calibrate(lambda: w @ w, cfg)

    def step(b: torch.Tensor) -> None:
        y = w
        for _ in range(reps):
            y = y @ w
        b.add_(y[0, 0])  # the step reads the batch (and the batch waits on the step's kernels)

    return step


def _calibrate(op: Callable[[], Any], cfg: Config) -> int:
    """How many ``op`` make about ``cfg.step_ms``."""
    op()
    _sync(cfg.device)
    t0 = time.perf_counter()
    for _ in range(10):
        op()
    _sync(cfg.device)
    per = (time.perf_counter() - t0) / 10
    return max(1, round(cfg.step_ms / 1e3 / per))


def _cases(cfg: Config) -> list[Case]:
    n = cfg.batches * cfg.batch
    fast = lambda: DataLoader(Samples(n, cfg.features), batch_size=cfg.batch, num_workers=2,  # noqa: E731
                              persistent_workers=True)
    slow = lambda: DataLoader(Samples(n, cfg.features, cfg.sample_ms / 1e3), batch_size=cfg.batch,  # noqa: E731
                              num_workers=2, persistent_workers=True)
    sample = torch.randn(cfg.batch, cfg.features)
    big = torch.randn(cfg.h2d_mib << 18)  # pageable, float32
    matmuls = _matmul_step(cfg)

    def cpu_step(b: torch.Tensor) -> None:
        time.sleep(cfg.cpu_step_ms / 1e3)
        b.add_(1)

    cases = {
        "gpu_bound": Case("gpu_bound", fast, matmuls, sample),
        "slow_loader": Case("slow_loader", slow, matmuls, sample),
        "h2d_bound": Case("h2d_bound", lambda: [big] * cfg.batches, lambda b: b.mul(2).sum(), big),
        "cpu_step": Case("cpu_step", fast, cpu_step, sample),
        "empty": Case("empty", fast, lambda b: None, sample, expected_override="no verdict"),
    }
    return [cases[c] for c in cfg.cases]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _through_gpufeed(case: Case, cfg: Config) -> tuple[float, Any]:
    """Steps/s through the prefetcher, each epoch timed from its first batch's step to the end (as the
    stats judge it), and the stats."""
    seconds, steps = 0.0, 0
    with CudaPrefetcher(case.loader(), device=cfg.device) as pf:
        for _ in range(cfg.epochs):
            it = iter(pf)
            case.step(next(it))
            _sync(cfg.device)
            t0 = time.perf_counter()
            for b in it:
                case.step(b)
                steps += 1
            _sync(cfg.device)
            seconds += time.perf_counter() - t0
        stats = pf.stats
        stats.summary()  # reads the GPU's events before the prefetcher closes
    return steps / seconds, stats


def _resident(case: Case, cfg: Config) -> float:
    b = case.sample.to(cfg.device)
    for _ in range(2):
        case.step(b)
    _sync(cfg.device)
    steps = cfg.epochs * (cfg.batches - 1)
    t0 = time.perf_counter()
    for _ in range(steps):
        case.step(b)
    _sync(cfg.device)
    return steps / (time.perf_counter() - t0)


def run_case(case: Case, cfg: Config) -> dict[str, Any]:
    resident = _resident(case, cfg)
    fed, stats = _through_gpufeed(case, cfg)
    ratio = fed / resident
    expected = case.expected_override or ("INPUT-BOUND" if ratio < TRUTH_RATIO else "ok")
    d = stats.as_dict()
    row = {"case": case.name, "expected": expected, "verdict": d["verdict"],
           "match": d["verdict"] == expected,
           "steps_per_s": fed, "resident_steps_per_s": resident, "ratio": ratio,
           "truth_waited_share": max(0.0, 1 - ratio), "starved_fraction": d["starved_fraction"],
           "reason": d["reason"], "next_step": d["next_step"], "summary": stats.summary(), "stats": d}
    print(f"{case.name:12s} expected {expected:12s} said {d['verdict']:12s} ratio {ratio:.3f} "
          f"waited {d['starved_fraction']:.1%}\n    {row['summary']}", flush=True)
    return row


def measure_cost(cfg: Config) -> dict[str, float]:
    """The loop thread's time a batch with and without measuring: an empty loop over small batches, one
    prefetcher each iterated for an epoch a round (as a training run keeps one over its epochs)."""
    pin = cfg.device.type == "cuda"
    data = [torch.randn(4096).pin_memory() if pin else torch.randn(4096) for _ in range(cfg.cost_batches)]
    per: dict[bool, list[float]] = {True: [], False: []}
    pfs = {measure: CudaPrefetcher(data, device=cfg.device, measure=measure) for measure in (True, False)}
    try:
        for r in range(cfg.cost_rounds):
            for measure in (True, False) if r % 2 == 0 else (False, True):  # (each first in turn)
                t0 = time.perf_counter()
                for _b in pfs[measure]:
                    pass
                per[measure].append((time.perf_counter() - t0) / len(data) * 1e6)
                _sync(cfg.device)
    finally:
        for pf in pfs.values():
            pf.close()
    on, off = statistics.median(per[True]), statistics.median(per[False])
    return {"us_per_batch_measure_on": on, "us_per_batch_measure_off": off, "measure_cost_us": on - off}


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# Verdict: {doc['card']}", "", "| case | expected | verdict | match | ratio to resident | "
             "waited | next step |", "| --- | --- | --- | --- | ---: | ---: | --- |"]
    for r in doc["cases"]:
        lines.append(f"| {r['case']} | {r['expected']} | {r['verdict']} | {'yes' if r['match'] else 'NO'} | "
                     f"{r['ratio']:.3f} | {r['starved_fraction']:.1%} | {r['next_step'] or r['reason']} |")
    c = doc["cost"]
    lines += ["", f"Measuring costs the loop's thread {c['measure_cost_us']:.1f} us a batch "
              f"({c['us_per_batch_measure_on']:.1f} us on, {c['us_per_batch_measure_off']:.1f} us off)."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> Config:
    p = parser(__doc__, "verdict", "tiny, on the CPU, seconds")
    p.add_argument("--batches", type=int, default=60, help="batches an epoch")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--features", type=int, default=4096)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--sample-ms", type=float, default=2.0, help="slow_loader: sleep a sample, per worker")
    p.add_argument("--h2d-mib", type=int, default=256)
    p.add_argument("--cpu-step-ms", type=float, default=20.0)
    p.add_argument("--cost-batches", type=int, default=2000)
    p.add_argument("--cost-rounds", type=int, default=7)
    p.add_argument("--cases", default=",".join(CASES))
    a = p.parse_args(argv)
    if a.smoke:
        a.batches, a.epochs, a.batch, a.features, a.step_ms = 14, 1, 8, 64, 2.0
        a.sample_ms, a.h2d_mib, a.cpu_step_ms, a.cost_batches, a.cost_rounds = 1.0, 1, 2.0, 200, 1
    cases = tuple(c for c in a.cases.split(",") if c)
    unknown = set(cases) - set(CASES)
    if unknown:
        raise SystemExit(f"--cases: unknown {sorted(unknown)}; choose from {','.join(CASES)}")
    return Config(pick_device(a.device, a.smoke), a.smoke, a.out, a.batches, a.epochs, a.batch, a.features,
                  a.step_ms, a.sample_ms, a.h2d_mib, a.cpu_step_ms, a.cost_batches, a.cost_rounds, cases)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    cfg.out.mkdir(parents=True, exist_ok=True)
    print(f"verdict benchmark on {cfg.device} ({card_name(cfg.device)}), torch {torch.__version__}",
          flush=True)
    doc = {**run_info(cfg.device, cfg.smoke), "truth_ratio": TRUTH_RATIO,
           "config": {k: v for k, v in vars(cfg).items() if k not in ("device", "out")}}
    doc["cases"] = [run_case(case, cfg) for case in _cases(cfg)]
    doc["cost"] = measure_cost(cfg)
    md = markdown(doc)
    stem = save_results(cfg.out, "verdict", doc, md)
    print(f"\n{md}\nwrote {stem}.json and {stem}.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
