"""Typed input columns and the one batch structure every consumer reads.

:mod:`sparktrain.data.columns` says which DataFrame columns feed the model, as what dtype
and shape, and how the model is called; :mod:`sparktrain.data.batch` turns gathered rows
into a :class:`~sparktrain.data.batch.Batch` (padding, masks, decoding, collate) and calls
the model with it. Executor-side code: no pyspark here.
"""
