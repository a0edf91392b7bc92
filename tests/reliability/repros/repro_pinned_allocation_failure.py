"""A failing pinned allocation raises into the consumer instead of falling back to pageable copies.

``PinnedPool``'s docstring: "Pinned allocation can fail (locked-memory limits): ``available`` is then False
and the caller reads into pageable memory." The code of the time set ``available = budget > 0`` once and
never caught an allocation error: ``_allocate`` let torch's RuntimeError (``cudaHostAlloc`` failing, or no
driver) propagate out of ``acquire``, so the epoch failed.

Fix: in ``PinnedPool._allocate`` (or ``try_acquire``), catch the RuntimeError of
``torch.empty(..., pin_memory=True)``, set ``self.available = False`` and return None; the SourceLoader's
reads (``loaders._reads.EpochReads``) then go to pageable memory, and the device stage says so once
(see repro_source_mode_budget_zero.py for a budget of 0).

Runs anywhere: on a machine without an NVIDIA driver pinning fails by itself; with CUDA, the failure is
simulated. Exit status: 1 while the bug is present, 0 once fixed.
"""

import sys

import torch

from gpufeed.host_memory import pinned_pool


def main() -> int:
    real = torch.empty

    def failing_empty(*a, **kw):
        if kw.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (simulated cudaHostAlloc failure)")
        return real(*a, **kw)

    if torch.cuda.is_available():
        pinned_pool.torch.empty = failing_empty  # the module's `torch` is torch: patched for this run
    pool = pinned_pool.PinnedPool(budget=1 << 20, pin=True)
    try:
        buf = pool.try_acquire(4096)
    except RuntimeError as exc:
        print(f"BUG: PinnedPool.try_acquire raised {exc!r}; available={pool.available} (documented: False, "
              "and a fallback to pageable memory)")
        return 1
    finally:
        torch.empty = real
    ok = buf is None and not pool.available
    print("falls back: fixed" if ok else f"BUG: got {buf}, available={pool.available}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
