"""Staging from a background thread: does CPU placement explain the gap to the main thread? (GPU machine)

    PYTHONPATH=src python benchmarks/_diag_affinity.py

Prints the machine's NUMA layout and the GPU's local CPUs, then the end-to-end rate of the 4 x 32 MiB
pinned ring of ``_diag_ring.py`` over 24 distinct 64 MiB pageable batches: from the main thread, from a
background thread, and from a background thread bound (``os.sched_setaffinity``, inherited by the
OpenMP team it starts) to the GPU's local CPUs or to either half of the machine.
"""

import os
import subprocess

import torch
from _diag_ring import SIZE, MiB, in_thread, ring


def sh(cmd):
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


def main():
    print(sh("lscpu | grep -i -E 'numa|socket|model name|L3'"))
    print(sh("nvidia-smi topo -m"))
    bus = sh("nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader").lower()
    bus = bus[4:] if bus.startswith("0000") and len(bus) > 12 else bus
    local = sh(f"cat /sys/bus/pci/devices/{bus}/local_cpulist 2>/dev/null || true")
    node = sh(f"cat /sys/bus/pci/devices/{bus}/numa_node 2>/dev/null || true")
    print("GPU", bus, "numa_node", node, "local_cpulist", local)
    srcs = [torch.full((SIZE,), i, dtype=torch.uint8) for i in range(24)]
    n = os.cpu_count()
    half = n // 2
    cases = {"main": lambda: ring(32 * MiB, 4, srcs)}
    cases["thread"] = lambda: in_thread(lambda: ring(32 * MiB, 4, srcs))
    cases[f"thread, cpus 0-{half - 1}"] = lambda: in_thread(lambda: ring(32 * MiB, 4, srcs), range(half))
    cases[f"thread, cpus {half}-{n - 1}"] = lambda: in_thread(lambda: ring(32 * MiB, 4, srcs), range(half, n))
    cases["main again"] = lambda: ring(32 * MiB, 4, srcs)
    cases["thread again"] = lambda: in_thread(lambda: ring(32 * MiB, 4, srcs))
    for name, fn in cases.items():
        print(f"{name}: {fn()} GB/s", flush=True)
    torch.set_num_threads(8)
    print(f"main, 8 omp threads: {ring(32 * MiB, 4, srcs)} GB/s", flush=True)
    print(f"thread, 8 omp threads, cpus 0-{half - 1}: "
          f"{in_thread(lambda: (torch.set_num_threads(8), ring(32 * MiB, 4, srcs))[1], range(half))} GB/s")


if __name__ == "__main__":
    main()
