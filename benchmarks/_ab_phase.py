"""Where a background thread's time per batch goes (experiment)."""

import collections
import queue
import statistics
import threading
import time

import torch

MiB = 1 << 20
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)


def med(xs):
    return statistics.median(xs) * 1e6


def pin_times(nbytes, reps=40):
    src = [torch.empty(nbytes // 4).fill_(i) for i in range(8)]
    out = []
    for i in range(reps):
        s = src[i % 8]
        t0 = time.perf_counter()
        p = s.pin_memory()
        out.append(time.perf_counter() - t0)
        del p
    return med(out[5:])


def in_thread(fn, *a):
    r = []
    th = threading.Thread(target=lambda: r.append(fn(*a)))
    th.start()
    th.join()
    return r[0]


for nb in (8 * MiB, 64 * MiB):
    print(f"pin_memory {nb >> 20} MiB: main {pin_times(nb):.0f} us, thread {in_thread(pin_times, nb):.0f} us, "
          f"main again {pin_times(nb):.0f} us", flush=True)


def bg_run(batches, pinned_src, phases, depth=2, stage="whole"):
    q = queue.SimpleQueue()
    slots = threading.Semaphore(depth)
    stream = torch.cuda.Stream()
    consumer = torch.cuda.current_stream()
    ph = collections.defaultdict(list)

    def run():
        torch.cuda.set_device(dev)
        for b in batches:
            t0 = time.perf_counter()
            slots.acquire()
            t1 = time.perf_counter()
            with torch.cuda.stream(stream):
                t2 = time.perf_counter()
                if stage == "whole":
                    pinned = [t if pinned_src else t.pin_memory() for t in b]
                    t3 = time.perf_counter()
                    out = [t.to(dev, non_blocking=True) for t in pinned]
                t4 = time.perf_counter()
                ev = torch.cuda.Event()
                ev.record(stream)
            t5 = time.perf_counter()
            for t in out:
                t.record_stream(consumer)
            q.put((out, ev))
            t6 = time.perf_counter()
            for k, a, z in (("acquire", t0, t1), ("enter", t1, t2), ("pin", t2, t3), ("to", t3, t4),
                            ("event+exit", t4, t5), ("record+put", t5, t6)):
                ph[k].append(z - a)
        q.put(None)

    th = threading.Thread(target=run)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    th.start()
    waits = []
    n = 0
    while True:
        w0 = time.perf_counter()
        item = q.get()
        waits.append(time.perf_counter() - w0)
        if item is None:
            break
        slots.release()
        consumer.wait_event(item[1])
        n += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    th.join()
    nbytes = sum(t.nbytes for t in batches[0])
    if phases:
        print("   " + ", ".join(f"{k} {med(v):.0f}" for k, v in ph.items()) + f", consumer wait {med(waits):.0f}")
    return n * nbytes / dt / 1e9


for nb, nt in ((8 * MiB, 1), (64 * MiB, 1), (64 * MiB, 4)):
    for pinned_src in (False, True):
        distinct = max(2, (1 << 30) // nb)
        pool = [[torch.empty(nb // nt // 4, pin_memory=pinned_src).fill_(i) for _ in range(nt)]
                for i in range(distinct)]
        batches = [pool[i % distinct] for i in range(max(32, distinct))]
        bg_run(batches, pinned_src, False)
        r = bg_run(batches, pinned_src, True)
        # in-loop reference
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in batches:
            out = [t.pin_memory().to(dev, non_blocking=True) for t in b]
        torch.cuda.synchronize()
        r2 = len(batches) * nb / (time.perf_counter() - t0) / 1e9
        print(f"{nb >> 20} MiB x{nt} pinned_src={pinned_src}: bg whole {r:.1f} GB/s, in-loop {r2:.1f} GB/s", flush=True)
        del pool, batches

# torch threads and OMP
print("torch threads", torch.get_num_threads(), torch.__config__.parallel_info())
