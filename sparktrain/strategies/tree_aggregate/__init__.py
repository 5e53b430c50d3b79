"""``strategy="tree_aggregate"``, all of it: the MLlib way, one ordinary Spark job per round.

One feature, one folder. A module's name says which side of the job it runs on:

- :mod:`.strategy`: the plug-in (:class:`TreeAggregate`: its abilities, checks and
  launch), which the registry imports by this package's name;
- ``driver*``: the driver's half. :mod:`.driver` is the round loop (size, train epochs
  of rounds, checkpoint, summarise); :mod:`.driver_round` caches the data and runs one
  round as one Spark job (RDDs, broadcasts, ``treeAggregate``), :mod:`.driver_frames`
  the same under Spark Connect (DataFrame operations); :mod:`.driver_weights` serves the
  ``delta+`` weights mirror; :mod:`.driver_volume` reads Spark's traffic counts;
- ``task*``: what runs in a partition, on the executors (never importing pyspark).
  :mod:`.task` computes a partition's contribution to a round, :mod:`.task_frames` runs
  it and the tree's levels as Arrow functions under Spark Connect, :mod:`.task_weights`
  keeps the tasks' copy of the ``delta+`` mirror;
- both sides: :mod:`.codec` (a contribution, its compression and treeAggregate's combOp)
  and :mod:`.flat` (parameters as one flat vector and back).
"""

from sparktrain.strategies.tree_aggregate.strategy import TreeAggregate

__all__ = ["TreeAggregate"]
