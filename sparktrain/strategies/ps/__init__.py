"""``strategy="ps"``, all of it: a parameter server in the driver, pushes and pulls from
the tasks.

One feature, one folder. A module's name says which side of the job it runs on:

- :mod:`.strategy`: the plug-in (:class:`ParameterServer`: its abilities, checks and
  driver half), which the registry imports by this package's name;
- ``server*``: the driver's side. :mod:`.server` hosts the shards
  (:func:`~sparktrain.strategies.ps.server.start_parameter_server`), each with its
  consistency ledger (:mod:`.server_consistency`: the sync/async/ssp rules), its rows of
  the ``sparse=True`` tables (:mod:`.server_tables`) and its counters
  (:mod:`.server_stats`, the summary's ``ps`` entry); :mod:`.server_persist` checkpoints
  the server from the driver (driver restarts);
- :mod:`.client`: what runs in a task (never importing pyspark):
  :class:`~sparktrain.strategies.ps.client.ParameterServerSync`, the ranks' ``StepSync``;
- both sides: :mod:`.protocol` (the messages), :mod:`.layout` (the flat vector and its
  shards) and :mod:`.bootstrap` (a ``sparktrain.run`` job's server, started from rank 0's
  model: rank 0's request and the driver's :class:`~sparktrain.strategies.ps.bootstrap.Bootstrap`).
"""

from sparktrain.strategies.ps.strategy import ParameterServer

__all__ = ["ParameterServer"]
