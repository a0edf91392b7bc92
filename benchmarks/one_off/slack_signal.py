"""Which cheap signal tells a loop whose GPU has slack (an inline copy is free) from one whose GPU is the bound?

Loops: the CNN step (launch-bound), a wider CNN (GPU-bound), each with and without loss.item() every step.
For each: steps/s with the copy inline (.to(non_blocking) of a pinned batch) and on a side stream one
batch ahead (wait_stream + record_stream), 3 rounds; the GPU's busy time a step (steps queued behind a
sleep); and two signals read in the inline loop: s1, the share of next() calls at which the event recorded
at the previous next() had completed; s2, the share at which the loop's stream was empty (query()).
"""
import statistics, sys, time, itertools, traceback
import torch
import torch.nn.functional as F
sys.path.insert(0, "benchmarks")
from bench_loops import cnn

dev = torch.device("cuda")
N = 60
data = [(torch.randn(64, 3, 128, 128).pin_memory(), torch.randint(0, 100, (64,)).pin_memory()) for _ in range(8)]
side_stream = torch.cuda.Stream()

def make(width, sync):
    torch.manual_seed(0)
    model = cnn(100, width).to(dev).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    def step(b):
        x, y = b
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        if sync:
            loss.item()
    return step

def inline(step, signals):
    prev = None; s1 = s2 = 0
    for i in range(N):
        cur = torch.cuda.Event()
        if prev is not None:
            s1 += prev.query()
            s2 += torch.cuda.current_stream().query()
        cur.record(); prev = cur
        x, y = data[i % len(data)]
        step((x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)))
    signals.append((s1 / (N - 1), s2 / (N - 1)))

def side(step):
    def issue(b):
        with torch.cuda.stream(side_stream):
            return (b[0].to(dev, non_blocking=True), b[1].to(dev, non_blocking=True))
    nxt = issue(data[0])
    for i in range(N):
        torch.cuda.current_stream().wait_stream(side_stream)
        cur = nxt
        for t in cur:
            t.record_stream(torch.cuda.current_stream())
        nxt = issue(data[(i + 1) % len(data)])
        step(cur)

def timed(fn):
    torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
    return N / (time.perf_counter() - t0)

for width, sync in itertools.product((32, 96), (False, True)):
    try:
        step = make(width, sync)
        b = (data[0][0].to(dev), data[0][1].to(dev))
        for _ in range(3):
            step(b)
        make_q = make(width, False)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000_000); e0.record(); [make_q(b) for _ in range(10)]; e1.record()
        torch.cuda.synchronize()
        gpu_us = e0.elapsed_time(e1) / 10 * 1e3
        signals = []
        res = {"inline": [], "side": []}
        for r in range(3):
            res["inline"].append(timed(lambda: inline(step, signals)))
            res["side"].append(timed(lambda: side(step)))
        inl, sd = statistics.median(res["inline"]), statistics.median(res["side"])
        s1 = statistics.median(s for s, _ in signals); s2 = statistics.median(s for _, s in signals)
        print(f"width {width:3d} sync {sync!s:5s}: GPU {gpu_us:6.0f} us a step, period {1e6 / inl:6.0f} us inline; "
              f"inline {inl:6.1f} side {sd:6.1f} steps/s (side/inline {sd / inl:.3f}); s1 {s1:.2f} s2 {s2:.2f}", flush=True)
    except Exception:
        traceback.print_exc()
