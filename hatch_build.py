"""Wheel build hook: compile gpufeed's optional native reader, ``src/gpufeed/sources/_pread_many.c``.

The library is plain C loaded with ctypes (no CPython API), so one build serves every Python of the
platform. It is optional: with no working C compiler the build goes on without it (a note is printed)
and gpufeed reads with ``os.preadv`` from Python instead. The compiler is ``$CC``, else the one Python
was built with (``sysconfig``), else ``cc``; ``GPUFEED_NO_NATIVE=1`` skips it.

A regular wheel gets the library force-included and a platform tag (``py3-none-<platform>``); an
editable install imports from ``src/``, so the library is written there (git ignores it).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = "src/gpufeed/sources/_pread_many.c"
TARGET = "gpufeed/sources/_pread_many.so"


class NativeReaderHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        if os.environ.get("GPUFEED_NO_NATIVE", "") not in ("", "0"):
            self.app.display_info("gpufeed: GPUFEED_NO_NATIVE is set: no native reader (Python fallback)")
            return
        root = Path(self.root)
        if version == "editable":
            out = root / "src" / TARGET
        else:
            try:
                self._tmp = tempfile.mkdtemp(prefix="gpufeed-native-")
            except OSError as exc:
                self.app.display_warning(f"gpufeed: native reader not built ({exc}); Python fallback")
                return
            out = Path(self._tmp) / Path(TARGET).name
        error = compile_library(root / SOURCE, out)
        if error:
            self.app.display_warning(f"gpufeed: native reader not built ({error}); gpufeed will read "
                                     "shuffled rows with os.preadv from Python (slower, same results)")
            return
        if version != "editable":
            build_data["force_include"][str(out)] = TARGET
            build_data["pure_python"] = False
            build_data["tag"] = f"py3-none-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}"

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        tmp = getattr(self, "_tmp", None)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def compile_library(source: Path, out: Path) -> str:
    """Compile ``source`` into the shared library ``out``; ``""`` on success, else why it failed."""
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    partial = out.with_name(out.name + ".tmp")
    cmd = [*cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(partial), str(source)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=120)
        if run.returncode != 0 or not partial.is_file():
            partial.unlink(missing_ok=True)
            return f"{shlex.join(cmd)} exited with {run.returncode}: {run.stderr.strip()[-500:]}"
        os.replace(partial, out)  # never a half-written library where gpufeed loads it
    except Exception as exc:  # whatever goes wrong here, the install goes on without the library
        return f"{shlex.join(cmd)}: {exc}"
    return ""
