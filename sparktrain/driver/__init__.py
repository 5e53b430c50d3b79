"""The driver's side of a job: opening it (:mod:`.job`, :mod:`.prepare`), the checks
before a barrier stage (:mod:`.resources`, :mod:`.gpu`, :mod:`.occupancy`), Spark as the
driver sees it (:mod:`.spark_env`), the stage runner (:mod:`.stage_runner`) and its one
launcher (:mod:`.barrier`), and the services the tasks dial (:mod:`.services`).

Runs on the driver only; executor code never imports it.
"""
