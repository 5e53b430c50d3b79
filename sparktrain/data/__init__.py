"""A task's data: typed input columns, its partition's rows, and the one batch structure
every consumer reads.

:mod:`sparktrain.data.columns` says which DataFrame columns feed the model, as what dtype
and shape, and how the model is called. A task's partition becomes a
:class:`~sparktrain.data.partition_data.PartitionData` (:mod:`sparktrain.data.partition_data`:
Arrow batches or RDD rows in, shuffled mini-batches out), one store per column
(:mod:`sparktrain.data.features` for dense columns, :mod:`sparktrain.data.ragged` for
variable-length ones), spilled to memory-mapped Arrow IPC files past ``data_memory_mb``
(:mod:`sparktrain.data.spill`), its next batches gathered on a thread
(:mod:`sparktrain.data.prefetch`). :mod:`sparktrain.data.batch` turns gathered rows into a
:class:`~sparktrain.data.batch.Batch` (padding, masks, decoding, collate) and calls the
model with it. Executor-side code: no pyspark here.
"""
