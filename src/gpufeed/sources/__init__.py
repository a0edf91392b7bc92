"""Sources: collections of fixed-shape samples that write rows straight into gpufeed's buffers.

``import gpufeed.sources`` imports no optional backend: h5py and kvikio load when a source needs them.
"""

from gpufeed.sources._identity import FileChangedError
from gpufeed.sources.base import BatchSource, Field, Rows
from gpufeed.sources.gds import GDSSource
from gpufeed.sources.h5 import H5Source
from gpufeed.sources.raw import RawSource
from gpufeed.sources.sampling import coalesce, plan_batches

__all__ = [
    "BatchSource",
    "Field",
    "FileChangedError",
    "GDSSource",
    "H5Source",
    "RawSource",
    "Rows",
    "coalesce",
    "plan_batches",
]
