"""Loaders: what yields host batches to the device stage.

* :class:`~gpufeed.loaders.dataloader.LoaderAdapter` wraps any DataLoader, iterable or factory;
* :class:`~gpufeed.loaders.source_loader.SourceLoader` batches, shuffles and shards a BatchSource.

Both own their epoch and resume state, and hand out :class:`~gpufeed.host_memory.HostBatch` objects.
"""
