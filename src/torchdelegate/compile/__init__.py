"""Compiling partitions beyond one at a time: a content-addressed compile cache, worker processes,
a Dask cluster (``torchdelegate.preprocessing``)."""
