"""The two things a prefetcher can wrap: an iterable (a loader) or a BatchSource."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gpufeed._copier import Copier, Delivered, WithState
from gpufeed.staging import Chunk, byte_view, split


def make_mode(source: Any, pf: Any, **kw: Any) -> Any:
    from gpufeed.sources.base import BatchSource

    if isinstance(source, BatchSource) and not isinstance(source, Iterable):
        return SourceMode(source, pf, **kw)
    if kw.get("batch_size") is not None or kw.get("shuffle"):
        raise ValueError(
            "batch_size/shuffle/drop_last/seed/rank/world_size apply to a BatchSource; "
            f"{type(source).__name__} is an iterable that batches itself (set them on your DataLoader)"
        )
    return IterableMode(source)


def _forward_set_epoch(loader: Any, epoch: int) -> None:
    seen: set[int] = set()
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        fn = getattr(obj, "set_epoch", None)
        if obj is not None and callable(fn) and id(obj) not in seen:
            seen.add(id(obj))
            fn(epoch)


class IterableMode:
    """Wraps a loader: any re-iterable, or a zero-argument callable that returns a fresh iterable."""

    def __init__(self, loader: Any) -> None:
        is_factory = callable(loader) and not isinstance(loader, Iterable)
        if not is_factory and not isinstance(loader, Iterable):
            raise ValueError(
                f"CudaPrefetcher needs an iterable (a DataLoader, a list), a callable returning one, "
                f"or a BatchSource; got {type(loader).__name__}"
            )
        self.source = loader
        self._factory = loader if is_factory else None
        self.stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None))

    def length(self) -> int:
        try:
            return len(self.source)
        except TypeError:
            raise TypeError(f"the wrapped {type(self.source).__name__} has no len()") from None

    def set_epoch(self, epoch: int, implicit: bool = False) -> None:
        if not implicit:  # like a DataLoader: a sampler's epoch changes only when set_epoch is called
            _forward_set_epoch(self.source, epoch)

    def initial_state(self, epoch: int, start: int) -> Any:
        return self.source.state_dict() if self.stateful else None

    def state_dict(self, last: Any, epoch: int) -> dict[str, Any]:
        if not self.stateful:
            raise TypeError(
                f"cannot take the state of a {type(self.source).__name__}: it has no state_dict(). "
                "Wrap a torchdata StatefulDataLoader (pip install 'gpufeed[resume]') or use a BatchSource"
            )
        if last is None:
            last = self.source.state_dict()
        return {"gpufeed": STATE_VERSION, "mode": "loader", "epoch": epoch, "loader": last}

    def load_state_dict(self, state: dict[str, Any]) -> tuple[int, int]:
        _check_state(state, "loader")
        if not self.stateful:
            self.state_dict(None, 0)  # raises the TypeError that says why
        self.source.load_state_dict(state["loader"])
        return int(state["epoch"]), 0

    def batches(self, epoch: int, start: int = 0) -> Iterable[Any]:
        if self._factory is not None:
            return _Lazy(self._factory)
        if self.stateful:
            return _with_state(self.source)
        return self.source

    def close(self) -> None:
        pass


class _Lazy:
    def __init__(self, factory: Any) -> None:
        self.factory = factory

    def __iter__(self) -> Iterator[Any]:
        return iter(self.factory())


def _with_state(loader: Any) -> Iterator[WithState]:
    for batch in loader:
        yield WithState(batch, loader.state_dict())


class SourceMode:
    """Wraps a BatchSource: gpufeed samples, batches, shards and reads it into its own buffers."""

    def __init__(self, source: Any, pf: Any, *, batch_size: int | None, shuffle: bool | str, drop_last: bool,
                 seed: int, rank: int | None, world_size: int | None, pad: bool) -> None:
        if batch_size is None or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"a BatchSource needs batch_size=N (an int >= 1), got {batch_size!r}")
        if shuffle not in (False, True, "blocks"):
            raise ValueError(f"shuffle must be False, True or 'blocks', got {shuffle!r}")
        if rank is None and world_size is None and _dist_ready():
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        rank, world_size = rank or 0, world_size or 1
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.source = source
        self.config = dict(batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, seed=int(seed),
                           rank=rank, world_size=world_size, pad=pad)
        self.stateful = True
        self._epoch = 0

    def _plan(self, epoch: int) -> list[Any]:
        from gpufeed.sources.sampling import plan_batches

        c = self.config
        return plan_batches(len(self.source), c["batch_size"], shuffle=c["shuffle"], drop_last=c["drop_last"],
                            seed=c["seed"], epoch=epoch, rank=c["rank"], world_size=c["world_size"],
                            pad=c["pad"])

    def length(self) -> int:
        return len(self._plan(self._epoch))

    def set_epoch(self, epoch: int, implicit: bool = False) -> None:
        self._epoch = epoch

    def initial_state(self, epoch: int, start: int) -> dict[str, int]:
        return {"epoch": epoch, "batch": start}

    def state_dict(self, last: Any, epoch: int) -> dict[str, Any]:
        pos = last or {"epoch": epoch, "batch": 0}
        return {"gpufeed": STATE_VERSION, "mode": "source", **pos, "num_samples": len(self.source),
                "config": dict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> tuple[int, int]:
        _check_state(state, "source")
        mine = {**self.config, "num_samples": len(self.source)}
        theirs = {**state.get("config", {}), "num_samples": state.get("num_samples")}
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            what = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"this state was saved with another configuration ({what}); "
                             "resume with the same source, batch_size, shuffle, seed, drop_last and ranks")
        epoch, start = int(state["epoch"]), int(state["batch"])
        if start >= len(self._plan(epoch)):  # the epoch was complete: resume at the next one
            epoch, start = epoch + 1, 0
        return epoch, start

    def batches(self, epoch: int, start: int = 0) -> Iterator[WithState]:
        plan = self._plan(epoch)
        for i in range(start, len(plan)):
            yield WithState(SourceBatch(self.source, plan[i]), {"epoch": epoch, "batch": i + 1})

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if callable(close):
            close()


STATE_VERSION = 1
_ALIGN = 64  # each field's region in a staging buffer starts on a cache line (and any dtype's alignment)


def _regions(fields: Any, nrows: int) -> tuple[dict[str, int], int]:
    """Byte offsets of each field's ``nrows`` rows inside one staging buffer, and the buffer's size."""
    offsets, off = {}, 0
    for k, f in fields.items():
        offsets[k] = off
        off += -(-(nrows * f.sample_nbytes) // _ALIGN) * _ALIGN
    return offsets, off


def _check_state(state: Any, mode: str) -> None:
    if not isinstance(state, dict) or "gpufeed" not in state:
        raise ValueError(f"not a gpufeed state_dict: expected a dict from CudaPrefetcher.state_dict(), got "
                         f"{type(state).__name__}")
    if state["gpufeed"] != STATE_VERSION:
        raise ValueError(f"gpufeed state version {state['gpufeed']} is not supported (this is {STATE_VERSION})")
    if state.get("mode") != mode:
        raise ValueError(f"this state was saved from a prefetcher over a {state.get('mode')}, "
                         f"but this one wraps a {mode}; resume with the same kind of input")


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class SourceBatch:
    """One batch of a BatchSource: which rows; the copier calls :meth:`gpufeed_read` to read them."""

    def __init__(self, source: Any, rows: Any) -> None:
        self.source = source
        self.rows = rows

    def gpufeed_read(self, copier: Copier, stop: threading.Event) -> Delivered:
        fields = self.source.fields
        n = len(self.rows)
        dev = copier.device if copier.stream is not None else torch.device("cpu")
        reads_to = getattr(self.source, "reads_to", "host")
        nbytes = n * sum(f.sample_nbytes for f in fields.values())
        with torch.cuda.stream(copier.stream) if copier.stream is not None else _null():
            start = copier._begin() if copier.stream is not None else None
            out = {k: torch.empty((n, *f.shape), dtype=f.dtype, device=dev) for k, f in fields.items()}
            if dev.type == "cpu" or reads_to == "device":
                if dev.type == "cuda":
                    copier.stream.synchronize()  # fence: no queued copy-stream work still touches these blocks
                self._read_direct(copier, out, stop)
            else:
                copier.pipeline.run(self._chunks(out, copier.pool.chunk_bytes, copier.pool.fill_bytes,
                                                 copier.pipeline.threads), stop)
            batch: Any = out
            if copier.transform is not None:
                batch = copier.transform(batch)
            fresh = [t for t in (batch.values() if isinstance(batch, dict) else []) if t.device == dev]
            event = copier._end(start, []) if start is not None else None
        copier.stats.add(bytes=nbytes)
        return Delivered(batch, event, fresh)

    def _row_pieces(self, row_bytes: int, piece_bytes: int) -> list[tuple[int, int]]:
        per = max(1, piece_bytes // max(1, row_bytes))
        return [(a, a + k) for a, k in split(len(self.rows), per)]

    def _read_direct(self, copier: Copier, out: dict[str, torch.Tensor], stop: threading.Event) -> None:
        row_bytes = sum(t[0].numel() * t.element_size() for t in out.values()) if len(self.rows) else 1
        threads = copier.pipeline.threads
        per = max(1, min(copier.pool.fill_bytes // max(1, row_bytes), -(-len(self.rows) // threads)))
        pieces = [(a, a + k) for a, k in split(len(self.rows), per)]
        futs = [copier.pipeline.executor.submit(self.source.read, self.rows[a:b],
                                                {k: t[a:b] for k, t in out.items()}) for a, b in pieces]
        for f in futs:
            f.result()

    def _chunks(self, out: dict[str, torch.Tensor], chunk_bytes: int, fill_bytes: int, threads: int) -> list[Chunk]:
        fields = self.source.fields
        row_bytes = sum(f.sample_nbytes for f in fields.values())
        chunks = []
        for r0, r1 in self._row_pieces(row_bytes, chunk_bytes):
            offsets, nbytes = _regions(fields, r1 - r0)
            copies = [(byte_view(out[k])[r0 * f.sample_nbytes : r1 * f.sample_nbytes], offsets[k],
                       (r1 - r0) * f.sample_nbytes) for k, f in fields.items()]
            pieces = self._sub(r0, r1, row_bytes, fill_bytes, threads)
            chunks.append(Chunk(nbytes, [], copies, prepare=self._binder(offsets, r0, pieces)))
        return chunks

    def _sub(self, r0: int, r1: int, row_bytes: int, fill_bytes: int, threads: int) -> list[tuple[int, int]]:
        # At least one read per worker thread for the batch, so every thread reads (like a 16-thread pread).
        per = max(1, min(fill_bytes // max(1, row_bytes), -(-len(self.rows) // threads)))
        return [(r0 + a, r0 + a + k) for a, k in split(r1 - r0, per)]

    def _binder(self, offsets: dict[str, int], r0: int, pieces: list[tuple[int, int]]) -> Any:
        """Reads of rows ``[a, b)`` for each piece, into their places in a chunk buffer holding rows from
        ``r0``, each field's region starting at ``offsets``; the views are made when the buffer is bound."""
        fields, read = self.source.fields, self.source.read

        def bind(buf: torch.Tensor) -> list[Any]:
            jobs = []
            for a, b in pieces:
                views = {}
                for k, f in fields.items():
                    base = offsets[k] + (a - r0) * f.sample_nbytes
                    views[k] = buf[base : base + (b - a) * f.sample_nbytes].view(f.dtype).view(b - a, *f.shape)
                jobs.append(functools.partial(read, self.rows[a:b], views))
            return jobs

        return bind


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None
