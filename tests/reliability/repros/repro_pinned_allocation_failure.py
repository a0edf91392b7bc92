"""A failing pinned allocation raises into the consumer instead of falling back to pageable copies.

``PinnedPool``'s docstring: "Pinned allocation can fail (locked-memory limits, a budget of zero):
``available`` is then False and the prefetcher falls back to pageable copies with one warning." The code
sets ``available = budget > 0`` once and never catches an allocation error: ``_allocate`` lets torch's
RuntimeError (``cudaHostAlloc`` failing, or no driver) propagate out of ``acquire``, so the epoch fails.

Fix: in ``PinnedPool._allocate`` (or ``try_acquire``), catch the RuntimeError of
``torch.empty(..., pin_memory=True)``, set ``self.available = False`` and return None; have
``Copier._pinned_ok`` (and source mode, see repro_source_mode_budget_zero.py) take the pageable path with
its one warning.

Runs anywhere: on a machine without an NVIDIA driver pinning fails by itself; with CUDA, the failure is
simulated. Exit status: 1 while the bug is present, 0 once fixed.
"""

import sys

import torch

from gpufeed import pinned_pool as staging


def main() -> int:
    real = torch.empty

    def failing_empty(*a, **kw):
        if kw.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (simulated cudaHostAlloc failure)")
        return real(*a, **kw)

    if torch.cuda.is_available():
        staging.torch.empty = failing_empty  # staging's `torch` is the torch module: patch it for this run
    pool = staging.PinnedPool(budget=1 << 20, chunk_bytes=4096, pin=True)
    try:
        buf = pool.try_acquire(4096)
    except RuntimeError as exc:
        print(f"BUG: PinnedPool.try_acquire raised {exc!r}; available={pool.available} (documented: False, "
              "and a fallback to pageable copies with one warning)")
        return 1
    finally:
        torch.empty = real
    ok = buf is None and not pool.available
    print("falls back: fixed" if ok else f"BUG: got {buf}, available={pool.available}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
