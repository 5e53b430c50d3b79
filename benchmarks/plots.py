"""What every benchmark plot starts and ends with: pyplot on the file-only backend; laid
out, written as PNG, closed."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_figure(fig: Any, path: Path) -> None:
    """Lay ``fig`` out, write it to ``path`` (folders made) at 110 dpi and close it, so
    that a benchmark drawing many plots holds no figure it is done with."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend: benchmarks write PNG files and never
    open a window (a machine without a display, a CI job). Imported here, on demand,
    because matplotlib is a benchmark extra that the package does not need."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
