"""What the driver serves a barrier stage's tasks over the authenticated wire, one
attempt at a time: the rendezvous (:mod:`.rendezvous`), rank 0's progress
(:mod:`.metrics_server`, whose display hands records to :mod:`.loggers`: callbacks,
TensorBoard, MLflow), the trained state (:mod:`.state_receiver`) and payloads too big
for a Spark Connect plan (:mod:`.payload_server`). Each is a
:class:`~sparktrain.wire.service.DriverService`; the tasks' halves live in
:mod:`sparktrain.task`.
"""
