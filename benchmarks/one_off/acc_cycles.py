"""Which rows of bench_trainers leave CUDA objects in reference cycles (a later row's forked worker that
collects them aborts). One-off."""
import gc, collections, sys, torch
sys.path.insert(0, "benchmarks")
import bench_trainers as bt
def is_cuda_obj(o):
    try:
        if isinstance(o, torch.Tensor):
            return o.is_cuda or o.is_pinned()
        return isinstance(o, (torch._C._CudaEventBase, torch._C._CudaStreamBase))
    except Exception:
        return False
cfg = bt.parse_args(["--rounds", "1", "--steps", "30", "--warmup", "5"])
work = bt.works(cfg)[0]
gc.collect()
for trainer, method in [("accelerate", "own"), ("accelerate", "gpufeed"), ("lightning", "gpufeed"),
                        ("lightning_dm", "gpufeed"), ("hf_trainer", "own"), ("hf_trainer", "gpufeed"),
                        ("torchtitan", "own"), ("torchtitan", "gpufeed"), ("lightning", "own")]:
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        r = bt.RUNNERS[trainer](method, cfg, work)
    except Exception as e:
        r = f"ERROR {type(e).__name__}: {str(e)[:100]}"
    n = gc.collect()
    gc.set_debug(0)
    cuda = [o for o in gc.garbage if is_cuda_obj(o)]
    mods = collections.Counter(type(o).__module__.split(".")[0] for o in gc.garbage)
    print(f"== {trainer} {method}: {r}; {n} unreachable, {len(cuda)} CUDA objects: "
          f"{collections.Counter((type(o).__qualname__, 'pinned' if isinstance(o, torch.Tensor) and o.is_pinned() else '') for o in cuda).most_common(5)}")
    print("   modules:", mods.most_common(8))
    ids = {id(o) for o in gc.garbage}
    for o in cuda[:2]:
        chain, cur = [type(o).__qualname__], o
        for _ in range(8):
            refs = [x for x in gc.get_referrers(cur) if id(x) in ids]
            if not refs: break
            cur = refs[0]
            d = f"{sorted(cur)[:5]}" if isinstance(cur, dict) and all(isinstance(k, str) for k in cur) else ""
            chain.append(f"{type(cur).__module__}.{type(cur).__qualname__}{d}")
        print("    chain:", " <- ".join(chain))
    gc.garbage.clear()
