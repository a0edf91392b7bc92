"""GDSSource: kvikio ``CuFile`` reads, into GPU memory when GPUDirect Storage runs, pinned host otherwise."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from gpufeed._extras import require

from ._files import FileDescriptors, PathLike, as_paths, pread_exact, short_read_message, source_label
from ._gather import file_maps
from ._host_source import FileSource, gather_flag, try_gather
from ._layout import Layout
from ._out_tensors import check_outs, device_bytes, host_bytes
from ._per_process import _PerProcess
from ._pread import pread_many
from ._runs import Runs, check_rows
from .base import Rows
from .h5 import H5Source
from .raw import RawSource

_H5_SUFFIXES = (".h5", ".hdf5", ".he5", ".hdf")
_H5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


class GDSSource(FileSource):
    """Samples read with kvikio's ``CuFile.pread``, by byte offset, on kvikio's thread pool.

    Takes what ``RawSource`` reads (raw files, ``.npy``, gpufeed manifests) and HDF5 datasets that
    ``H5Source`` reads by byte offset (contiguous, or chunked and uncompressed). Compressed HDF5 has no
    byte offsets to read: use ``H5Source``, or ``convert_h5_to_raw`` once and a ``GDSSource`` on the result.

    Two modes, reported by ``.mode``:

    * ``"gds"``, when GPUDirect Storage is available (the ``nvidia-fs`` driver is loaded and kvikio does
      not prefer compat mode): ``reads_to == "device"``, the disk DMA-writes the VRAM buffers.
    * ``"compat"``, the usual case on cloud machines: ``reads_to == "host"``, kvikio's threads ``pread``
      into the prefetcher's pinned host buffers and gpufeed copies them on its own copy stream. kvikio's
      own device writes in compat mode serialize with work on the legacy default stream (a read next to a
      default-stream matmul loop takes the sum of both: docs/design.md), which would stall most training
      steps; reading to host keeps the copy overlapped with compute.

    Every future is waited on and its byte count checked: a short read raises OSError naming the file.
    In compat mode, reads smaller than one kvikio task (``task_size``, 4 MiB by default: random rows of
    a shuffled batch) go through ``os.preadv`` on the calling thread, which kvikio would do on one of its
    threads anyway, minus the hand-off.

    Memory ordering (``"gds"`` mode): cuFile writes device memory outside every CUDA stream. ``read``
    returns after all bytes have landed, so they are visible to any stream that runs afterwards; the
    caller must ensure no kernel still reads the buffer being overwritten. ``CudaPrefetcher`` does: it
    allocates each batch's device tensors fresh on its copy stream and waits for that stream's queued work
    before passing them to ``read``.

    Not fork-safe (kvikio's thread pool does not survive ``fork``); pickling carries only paths and
    settings, and the copy opens its own ``CuFile`` handles.

    Args:
        source: a ``RawSource`` or ``H5Source`` to read by offset, or a path (list of paths) to build one
            from: HDF5 files (by suffix or signature) become ``H5Source(source, *args, **kwargs)``,
            anything else ``RawSource(source, *args, **kwargs)``. ``None`` with ``fields=`` for RawSource.
        mode: ``"auto"`` (GDS if available, else compat), ``"gds"`` (raise if GDS is unavailable) or
            ``"compat"`` (always read to host).
        num_threads: kvikio's thread pool size (a process-wide kvikio setting). ``None`` keeps the
            current one unless it is 1 (kvikio's default), which is raised to ``min(16, cpu count)``.
        task_size: bytes per kvikio task (``None``: kvikio's default).
        mmap_gather: in ``"compat"`` mode, how shuffled batches are read, as for ``RawSource``. ``None``:
            the setting of the source given (for a source built from paths, its default: rows in the
            page cache gathered from memory maps). ``"gds"`` mode reads into device memory, where no
            gather applies: ``mode="gds"`` with ``mmap_gather=True`` raises ValueError, and ``mode="auto"``
            that finds GPUDirect Storage reads without it.

    Raises:
        ImportError: kvikio is not installed (``pip install 'gpufeed[gds]'``).
        ValueError: a field cannot be read by byte offset (names it, the file and the fix), or
            ``mmap_gather=True`` with ``mode="gds"``.
        RuntimeError: ``mode="gds"`` where GDS is unavailable.

    Example:
        >>> src = GDSSource("train.raw/manifest.json")        # doctest: +SKIP
        >>> src.mode, src.reads_to                            # doctest: +SKIP
        ('compat', 'host')
    """

    picklable = True
    fork_safe = False

    def __init__(
        self,
        source: RawSource | H5Source | PathLike | Sequence[PathLike] | None = None,
        *args: Any,
        mode: Literal["auto", "gds", "compat"] = "auto",
        num_threads: int | None = None,
        task_size: int | None = None,
        mmap_gather: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if mode not in ("auto", "gds", "compat"):
            raise ValueError(f"GDSSource: mode must be 'auto', 'gds' or 'compat', got {mode!r}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"GDSSource: num_threads must be an int >= 1, got {num_threads!r}")
        inner = _inner(source, args, kwargs)
        gather = inner.mmap_gather if mmap_gather is None else mmap_gather
        self._mmap_gather = gather_flag(gather, "GDSSource")
        if self._mmap_gather is True and mode == "gds":
            raise ValueError("GDSSource: mmap_gather applies to reads into host memory (compat mode) and "
                             "mode='gds' reads into device memory; pass mode='compat', or leave it at None")
        self._layouts: dict[str, Layout] = dict(inner._layouts)
        self._paths: list[str] = list(inner._paths)
        _check_offsets(inner, self._layouts, self._paths)
        self._fields = {n: lay.field for n, lay in self._layouts.items()}
        self._len = len(inner)
        self._inner_repr = repr(inner)
        ids = getattr(inner._fds, "idents", None)  # each file as the inner source found it
        self._idents = None if ids is None else [ids[p] for p in self._paths]
        self._task_size = task_size
        self._where = source_label("GDSSource", self._paths)
        self._configure(mode, num_threads)

    def _configure(self, mode: str, num_threads: int | None) -> None:
        require("kvikio", "GDSSource")
        defaults = require("kvikio.defaults", "GDSSource")  # a submodule `import kvikio` does not load
        compat = bool(defaults.is_compat_mode_preferred())
        if mode == "gds" and compat:
            raise RuntimeError(
                "GDSSource(mode='gds'): GPUDirect Storage is not available here (kvikio prefers compat "
                "mode: no nvidia-fs driver, or KVIKIO_COMPAT_MODE=ON); use mode='auto' or 'compat'"
            )
        self._requested = mode
        self._mode: Literal["gds", "compat"] = "compat" if (compat or mode == "compat") else "gds"
        current = int(defaults.get("num_threads"))
        want = num_threads or (current if current > 1 else max(2, min(16, os.cpu_count() or 1)))
        if want != current:
            defaults.set({"num_threads": want})  # process-wide; takes effect for later reads
        self._num_threads = want
        # In compat mode a read smaller than one kvikio task runs on one kvikio thread anyway: read it
        # with os.preadv on the calling thread instead and skip the future's hand-off, which costs more
        # than such a read (docs/design.md, "kvikio in compat mode").
        self._small = int(self._task_size or defaults.get("task_size")) if self._mode == "compat" else 0
        self._files = _CuFiles(self._paths)
        self._fds = FileDescriptors(self._paths, getattr(self, "_idents", None), self._where)
        self._maps = file_maps(self._paths, self._mmap_gather) if self._mode == "compat" else None

    @property
    def mode(self) -> Literal["gds", "compat"]:
        """``"gds"`` (GPUDirect Storage into device memory) or ``"compat"`` (kvikio POSIX reads to host)."""
        return self._mode

    @property
    def reads_to(self) -> Literal["host", "device"]:
        """``"device"`` in ``"gds"`` mode, ``"host"`` in ``"compat"`` mode."""
        return "device" if self._mode == "gds" else "host"

    @property
    def num_threads(self) -> int:
        """kvikio's thread pool size when this source was made."""
        return self._num_threads

    def describe(self) -> str:
        """Mode, where reads land, kvikio threads, and the source the offsets came from."""
        return (
            f"GDSSource: mode {self._mode} (asked {self._requested}), reads to {self.reads_to} memory, "
            f"{self._num_threads} kvikio threads, over {self._inner_repr}"
        )

    def read(self, rows: Rows, out: Mapping[str, torch.Tensor]) -> None:
        """Write ``rows`` of every field into ``out[name][: len(rows)]``, in the order of ``rows``.

        ``out`` tensors are CUDA tensors in ``"gds"`` mode and host tensors (pinned for speed) in
        ``"compat"`` mode. Returns after every byte has landed.

        Raises:
            IndexError: a row is outside ``[0, len(self))``.
            ValueError: an ``out`` tensor is missing, too small, of the wrong dtype/shape or device.
            FileChangedError: (an OSError) a file changed after the source was made (names it).
            OSError: a read came back short (file truncated) or kvikio failed.
        """
        runs = check_rows(rows, self._len, self._where)
        device_type = "cuda" if self._mode == "gds" else "cpu"
        bufs = check_outs(self._fields, out, runs.n, device_type, self._where)
        if runs.n == 0:
            return
        self._checked_read(lambda: self._read_all(runs, bufs, device_type))

    def _read_all(self, runs: Runs, bufs: Mapping[str, torch.Tensor], device_type: str) -> None:
        pending: list[tuple[Any, int, int, int]] = []
        error: BaseException | None = None
        small, paths = self._small, self._paths
        try:
            for name, layout in self._layouts.items():
                nbytes = runs.n * layout.row_nbytes
                t = bufs[name]
                if try_gather(layout, runs, t, self._maps):  # as RawSource does
                    continue
                if device_type == "cpu" and runs.rows is not None:  # a shuffled batch: many short runs
                    self._read_scattered(layout, runs, t, pending)
                    continue
                buf: Any = device_bytes(t, nbytes) if device_type == "cuda" else host_bytes(t, nbytes)
                for f, fo, nb, oo in zip(*layout.byte_reads(runs), strict=True):
                    if nb < small:
                        pread_exact(self._fds.get(f), buf[oo : oo + nb], fo, paths[f])
                        continue
                    fut = self._files.get(f).pread(buf[oo : oo + nb], nb, fo, self._task_size)
                    pending.append((fut, f, fo, nb))
        except BaseException as exc:
            error = exc
        # Wait on every future even after an error: none may write into out after read returns.
        for fut, file, offset, nbytes in pending:
            try:
                got = fut.get()
            except Exception as exc:  # kvikio raises RuntimeError for POSIX errors, EOF included
                if error is None:
                    error = OSError(
                        f"kvikio read of {paths[file]} ({nbytes} bytes at offset {offset}) failed: {exc}; "
                        "was the file truncated or rewritten? recreate the source"
                    )
                    error.__cause__ = exc
                continue
            except BaseException as exc:
                error = error or exc
                continue
            if got != nbytes and error is None:
                error = OSError(short_read_message(paths[file], offset, nbytes, got))
        if error is not None:
            raise error

    def _read_scattered(self, layout: Layout, runs: Runs, t: torch.Tensor, pending: list) -> None:
        """Compat mode, rows given as an array: reads of a kvikio task or more go to kvikio's threads
        (their futures into ``pending``), then all the shorter ones in one ``pread_many`` on this thread."""
        files, fo, nb, oo = layout.read_arrays(runs)
        nbytes = runs.n * layout.row_nbytes
        long = nb >= self._small
        if long.any():
            buf = host_bytes(t, nbytes)
            for i in np.flatnonzero(long).tolist():
                f = files if isinstance(files, int) else int(files[i])
                a, k = int(oo[i]), int(nb[i])
                pending.append((self._files.get(f).pread(buf[a : a + k], k, int(fo[i]), self._task_size),
                                f, int(fo[i]), k))
            short = ~long
            files = files if isinstance(files, int) else files[short]
            fo, nb, oo = fo[short], nb[short], oo[short]
        pread_many(self._fds, self._paths, files, fo, nb, oo, t.data_ptr(), nbytes)

    def close(self) -> None:
        """Close this process's kvikio and OS file handles (a later ``read`` reopens them). Idempotent."""
        self._files.close()
        super().close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_files"] = state["_fds"] = state["_maps"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._configure(self._requested, self._num_threads)

    def __repr__(self) -> str:
        return f"GDSSource({len(self)} samples, mode={self._mode}, reads_to={self.reads_to})"


class _CuFiles(_PerProcess):
    """kvikio ``CuFile`` handles, opened lazily per process; they outlive every future made from them."""

    def _open(self, path: str) -> Any:
        return require("kvikio", "GDSSource").CuFile(path, "r")

    def _close(self, handle: Any) -> None:
        handle.close()


def _inner(source: Any, args: tuple, kwargs: dict) -> RawSource | H5Source:
    if isinstance(source, (RawSource, H5Source)):
        if args or kwargs:
            raise ValueError("GDSSource: extra arguments are for building a source from paths; got a source")
        return source
    if source is None:
        return RawSource(None, *args, **kwargs)
    paths = as_paths(source, "GDSSource")
    if all(_looks_hdf5(p) for p in paths):
        return H5Source(source, *args, **kwargs)
    return RawSource(source, *args, **kwargs)


def _looks_hdf5(path: str) -> bool:
    if path.lower().endswith(_H5_SUFFIXES):
        return True
    try:
        with open(path, "rb") as fh:
            return fh.read(8) == _H5_SIGNATURE
    except OSError:
        return False


def _check_offsets(inner: RawSource | H5Source, layouts: Mapping[str, Layout], paths: Sequence[str]) -> None:
    for name, layout in layouts.items():
        if layout.by_offset:
            continue
        ext = next(e for e in layout.extents if e.offset < 0)
        reason = ""
        if isinstance(inner, H5Source):
            reason = next((r for p, k, r in inner._how[name] if k not in ("contiguous", "chunked")), "")
        raise ValueError(
            f"GDSSource: field '{name}' in {paths[ext.file]} cannot be read by byte offset ({reason}); "
            "use H5Source for it, or convert once with convert_h5_to_raw(...) and read the manifest "
            "with GDSSource"
        )
