# ruff: noqa
"""Which of gpufeed's structures cost in a loaded loop: variants of a minimal prefetcher (fake CUDA)."""
import collections, statistics, sys, threading, time, torch
from typing import Any, NamedTuple
exec(open(__file__.replace("ablate.py", "minimal.py")).read().split("pf = make(data)")[0])
from gpufeed._tree import flatten
from gpufeed.stats import PrefetchStats
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
opt = torch.optim.Adam(model.parameters())
xs = torch.randn(32, 64)
def step():
    loss = model(xs).square().mean(); opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
def window(it, n=1500, loaded=True):
    inside = 0.0; k = 0
    while k < n:
        t = time.perf_counter(); b = next(it, None); inside += time.perf_counter() - t
        if b is None: break
        if loaded: step()
        k += 1
    return inside / k * 1e6

class HB(NamedTuple):
    batch: Any
    lease: Any = None
    state: Any = None
class DB(NamedTuple):
    batch: Any
    event: Any
    state: Any
    stream: Any
    fresh: Any
    timed: bool = False

def gen(lst):
    for b in lst:
        yield HB(b)

class Stage:
    def __init__(self, stats):
        self.stats = stats; self.cur = object()
    def current(self): return self.cur
    def copy(self, hb, flat=True):
        leaves, rebuild = flatten(hb.batch)
        out = list(leaves); pinned = []; n = 0
        for i, t in enumerate(leaves):
            n += t.nbytes
            if t.is_pinned(): pinned.append(i)
        self.stats.bytes += n
        consumer = self.current()
        for i in pinned:
            out[i] = leaves[i].to(dev, non_blocking=True)
        return DB(rebuild(out), None, hb.state, consumer, None)
    def hand_over(self, item):
        s = self.current()
        if s is not item.stream: raise RuntimeError
        return item.batch

class Variant:
    def __init__(self, lst, opts):
        self.o = opts; self.lst = lst
        self.stats = PrefetchStats(device="cuda")
        self.stage = Stage(self.stats)
        self.it = gen(lst) if "gen" in opts else iter([HB(b) for b in lst])
        self.ahead = collections.deque(); self.depth = 2; self.busy = threading.Lock(); self.last = None
    def __iter__(self): return self
    def __next__(self):
        o = self.o
        mark = self.stats.mark() if "stats" in o else None
        if "lock" in o:
            with self.busy: self._fill()
        else:
            self._fill()
        if not self.ahead: raise StopIteration
        item = self.ahead.popleft()
        b = self.stage.hand_over(item)
        if "stats" in o:
            self.last = self.stats.served(mark, self.last, False)
        self.stats.batches += 1
        return b
    def _fill(self):
        while len(self.ahead) <= self.depth:
            t0 = time.perf_counter()
            hb = next(self.it, None)
            if hb is None: return
            self.stats.fetch_s += time.perf_counter() - t0
            self.ahead.append(self.stage.copy(hb))

data = [(torch.zeros(4), torch.zeros(2, dtype=torch.long)) for _ in range(1500)]
variants = {"plain": lambda: plain(data), "minimal": lambda: Minimal(data),
            "staged": lambda: Variant(data, set()), "+gen": lambda: Variant(data, {"gen"}),
            "+gen+stats": lambda: Variant(data, {"gen", "stats"}), "+gen+stats+lock": lambda: Variant(data, {"gen", "stats", "lock"})}
pf = make(data)
variants["gpufeed"] = lambda: iter(pf)
loaded = "--empty" not in sys.argv
res = {k: [] for k in variants}
for r in range(15):
    for k, mk in variants.items():
        res[k].append(window(mk(), loaded=loaded))
for k, v in res.items():
    print(f"{k:18s} {statistics.median(v):6.2f} us ({min(v):.2f}-{max(v):.2f})")
