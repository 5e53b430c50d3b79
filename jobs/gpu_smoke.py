"""A two-minute check of sparktrain on a machine with one GPU: placement, NCCL, a fit.

    python jobs/gpu_smoke.py             # on the GPU machine (CUDA build of torch)
    python jobs/gpu_smoke.py --dry-run   # the same checks on the CPU (gloo), e.g. in CI

1. placement: a Spark task of ``local-cluster[1,1,1024]`` whose worker discovered the
   GPU (``spark.worker.resource.gpu.*``, ``spark.task.resource.gpu.amount=1``) gets its
   address and pins itself to it (``sparktrain.task.device.place``);
2. NCCL: ``torch.distributed`` with the ``nccl`` backend (``gloo`` with ``--dry-run``)
   all-reduces a tensor on the device in a world of one, or says why it cannot;
3. a fit: the digits MLP on one worker with ``device="cuda"`` (``"cpu"`` with
   ``--dry-run``) reaches test accuracy > 0.9.

Prints one line per check and exits 1 when one fails. With ``--dry-run`` the discovery
script reports a made-up GPU "0" and CUDA is never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the real machine's GPUs: nvidia-smi's indices, else what torch sees
_DISCOVER = """#!%(python)s
import json, shutil, subprocess
if shutil.which("nvidia-smi"):
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
        capture_output=True, text=True, check=True,
    ).stdout
    ids = [line.strip() for line in out.splitlines() if line.strip()]
else:
    import torch
    ids = [str(i) for i in range(torch.cuda.device_count())]
print(json.dumps({"name": "gpu", "addresses": ids}))
"""
_DISCOVER_DRY = """#!%(python)s
print('{"name": "gpu", "addresses": ["0"]}')
"""


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the same checks on the CPU")
    p.add_argument("--epochs", type=int, default=10, help="epochs of the digits fit")
    p.add_argument("--json", metavar="PATH", help="write the checks' results here")
    return p.parse_args(argv)


def discovery_script(directory: Path, dry_run: bool) -> Path:
    script = directory / "discover_gpus.py"
    script.write_text((_DISCOVER_DRY if dry_run else _DISCOVER) % {"python": sys.executable})
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _task_placement(requested: str, _: Any) -> Any:
    """In the Spark task: its GPU addresses and where sparktrain places it."""
    from pyspark import TaskContext

    from sparktrain.driver.barrier import task_gpus
    from sparktrain.task.device import place

    gpus = task_gpus(TaskContext.get())
    placement = place(requested, gpus)
    yield json.dumps(placement.stats())


def check_placement(spark: Any, device: str) -> str:
    import functools

    rows = spark.sparkContext.parallelize([0], 1)
    got = json.loads(rows.mapPartitions(functools.partial(_task_placement, device)).collect()[0])
    if not got["gpus"]:
        raise AssertionError(f"the task was given no GPU: {got}")
    want = "cpu" if device == "cpu" else "cuda"
    if not got["device"].startswith(want):
        raise AssertionError(f"the task trains on {got['device']}, not {want}: {got}")
    return f"task GPU {got['gpus'][0]} -> {got['device']}"


def check_collective(dry_run: bool) -> str:
    import torch
    import torch.distributed as dist

    backend = "gloo" if dry_run else "nccl"
    if not dist.is_available():
        return "SKIP: this torch build has no torch.distributed"
    if backend == "nccl" and not dist.is_nccl_available():
        return "SKIP: this torch build has no NCCL (a CPU build?); the ring/tree need none"
    with socket.socket() as s:  # a free port for the store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        device = torch.device("cpu") if dry_run else torch.device("cuda", 0)
        t = torch.arange(4, dtype=torch.float32, device=device)
        dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if t.cpu().tolist() != [0.0, 1.0, 2.0, 3.0]:
            raise AssertionError(f"all_reduce gave {t.tolist()}")
    finally:
        dist.destroy_process_group()
    return f"{backend} all_reduce on {device}"


def check_fit(spark: Any, device: str, epochs: int) -> str:
    from sparktrain import TrainConfig, Trainer, datasets

    split = datasets.digits()
    train = datasets.to_dataframe(spark, split.x_train, split.y_train, 1)
    test = datasets.to_dataframe(spark, split.x_test, split.y_test, 1)
    cfg = TrainConfig(
        epochs=epochs,
        batch_size=32,
        lr=0.05,
        optimizer="sgd",
        optimizer_kwargs={"momentum": 0.9},
        num_workers=1,
        device=device,
        progress=False,
    )
    result = Trainer("sparktrain.models:digits_mlp", cfg, spark=spark).fit(
        train, validation_data=test
    )
    accuracy = result.summary["metric_value"]
    placement = result.summary.get("placement", [{}])[0]
    if accuracy <= 0.9:
        raise AssertionError(f"test accuracy {accuracy:.4f} <= 0.9")
    return f"digits accuracy {accuracy:.4f} on {placement.get('device')} in {epochs} epochs"


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the GPU checks (no CUDA build, no device), or ``None``;
    asked before Spark starts, whose resource discovery would otherwise fail in Py4J."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build (no CUDA)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    device = "cpu" if args.dry_run else "cuda"
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if not args.dry_run:
        missing = no_gpu_reason()
        if missing:
            print(
                f"gpu smoke: {missing}. On a machine without a GPU, run the same checks on "
                "the CPU: python jobs/gpu_smoke.py --dry-run",
                file=sys.stderr,
            )
            return 2
    from sparktrain.session import get_or_create_session

    results: dict[str, str] = {}
    failed = False
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as tmp:
        # local-cluster, not local[N]: Spark assigns tasks resources only on a cluster
        # manager (a local[N] task never starts when it asks for a GPU)
        conf = {
            "spark.worker.resource.gpu.discoveryScript": str(
                discovery_script(Path(tmp), args.dry_run)
            ),
            "spark.worker.resource.gpu.amount": "1",
            "spark.executor.resource.gpu.amount": "1",
            "spark.task.resource.gpu.amount": "1",
        }
        spark = get_or_create_session(
            "local-cluster[1,1,1024]", app_name="gpu-smoke", conf=conf, warm_workers=False
        )
        checks: list[tuple[str, Callable[[], str]]] = [
            ("placement", lambda: check_placement(spark, device)),
            ("collective", lambda: check_collective(args.dry_run)),
            ("fit", lambda: check_fit(spark, device, args.epochs)),
        ]
        try:
            for name, check in checks:
                t0 = time.perf_counter()
                try:
                    line = check()
                    status = "SKIP" if line.startswith("SKIP") else "OK"
                except Exception as exc:
                    line, status, failed = f"{type(exc).__name__}: {exc}", "FAIL", True
                results[name] = f"{status} {line.removeprefix('SKIP: ')}"
                print(f"{name:<10} {status:<4} {line} ({time.perf_counter() - t0:.1f} s)")
        finally:
            spark.stop()
    mode = "dry run on the CPU" if args.dry_run else "GPU"
    outcome = "FAILED" if failed else "passed"
    print(f"gpu smoke ({mode}): {outcome} in {time.perf_counter() - started:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"failed": failed, "checks": results}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
