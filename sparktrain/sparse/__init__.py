"""Embedding tables built with ``sparse=True`` (docs/sparse.md): which parameters they
are and their gradients as rows (:mod:`.rows`, which every strategy's worker half reads),
and the ring's and the tree's row path: the per-step exchange of the rows a step touched
(:mod:`.exchange`), its compressed messages (:mod:`.row_codec`) and how an optimizer
steps the averaged rows (:mod:`.stepper`).

Executor code: no pyspark here.
"""
