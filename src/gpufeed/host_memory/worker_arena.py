"""DataLoader workers collate into shared memory that the main process pinned once: :class:`WorkerArena`.

A DataLoader worker hands each batch over in a fresh shared-memory segment, which the main process maps
(a page fault per page) and, to copy it to the GPU without a stall, copies once more into pinned memory,
192 MiB at a time for a ResNet batch: the loader's hand-over, not the link, then bounds the loop
(docs/design.md, "A training loop: ResNet-18"). Here each worker collates its batch into a slot, a
shared-memory buffer of its own that the main process registered with CUDA (``cudaHostRegister``) the
first time it arrived. What crosses to the main process is the batch's structure and the slot's number:
the main process copies nothing, and the copy engine reads the slot directly. A worker makes, at its first
batch, as many slots as the pipeline holds of its batches, so that their registrations (milliseconds
each) fall in the epoch's start-up, not in the middle of training. The slots outlive the workers (a
DataLoader without persistent workers starts new ones each epoch, and they are handed the same slots), so
each is pinned once in a prefetcher's life.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data._utils.collate import (
    collate,
    collate_tensor_fn,
    default_collate,
    default_collate_fn_map,
)

from gpufeed._staging import aligned
from gpufeed._threads import Stopped
from gpufeed._tree import Rebuild, flatten
from gpufeed.host_memory import Lease, plain, register, unregister

#: A new slot's size is the batch's bytes rounded up to a whole number of these, so that batches a little
#: larger (a ragged last sample, a longer sequence) still fit it.
SLOT_GRAIN = 1 << 20
FREE, BUSY = 0, 1
#: ``state[-1]``: whether the workers collate into slots (only while a prefetcher iterates the loader), and
#: whether the prefetcher closed (its persistent workers then drop the slots they hold).
IDLE, ITERATING, CLOSED = 0, 1, 2


@dataclass(frozen=True)
class _Leaf:
    """Where one tensor of a slotted batch lies in its slot."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class SlotBatch:
    """What a worker sends instead of a batch: the batch with each tensor replaced by a :class:`_Leaf`, the
    number and generation of the slot that holds the tensors' bytes, and the worker's slots whose
    generation the main process has not installed, by number: ``(generation, slot)``, the slot's memory
    crossing as a shared-memory handle."""

    sid: int
    gen: int
    batch: Any
    new: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)


class SlotCollate:
    """The collate function a DataLoader's workers run while a prefetcher iterates it: the loader's own
    ``collate_fn``, then the batch's tensors copied into a free slot of this worker (``default_collate``'s
    stacks are made in the slot itself, with no copy after).

    Worker ``w`` owns the slot numbers ``w * per_worker`` to ``(w + 1) * per_worker - 1``; ``state`` (shared
    memory) says which are busy: a worker marks a slot busy before it writes it, the main process marks it
    free once the copy that read it completed. A worker with no free slot that fits makes one (in a number
    it does not use yet, or in place of a free one too small); with none free it sends the batch as the
    DataLoader would, so a batch never waits for a slot. A worker that makes a slot makes, beside it, free
    ones of the same size in numbers it does not use yet, until it has ``ahead`` slots that fit (the
    batches of its own that the pipeline holds at once): the main process registers them all with that
    first batch. ``state[-1]`` is ``ITERATING`` while a prefetcher iterates the loader: persistent workers
    send plain batches to anyone who iterates the loader after it (``IDLE``), and drop their slots once the
    prefetcher closed (``CLOSED``).

    Each slot number has a generation, raised each time a worker makes a new slot there; ``installed``
    (shared) holds the generation the main process installed, and a worker sends each of its slots whose
    generation is not installed with every batch, until it is: a batch that carried a new slot and was
    dropped (a persistent DataLoader discards the batches of a broken-off epoch) is never taken to have
    installed it, and the main process installs a generation only over an older one.
    """

    def __init__(self, collate_fn: Any, state: torch.Tensor, installed: torch.Tensor,
                 slots: dict[int, torch.Tensor], per_worker: int, ahead: int) -> None:
        self.collate_fn = collate_fn
        self.state = state
        self.installed = installed
        self.slots = slots
        self.per_worker = per_worker
        self.ahead = ahead
        self._mine: dict[int, torch.Tensor] | None = None  # in a worker: its slots, from its first batch
        self._gens: dict[int, int] = {}  # in a worker: the generation of each of its slots
        self._flags: Any = None  # in a worker: ``state`` as numpy (an element read costs no torch call)
        self._installed: Any = None  # in a worker: ``installed`` as numpy

    def __call__(self, samples: Any) -> Any:
        info = torch.utils.data.get_worker_info()
        if self._flags is None:
            self._flags, self._installed = self.state.numpy(), self.installed.numpy()
        if info is None or self._flags[-1] != ITERATING:
            if self._flags[-1] == CLOSED:  # persistent workers let go of a closed prefetcher's slots
                self._mine = {}
            return self.collate_fn(samples)
        leaves, rebuild = self._collate(samples)
        offsets, total = [], 0
        for t in leaves:
            offsets.append(total)
            total += aligned(t.nbytes)
        fits = all(isinstance(t, _Stack) or plain(t) for t in leaves)
        sid = self._take(info.id, total) if fits and total else None
        if sid is None:  # the batch as the loader's collate_fn makes it
            return rebuild([t.stacked() if isinstance(t, _Stack) else t for t in leaves])
        slot, gen = self._mine[sid], self._gens[sid]
        for t, off in zip(leaves, offsets, strict=True):
            if t.nbytes:
                view = slot[off : off + t.nbytes].view(t.dtype).view(t.shape)
                if isinstance(t, _Stack):
                    t.stack_into(view)
                else:
                    view.copy_(t)
        specs = [_Leaf(off, t.dtype, tuple(t.shape)) for t, off in zip(leaves, offsets, strict=True)]
        installed, gens = self._installed, self._gens
        new = {i: (gens[i], s) for i, s in self._mine.items() if installed[i] != gens[i]}
        return SlotBatch(sid, gen, rebuild(specs), new)

    def _collate(self, samples: Any) -> tuple[list[Any], Any]:
        """The batch's leaves (tensors, and with ``default_collate`` the stacks put off: :class:`_Stack`)
        and what rebuilds the batch around new ones."""
        tensor_rule = default_collate_fn_map.get(torch.Tensor)
        if self.collate_fn is default_collate and tensor_rule is collate_tensor_fn:
            stacks: list[_Stack] = []  # (default_collate's map as it is now: types registered after import)
            rules = {**default_collate_fn_map, torch.Tensor: functools.partial(_stack_later, stacks)}
            leaves, rebuild = flatten(collate(samples, collate_fn_map=rules), leaf=(torch.Tensor, _Stack))
            if sum(isinstance(t, _Stack) for t in leaves) == len(stacks):
                return leaves, rebuild
            # a stack inside a container flatten does not see into (a deque): collated again, as it is
        return flatten(self.collate_fn(samples))

    def _take(self, worker: int, nbytes: int) -> int | None:
        """The number of a slot of at least ``nbytes`` of this worker, marked busy (made if need be, with
        free ones beside it up to ``ahead`` that fit)."""
        numbers = range(worker * self.per_worker, (worker + 1) * self.per_worker)
        if self._mine is None:
            self._mine = {i: self.slots[i] for i in numbers if i in self.slots}
            self._gens = {i: int(self._installed[i]) for i in self._mine}
        state, mine = self._flags, self._mine
        for i in numbers:
            if i in mine and state[i] == FREE and mine[i].numel() >= nbytes:
                state[i] = BUSY
                return i
        unused = [i for i in numbers if i not in mine]
        too_small = [i for i in numbers if i in mine and state[i] == FREE]  # (none free fits)
        fitting = sum(s.numel() >= nbytes for s in mine.values())
        made = unused[: max(1, self.ahead - fitting)] or too_small[:1]  # (a larger batch: one at a time)
        for i in made:
            mine[i] = torch.empty(-(-nbytes // SLOT_GRAIN) * SLOT_GRAIN, dtype=torch.uint8).share_memory_()
            self._gens[i] = max(self._gens.get(i, 0), int(self._installed[i])) + 1
            state[i] = FREE
        if not made:
            return None
        state[made[0]] = BUSY
        return made[0]


class _Stack:
    """Tensors that ``default_collate`` stacks, stacked later: straight into a slot. In a worker,
    ``default_collate`` stacks into a fresh shared-memory segment, whose pages fault in (zeroed) one by one;
    a slot's pages are mapped already (docs/design.md, "A training loop: ResNet-18", has the figures)."""

    __slots__ = ("dtype", "nbytes", "shape", "tensors")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        elem = tensors[0]
        self.tensors = tensors
        self.dtype = elem.dtype
        self.shape = (len(tensors), *elem.shape)
        self.nbytes = len(tensors) * elem.nbytes

    def stack_into(self, out: torch.Tensor) -> None:
        torch.stack(self.tensors, 0, out=out)

    def stacked(self) -> torch.Tensor:
        return collate_tensor_fn(self.tensors)


def _stackable(batch: list[torch.Tensor]) -> bool:
    """Whether ``default_collate`` would stack ``batch`` with nothing to fail:
    :func:`~gpufeed.host_memory.plain` tensors of one shape and dtype, with bytes, none requiring grad.
    The stack is put off until the slot is known, so everything it could fail on is checked here, in the
    worker, for every sample, with the cheapest attributes that say as much (``is_cpu``, not ``.device``,
    which makes an object a call; a sample of the first one's plain dtype is not quantized; ``is_nested``
    before ``shape``, which a nested tensor lacks)."""
    elem = batch[0]
    if not (plain(elem) and elem.nbytes):
        return False
    tensor, strided, shape, dtype = torch.Tensor, torch.strided, elem.shape, elem.dtype
    return all(type(t) is tensor and t.is_cpu and t.layout is strided and not t.is_nested and t.dtype is dtype
               and t.shape == shape and not t.requires_grad for t in batch)


def _stack_later(made: list[_Stack], batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> Any:
    """``default_collate``'s rule for tensors, the stack put off (``_Stack``, noted in ``made``) where it
    cannot fail (``_stackable``). Any other batch is collated now, so an error is raised where
    ``default_collate`` raises it."""
    if _stackable(batch):
        made.append(_Stack(batch))
        return made[-1]
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


class WorkerArena:
    """A prefetcher's slots (shared memory its DataLoader workers collate into), each pinned once.

    Invariants: a slot is marked free only when no copy reads it (the release function :meth:`open` returns
    is called once the copy that read it completed); a slot is unregistered only when no copy reads it (a
    worker replaced it, or the prefetcher closed: at once, or once its copy completed); no slot is
    installed after :meth:`close`; slots are handed to the workers of one iteration at a time
    (:meth:`begin` to :meth:`end`), so two sets of workers never share them; and to the workers of one
    loader for as long as it lives (its persistent workers keep their own record of the slots, and may
    still be collating a batch of a broken-off epoch): another loader's batches cross as the DataLoader
    sends them, as do those of a persistent loader whose workers another prefetcher started.
    ``pin=False`` (the CPU path) keeps the slots in shared memory only: the batch is copied out of its slot
    before the slot is released. ``required``: the slots were asked for (``worker_slots=True``), so a
    loader without workers to collate into them is an error, not a fallback.
    """

    def __init__(self, pin: bool, depth: int = 1, stats: Any = None, required: bool = False) -> None:
        self.stats = stats  # the prefetcher's: counts the batches that crossed in slots
        self.pin = pin
        self.required = required
        self.depth = depth  # the prefetcher's: batches it holds ahead of the loop
        self._slots: dict[int, torch.Tensor] = {}
        self._leased: set[int] = set()
        self._state: torch.Tensor | None = None
        self._flags: Any = None  # ``_state`` as numpy
        self._installed: torch.Tensor | None = None  # the generation of each slot installed here (shared)
        self._gens: Any = None  # ``_installed`` as numpy: read on every batch, without a torch call
        self._open = False  # an iteration's workers hold the slots
        self._registered: set[int] = set()  # the addresses of the slots registered with CUDA
        self._per_worker = 0
        self._owner: weakref.ref[Any] | None = None  # the loader whose workers the slots are handed to
        self._closed = False
        self._lock = threading.Lock()  # the loop's thread opens; a close() from another thread may release
        self._pending: collections.deque[tuple[Any, int]] = collections.deque()  # (copy event, slot) leased
        self._cached: dict[int, tuple[Any, list[torch.Tensor]]] = {}  # a slot's views, by its layout

    def begin(self, loader: Any) -> SlotCollate | None:
        """The collate function for the workers of an iteration of ``loader`` about to start, or None where
        slots cannot be handed out: the workers of an earlier iteration may still run (its iterator
        outlived its stop), the loader's workers changed while slots were in use, or the slots belong to
        another loader that is still alive."""
        prefetch = loader.prefetch_factor or 2
        per_worker = prefetch + 2  # a worker's queued batches, and two being copied
        size = loader.num_workers * per_worker
        # Made at a worker's first batch: its queued batches, and its share of those the prefetcher holds
        # (``depth`` ahead, the one being fetched and the one whose copy the loop's batch is).
        ahead = min(per_worker, prefetch + -(-(self.depth + 2) // loader.num_workers))
        with self._lock:
            if self._quiet_another_s_workers(loader):  # (first: whatever else holds the slots, they are told)
                return None
            owner = self._owner() if self._owner is not None else None
            if self._open or (owner is not None and owner is not loader):
                return None
            if self._state is None or self._per_worker != per_worker or len(self._state) != size + 1:
                if self._leased:
                    return None
                self._unregister_all()
                self._state = torch.zeros(size + 1, dtype=torch.int8).share_memory_()
                self._flags = self._state.numpy()
                self._installed = torch.zeros(size, dtype=torch.int64).share_memory_()
                self._gens = self._installed.numpy()
                self._per_worker = per_worker
            self._owner = weakref.ref(loader)
            for i in range(size):  # a batch of a stopped iteration never arrives: its slot is free again
                if i not in self._leased:
                    self._flags[i] = FREE
            self._flags[-1] = ITERATING
            self._open = True
            return SlotCollate(loader.collate_fn, self._state, self._installed, dict(self._slots), per_worker,
                               ahead)

    def _quiet_another_s_workers(self, loader: Any) -> bool:
        """Tell ``loader``'s persistent workers to send plain batches from now on if they run another
        prefetcher's collate function (they keep the one they started with: that prefetcher's iteration
        ends here); returns whether they do."""
        theirs = getattr(getattr(loader, "_iterator", None), "_collate_fn", None)
        if not isinstance(theirs, SlotCollate) or theirs.state is self._state:
            return False
        if theirs.state[-1] == ITERATING:
            theirs.state[-1] = IDLE
        return True

    def end(self) -> None:
        """The iteration ended and its workers shut down (persistent ones send plain batches until the
        next)."""
        with self._lock:
            self._open = False
            if self._flags is not None and not self._closed:
                self._flags[-1] = IDLE

    def open(self, sb: SlotBatch) -> tuple[list[torch.Tensor], Rebuild, Lease]:
        """The tensors of ``sb``'s batch as views of its slot (pinned), what rebuilds the batch around them,
        and its lease: called with the event of the copy that read the slot, which is free again once that
        event completed (a second call does nothing)."""
        self._collect()
        with self._lock:
            if self._closed:  # a batch fetched while another thread closed the prefetcher: never handed out
                raise Stopped
            for sid, (gen, slot) in sb.new.items():
                if gen > self._gens[sid]:  # (a batch taken out of order may carry an older one)
                    self._install(sid, slot)
                    self._gens[sid] = gen
            if self._gens[sb.sid] != sb.gen:  # (the generations above make this unreachable)
                raise RuntimeError(f"gpufeed: worker slot {sb.sid} generation {sb.gen} was never installed")
            slot = self._slots[sb.sid]
            self._leased.add(sb.sid)
        released = False

        def lease(event: Any) -> None:
            nonlocal released
            if not released:
                released = True
                if event is None or event.query():
                    self._release(sb.sid)
                else:
                    self._pending.append((event, sb.sid))

        if self.stats is not None:
            self.stats.slot_batches += 1
        specs, rebuild = flatten(sb.batch, leaf=_Leaf)
        return self._views(sb.sid, slot, specs), rebuild, lease

    def _views(self, sid: int, slot: torch.Tensor, specs: list[_Leaf]) -> list[torch.Tensor]:
        """The tensors ``specs`` describe, as views of ``slot``: made once for a slot and a layout, as batches
        of one shape follow each other (three torch calls a tensor otherwise, every batch). The views go only
        to the device stage, which copies them; they are dropped with the slot."""
        key = (slot.data_ptr(), tuple(specs))
        cached = self._cached.get(sid)
        if cached is None or cached[0] != key:
            views = [slot[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in specs]
            cached = self._cached[sid] = (key, views)
        return list(cached[1])

    def _collect(self, wait: bool = False) -> None:
        """Release the slots whose copies completed (all of them, waiting, with ``wait``)."""
        while self._pending and (wait or self._pending[0][0].query()):
            event, sid = self._pending.popleft()
            if wait:
                event.synchronize()
            self._release(sid)

    def _release(self, sid: int) -> None:
        with self._lock:
            self._leased.discard(sid)
            if self._closed:
                self._cached.pop(sid, None)
                slot = self._slots.pop(sid, None)
                if slot is not None:
                    self._unregister(slot)
            elif self._flags is not None:
                self._flags[sid] = FREE

    def close(self) -> None:
        """Unregister every slot once no copy reads it, and tell persistent workers to let go of theirs."""
        try:
            self._collect(wait=True)
        except Exception:  # a broken CUDA context: nothing left to wait for
            pass
        with self._lock:
            self._closed = True
            if self._flags is not None:
                self._flags[-1] = CLOSED
            for sid in [i for i in self._slots if i not in self._leased]:
                self._cached.pop(sid, None)
                self._unregister(self._slots.pop(sid))

    def _install(self, sid: int, slot: torch.Tensor) -> None:
        self._cached.pop(sid, None)
        old = self._slots.pop(sid, None)
        if old is not None:
            self._unregister(old)
        if self.pin:
            try:
                register(slot)
                self._registered.add(slot.data_ptr())
            except RuntimeError as exc:  # the locked-memory limit: the batch is staged as a pageable one
                self.pin = False
                warnings.warn(f"gpufeed: cannot pin the DataLoader workers' shared buffers ({exc}); their "
                              "batches are staged through pinned memory instead. Raise the locked-memory "
                              "limit (ulimit -l) or pass worker_slots=False", RuntimeWarning, stacklevel=2)
        self._slots[sid] = slot

    def _unregister_all(self) -> None:
        for slot in self._slots.values():
            self._unregister(slot)
        self._slots.clear()
        self._cached.clear()

    def _unregister(self, slot: torch.Tensor) -> None:
        if slot.data_ptr() in self._registered:
            self._registered.discard(slot.data_ptr())
            unregister(slot)
