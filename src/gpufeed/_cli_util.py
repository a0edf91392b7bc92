"""Small helpers shared by the ``gpufeed`` CLI commands: sizes, tables, errors, version look-ups."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


class CLIError(Exception):
    """A user error: printed as ``gpufeed <command>: error: <message>``, exit status 1, no traceback."""


def parse_size(text: str) -> int:
    """Bytes from a size like ``"256MiB"``, ``"2GiB"``, ``"8MB"``, ``"1e9"`` (K/M/G alone are binary).

    Example:
        >>> parse_size("2GiB"), parse_size("8MB"), parse_size("4k")
        (2147483648, 8000000, 4096)
    """
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r}; write e.g. 256MiB, 2GiB, 500MB or 1e9")
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """``"256 MiB"``, ``"4.0 GiB"``, ``"812 B"``: binary units, short.

    Example:
        >>> format_bytes(256 << 20), format_bytes(3 << 29), format_bytes(100)
        ('256 MiB', '1.5 GiB', '100 B')
    """
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            text = f"{n / size:.1f}"
            return f"{text[:-2] if text.endswith('.0') else text} {unit}"
    return f"{int(n)} B"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A plain-text table: columns padded to their widest cell; ``align`` is one ``l``/``r`` per column.

    Example:
        >>> print(table(["a", "b"], [["x", 1], ["yy", 22]], "lr"))
        a    b
        x    1
        yy  22
    """
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(header))]
    align = align.ljust(len(header), "l")[: len(header)]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(row, widths, align, strict=True)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def version_of(module: str) -> str | None:
    """The installed version of the distribution providing top-level ``module``, or None if absent.

    Nothing is imported (kvikio's import alone loads CUDA libraries). Works for distributions whose name
    differs from the module, such as ``kvikio-cu13`` providing ``kvikio``.
    """
    if importlib.util.find_spec(module) is None:
        return None
    dists = _packages().get(module) or [module]
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown version"


@functools.lru_cache(maxsize=1)
def _packages() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


def say(text: str = "", file: TextIO | None = None) -> None:
    """Print one line and flush it now (progress shows up even through a pipe)."""
    out = file if file is not None else sys.stdout
    print(text, file=out, flush=True)


def native_reader() -> tuple[bool, str]:
    """Whether gpufeed's sources read files with the native C reader (``_pread_many.so``) in this
    process: ``(True, "")``, or ``(False, why not)``. ``gpufeed doctor`` and ``gpufeed bench`` both report
    it from here.

    Example:
        >>> native_reader()  # doctest: +SKIP
        (False, 'the native reader was not built at install')
    """
    from gpufeed.sources import _pread

    if _pread.backend() == "native":
        return True, ""
    if os.environ.get("GPUFEED_NATIVE_PREAD") == "0":
        return False, "GPUFEED_NATIVE_PREAD=0"
    return False, "the native reader was not built at install"
