"""gpufeed under torch.distributed: two real processes (gloo, CPU), and examples/ddp.py under torchrun.

One spawn of two ranks runs every scenario and writes what each rank received to a JSON file; the tests
below check those records (a failure names the scenario instead of hanging a collective).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from conftest import launched
from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.sources import RawSource, plan_batches

WORLD = 2
N = 103  # not a multiple of anything below: every mode has a tail to deal with
BATCH = 8
SEED = 7
SPAWN_TIMEOUT_S = 60
ROOT = Path(__file__).resolve().parents[1]

#: name -> CudaPrefetcher keywords; rank and world_size are never passed: they come from torch.distributed.
SOURCE_CASES = {
    "shuffle": dict(shuffle=True),
    "in_order": dict(shuffle=False),
    "blocks": dict(shuffle="blocks"),
    "drop_last": dict(shuffle=True, drop_last=True),
    "pad": dict(shuffle=True, pad=True),
}
EPOCHS = [0, 1, 1]  # set_epoch before each pass: a new epoch reshuffles, the same epoch repeats


def write_data(directory: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    np.save(directory / "x.npy", rng.integers(0, 255, (n, 5), dtype=np.uint8))
    np.save(directory / "y.npy", np.arange(n, dtype=np.int64))


def open_source(directory: Path) -> RawSource:
    return RawSource(fields={"x": directory / "x.npy", "y": directory / "y.npy"})


# -- what every rank runs ------------------------------------------------------------------------------

def _source_case(data: Path, kw: dict) -> dict:
    x = np.load(data / "x.npy")
    out: dict = {"epochs": [], "bytes_ok": True}
    with CudaPrefetcher(SourceLoader(open_source(data), batch_size=BATCH, seed=SEED, **kw)) as pf:
        out["device"], out["len"] = str(pf.device), len(pf)
        cfg = pf.state_dict()["loader"]["config"]
        out["rank"], out["world_size"] = cfg["rank"], cfg["world_size"]
        for epoch in EPOCHS:
            pf.set_epoch(epoch)
            batches = []
            for b in pf:
                batches.append(b["y"].tolist())
                out["bytes_ok"] &= bool(np.array_equal(b["x"].cpu().numpy(), x[b["y"].cpu().numpy()]))
            out["epochs"].append(batches)
        out["implicit_next_epoch"] = [b["y"].tolist() for b in pf]  # no set_epoch: epoch 2
    return out


def _resume_case(data: Path) -> dict:
    """Stop after 3 batches of epoch 1, resume in a new prefetcher: the rest, then epoch 2."""
    kw = dict(batch_size=BATCH, shuffle=True, seed=SEED)
    with CudaPrefetcher(SourceLoader(open_source(data), **kw)) as pf:
        pf.set_epoch(1)
        it = iter(pf)
        head = [next(it)["y"].tolist() for _ in range(3)]
        state = pf.state_dict()
    with CudaPrefetcher(SourceLoader(open_source(data), **kw)) as pf:
        pf.load_state_dict(state)
        rest = [b["y"].tolist() for b in pf]
        after = [b["y"].tolist() for b in pf]
    return {"head": head, "rest": rest, "next_epoch": after}


def _tiny_case(tiny: Path) -> dict:
    """One sample, two ranks: only pad=True gives both ranks a batch."""
    out: dict = {}
    with CudaPrefetcher(SourceLoader(open_source(tiny), batch_size=BATCH, pad=True)) as pf:
        out["pad"] = [b["y"].tolist() for b in pf]
    try:
        with CudaPrefetcher(SourceLoader(open_source(tiny), batch_size=BATCH)) as pf:
            out["no_pad"] = [b["y"].tolist() for b in pf]
    except ValueError as exc:
        out["no_pad_error"] = str(exc)
    return out


def _sampler_case(drop_last: bool) -> dict:
    """A DataLoader with a DistributedSampler, wrapped: the same order as the bare DataLoader's."""
    data = TensorDataset(torch.arange(N))

    def loader() -> DataLoader:
        return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=True, seed=SEED,
                                                                            drop_last=drop_last))

    plain = loader()
    out: dict = {"wrapped": [], "plain": []}
    with CudaPrefetcher(loader(), depth=2) as pf:
        out["device"] = str(pf.device)
        for epoch in EPOCHS:
            pf.set_epoch(epoch)  # forwarded to the DistributedSampler
            plain.sampler.set_epoch(epoch)
            out["wrapped"].append([y.tolist() for (y,) in pf])
            out["plain"].append([y.tolist() for (y,) in plain])
        out["sampler_epoch"] = pf.sampler.epoch
    return out


def _rank_main(rank: int, init_file: str, data: str, tiny: str, results: str) -> None:
    torch.set_num_threads(1)
    if torch.cuda.is_available():  # as a DDP script does; gpufeed's device=None must follow it
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=SPAWN_TIMEOUT_S))
    try:
        out = {name: _source_case(Path(data), kw) for name, kw in SOURCE_CASES.items()}
        cuda = torch.cuda.is_available()
        out["current_device"] = str(torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")
        out["resume"] = _resume_case(Path(data))
        out["tiny"] = _tiny_case(Path(tiny))
        out["sampler"] = _sampler_case(drop_last=False)
        out["sampler_drop_last"] = _sampler_case(drop_last=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(results, f"rank{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of the two ranks received, one dict per rank."""
    tmp = tmp_path_factory.mktemp("dist")
    (tmp / "data").mkdir()
    (tmp / "tiny").mkdir()
    write_data(tmp / "data", N)
    write_data(tmp / "tiny", 1)
    args = (str(tmp / "init"), str(tmp / "data"), str(tmp / "tiny"), str(tmp))
    ctx = mp.start_processes(_rank_main, args=args, nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {WORLD} ranks did not finish within {SPAWN_TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def shares(ranks: list[dict], case: str, e: int) -> list[list[list[int]]]:
    return [r[case]["epochs"][e] for r in ranks]


# -- BatchSource under torch.distributed ---------------------------------------------------------------

def test_rank_world_size_and_device_come_from_the_process_group(ranks):
    for rank, r in enumerate(ranks):
        assert (r["shuffle"]["rank"], r["shuffle"]["world_size"]) == (rank, WORLD)
        assert r["shuffle"]["device"] == r["sampler"]["device"] == r["current_device"]
        assert all(r[case]["bytes_ok"] for case in SOURCE_CASES)


@pytest.mark.parametrize("case", ["shuffle", "in_order", "blocks"])
def test_ranks_cover_the_data_exactly_once_in_equal_numbers_of_batches(ranks, case):
    for e in range(len(EPOCHS)):
        per_rank = shares(ranks, case, e)
        counts = [len(batches) for batches in per_rank]
        assert counts == [ranks[0][case]["len"]] * WORLD
        assert all(0 < len(b) <= BATCH for batches in per_rank for b in batches)
        seen = [set(flat(batches)) for batches in per_rank]
        assert not seen[0] & seen[1]  # disjoint
        assert sorted(flat(flat(per_rank))) == list(range(N))  # union: each sample exactly once


@pytest.mark.parametrize("case", list(SOURCE_CASES))
def test_set_epoch_reshuffles_identically_on_every_rank(ranks, case):
    kw = SOURCE_CASES[case]
    for rank, r in enumerate(ranks):
        for e, epoch in enumerate([*EPOCHS, 2]):
            got = r[case]["epochs"][e] if e < len(EPOCHS) else r[case]["implicit_next_epoch"]
            plan = plan_batches(N, BATCH, seed=SEED, epoch=epoch, rank=rank, world_size=WORLD, **kw)
            assert got == [np.asarray(list(rows)).tolist() for rows in plan], (rank, epoch)
        epochs = r[case]["epochs"]
        assert epochs[1] == epochs[2]  # set_epoch(1) twice: the same order
        assert (epochs[0] == epochs[1]) == (kw["shuffle"] is False)


def test_drop_last_gives_full_disjoint_batches(ranks):
    dropped = []
    for e in range(len(EPOCHS)):
        per_rank = shares(ranks, "drop_last", e)
        assert [len(b) for b in per_rank] == [N // (BATCH * WORLD)] * WORLD
        assert all(len(b) == BATCH for batches in per_rank for b in batches)
        everything = flat(flat(per_rank))
        assert len(everything) == len(set(everything)) == N // (BATCH * WORLD) * BATCH * WORLD
        dropped.append(set(range(N)) - set(everything))
    assert dropped[0] != dropped[1]  # which samples are dropped changes with the epoch


def test_pad_gives_every_rank_as_many_samples_covering_all(ranks):
    for e in range(len(EPOCHS)):
        per_rank = shares(ranks, "pad", e)
        assert len({len(b) for b in per_rank}) == 1
        assert [len(flat(b)) for b in per_rank] == [-(-N // WORLD)] * WORLD
        everything = flat(flat(per_rank))
        assert sorted(set(everything)) == list(range(N))
        assert len(everything) - N == -(-N // WORLD) * WORLD - N  # only the padding repeats


def test_without_pad_too_few_samples_for_the_ranks_is_an_error_that_names_the_fix(ranks):
    for r in ranks:
        assert r["tiny"]["pad"] == [[0]]  # one sample, repeated so that both ranks get a batch
        assert "pad=True" in r["tiny"]["no_pad_error"] and "drop_last=True" in r["tiny"]["no_pad_error"]


def test_each_rank_resumes_its_own_share(ranks):
    for rank, r in enumerate(ranks):
        full = ranks[rank]["shuffle"]["epochs"][1]
        assert r["resume"]["head"] + r["resume"]["rest"] == full
        assert r["resume"]["next_epoch"] == ranks[rank]["shuffle"]["implicit_next_epoch"]


# -- a DataLoader with a DistributedSampler, wrapped -----------------------------------------------------

@pytest.mark.parametrize("case", ["sampler", "sampler_drop_last"])
def test_distributed_sampler_loader_works_unchanged(ranks, case):
    for r in ranks:
        assert r[case]["wrapped"] == r[case]["plain"]  # the same order as the bare DataLoader, every epoch
        assert r[case]["wrapped"][0] != r[case]["wrapped"][1]  # set_epoch reached the sampler
        assert r[case]["wrapped"][1] == r[case]["wrapped"][2]
        assert r[case]["sampler_epoch"] == EPOCHS[-1]
    for e in range(len(EPOCHS)):
        per_rank = [flat(r[case]["wrapped"][e]) for r in ranks]
        assert len(per_rank[0]) == len(per_rank[1])
        if case == "sampler":  # DistributedSampler pads by repeating samples, like gpufeed's pad=True
            assert sorted(set(per_rank[0] + per_rank[1])) == list(range(N))
        else:
            assert not set(per_rank[0]) & set(per_rank[1])


# -- examples/ddp.py under torchrun ----------------------------------------------------------------------

def test_ddp_example_under_torchrun():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = launched([str(ROOT / "examples" / "ddp.py"), "--smoke", "--cpu"], nproc=WORLD, timeout=90, env=env,
                    cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(WORLD):
        for epoch in range(2):
            assert f"rank {rank}/{WORLD}: epoch {epoch}: 16 batches, 500 samples on cpu, " in proc.stdout
    passed = [line for line in proc.stdout.splitlines() if line.startswith("PASS: ")]
    assert len(passed) == 1 and passed[0].startswith("PASS: 2 rank(s) x 2 epochs on cpu (gloo): every epoch")
    assert "FAIL" not in proc.stdout


def test_a_launch_runs_again_only_after_torch_s_gloo_teardown_abort(monkeypatch):
    import subprocess

    import conftest

    results = []

    def run(cmd, **kwargs):
        code, text = results.pop(0)
        return subprocess.CompletedProcess(cmd, code, text, "")

    monkeypatch.setattr(subprocess, "run", run)
    results[:] = [(1, "PASS\nterminate called without an active exception"), (0, "PASS")]
    assert conftest.launched(["x.py"]).returncode == 0 and not results
    results[:] = [(1, "FAIL: rank 1 saw a batch twice"), (0, "PASS")]
    assert conftest.launched(["x.py"]).returncode == 1 and len(results) == 1
