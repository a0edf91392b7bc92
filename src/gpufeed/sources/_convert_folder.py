"""The output folder of ``convert_h5_to_raw``: one lock for a whole conversion, generations of data files,
and the one rename that moves the folder from one generation to the next.

A conversion writes a new generation beside the current one (data files named ``<field>.gen-<id>.bin``),
then renames its manifest over ``manifest.json``: a reader finds the old manifest with its files or the
new one with its files, never a mix, and never no manifest. Whatever a conversion killed at any instant
left behind (a generation no manifest names, a temporary manifest) is convert's own by its name, and the
next conversion removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import _manifest
from ._files import io_error

LOCK = ".gpufeed-convert.lock"
_GENERATION = re.compile(r"\.gen-[0-9a-f]{12}\.bin$")
# A temporary manifest (``.manifest.json.tmp-<id>``), or a data file of an older gpufeed
# (``.<field>.bin.tmp-<pid>``), left by a conversion that was killed.
_TEMPORARY = re.compile(r"^\..+\.tmp-[0-9a-f]+$")


def new_generation() -> str:
    return secrets.token_hex(6)


def data_file(stem: str, generation: str) -> str:
    return f"{stem}.gen-{generation}.bin"


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold ``out``'s lock (``fcntl.flock`` on its lock file, exclusive), creating the folder if need be;
    wait while another conversion holds it. The lock goes with the process: a killed holder frees it."""
    while True:
        fd = _open_lock(out)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _still_there(fd, out / LOCK):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # a failed first conversion removed the folder while we waited: lock the new one
    try:
        yield
    finally:
        os.close(fd)


def _open_lock(out: Path) -> int:
    try:
        out.mkdir(parents=True, exist_ok=True)
        return os.open(out / LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        raise io_error(exc, f"gpufeed convert cannot write in the output folder {out}; choose a folder you "
                       "can write to, or fix its permissions", str(out)) from exc


def _still_there(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def named_files(out: Path) -> set[str] | None:
    """The data files the manifest in ``out`` names (any version of it, parsed without checks); an empty
    set without a manifest, None when ``manifest.json`` is not a gpufeed manifest."""
    try:
        doc: Any = json.loads((out / _manifest.NAME).read_text())
        if doc.get("format") != _manifest.FORMAT:
            return None
        return {str(spec["file"]) for spec in doc["fields"].values()}
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def foreign(out: Path, named: set[str] | None) -> list[str]:
    """The entries of ``out`` that gpufeed convert did not write."""
    mine = {LOCK} | (named or set()) | ({_manifest.NAME} if named is not None else set())
    return sorted(n for n in os.listdir(out) if n not in mine and not _leftover(n))


def _leftover(name: str) -> bool:
    return bool(_GENERATION.search(name) or _TEMPORARY.match(name))


def remove_leftovers(out: Path, keep: set[str], old: set[str] | None = None) -> None:
    """Remove what earlier conversions left in ``out``: generations and temporaries that ``keep`` (the
    current manifest's files) does not name, and the files of ``old`` (the manifest it replaced)."""
    for name in os.listdir(out):
        if name not in keep and (_leftover(name) or name in (old or ())):
            try:
                os.unlink(out / name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise io_error(exc, f"removing {name}, a file an earlier conversion left in {out}",
                               str(out / name)) from exc


def switch(out: Path, doc: dict[str, Any], generation: str) -> Path:
    """Write the manifest of a new generation, whose files are written and synced, and rename it over
    ``manifest.json``: the one step that replaces the folder's conversion."""
    manifest = out / _manifest.NAME
    tmp = _manifest.write_temp(manifest, doc, generation)
    try:
        os.replace(tmp, manifest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise io_error(exc, f"renaming {tmp.name} to {manifest}; the earlier conversion in {out} is "
                       "unchanged", str(manifest)) from exc
    _sync_folder(out)
    return manifest


def _sync_folder(out: Path) -> None:
    """Make the rename durable (a crash of the machine, not only of the process, keeps it); a folder that
    cannot be synced (some network file systems) keeps it as its file system does."""
    try:
        fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
