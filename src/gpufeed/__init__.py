"""gpufeed: the GPU never waits for data.

Example:
    >>> from gpufeed import CudaPrefetcher
    >>> for batch in CudaPrefetcher([{"x": torch.ones(2)}], device="cpu"):  # doctest: +SKIP
    ...     pass
"""

from gpufeed.prefetcher import CudaPrefetcher
from gpufeed.sources.base import BatchSource, Field
from gpufeed.stats import PrefetchStats

__all__ = [
    "BatchSource",
    "CudaPrefetcher",
    "Field",
    "PrefetchStats",
]

__version__ = "0.1.0"
