"""The parameter-server strategy (``strategy="ps"``).

The server runs inside the driver (:func:`~sparktrain.ps.server.start_parameter_server`);
each barrier task pushes gradients to and pulls parameters from it through
:class:`~sparktrain.ps.client.ParameterServerSync`. The wire format lives in
:mod:`sparktrain.ps.protocol`, the flat-vector layout and sharding in
:mod:`sparktrain.ps.layout`, the sync/async/ssp rules in :mod:`sparktrain.ps.consistency`,
the server's figures in :mod:`sparktrain.ps.stats`, its checkpoints (driver restarts) in
:mod:`sparktrain.ps.persist`.
"""

from sparktrain.ps.layout import shard_ranges

__all__ = ["shard_ranges"]
