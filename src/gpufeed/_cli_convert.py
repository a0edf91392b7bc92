"""``gpufeed convert H5 OUTDIR``: HDF5 datasets to raw files + ``manifest.json`` (``convert_h5_to_raw``)."""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

from gpufeed._cli_util import CLIError, format_bytes, say


def run(args: argparse.Namespace) -> int:
    try:
        from gpufeed.convert import convert_h5_to_raw
    except ImportError as exc:
        if "h5py" in str(exc):
            raise
        raise CLIError(
            f"gpufeed.convert.convert_h5_to_raw is not available in this install ({exc}); "
            "upgrade gpufeed"
        ) from None
    if not os.path.exists(args.h5):
        raise CLIError(f"no such file: {args.h5}")
    manifest = Path(args.outdir) / "manifest.json"
    before = manifest.stat().st_mtime_ns if manifest.exists() else None
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():  # skipped datasets are listed below, not as a Python warning
            warnings.simplefilter("ignore", RuntimeWarning)
            path = Path(convert_h5_to_raw(args.h5, args.outdir, fields=args.fields,
                                          force=getattr(args, "force", False)))
    except (ValueError, OSError) as exc:
        raise CLIError(_for_cli(str(exc))) from None
    seconds = time.perf_counter() - t0
    fresh = before is None or path.stat().st_mtime_ns != before
    doc = json.loads(path.read_text())
    fields = doc.get("fields", {})
    total = sum(int(spec.get("file_size", 0)) for spec in fields.values())
    verb = f"converted in {seconds:.1f}s" if fresh else "up to date (source unchanged), nothing rewritten"
    say(f"{args.h5} -> {path}: {len(fields)} field(s), {format_bytes(total)}, {verb}")
    for name, spec in fields.items():
        shape = tuple(spec.get("shape", ()))
        samples, dtype, file = spec.get("num_samples"), spec.get("dtype"), spec.get("file")
        say(f"  {name}: {samples} samples of {shape} {dtype} -> {file}")
    for name, why in doc.get("skipped", {}).items():
        say(f"  {name}: skipped ({_for_cli(why)})")
    meta = doc.get("metadata") or {}
    if meta.get("attrs") or meta.get("datasets"):
        kept = [*meta.get("datasets", {}), *(f"attributes of {obj}" for obj in meta.get("attrs", {}))]
        say(f"  kept as metadata (source.metadata): {', '.join(kept)}")
    say(f"read it with RawSource({str(path)!r}) or GDSSource({str(path)!r})")
    return 0


def _for_cli(message: str) -> str:
    """The library's message in the CLI's words: no Python function names, the flag for the keyword."""
    for prefix in ("convert_h5_to_raw: ", "H5Source: "):
        message = message.replace(prefix, "")
    return message.replace("fields=", "--fields").replace("force=True (--force)", "--force")
