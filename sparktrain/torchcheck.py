"""Refuse a torch whose ``torch.load(weights_only=True)`` can be bypassed.

Every load of saved weights in sparktrain (checkpoints, saved pyspark.ml models) rests on
``torch.load(..., weights_only=True)``, which has known bypasses below torch 2.6
(CVE-2025-32434: a crafted file runs code even with ``weights_only=True``). setup.cfg
asks for ``torch>=2.6``; this check holds where pip's resolver was not asked (a torch
installed or pinned by other means). :func:`check_torch` runs when ``sparktrain`` is
imported, on the driver and in every Python worker.

Cheap: it imports no torch. It reads the version from torch already in ``sys.modules``,
else from ``torch/version.py`` beside the torch that ``import torch`` would load.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

SAFE_TORCH = (2, 6)
"""The first torch whose ``weights_only=True`` has no known bypass (CVE-2025-32434)."""

_VERSION_LINE = re.compile(r"""^__version__\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""", re.MULTILINE)
_RELEASE = re.compile(r"^(\d+)\.(\d+)")


class UnsafeTorchError(ImportError):
    """The installed torch's ``torch.load(weights_only=True)`` can be bypassed."""


def installed_torch_version() -> str | None:
    """The version of the torch this process has or would import; None when there is no
    torch or its version cannot be read without importing it."""
    torch = sys.modules.get("torch")
    if torch is not None:
        version = getattr(torch, "__version__", None)
        return None if version is None else str(version)
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    match = _VERSION_LINE.search(text)
    return match.group(1) if match else None


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string (``"2.13.0+cpu"`` -> ``(2, 13)``); None
    when it does not start with two numbers."""
    match = _RELEASE.match(version.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_torch(version: str | None = None) -> None:
    """Raise :class:`UnsafeTorchError` when torch ``version`` (default: the installed
    one) is below :data:`SAFE_TORCH`. No torch, or a version that cannot be read, is
    let through: nothing then loads weights, or the check cannot tell."""
    version = installed_torch_version() if version is None else version
    found = None if version is None else release(version)
    if found is None or found >= SAFE_TORCH:
        return
    floor = ".".join(map(str, SAFE_TORCH))
    raise UnsafeTorchError(
        f"sparktrain needs torch >= {floor}, found torch {version}: every load of saved "
        f"weights relies on torch.load(weights_only=True), which torch < {floor} lets a "
        f"crafted file bypass (CVE-2025-32434). Upgrade torch: pip install 'torch>={floor}'"
    )
