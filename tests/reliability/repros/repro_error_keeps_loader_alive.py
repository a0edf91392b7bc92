"""After a loader error reaches the consumer and is handled, the failed epoch's loader iterator stays alive
until the cyclic garbage collector runs: for a DataLoader, its worker processes (and their shared memory)
stay alive too, and workers forked later inherit the dead iterator and print "Exception ignored in
_MultiProcessingDataLoaderIter.__del__ ... AssertionError: can only test a child process" when they
collect it.

Cause: ``Failure.reraise`` (then ``gpufeed._worker``, now ``gpufeed._threads``) raised ``self.exc`` from a
frame whose ``self`` references the Failure, which references the exception, whose traceback references
that frame: a reference cycle. (The fetch thread's ``del it``, in the code of the time, could not free the
iterator while the traceback held its frames.)

Fix (as ``concurrent.futures.Future.result`` does):
``def reraise(self): exc, self.exc = self.exc, None; try: raise exc.with_traceback(exc.__traceback__)
finally: del exc, self``. Checked: with it, the iterator is freed as soon as the except block ends.

Exit status: 1 while the bug is present, 0 once fixed.
"""

import gc
import sys
import weakref

import torch

from gpufeed import CudaPrefetcher

refs = []


class Loader:
    """Hands out a class-based iterator, like a DataLoader's (whose ``__next__`` frame holds ``self``)."""

    def __iter__(self):
        it = Batches()
        refs.append(weakref.ref(it))
        return it


class Batches:
    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        if self.i == 2:
            raise ValueError("loader failed")
        return torch.zeros(1)


def main() -> int:
    gc.disable()
    with CudaPrefetcher(Loader(), device="cpu") as pf:
        try:
            for _ in pf:
                pass
        except ValueError:
            pass
        alive = refs[0]() is not None
    gc.enable()
    if alive:
        print("BUG: the failed epoch's loader iterator is still alive after the error was handled "
              "(freed only by gc.collect())")
        return 1
    print("freed at once: fixed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
