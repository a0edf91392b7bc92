"""gpufeed's Python per batch on its CUDA path, run on the CPU: the device stage told it is on CUDA, with
stand-ins for the stream calls; the copies are CPU .to() (a no-op). Counts the Python calls a next() makes
(deterministic) and times next() against a plain loop making the same torch calls."""
import sys, time, statistics
import torch
from gpufeed import CudaPrefetcher, _device

class FakeStream:
    def synchronize(self): pass
class FakeStreams:
    def __init__(self): self.s = FakeStream()
    def current(self): return self.s

def make(data, measure=False):
    pf = CudaPrefetcher(data, device="cpu")
    st = pf._stage
    st.cuda = True
    st.streams = FakeStreams()
    st.costs = _device._Costs((4e-6, 55e9)); st.costs.calls_s = 1.0  # every batch on the loop's stream
    st.stager.pin = False
    st.pinning = False
    return pf

_device.RECHECK_EVERY = 1 << 30
N = 2000
pinned_like = [(torch.zeros(4), torch.zeros(2, dtype=torch.long)) for _ in range(N)]
def plain(data):
    dev = torch.device("cpu")
    for x, y in data:
        x.is_pinned(); y.is_pinned()
        yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

import collections
def count_calls(it, n=200, show=False):
    calls = [0]; names = collections.Counter()
    def prof(frame, event, arg):
        if event == "call":
            calls[0] += 1
            names[f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_code.co_name}"] += 1
    for _ in range(50):
        next(it)
    sys.setprofile(prof)
    for _ in range(n):
        next(it)
    sys.setprofile(None)
    if show:
        for k, v in names.most_common():
            print(f"   {v / n:5.2f} {k}")
    return calls[0] / n

def timing(make_it, rounds=7):
    out = []
    for _ in range(rounds):
        it = make_it()
        t0 = time.perf_counter(); k = 0
        for _ in it:
            k += 1
        out.append((time.perf_counter() - t0) / k * 1e6)
    return statistics.median(out)

# (the library's frames only: torch's Python wrappers count as well, the same in both)
is_pinned_ok = True
try:
    torch.zeros(1).is_pinned()
except Exception:
    is_pinned_ok = False
mlp_like = [(torch.zeros(512 * 256), torch.zeros(512, dtype=torch.long)) for _ in range(400)]
for name, data in (("tiny pageable leaves (packed)", pinned_like), ("MLP-shaped pageable", mlp_like)):
    pf = make(data)
    print("==", name)
    print("python calls a next(): gpufeed", count_calls(iter(pf), show=True), " plain", count_calls(plain(data)))
    print(f"us a batch: gpufeed {timing(lambda: iter(pf)):.2f}  plain {timing(lambda: plain(data)):.2f}")
real = torch.Tensor.is_pinned
torch.Tensor.is_pinned = lambda self, *a: True  # (2 calls a batch of its own)
pf = make(pinned_like)
print("== pinned (is_pinned patched: 2 of the calls are the patch)")
print("python calls a next(): gpufeed", count_calls(iter(pf), show=True), " plain", count_calls(plain(pinned_like)))
print(f"us a batch: gpufeed {timing(lambda: iter(pf)):.2f}  plain {timing(lambda: plain(pinned_like)):.2f}")
torch.Tensor.is_pinned = real
