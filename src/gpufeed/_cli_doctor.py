"""``gpufeed doctor``: what this machine offers an input pipeline, measured, and what to change."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import tempfile
import time
from typing import Any

import torch

from gpufeed._cli_util import CLIError, format_bytes, native_reader, parse_size, say, version_of

#: Optional modules: (module, what it is for, the extra that installs it).
OPTIONAL = (
    ("h5py", "HDF5 (H5Source, gpufeed bench)", "gpufeed[hdf5]"),
    ("kvikio", "GPUDirect Storage (GDSSource)", "gpufeed[gds]"),
    ("nvtx", "NVTX ranges (GPUFEED_NVTX=1)", "gpufeed[nvtx]"),
    ("torchdata", "resumable loaders (StatefulDataLoader)", "gpufeed[resume]"),
    ("matplotlib", "bench.png", "gpufeed[dev]"),
)


def run(args: argparse.Namespace) -> int:
    try:
        probe = parse_size(args.probe_bytes)
    except ValueError as exc:
        raise CLIError(f"--probe-bytes: {exc}") from None
    if probe < 1 << 20:
        raise CLIError(f"--probe-bytes must be at least 1MiB, got {args.probe_bytes}")
    report = collect(probe)
    if args.json:
        print(json.dumps(report, indent=2), flush=True)
    else:
        say(render(report))
    return 0


def collect(probe_bytes: int) -> dict[str, Any]:
    """Every check, as a JSON-able dict (``render`` prints it)."""
    from gpufeed import __version__

    cuda = torch.cuda.is_available()
    report: dict[str, Any] = {
        "gpufeed": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "device": _device_info() if cuda else None,
        "h2d": _h2d(probe_bytes) if cuda else None,
        "gpu_busy": _gpu_busy() if cuda else None,
        "page_cache_read": _page_cache_read(probe_bytes),
        "staging_copy": {"threads": torch.get_num_threads()},
        "packages": {m: version_of(m) for m, _, _ in OPTIONAL},
        "gds": _gds(cuda),
        "env": {k: os.environ.get(k) for k in ("GPUFEED_NVTX", "GPUFEED_TRACE", "GPUFEED_DEBUG",
                                               "GPUFEED_NATIVE_PREAD", "KVIKIO_COMPAT_MODE",
                                               "KVIKIO_NTHREADS", "CUDA_VISIBLE_DEVICES")},
        "locked_memory_limit": _memlock(),
    }
    report["advice"] = advice(report)
    return report


# -- probes --------------------------------------------------------------------------------------------


def _device_info() -> dict[str, Any]:
    i = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(i)
    return {
        "index": i,
        "name": props.name,
        "count": torch.cuda.device_count(),
        "memory_bytes": int(props.total_memory),
        "capability": f"{props.major}.{props.minor}",
    }


def _gpu_busy() -> float | None:
    """NVML's utilization of the current device over the last two seconds (0 to 1), as the stream choice
    reads it; None where NVML cannot be read."""
    from gpufeed._gpu_idle import busy_reader

    read = busy_reader(torch.device("cuda", torch.cuda.current_device()))
    spans = [] if read is None else read(time.perf_counter() - 2.0)
    if not spans:
        return None
    return sum((t1 - t0) * busy for t0, t1, busy in spans) / sum(t1 - t0 for t0, t1, _ in spans)


def _h2d(nbytes: int, reps: int = 5) -> dict[str, float]:
    """Host-to-device GB/s from pinned and from pageable memory (best of ``reps``, CUDA events)."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for kind, pin in (("pinned_GBps", True), ("pageable_GBps", False)):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        src.fill_(1)
        dst.copy_(src, non_blocking=pin)  # warm-up
        best = float("inf")
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=pin)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        out[kind] = nbytes / best / 1e9
        del src
    return out


def _page_cache_read(nbytes: int) -> dict[str, Any]:
    """GB/s of reading a temp file that is in the page cache: one thread, and ``min(8, cpus)`` threads."""
    import numpy as np

    threads = max(2, min(8, os.cpu_count() or 1))
    buf = np.empty(nbytes, dtype=np.uint8)
    with tempfile.NamedTemporaryFile(prefix="gpufeed-doctor-") as fh:
        block = np.full(min(nbytes, 8 << 20), 7, dtype=np.uint8)
        for off in range(0, nbytes, len(block)):
            fh.write(block[: min(len(block), nbytes - off)].tobytes())
        fh.flush()
        fd = fh.fileno()
        _pread_all(fd, memoryview(buf), 0)  # warm: the file is now surely in the page cache
        one = _best(lambda: _pread_all(fd, memoryview(buf), 0))
        many = _best(lambda: _pread_parallel(fd, buf, threads))
    return {"bytes": nbytes, "threads": threads, "one_thread_GBps": nbytes / one / 1e9,
            "threaded_GBps": nbytes / many / 1e9, "where": tempfile.gettempdir(),
            "shuffled_rows": "native" if native_reader()[0] else "python"}


def _best(fn: Any, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _pread_all(fd: int, mv: memoryview, offset: int) -> None:
    done = 0
    while done < len(mv):
        got = os.preadv(fd, [mv[done:]], offset + done)
        if got <= 0:
            raise OSError(f"short read from the doctor's temp file at offset {offset + done}")
        done += got


def _pread_parallel(fd: int, buf: Any, threads: int) -> None:
    n = len(buf)
    step = -(-n // threads)
    mv = memoryview(buf)
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        futs = [ex.submit(_pread_all, fd, mv[a : min(n, a + step)], a) for a in range(0, n, step)]
        for f in futs:
            f.result()


def _gds(cuda: bool) -> dict[str, Any]:
    """Whether GDSSource would run, and in which kvikio mode (kvikio's own settings; no file is opened)."""
    if version_of("kvikio") is None:
        reason = "kvikio is not installed (pip install 'gpufeed[gds]')"
        return {"available": False, "mode": None, "reason": reason}
    try:
        import kvikio
        import kvikio.defaults
    except Exception as exc:  # e.g. libkvikio or libcufile missing
        return {"available": False, "mode": None, "reason": f"kvikio does not import: {exc}"}
    info: dict[str, Any] = {"kvikio": getattr(kvikio, "__version__", None)}
    try:
        info["compat_mode_setting"] = str(kvikio.defaults.get("compat_mode"))
        info["num_threads"] = int(kvikio.defaults.get("num_threads"))
        compat = bool(kvikio.defaults.is_compat_mode_preferred())
    except Exception as exc:
        return {**info, "available": False, "mode": None, "reason": f"kvikio settings unreadable: {exc}"}
    try:
        import kvikio.cufile_driver

        info["gds_driver"] = bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception as exc:  # libcufile absent or the driver cannot open
        info["gds_driver"] = False
        info["gds_driver_error"] = str(exc)
    if not cuda:
        return {**info, "available": False, "mode": "compat" if compat else "gds",
                "reason": "no CUDA device: GDSSource needs one"}
    mode = "compat" if compat else "gds"
    reason = ("GPUDirect Storage: the disk DMA-writes GPU memory" if mode == "gds" else
              "compat mode: kvikio's threads pread into host memory (no nvidia-fs driver, or "
              "KVIKIO_COMPAT_MODE=ON); the usual case on cloud VMs, about as fast as RawSource")
    return {**info, "available": True, "mode": mode, "reason": reason}


def _memlock() -> int | None:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        return None if soft == resource.RLIM_INFINITY else int(soft)
    except (ImportError, OSError, ValueError):
        return None


# -- advice and rendering ------------------------------------------------------------------------------


def advice(r: dict[str, Any]) -> list[str]:
    out = []
    if not r["cuda_available"]:
        why = ("torch is a CUDA build but sees no GPU (no driver, or CUDA_VISIBLE_DEVICES hides them)"
               if r["torch_cuda"] else "torch is a CPU-only build: install a CUDA build on a GPU machine")
        out.append(f"no CUDA device: gpufeed runs on the CPU (no streams); {why}")
    h2d = r.get("h2d")
    if h2d:
        ratio = h2d["pinned_GBps"] / max(h2d["pageable_GBps"], 1e-9)
        if ratio > 1.5:
            out.append(f"pinned copies are {ratio:.1f}x pageable ones here: let gpufeed stage through its "
                       "pinned pool (the default), not .to(device) from pageable tensors in the loop")
    if r["cuda_available"] and r["gpu_busy"] is None:
        out.append("NVML's utilization cannot be read here (nvidia-ml-py missing, a MIG slice, no driver "
                   "access): gpufeed cannot see your GPU idle between kernels, and keeps batches over a few "
                   "MiB on its copy stream even in a step bound by your thread")
    pc = r["page_cache_read"]
    if pc["threaded_GBps"] > 1.3 * pc["one_thread_GBps"]:
        out.append(f"parallel reads are {pc['threaded_GBps'] / pc['one_thread_GBps']:.1f}x one thread: "
                   "prefer RawSource/H5Source on contiguous data (parallel pread) over h5py slicing")
    if pc.get("shuffled_rows") == "python" and native_reader()[1] != "GPUFEED_NATIVE_PREAD=0":
        out.append("shuffled rows are read by a Python loop (several times slower): the native reader "
                   "was not built when gpufeed was installed (no C compiler?); reinstall with one "
                   "(pip install --force-reinstall --no-deps gpufeed)")
    pk = r["packages"]
    if pk["h5py"] is None:
        out.append("h5py is missing: pip install 'gpufeed[hdf5]' for H5Source and gpufeed bench")
    if r["cuda_available"] and pk["kvikio"] is None:
        out.append("kvikio is missing: pip install 'gpufeed[gds]' to try GDSSource")
    gds = r["gds"]
    if r["cuda_available"] and gds.get("available") and gds.get("mode") == "compat":
        out.append("GDS would run in compat mode: expect RawSource-like speed; GDSSource still saves a "
                   "staging copy only where the nvidia-fs driver is loaded")
    if pk["nvtx"] is None and r["cuda_available"]:
        out.append("nvtx is missing: pip install 'gpufeed[nvtx]' for cheaper GPUFEED_NVTX=1 ranges in nsys")
    lock = r.get("locked_memory_limit")
    if r["cuda_available"] and lock is not None and lock < (512 << 20):
        out.append(f"the locked-memory limit is {format_bytes(lock)} (ulimit -l): if pinning fails, "
                   "gpufeed falls back to pageable copies; raise it or lower pinned_budget")
    if not out:
        out.append("nothing to change: run gpufeed bench to compare the loops on this machine")
    return out


def render(r: dict[str, Any]) -> str:
    lines = ["gpufeed doctor"]

    def row(key: str, value: Any) -> None:
        lines.append(f"  {key:<18} {value}")

    row("gpufeed", r["gpufeed"])
    row("python", f"{r['python']} ({r['platform']})")
    row("torch", f"{r['torch']} (CUDA build: {r['torch_cuda'] or 'none, CPU-only'})")
    if r["cuda_available"]:
        d = r["device"]
        row("CUDA", f"available, {d['count']} device(s)")
        row("device", f"cuda:{d['index']} {d['name']} (compute {d['capability']}, "
                      f"{format_bytes(d['memory_bytes'])})")
        h = r["h2d"]
        row("H2D pinned", f"{h['pinned_GBps']:.1f} GB/s")
        row("H2D pageable", f"{h['pageable_GBps']:.1f} GB/s")
        busy = r["gpu_busy"]
        row("GPU busy (NVML)", "not readable" if busy is None else
            f"{busy:.0%} over the last 2 s; read once a second, the copies go on your stream where your GPU "
            "idles enough")
    else:
        row("CUDA", "not available: device cpu")
        row("H2D", "n/a (no CUDA device)")
    pc = r["page_cache_read"]
    row("page-cache read", f"{pc['one_thread_GBps']:.1f} GB/s one thread, "
        f"{pc['threaded_GBps']:.1f} GB/s with {pc['threads']} threads "
        f"({format_bytes(pc['bytes'])} file in {pc['where']})")
    if pc["shuffled_rows"] == "native":
        row("shuffled reads", "native: rows in the page cache gathered from memory maps, others read by "
            "each reader in one C call (GIL released once)")
    else:
        why = native_reader()[1]
        row("shuffled reads", f"Python os.preadv loop, no memory-map gather by default ({why})")
    threads = r["staging_copy"]["threads"]
    row("staging copy", f"torch's parallel copy, {threads} threads (torch.get_num_threads()); ToDevice: one")
    row("CPUs", r["cpu_count"])
    for module, what, extra in OPTIONAL:
        v = r["packages"][module]
        row(module, f"{v}  ({what})" if v else f"not installed ({what}; pip install '{extra}')")
    g = r["gds"]
    if g.get("available"):
        row("GDS", f"would run: {g['mode']} mode ({g['reason']})")
    else:
        row("GDS", f"would not run: {g['reason']}")
    env = ", ".join(f"{k}={v}" for k, v in r["env"].items() if v is not None) or "none set"
    row("env", env)
    lines.append("advice:")
    lines += [f"  - {a}" for a in r["advice"]]
    return "\n".join(lines)
