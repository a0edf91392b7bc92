"""Lazy imports of optional backends, with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

_EXTRA_OF = {
    "h5py": "hdf5",
    "kvikio": "gds",
    "cupy": "gds",
    "nvtx": "nvtx",
    "torchdata": "resume",
    "torchdata.nodes": "nodes",  # (torchdata >= 0.10: gpufeed.nodes)
    "matplotlib": "dev",
    "nvidia.libnvcomp": "nvcomp",  # a namespace package: looked up by its full name
}


def require(module: str, what: str = "") -> ModuleType:
    """Import ``module`` or raise an ImportError naming the gpufeed extra that provides it.

    Args:
        module: the top-level module name, e.g. ``"h5py"``.
        what: the feature that needs it, for the message (e.g. ``"H5Source"``).

    Example:
        >>> np = require("numpy")
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = _EXTRA_OF.get(module) or _EXTRA_OF.get(module.split(".")[0])
        need = f"{what} needs {module}" if what else f"{module} is not installed"
        hint = f"pip install 'gpufeed[{extra}]'" if extra else f"pip install {module}"
        raise ImportError(f"{need}; install it with: {hint}") from exc
