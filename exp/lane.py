# ruff: noqa
"""The CPU machine's loaded-loop harness (a small CPU training step between batches, one thread; the device
stage told it is on CUDA, every batch on the loop's stream, is_pinned()/pin_memory() stood in): gpufeed
against (a) ``lane``, the epoch as one generator with a flat batch's loop-stream copy written inline, every
per-batch feature kept (fetch timing, the stats' wait, the verdict's ask, the lock, the state), and (b)
``leancopy``, gpufeed with only the stage's copy replaced by that inline copy. 21 interleaved rounds,
us a batch in next(), paired differences. Run: python exp/lane.py [--pageable]."""
import collections, statistics, sys, time, torch
torch.set_num_threads(1)
PAGEABLE = "--pageable" in sys.argv
N = 1500
data = [(torch.zeros(17000), torch.zeros(512, dtype=torch.long)) for _ in range(N)]
torch.Tensor.is_pinned = (lambda self, *a: False) if PAGEABLE else (lambda self, *a: True)
torch.Tensor.pin_memory = lambda self, *a: self.clone()
dev = torch.device("cpu")
def plain(lst):
    for x, y in lst:
        if PAGEABLE:
            yield x.pin_memory().to(dev, non_blocking=True), y.pin_memory().to(dev, non_blocking=True)
        else:
            yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
from gpufeed import CudaPrefetcher, _device, host_memory
host_memory.pinned_empty = lambda n: torch.empty(n, dtype=torch.uint8)
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
    st.stager.pin = True
    return pf
_device.RECHECK_EVERY = 1 << 30
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
opt = torch.optim.Adam(model.parameters())
xs = torch.randn(32, 64)
def step():
    loss = model(xs).square().mean(); opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
def window(it, n=1400, loaded=True):
    inside = 0.0; k = 0
    while k < n:
        t = time.perf_counter(); b = next(it, None); inside += time.perf_counter() - t
        if b is None: break
        if loaded: step()
        k += 1
    return inside / k * 1e6

import threading, statistics
from gpufeed._device import DeviceBatch, _device_batch, RECHECK_EVERY
from gpufeed._tree import flatten
from gpufeed._threads import Failure
from gpufeed import host_memory as hm
def lane(pf):
    stage, stats = pf._stage, pf.stats
    batches = pf._loader.host_batches(pf.device, pf._arena)
    fetch = batches.__next__
    device = stage.device
    costs = stage.costs
    current = stage.streams.current
    meter = stage.meter
    ahead = collections.deque()
    depth = pf.depth
    busy = threading.Lock()
    perf = time.perf_counter
    last = None
    ended = False
    handed = 0
    count = 0
    while True:
        t0 = perf()
        f0, s0 = stats.fetch_s, stats.stage_s
        if meter is not None and last is not None:
            meter.asked(current, (t0, f0, s0))
        with busy:
            while not ended and len(ahead) <= depth:
                t1 = perf()
                try:
                    hb = fetch()
                except StopIteration:
                    ended = True
                    break
                except Exception as exc:
                    ahead.append(Failure.caught(exc)); ended = True; break
                t2 = perf()
                stats.fetch_s += t2 - t1
                batch, lease, state = hb
                kind = type(batch)
                if lease is None and stage.transform is None and (kind is tuple or kind is list or kind is dict):
                    leaves = list(batch.values()) if kind is dict else batch
                    nbytes = 0
                    out = []
                    for t in leaves:
                        if type(t) is not torch.Tensor or t.is_cuda:
                            out = None; break
                        nbytes += t.nbytes
                        out.append(t.to(device, non_blocking=True) if t.is_pinned() else hm.pin(t).to(device, non_blocking=True))
                    count += 1
                    if out is not None and nbytes < costs.loop_bytes and count % RECHECK_EVERY:
                        stats.bytes += nbytes
                        stats.loop_stream_batches += 1
                        moved = dict(zip(batch, out)) if kind is dict else kind(out)
                        ahead.append(_device_batch((moved, None, state, current(), None, False)))
                        continue
                try:
                    ahead.append(stage.copy(hb))
                except Exception as exc:
                    ahead.append(Failure.caught(exc)); ended = True
        if not ahead:
            return
        item = ahead.popleft()
        if type(item) is not DeviceBatch:
            item.reraise()
        if not handed: pf._loader.epoch_started()
        handed += 1
        batch = stage.hand_over(item)
        pf._state = item.state
        now = perf()
        if last is None:
            stats.startup_s += now - t0
        else:
            stats.wait_s += now - t0
            stats.wall_s += now - last
        last = now
        stats.batches += 1
        yield batch

def lean_copy(stage):
    real = stage.copy
    device, costs, current, stats = stage.device, stage.costs, stage.streams.current, stage.stats
    pin = hm.pin
    def copy(hb):
        batch, lease, state = hb
        kind = type(batch)
        if lease is None and stage.transform is None and (kind is tuple or kind is list or kind is dict):
            leaves = list(batch.values()) if kind is dict else batch
            nbytes = 0
            for t in leaves:
                if type(t) is not torch.Tensor or t.is_cuda:
                    return real(hb)
                nbytes += t.nbytes
            stage._count += 1
            if nbytes < costs.loop_bytes and stage._count % RECHECK_EVERY:
                out = [t.to(device, non_blocking=True) if t.is_pinned() else pin(t).to(device, non_blocking=True) for t in leaves]
                stats.bytes += nbytes
                stats.loop_stream_batches += 1
                moved = dict(zip(batch, out)) if kind is dict else kind(out)
                return _device_batch((moved, None, state, current(), None, False))
        return real(hb)
    return copy
pfa, pfb, pfc = make(data), make(data), make(data)
pfc._stage.copy = lean_copy(pfc._stage)
res = {"plain": [], "gpufeed": [], "lane": [], "leancopy": []}
for r in range(21):
    res["plain"].append(window(plain(data)))
    order = [("gpufeed", lambda: iter(pfa)), ("lane", lambda: lane(pfb)), ("leancopy", lambda: iter(pfc))]
    if r % 2: order.reverse()
    for k, mk in order:
        it = mk(); res[k].append(window(it)); it.close()
med = {k: statistics.median(v) for k, v in res.items()}
print(("pageable " if PAGEABLE else "pinned ") + str({k: round(v, 2) for k, v in med.items()}),
      "paired lane-gpufeed", round(statistics.median([g - c for g, c in zip(res["lane"], res["gpufeed"])]), 2),
      "paired leancopy-gpufeed", round(statistics.median([g - c for g, c in zip(res["leancopy"], res["gpufeed"])]), 2))
