"""Throwaway: why does a small-batch DataLoader loop lose with gpufeed? Candidates side by side."""
import os, queue, sys, threading, time, statistics, json
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = True


def mlp():
    m = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(dev)
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    def step(x, y):
        loss = nn.functional.cross_entropy(m(x), y)
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    return step


def tok():
    emb = nn.Embedding(1000, 256).to(dev)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(256, 4, 512, batch_first=True), 2).to(dev)
    head = nn.Linear(256, 1000).to(dev)
    ps = list(emb.parameters()) + list(enc.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(ps, 1e-3)
    def step(x, y):
        h = enc(emb(x))
        loss = nn.functional.cross_entropy(head(h[:, -1]), y)
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    return step


def data(kind, n):
    if kind == "mlp":
        return TensorDataset(torch.randn(n * 512, 256), torch.randint(0, 10, (n * 512,))), 512
    return TensorDataset(torch.randint(0, 1000, (n * 8, 2048)), torch.randint(0, 1000, (n * 8,))), 8


# ---- candidates -------------------------------------------------------------------------------
def plain_to(loader):
    for x, y in loader:
        yield x.to(dev), y.to(dev)


def pin_nb(loader):
    for x, y in loader:
        if not x.is_pinned():
            x, y = x.pin_memory(), y.pin_memory()
        yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)


def lean_inline(loader, depth=2):
    """A one-way inline side-stream prefetcher with minimal bookkeeping."""
    copy = lean_inline.stream
    cur = torch.cuda.current_stream()
    it = iter(loader)
    ahead = []
    def pull():
        try:
            x, y = next(it)
        except StopIteration:
            return None
        with torch.cuda.stream(copy):
            if not x.is_pinned():
                x, y = x.pin_memory(), y.pin_memory()
            gx, gy = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            ev = torch.cuda.Event(); ev.record(copy)
        gx.record_stream(cur); gy.record_stream(cur)
        return gx, gy, ev
    for _ in range(depth):
        ahead.append(pull())
    while True:
        ahead.append(pull())
        item = ahead.pop(0)
        if item is None:
            return
        item[2].wait(cur)
        yield item[0], item[1]


def lean_thread(loader, depth=2, one_thread=True):
    """SPDL/torch pin-thread style: a thread receives, pins, copies, records; the loop waits on an event."""
    copy = lean_thread.stream
    cur = torch.cuda.current_stream()
    q = queue.SimpleQueue()
    tokens = queue.SimpleQueue()
    for _ in range(depth):
        tokens.put(None)
    stop = threading.Event()
    def run():
        if one_thread:
            torch.set_num_threads(1)
        torch.cuda.set_stream(copy)
        try:
            for x, y in loader:
                tokens.get()
                if stop.is_set():
                    return
                if not x.is_pinned():
                    x, y = x.pin_memory(), y.pin_memory()
                gx, gy = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                ev = torch.cuda.Event(); ev.record(copy)
                gx.record_stream(cur); gy.record_stream(cur)
                q.put((gx, gy, ev))
        except BaseException as e:
            q.put(e); return
        q.put(None)
    t = threading.Thread(target=run, daemon=True); t.start()
    while True:
        item = q.get()
        if item is None:
            return
        if isinstance(item, BaseException):
            raise item
        tokens.put(None)
        item[2].wait(cur)
        yield item[0], item[1]


def gpufeed_default(pf):
    return pf


# ---- measure -----------------------------------------------------------------------------------
def run_epoch(batches, step, skip=5):
    torch.cuda.synchronize()
    t0 = time.perf_counter(); n = 0; ts = None
    for x, y in batches:
        step(x, y)
        n += 1
        if n == skip:
            torch.cuda.synchronize(); ts = time.perf_counter()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    return n / (t1 - t0), (n - skip) / (t1 - ts)


def main():
    sys.path.insert(0, "src")
    import gpufeed, gpufeed.prefetcher as P
    from gpufeed import CudaPrefetcher
    lean_inline.stream = torch.cuda.Stream()
    lean_thread.stream = torch.cuda.Stream()
    results = []
    nb = int(os.environ.get("NB", "120"))
    for kind in ("mlp", "tok"):
        step = mlp() if kind == "mlp" else tok()
        ds, bs = data(kind, nb)
        for feed in ("dl2", "dl2pin", "dl2pinpers", "listpage", "listpin"):
            if feed.startswith("dl"):
                loader = DataLoader(ds, batch_size=bs, num_workers=2, pin_memory="pin" in feed,
                                    persistent_workers="pers" in feed)
            else:
                xs = ds.tensors[0].split(bs); ys = ds.tensors[1].split(bs)
                lst = [(x.clone(), y.clone()) for x, y in zip(xs, ys)]
                if feed == "listpin":
                    lst = [(x.pin_memory(), y.pin_memory()) for x, y in lst]
                loader = lst
            pf = CudaPrefetcher(loader)
            pf_ns = CudaPrefetcher(loader, worker_slots=False) if feed.startswith("dl") else None
            pf_inl = CudaPrefetcher(loader)
            meths = {
                "to": lambda: plain_to(loader),
                "pin_nb": lambda: pin_nb(loader),
                "gpufeed": lambda: pf,
                "gpufeed_noslots": (lambda: pf_ns) if pf_ns else None,
                "lean_inline": lambda: lean_inline(loader),
                "lean_thread1": lambda: lean_thread(loader),
                "lean_threadN": lambda: lean_thread(loader, one_thread=False),
            }
            meths = {k: v for k, v in meths.items() if v}
            for k, f in meths.items():  # warm
                run_epoch(f(), step)
            rows = {k: [] for k in meths}
            for r in range(3):
                for k, f in meths.items():
                    rows[k].append(run_epoch(f(), step))
            best_full = max(statistics.median(v[0] for v in rows[k]) for k in ("to", "pin_nb"))
            best_steady = max(statistics.median(v[1] for v in rows[k]) for k in ("to", "pin_nb"))
            for k, v in rows.items():
                full = statistics.median(a for a, _ in v); steady = statistics.median(b for _, b in v)
                line = dict(kind=kind, feed=feed, method=k, full=round(full, 1), steady=round(steady, 1),
                            r_full=round(full / best_full, 3), r_steady=round(steady / best_steady, 3),
                            threaded=getattr(getattr(meths[k](), "stats", None), "threaded_batches", None))
                print(json.dumps(line), flush=True)
                results.append(line)
            pf.close(); pf_inl.close()
            if pf_ns: pf_ns.close()
    out = os.environ.get("OUT", ".")
    json.dump(results, open(os.path.join(out, "diag.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
