"""The ``gpufeed`` command: ``bench``, ``doctor``, ``inspect`` and ``convert``.

Each command lives in a private module (``_cli_bench``, ``_cli_doctor``, ``_cli_inspect``) imported only
when that command runs, so ``gpufeed --help`` and the other commands never load h5py, kvikio or
matplotlib.

Example:
    >>> from gpufeed.cli import main
    >>> main(["inspect", "train.h5"])          # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from gpufeed._cli_util import CLIError

_EPILOG = """\
examples:
  gpufeed bench                          # naive loop vs DataLoader vs gpufeed, on synthetic HDF5
  gpufeed bench --size 2GiB --device cuda:1 --out results/
  gpufeed doctor                         # CUDA, pinned and disk bandwidth, GDS, installed extras
  gpufeed inspect train.h5               # how gpufeed would read each dataset, and why
  gpufeed convert train.h5 train.raw/    # HDF5 -> raw files + manifest.json (for RawSource/GDSSource)

Errors print one line; GPUFEED_DEBUG=1 shows the full traceback instead.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpufeed",
        description="gpufeed: the GPU never waits for data. Measure, diagnose and prepare input pipelines.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpufeed {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    bench = sub.add_parser(
        "bench", help="naive loop vs DataLoader vs gpufeed on synthetic HDF5: table, bench.json, bench.png",
        description="Write a synthetic HDF5 data set, read it to the device with the naive h5py loop, a "
                    "DataLoader, gpufeed over that DataLoader, gpufeed's H5Source and (with kvikio and "
                    "CUDA) GDSSource; print GB/s, consumer wait and speed-up; write bench.json and "
                    "bench.png.",
    )
    _module("_cli_bench").add_arguments(bench)
    bench.set_defaults(module="_cli_bench")

    doctor = sub.add_parser(
        "doctor", help="versions, CUDA, pinned/pageable H2D and page-cache bandwidth, GDS, advice",
        description="Report what this machine can do for an input pipeline, and what to change.",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--probe-bytes", default="64MiB", help="size of each bandwidth probe (default 64MiB)")
    doctor.set_defaults(module="_cli_doctor")

    inspect = sub.add_parser(
        "inspect", help="an HDF5, .npy or manifest file: fields, layout, and the read path gpufeed takes",
        description="Describe FILE (HDF5, .npy or a gpufeed manifest) and how gpufeed would read it.",
    )
    inspect.add_argument("file", help="an .h5/.hdf5 file, a .npy file, or a manifest.json (or its folder)")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(module="_cli_inspect")

    convert = sub.add_parser(
        "convert", help="HDF5 -> raw files + manifest.json (cached), for RawSource and GDSSource",
        description="Convert the datasets of an HDF5 file into raw files plus a JSON manifest "
                    "(gpufeed.convert.convert_h5_to_raw); re-runs only when the source changed.",
    )
    convert.add_argument("h5", help="the HDF5 file")
    convert.add_argument("outdir", help="the folder to write the raw files and manifest.json into")
    convert.add_argument("--fields", nargs="+", default=None, metavar="DATASET",
                         help="datasets to convert (default: the largest group of datasets with one sample "
                              "count; the others are listed, small ones kept as metadata)")
    convert.add_argument("--force", action="store_true",
                         help="write into a folder that holds files gpufeed convert did not write")
    convert.set_defaults(module="_cli_convert")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gpufeed`` command line; returns the exit status (0 ok, 1 failed, 2 bad usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(_module(args.module).run(args) or 0)
    except (CLIError, ImportError, ValueError, OSError) as exc:  # bad input or a missing extra
        if os.environ.get("GPUFEED_DEBUG", "0") not in ("", "0"):
            raise  # the full traceback, for a bug report
        return _fail(args.command, str(exc) or type(exc).__name__)
    except KeyboardInterrupt:
        print(f"gpufeed {args.command}: interrupted", file=sys.stderr)
        return 130


def _fail(command: str, message: str) -> int:
    print(f"gpufeed {command}: error: {message}", file=sys.stderr, flush=True)
    return 1


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"gpufeed.{name}")


def _version() -> str:
    from gpufeed import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
