"""The staging copy on gpufeed's own threads (``_hostcopy.c``), built on first use with the system compiler.

torch's CPU copy gives each OpenMP thread one fixed share, so a copy lasts as long as its slowest thread;
here each thread takes 256 KiB pieces until none is left. Measured on an H200 machine (4 x 32 MiB ring
over 24 distinct 64 MiB pageable batches, ``benchmarks/_diag_pcopy.py``): staging alone 80.9 GB/s
against torch's 59.3, end to end 54.1 against 50.0 with a 55 GB/s pinned ceiling.

The library is compiled once per machine into ``$GPUFEED_CACHE`` (default ``~/.cache/gpufeed``) with
``$CC`` or ``cc``, as Triton builds its launchers. Without a compiler, :func:`load` returns None and
staging uses torch's copy; ``gpufeed doctor`` and :data:`status` say which runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpufeed import _driver

Triple = tuple[int, int, int]
PIECE_BYTES = 256 << 10  # 1 MiB pieces ran slower (44.8 against 54.1 GB/s end to end, same machine)
_SOURCE = Path(__file__).with_name("_hostcopy.c")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
#: What :func:`load` found: ``"built <path>"``, or why the compiled copy is not used.
status = "not loaded yet"


def cache_dir() -> Path:
    base = os.environ.get("GPUFEED_CACHE")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpufeed"


def load() -> ctypes.CDLL | None:
    """The compiled copy, building it the first time on this machine; None when it cannot be built."""
    global _lib, _tried, status
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib = _open(_build())
            except (OSError, subprocess.SubprocessError) as exc:
                status = f"unavailable ({exc}); staging uses torch's copy"
            _tried = True
    return _lib


def _build() -> Path:
    source = _SOURCE.read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise OSError("no C compiler found (set CC, or install gcc)")
    flags = ["-O2", "-shared", "-fPIC", "-pthread"]
    # A home folder shared by machines of other architectures or C libraries gets one build for each.
    key = b"|".join([source, os.uname().machine.encode(), " ".join(platform.libc_ver()).encode(),
                     " ".join([cc, *flags]).encode()])
    tag = hashlib.sha256(key).hexdigest()[:16]
    refused = []
    folders = [Path(tempfile.gettempdir()) / f"gpufeed-{os.getuid()}"]
    try:
        folders.insert(0, cache_dir())
    except RuntimeError:  # no home folder (an unknown uid in a container): the temp folder alone
        pass
    for folder in folders:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue  # not writable: try the next folder
        if not _private(folder):
            refused.append(str(folder))
            continue  # another user could have put a library there: never load from it
        lib = folder / f"hostcopy-{tag}.so"
        if lib.exists():
            return lib
        try:
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        except OSError:
            continue
        os.close(fd)
        try:
            cmd = [cc, *flags, "-o", tmp, str(_SOURCE)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise OSError(f"{cc} failed: {r.stderr.strip()[-500:]}")
            os.replace(tmp, lib)  # atomic: a process building at the same time loads one or the other
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return lib
    why = f"; refused (not this user's, or writable by others): {', '.join(refused)}" if refused else ""
    raise OSError(f"no writable folder for the compiled copy ({', '.join(map(str, folders))}){why}")


def _private(folder: Path) -> bool:
    """Whether ``folder`` is this user's and no one else can write to it."""
    st = folder.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _open(path: Path) -> ctypes.CDLL:
    global status
    lib = ctypes.CDLL(str(path))  # CDLL: each call releases the GIL
    ptrs = ctypes.POINTER(ctypes.c_void_p)
    sizes = ctypes.POINTER(ctypes.c_size_t)
    lib.gpufeed_copy.argtypes = [ptrs, ptrs, sizes, sizes, ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    lib.gpufeed_copy.restype = ctypes.c_int
    vp, ip = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
    ints, ulls = ctypes.c_int, ctypes.POINTER(ctypes.c_ulonglong)
    lib.gpufeed_stage.argtypes = [ints, ip, ptrs, ptrs, sizes, sizes, ctypes.c_size_t, ints, ip, ulls, ptrs,
                                  sizes, ptrs, vp, vp, vp, ip]
    lib.gpufeed_stage.restype = ctypes.c_int
    status = f"built {path}"
    return lib


def _pieces(chunks: Sequence[tuple[int, Sequence[Triple]]]) -> tuple[Any, Any, Any, Any, Any, int]:
    """The segment arrays of ``gpufeed_copy``/``gpufeed_stage`` for ``(host_base, segments)`` per chunk.

    Returns ``dst``, ``src``, ``len`` (one entry per segment, each ``(src_address, offset, n)`` going to
    ``host_base + offset``), ``first`` (per chunk, each segment's first piece index and then the chunk's
    piece count: chunk ``c``'s part starts at ``seg_first[c] + c``), ``seg_first`` and the most pieces
    of any chunk.
    """
    nseg = sum(len(segments) for _, segments in chunks)
    n = len(chunks)
    seg_first = (ctypes.c_int * (n + 1))()
    dst = (ctypes.c_void_p * max(1, nseg))()
    src = (ctypes.c_void_p * max(1, nseg))()
    lens = (ctypes.c_size_t * max(1, nseg))()
    first = (ctypes.c_size_t * (nseg + n))()
    s = most = 0
    for c, (base, segments) in enumerate(chunks):
        seg_first[c] = s
        pieces = 0
        for i, (addr, off, m) in enumerate(segments):
            dst[s + i], src[s + i], lens[s + i] = base + off, addr, m
            first[s + c + i] = pieces
            pieces += -(-m // PIECE_BYTES)
        first[s + c + len(segments)] = pieces
        most = max(most, pieces)
        s += len(segments)
    seg_first[n] = s
    return dst, src, lens, first, seg_first, most


def copy(lib: ctypes.CDLL, base: int, segments: Sequence[Triple], threads: int) -> None:
    """Copy each ``(src_address, offset, n)`` of ``segments`` to ``base + offset`` on ``threads`` threads."""
    dst, src, lens, first, _, _ = _pieces([(base, segments)])
    rc = lib.gpufeed_copy(dst, src, lens, first, len(segments), PIECE_BYTES, max(1, threads))
    if rc != 0:
        raise OSError(rc, f"gpufeed: could not start the staging copy's threads: {os.strerror(rc)}")


def driver_ok() -> bool:
    """Whether the CUDA driver's functions were found (the Python path is used otherwise)."""
    return _driver.addresses() is not None


class StageError(RuntimeError):
    """A CUDA driver call of :func:`stage` failed; ``issued`` chunks before it were issued whole."""

    def __init__(self, message: str, issued: int) -> None:
        super().__init__(message)
        self.issued = issued


def stage(lib: ctypes.CDLL, work: Sequence[tuple[int, Sequence[Triple], Sequence[Triple], int]], stream: int,
          threads: int, funcs: tuple[int, int] | None = None) -> None:
    """Fill and send chunks in one call (``gpufeed_stage``), the GIL released throughout.

    ``work``: per chunk, ``(host_base, segments, copies, event)``: each ``(src_address, offset, n)`` of
    ``segments`` is copied to ``host_base + offset`` on the copy team; then each ``(device_address,
    offset, n)`` of ``copies`` is sent from ``host_base + offset`` on ``stream`` (a raw CUstream) and the
    raw CUevent ``event`` is recorded behind them. ``funcs``: the addresses of functions to call instead
    of the driver's ``cuMemcpyHtoDAsync_v2`` and ``cuEventRecord`` (tests without a GPU).
    """
    from_driver = funcs is None
    if funcs is None:
        funcs = _driver.addresses()
        if funcs is None:
            raise StageError("gpufeed: the CUDA driver (libcuda.so.1) was not found", 0)
    h2d, record = funcs
    dst, src, lens, first, seg_first, most = _pieces([(base, segments) for base, segments, _, _ in work])
    n = len(work)
    ncp = sum(len(copies) for _, _, copies, _ in work)
    copy_first = (ctypes.c_int * (n + 1))()
    cp_dev = (ctypes.c_ulonglong * max(1, ncp))()
    cp_host = (ctypes.c_void_p * max(1, ncp))()
    cp_len = (ctypes.c_size_t * max(1, ncp))()
    events = (ctypes.c_void_p * n)()
    k = 0
    for c, (base, _, copies, event) in enumerate(work):
        copy_first[c], events[c] = k, event
        for dev, off, m in copies:
            cp_dev[k], cp_host[k], cp_len[k] = dev, base + off, m
            k += 1
    copy_first[n] = k
    threads = min(threads, max(1, most))  # no more than the pieces of a chunk
    failed = ctypes.c_int(-1)
    rc = lib.gpufeed_stage(n, seg_first, dst, src, lens, first, PIECE_BYTES, max(1, threads), copy_first,
                           cp_dev, cp_host, cp_len, events, stream, h2d, record, ctypes.byref(failed))
    if rc < 0:
        why = f"could not start the staging copy's threads: {os.strerror(-rc)}"
        raise StageError(f"gpufeed: {why}", failed.value)
    if rc > 0:
        name = _driver.error_name(rc) if from_driver else "?"
        why = f"CUDA driver error {rc} ({name}) sending chunk {failed.value}"
        raise StageError(f"gpufeed: {why}", failed.value)
