"""gpufeed: the GPU never waits for data.

Example:
    >>> from gpufeed import CudaPrefetcher
    >>> for batch in CudaPrefetcher([{"x": torch.ones(2)}], device="cpu"):  # doctest: +SKIP
    ...     pass
"""

from importlib import metadata as _metadata

from gpufeed._static import StaticBatch
from gpufeed.convert import convert_h5_to_raw
from gpufeed.loaders.source_loader import SourceLoader
from gpufeed.prefetcher import CudaPrefetcher
from gpufeed.sources import BatchSource, Field, GDSSource, H5Source, RawSource
from gpufeed.stats import PrefetchStats

__all__ = [
    "BatchSource",
    "CudaPrefetcher",
    "Field",
    "GDSSource",
    "H5Source",
    "PrefetchStats",
    "RawSource",
    "SourceLoader",
    "StaticBatch",
    "convert_h5_to_raw",
]

try:  # one version number, pyproject.toml's
    __version__ = _metadata.version("gpufeed")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
