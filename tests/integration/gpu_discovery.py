"""Made-up GPUs for Spark's resource scheduling, as pyspark's TorchDistributor tests do.

Each worker of a local-cluster runs the discovery script once; the script hands out the
next address from a counter file, so the two workers on this one host report distinct
GPUs ("0", "1") as two real machines would.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

_SCRIPT = """#!{python}
import fcntl, json
with open({counter!r}, "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    n = int(f.read() or 0)
    f.seek(0)
    f.truncate()
    f.write(str(n + 1))
print(json.dumps({{"name": "gpu", "addresses": [str(n)]}}))
"""


def write_script(directory: Path) -> Path:
    """The discovery script, executable, with its counter next to it."""
    script = directory / "discover_gpus.py"
    script.write_text(_SCRIPT.format(python=sys.executable, counter=str(directory / "next")))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def discovery_conf(directory: Path) -> dict[str, str]:
    """Spark confs: one discovered GPU per worker and per executor; tasks ask for none by
    default (the training stage's profile asks)."""
    os.makedirs(directory, exist_ok=True)
    return {
        "spark.worker.resource.gpu.discoveryScript": str(write_script(directory)),
        "spark.worker.resource.gpu.amount": "1",
        "spark.executor.resource.gpu.amount": "1",
    }
