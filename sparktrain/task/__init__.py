"""What a Spark task runs: the entry (:mod:`.run_task`), the rendezvous (:mod:`.meet`),
``ctx`` (:mod:`.run_context`), the built-in loop (:mod:`.loop`), the optimizer step
(:mod:`.stepping`) and the step sync every strategy's worker half is
(:mod:`.step_sync`), reports, metrics and checkpoints.

Executor code: it sees only :class:`~sparktrain.task.context.WorkerContext` and never
imports pyspark, so threads or processes test it without Spark.
"""
