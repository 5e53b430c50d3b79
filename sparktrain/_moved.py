"""Modules that moved: their old dotted names keep working for one release, with a warning.

:data:`MOVED` maps an old module name to its new one. Importing an old name (``import``,
``from ... import``, ``importlib``, or unpickling an object pickled under it) warns with a
:class:`DeprecationWarning` that names the new module and returns the new module object
itself: ``sys.modules[old] is sys.modules[new]``, so classes, functions and module state
are the very same objects under both names. The finder is installed by
``sparktrain/__init__.py``, so it is in place before any ``sparktrain.*`` name resolves.

A move adds a row here (a plain dict: old -> new); the release after it deletes the row.
No sparktrain module imports an old name (tests/unit/test_moved.py checks).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import FrameType, ModuleType

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
    "sparktrain.metrics": "sparktrain.launch.metrics_server",
}

# what a row's warning adds, e.g. for a module that was split rather than moved
NOTES: dict[str, str] = {
    "sparktrain.metrics": (
        "Its executor's half (MetricsClient, start_reporter, STEP_REPORT_INTERVAL_S) is "
        "sparktrain.worker.metrics_client."
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


class _Alias(importlib.abc.Loader):
    """Loads an old name as the new module object itself."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(message(spec.name), DeprecationWarning, stacklevel=_stacklevel())
        module = importlib.import_module(self.new)
        # the import system sets __spec__ on what this returns: put the new one back in
        # exec_module (module_from_spec leaves __name__, __file__ and __loader__ alone)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec


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
