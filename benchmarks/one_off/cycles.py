"""Which of gpufeed's objects are left in reference cycles after a CUDA run (issue 37: a plain DataLoader's
worker forked later aborts with a CUDA initialization error). One-off."""
import gc, collections, sys, os, torch
from torch.utils.data import DataLoader, TensorDataset
from gpufeed import CudaPrefetcher
gc.collect()
ds = TensorDataset(torch.randn(4096, 512), torch.randint(0, 10, (4096,)))
def is_cuda_obj(o):
    try:
        if isinstance(o, torch.Tensor):
            return o.is_cuda or (o.device.type == "cpu" and o.is_pinned())
        return isinstance(o, (torch.cuda.Event, torch.cuda.Stream, torch._C._CudaEventBase, torch._C._CudaStreamBase))
    except Exception:
        return False
def run(kind):
    if kind == "list-pinned":
        src = [(torch.randn(512, 512).pin_memory(), torch.arange(512).pin_memory()) for _ in range(40)]
    elif kind == "list-8MiB":
        src = [(torch.randn(1024, 2048), torch.arange(1024)) for _ in range(40)]
    else:
        src = DataLoader(ds, batch_size=256, num_workers=2, shuffle=True, persistent_workers=(kind == "dl-pers"))
    pf = CudaPrefetcher(src)
    for e in range(3):
        for i, b in enumerate(pf):
            if e == 1 and i == 5:
                break
    pf.close()
CRASH = sys.argv[1:] == ["crash"]
for kind in ("list-pinned", "list-8MiB", "dl", "dl-pers"):
    if CRASH:
        run(kind); continue
    gc.set_debug(gc.DEBUG_SAVEALL)
    run(kind)
    n = gc.collect()
    gc.set_debug(0)
    cuda = [o for o in gc.garbage if is_cuda_obj(o)]
    c = collections.Counter(type(o).__module__ + "." + type(o).__qualname__ for o in gc.garbage)
    print(f"== {kind}: {n} unreachable, {len(cuda)} CUDA objects among them")
    print("   ", [k for k in c.most_common(25)])
    ids = {id(o) for o in gc.garbage}
    for o in cuda[:3]:
        chain = [type(o).__qualname__]
        cur = o
        for _ in range(6):
            refs = [r for r in gc.get_referrers(cur) if id(r) in ids and r is not gc.garbage]
            if not refs: break
            cur = refs[0]
            chain.append(type(cur).__qualname__ + (f"[{list(cur)[:6]}]" if isinstance(cur, dict) else ""))
        print("    chain:", " <- ".join(chain))
    gc.garbage.clear()
# the crash itself: a plain DataLoader's workers that collect, after gpufeed ran
def wi(_):
    gc.collect()
ok = 0
for b in DataLoader(ds, batch_size=256, num_workers=2, pin_memory=True, worker_init_fn=wi):
    ok += 1
print("plain DataLoader after gpufeed, workers collecting:", ok, "batches OK")
