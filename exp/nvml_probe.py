"""NVML's timestamped utilization samples on this card: spacing, clock, values beside the one-figure API."""
import time

import pynvml
import torch

pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(0).uuid}")
cycles = 50_000_000
x = torch.empty(1, device="cuda")
t_end = time.time() + 2.0
while time.time() < t_end:  # a busy second, then an idle one
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    if time.time() > t_end - 1.0:
        time.sleep(0.01)
now_us = time.time() * 1e6
_, got = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
print("samples in buffer:", len(got))
ts = [s.timeStamp for s in got]
print("last sample - time.time(): %.1f ms" % ((max(ts) - now_us) / 1e3))
recent = sorted((s.timeStamp, s.sampleValue.uiVal) for s in got)[-20:]
print("spacing ms:", [round((b[0] - a[0]) / 1e3, 1) for a, b in zip(recent, recent[1:])])
print("values:", [v for _, v in recent])
print("utilization rates now:", pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
try:
    print(pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, int(time.time() * 1e6) + 10**6))
except pynvml.NVMLError as e:
    print("samples after now:", type(e).__name__, e)
from gpufeed._gpu_idle import busy_reader
r = busy_reader(torch.device("cuda", 0))
print("reader:", r.__name__ if r else None, r(time.perf_counter() - 2.0))
