# ruff: noqa
"""The loop thread's Python a batch on the CPU machine: the one-liner, a minimal depth-ahead prefetcher and
gpufeed (its device stage told it is on CUDA, every batch on the loop's stream, is_pinned() stood in)."""
import collections, statistics, time, torch
N = 2000
data = [(torch.zeros(4), torch.zeros(2, dtype=torch.long)) for _ in range(N)]
torch.Tensor.is_pinned = lambda self, *a: True
dev = torch.device("cpu")

def plain(lst):
    for x, y in lst:
        yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

class Minimal:
    """depth-ahead, one function a batch: take, flatten (flat tuple), check, copy, hand over, count."""
    def __init__(self, lst, depth=2):
        self.it = iter(lst); self.ahead = collections.deque(); self.depth = depth
        self.batches = 0; self.bytes = 0; self.wait = 0.0; self.perf = time.perf_counter
    def __iter__(self): return self
    def __next__(self):
        t0 = self.perf()
        ahead = self.ahead
        while len(ahead) <= self.depth:
            b = next(self.it, None)
            if b is None: break
            kind = type(b)
            leaves = list(b)
            out = []
            n = 0
            for t in leaves:
                n += t.nbytes
                if t.is_pinned():
                    out.append(t.to(dev, non_blocking=True))
            self.bytes += n
            ahead.append(kind(out))
        if not ahead: raise StopIteration
        self.batches += 1
        self.wait += self.perf() - t0
        return ahead.popleft()


from gpufeed import CudaPrefetcher, _device
class FakeStream:
    def synchronize(self): pass
class FakeStreams:
    def __init__(self): self.s = FakeStream()
    def current(self): return self.s
def make(data):
    pf = CudaPrefetcher(data, device="cpu")
    st = pf._stage
    st.cuda = True
    st.streams = FakeStreams()
    st.costs = _device._Costs((4e-6, 55e9)); st.costs.calls_s = 1.0; st.costs.loop_bytes = 1e18
    st.stager.pin = False; st.pinning = False
    return pf
_device.RECHECK_EVERY = 1 << 30
def timing(make_it, rounds=9):
    out = []
    for _ in range(rounds):
        it = make_it(); t0 = time.perf_counter(); k = 0
        for _ in it: k += 1
        out.append((time.perf_counter() - t0) / k * 1e6)
    return statistics.median(out)
pf = make(data)
for name, mk in (("plain", lambda: plain(data)), ("minimal", lambda: Minimal(data)), ("gpufeed", lambda: iter(pf))):
    print(name, f"{timing(mk):.2f} us")
