"""``strategy="ring"``, ``"tree"`` and ``"auto"``: gradients averaged by an allreduce
between the tasks, every rank stepping the same optimizer.

- :mod:`.strategy`: the plug-ins (:class:`Ring`, :class:`Tree`, :class:`Auto`, on
  :class:`Allreduce`), which the registry imports by this package's name;
- :mod:`.task_torch`: ``comm_backend="torch"``, the same averaging through
  ``torch.distributed`` (Gloo, NCCL) in the tasks (never importing pyspark).

What the ranks run otherwise is shared with the other strategies and lives in
:mod:`sparktrain.task`: :class:`~sparktrain.task.step_sync.AllreduceSync` (the buckets,
the overlap thread, compression per bucket), ZeRO-1's
:class:`~sparktrain.task.sharded.ShardedSync` and the gradient buckets
(:mod:`sparktrain.task.buckets`), since the task's optimizer step
(:mod:`sparktrain.task.stepping`) and checkpoints know them.
"""

from sparktrain.strategies.allreduce.strategy import Allreduce, Auto, Ring, Tree

__all__ = ["Allreduce", "Auto", "Ring", "Tree"]
