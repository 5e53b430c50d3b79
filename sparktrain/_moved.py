"""Modules that moved: their old dotted names keep working for one release, with a warning.

:data:`MOVED` maps an old module name to its new one. Importing an old name (``import``,
``from ... import``, ``importlib``, or unpickling an object pickled under it) warns with a
:class:`DeprecationWarning` that names the new module and returns the new module object
itself: ``sys.modules[old] is sys.modules[new]``, so classes, functions and module state
are the very same objects under both names. ``python -m old`` runs the new module's code
(an old ``spark.python.daemon.module`` in a Spark conf keeps working). An old package
name (``sparktrain.comm``) has a row too and each of its old modules one of its own; it
imports as a package of its own that forwards every other name to the new package
(:class:`_OldPackage`), so ``from sparktrain.launch import stage`` works as well as
``from sparktrain.comm import Mesh``. The finder is installed by
``sparktrain/__init__.py``, so it is in place before any ``sparktrain.*`` name resolves.

A move adds a row here (a plain dict: old -> new); the release after it deletes the row.
No sparktrain module imports an old name (tests/unit/test_moved.py checks).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import CodeType, FrameType, ModuleType

_TREE_AGGREGATE = "sparktrain.strategies.tree_aggregate"

# old dotted name -> new dotted name
MOVED: dict[str, str] = {
    # issue 33.1: tree_aggregate's driver half, task half and codec in one folder
    "sparktrain.launch.rounds": f"{_TREE_AGGREGATE}.driver",
    "sparktrain.launch.round_runner": f"{_TREE_AGGREGATE}.driver_round",
    "sparktrain.launch.round_frames": f"{_TREE_AGGREGATE}.driver_frames",
    "sparktrain.launch.weights_server": f"{_TREE_AGGREGATE}.driver_weights",
    "sparktrain.launch.spark_volume": f"{_TREE_AGGREGATE}.driver_volume",
    "sparktrain.worker.rounds": f"{_TREE_AGGREGATE}.task",
    "sparktrain.worker.round_frames": f"{_TREE_AGGREGATE}.task_frames",
    "sparktrain.worker.round_codec": f"{_TREE_AGGREGATE}.codec",
    "sparktrain.worker.weights_mirror": f"{_TREE_AGGREGATE}.task_weights",
    "sparktrain.worker.flat": f"{_TREE_AGGREGATE}.flat",
    # issue 33.1: the metrics channel split by side; the server module also answers the
    # client's three names for this old path (see NOTES)
    "sparktrain.metrics": "sparktrain.driver.services.metrics_server",
    # issue 33.1: the wire, comm/ -> wire/ (comm/allreduce.py is wire/collectives.py)
    "sparktrain.comm": "sparktrain.wire",
    "sparktrain.comm.chunked": "sparktrain.wire.chunked",
    "sparktrain.comm.connection": "sparktrain.wire.connection",
    "sparktrain.comm.frames": "sparktrain.wire.frames",
    "sparktrain.comm.handshake": "sparktrain.wire.handshake",
    "sparktrain.comm.link": "sparktrain.wire.link",
    "sparktrain.comm.listen": "sparktrain.wire.listen",
    "sparktrain.comm.mesh": "sparktrain.wire.mesh",
    "sparktrain.comm.preauth": "sparktrain.wire.preauth",
    "sparktrain.comm.ring": "sparktrain.wire.ring",
    "sparktrain.comm.security": "sparktrain.wire.security",
    "sparktrain.comm.service": "sparktrain.wire.service",
    "sparktrain.comm.stats": "sparktrain.wire.stats",
    "sparktrain.comm.tree": "sparktrain.wire.tree",
    "sparktrain.comm.allreduce": "sparktrain.wire.collectives",
    # issue 33.1: the driver, launch/ -> driver/; the services the tasks dial, and the
    # listeners the progress display feeds -> driver/services/
    "sparktrain.launch": "sparktrain.driver",
    "sparktrain.launch.barrier": "sparktrain.driver.barrier",
    "sparktrain.launch.console": "sparktrain.driver.console",
    "sparktrain.launch.daemon": "sparktrain.driver.daemon",
    "sparktrain.launch.gpu": "sparktrain.driver.gpu",
    "sparktrain.launch.job": "sparktrain.driver.job",
    "sparktrain.launch.occupancy": "sparktrain.driver.occupancy",
    "sparktrain.launch.pickling": "sparktrain.driver.pickling",
    "sparktrain.launch.prepare": "sparktrain.driver.prepare",
    "sparktrain.launch.resources": "sparktrain.driver.resources",
    "sparktrain.launch.spark_env": "sparktrain.driver.spark_env",
    "sparktrain.launch.warmup": "sparktrain.driver.warmup",
    "sparktrain.launch.stage": "sparktrain.driver.stage_runner",
    "sparktrain.launch.metrics_server": "sparktrain.driver.services.metrics_server",
    "sparktrain.launch.payload_server": "sparktrain.driver.services.payload_server",
    "sparktrain.launch.rendezvous": "sparktrain.driver.services.rendezvous",
    "sparktrain.launch.state_server": "sparktrain.driver.services.state_receiver",
    "sparktrain.loggers": "sparktrain.driver.services.loggers",
    # issue 33.1: what a task runs, worker/ -> task/; its data -> data/, the sparse row path ->
    # sparse/, comm_backend="torch"'s sync -> strategies/allreduce/
    "sparktrain.worker": "sparktrain.task",
    "sparktrain.worker.buckets": "sparktrain.task.buckets",
    "sparktrain.worker.context": "sparktrain.task.context",
    "sparktrain.worker.device": "sparktrain.task.device",
    "sparktrain.worker.divergence": "sparktrain.task.divergence",
    "sparktrain.worker.early_stop": "sparktrain.task.early_stop",
    "sparktrain.worker.evaluate": "sparktrain.task.evaluate",
    "sparktrain.worker.faults": "sparktrain.task.faults",
    "sparktrain.worker.loop": "sparktrain.task.loop",
    "sparktrain.worker.meet": "sparktrain.task.meet",
    "sparktrain.worker.memory": "sparktrain.task.memory",
    "sparktrain.worker.metrics_client": "sparktrain.task.metrics_client",
    "sparktrain.worker.precision": "sparktrain.task.precision",
    "sparktrain.worker.probe": "sparktrain.task.probe",
    "sparktrain.worker.run_context": "sparktrain.task.run_context",
    "sparktrain.worker.run_task": "sparktrain.task.run_task",
    "sparktrain.worker.scores": "sparktrain.task.scores",
    "sparktrain.worker.sharded": "sparktrain.task.sharded",
    "sparktrain.worker.staging": "sparktrain.task.staging",
    "sparktrain.worker.stepping": "sparktrain.task.stepping",
    "sparktrain.worker.schedule": "sparktrain.task.lr_schedule",
    "sparktrain.worker.state": "sparktrain.task.state_sender",
    "sparktrain.worker.payload": "sparktrain.task.payload_client",
    "sparktrain.worker.sync": "sparktrain.task.step_sync",
    "sparktrain.worker.torch_sync": "sparktrain.strategies.allreduce.task_torch",
    "sparktrain.worker.data": "sparktrain.data.partition_data",
    "sparktrain.worker.spill": "sparktrain.data.spill",
    "sparktrain.worker.prefetch": "sparktrain.data.prefetch",
    "sparktrain.worker.ragged": "sparktrain.data.ragged",
    "sparktrain.worker.features": "sparktrain.data.features",
    "sparktrain.worker.sparse_codec": "sparktrain.sparse.row_codec",
    "sparktrain.worker.sparse_exchange": "sparktrain.sparse.exchange",
    "sparktrain.worker.sparse_rows": "sparktrain.sparse.rows",
    "sparktrain.worker.sparse_step": "sparktrain.sparse.stepper",
    # issue 33.1: the parameter server in its strategy's folder, ps/ -> strategies/ps/ (the
    # driver's modules named server_*)
    "sparktrain.ps": "sparktrain.strategies.ps",
    "sparktrain.ps.server": "sparktrain.strategies.ps.server",
    "sparktrain.ps.client": "sparktrain.strategies.ps.client",
    "sparktrain.ps.protocol": "sparktrain.strategies.ps.protocol",
    "sparktrain.ps.layout": "sparktrain.strategies.ps.layout",
    "sparktrain.ps.bootstrap": "sparktrain.strategies.ps.bootstrap",
    "sparktrain.ps.consistency": "sparktrain.strategies.ps.server_consistency",
    "sparktrain.ps.persist": "sparktrain.strategies.ps.server_persist",
    "sparktrain.ps.stats": "sparktrain.strategies.ps.server_stats",
    "sparktrain.ps.tables": "sparktrain.strategies.ps.server_tables",
}

# what a row's warning adds, e.g. for a module that was split rather than moved
NOTES: dict[str, str] = {
    "sparktrain.metrics": (
        "Its executor's half (MetricsClient, start_reporter, STEP_REPORT_INTERVAL_S) is "
        "sparktrain.task.metrics_client."
    ),
    # old packages whose modules went to more than one new one
    "sparktrain.worker": (
        "Its modules moved to sparktrain.task, sparktrain.data, sparktrain.sparse and "
        "sparktrain.strategies.allreduce; each old module name still imports its new module."
    ),
    "sparktrain.launch": (
        "The services the tasks dial are in sparktrain.driver.services; each old module name "
        "still imports its new module."
    ),
    "sparktrain.ps": (
        "The package re-exports only the strategy (ParameterServer); shard_ranges is "
        "sparktrain.strategies.ps.layout.shard_ranges."
    ),
}


def message(old: str) -> str:
    """The deprecation warning for importing ``old``."""
    text = (
        f"{old} moved to {MOVED[old]}; import it from there (the old path goes in the next release)"
    )
    return f"{text}. {NOTES[old]}" if old in NOTES else text


def _stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, from :meth:`_Alias.create_module`, of the line that
    imported the old name: past the frames of this module and of ``importlib`` (Python
    3.11's ``warnings.warn`` has no ``skip_file_prefixes``; it skips the frozen
    ``importlib._bootstrap`` frames itself, so they do not count)."""
    level = 1  # create_module
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not ("importlib" in name and "_bootstrap" in name):
            level += 1
            if name not in (__file__, importlib.__file__):
                break
        frame = frame.f_back
    return level


class _OldPackage(ModuleType):
    """An old package's name: a package of its own whose old modules import through their
    rows, and whose other names are the new package's (``from sparktrain.comm import
    Mesh``).

    Not the new package object itself: ``from old_package import old_module`` looks the
    module up by the package's ``__name__``, and the new package has no module of the old
    name (``sparktrain.launch.stage`` is ``sparktrain.driver.stage_runner``). Its
    ``__path__`` is empty, so only the finder finds its modules: a name without a row
    fails rather than loading a second copy of a new module.
    """

    def __init__(self, name: str, new: ModuleType) -> None:
        super().__init__(name, new.__doc__)
        self.__path__: list[str] = []
        self._new = new

    def __getattr__(self, attr: str) -> object:
        if f"{self.__name__}.{attr}" in MOVED:
            return importlib.import_module(f"{self.__name__}.{attr}")
        return getattr(self._new, attr)

    def __dir__(self) -> list[str]:
        prefix = self.__name__ + "."
        children = {o[len(prefix) :] for o in MOVED if o.startswith(prefix)}
        return sorted({*dir(self._new), *(c for c in children if "." not in c)})


class _Alias(importlib.abc.Loader):
    """Loads an old module name as the new module object itself (an old package name as
    an :class:`_OldPackage` over the new one)."""

    def __init__(self, new: str) -> None:
        self.new = new
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(message(spec.name), DeprecationWarning, stacklevel=_stacklevel())
        module = importlib.import_module(self.new)
        if hasattr(module, "__path__"):
            spec.submodule_search_locations = []  # a package: its modules have rows
            self._spec = spec
            return _OldPackage(spec.name, module)
        # the import system sets __spec__ on what this returns: put the new one back in
        # exec_module (module_from_spec leaves __name__, __file__ and __loader__ alone)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec

    def get_code(self, fullname: str) -> CodeType | None:
        """``python -m OLD`` (runpy asks for the code, not the module): the new module's
        code, which runpy runs as ``__main__``. Spark runs the Python daemon named by
        ``spark.python.daemon.module`` so, and a spark-defaults.conf may still name the
        old one."""
        warnings.warn(message(fullname), DeprecationWarning, stacklevel=2)
        spec = importlib.util.find_spec(self.new)
        loader = spec.loader if spec is not None else None
        if not isinstance(loader, importlib.abc.InspectLoader):
            raise ImportError(f"{self.new} cannot run as a script", name=fullname)
        return loader.get_code(self.new)


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of :data:`MOVED` (and nothing else)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once; idempotent)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
