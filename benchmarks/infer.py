"""Batch inference: a fitted model's ``transform`` against pyspark's own
``pyspark.ml.functions.predict_batch_udf``, same torch module, same data, same session.

    sparktrain bench infer --json docs/results/bench_infer.json
    sparktrain bench infer --rows 200000 --repeats 3     # smaller, quicker

The data are scikit-learn's digits (1,797 rows of 64 features as ml Vectors, as
``VectorAssembler`` makes them) replicated to ``--rows`` rows in ``--partitions``
partitions, cached and materialised before any timing. The module is the 64-128-10 MLP
(``sparktrain.models:digits_mlp``) trained for a few hundred full-batch Adam steps in this
process, so the predictions mean something; its weights go into a
:class:`~sparktrain.ml.TorchClassificationModel` and into ``predict_batch_udf``'s
``make_predict_fn`` alike. Each contender writes an ``id`` and what it selects to the
``noop`` sink (the whole query runs, nothing is stored):

* ``transform``: ``model.transform(df).select("id", "prediction")`` with the model's
  defaults (a new user's call: the probability and rawPrediction columns are there, and
  unselected; Spark prunes their expressions, sparktrain.ml.model);
* ``transform_prediction_only``: the same with ``probabilityCol=""`` and
  ``rawPredictionCol=""``, the pyspark.ml way to switch those columns off;
* ``transform_all``: the defaults with all three columns selected (two ml Vectors and a
  double per row);
* ``predict_batch_udf``: ``df.select(predict_fn(vector_to_array("features", "float32")))``
  with ``batch_size=--batch-size`` and ``input_tensor_shapes=[[64]]``, returning the
  argmax class as a double.

Every contender runs once untimed (Python workers import torch, build their module, the JVM
compiles the query), then ``--repeats`` rounds time each once, the order rotated each round
so that the machine's other load falls on all of them alike. Records are
``{contender, times_s, median_s, min_s, max_s}``; ``ratios`` are each transform's median
over ``predict_batch_udf``'s (``met``: at most 1.0). Before timing, both ways predict the
1,797 distinct rows and ``agreement`` is the share of equal predictions. ``load`` is the
1-minute load average before and after the timed rounds (``os.getloadavg``): on a machine
whose other work moves it above the cores' count the figures are not evidence.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sparktrain.errors import ConfigError

MODEL_FN = "sparktrain.models:digits_mlp"
CONTENDERS = ("transform", "transform_prediction_only", "transform_all", "predict_batch_udf")
BASELINE = "predict_batch_udf"
ARROW_BATCH_CONF = "spark.sql.execution.arrow.maxRecordsPerBatch"


# ---------------------------------------------------------------------- figures
def rounds(contenders: tuple[str, ...], repeats: int) -> Iterator[str]:
    """The timed runs' order: ``repeats`` rounds of every contender, rotated by one each
    round, so no contender always runs first or after the same one."""
    n = len(contenders)
    for r in range(repeats):
        for i in range(n):
            yield contenders[(r + i) % n]


def summarise(times: dict[str, list[float]]) -> dict[str, Any]:
    """Records (median, min, max per contender) and each transform's ratio of medians over
    the baseline's (``met`` when at most 1.0)."""
    records: list[dict[str, Any]] = [
        {
            "contender": name,
            "times_s": [round(t, 4) for t in ts],
            "median_s": statistics.median(ts),
            "min_s": min(ts),
            "max_s": max(ts),
        }
        for name, ts in times.items()
    ]
    medians: dict[str, float] = {r["contender"]: r["median_s"] for r in records}
    base = medians.get(BASELINE)
    ratios = {}
    if base:
        for name, median in medians.items():
            if name != BASELINE:
                ratio = median / base
                ratios[name] = {"ratio": ratio, "met": ratio <= 1.0}
    return {"records": records, "ratios": ratios}


def table(report: dict[str, Any]) -> str:
    """The results page's table: one row per contender, then the ratios."""
    lines = [
        f"{report['rows']:,} rows in {report['partitions']} partitions, "
        f"{report['repeats']} interleaved repeats, Arrow batches of "
        f"{report['arrow_batch']:,} rows, predict_batch_udf batch_size "
        f"{report['batch_size']:,}; predictions agree on {report['agreement']:.2%} of the "
        f"distinct rows.{_load(report)}",
        "",
        "| contender | median | min | max | rows/s (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in report["records"]:
        lines.append(
            f"| {r['contender']} | {r['median_s']:.2f} s | {r['min_s']:.2f} s "
            f"| {r['max_s']:.2f} s | {report['rows'] / r['median_s']:,.0f} |"
        )
    lines.append("")
    for name, r in report["ratios"].items():
        verdict = "met" if r["met"] else "MISSED"
        lines.append(f"- {name} / {BASELINE}, medians: {r['ratio']:.2f} (target <= 1.0: {verdict})")
    return "\n".join(lines)


def _load(report: dict[str, Any]) -> str:
    """The table's note of the load average around the timed rounds (older reports have
    none)."""
    load = report.get("load")
    if not load:
        return ""
    return f" Load average (1 min) {load['before']:.2f} before, {load['after']:.2f} after."


# ---------------------------------------------------------------------- the run
def _trained_module(seed: int) -> Any:
    """The digits MLP after full-batch Adam on the training split (a few seconds)."""
    import torch

    from sparktrain import datasets
    from sparktrain.models import digits_mlp

    split = datasets.digits()
    torch.manual_seed(seed)
    module = digits_mlp()
    x, y = torch.from_numpy(split.x_train), torch.from_numpy(split.y_train)
    opt = torch.optim.Adam(module.parameters(), lr=0.01)
    for _ in range(200):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(module(x), y).backward()
        opt.step()
    return module.eval()


def _data(spark: Any, rows: int, partitions: int) -> tuple[Any, Any]:
    """(the distinct digits as ``id, features`` (ml Vectors), those replicated to ``rows``
    rows in ``partitions`` partitions, cached and counted)."""
    import numpy as np
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    from sparktrain import datasets

    split = datasets.digits()
    x = np.concatenate([split.x_train, split.x_test])
    # the label column carries each distinct row's index: the key of the replication
    base = (
        datasets.to_dataframe(spark, x, np.arange(len(x)), 1)
        .select(
            F.col("label").cast("long").alias("k"),
            array_to_vector(F.col("features")).alias("features"),
        )
        .cache()
    )
    base.count()
    df = (
        spark.range(rows)
        .withColumn("k", F.col("id") % len(x))
        .join(F.broadcast(base), "k")
        .select("id", "features")
        .repartition(partitions)
        .cache()
    )
    if df.count() != rows:
        raise RuntimeError("the replicated data lost rows")
    return base.select(F.col("k").alias("id"), "features"), df


def contenders(module: Any, batch_size: int) -> tuple[Any, Any, Callable[[Any], Any]]:
    """(the default model, the prediction-only model, ``df -> predict_batch_udf`` query)."""
    from pyspark.ml.functions import predict_batch_udf, vector_to_array
    from pyspark.sql import functions as F
    from pyspark.sql.types import DoubleType

    from sparktrain.ml import TorchClassificationModel
    from sparktrain.result import state_to_bytes

    state = {k: v.clone() for k, v in module.state_dict().items()}
    model = TorchClassificationModel()._set_state(
        state_to_bytes(state), num_features=64, num_outputs=10
    )
    model._set(modelFn=MODEL_FN)
    lean = model.copy().setProbabilityCol("").setRawPredictionCol("")

    def make_predict_fn() -> Callable[[Any], Any]:
        # as pyspark's docs do: build the module once per Python worker
        import torch

        from sparktrain.models import digits_mlp

        net = digits_mlp()
        net.load_state_dict(state)
        net.eval()

        def predict(x: Any) -> Any:
            with torch.inference_mode():
                return net(torch.from_numpy(x)).argmax(dim=1).double().numpy()

        return predict

    udf = predict_batch_udf(
        make_predict_fn,
        return_type=DoubleType(),
        batch_size=batch_size,
        input_tensor_shapes=[[64]],
    )

    def theirs(df: Any) -> Any:
        features = vector_to_array(F.col("features"), "float32")
        return df.select("id", udf(features).alias("prediction"))

    return model, lean, theirs


def validate(args: argparse.Namespace) -> None:
    """Refuse arguments the bench cannot measure with."""
    for name in ("rows", "partitions", "repeats", "batch_size", "arrow_batch"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows scored per run")
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (interleaved)")
    parser.add_argument(
        "--batch-size", type=int, default=1024, help="predict_batch_udf's batch_size"
    )
    parser.add_argument(
        "--arrow-batch",
        type=int,
        default=10_000,
        help=f"{ARROW_BATCH_CONF} for every contender (Spark's default 10000)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the report here")
    parser.add_argument("--master", help="Spark master (default local[partitions])")


def main(args: argparse.Namespace) -> int:
    validate(args)
    from sparktrain.session import get_or_create_session

    master = args.master or f"local[{args.partitions}]"
    spark = get_or_create_session(
        master, app_name="sparktrain-bench-infer", conf={ARROW_BATCH_CONF: str(args.arrow_batch)}
    )
    spark.conf.set(ARROW_BATCH_CONF, str(args.arrow_batch))  # an already running session
    module = _trained_module(0)
    distinct, df = _data(spark, args.rows, args.partitions)
    model, lean, theirs = contenders(module, args.batch_size)

    ours_rows = {r.id: r.prediction for r in model.transform(distinct).collect()}
    their_rows = {r.id: r.prediction for r in theirs(distinct).collect()}
    agreement = sum(ours_rows[k] == their_rows[k] for k in ours_rows) / len(ours_rows)

    def noop(frame: Any) -> None:
        frame.write.format("noop").mode("overwrite").save()

    runs: dict[str, Callable[[], None]] = {
        "transform": lambda: noop(model.transform(df).select("id", "prediction")),
        "transform_prediction_only": lambda: noop(lean.transform(df).select("id", "prediction")),
        "transform_all": lambda: noop(
            model.transform(df).select("id", "prediction", "probability", "rawPrediction")
        ),
        "predict_batch_udf": lambda: noop(theirs(df)),
    }
    for name in CONTENDERS:  # warm-up
        runs[name]()
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    load_before = os.getloadavg()[0]
    for name in rounds(CONTENDERS, args.repeats):
        started = time.perf_counter()
        runs[name]()
        times[name].append(time.perf_counter() - started)
        print(f"{name}: {times[name][-1]:.2f} s", flush=True)
    load_after = os.getloadavg()[0]
    df.unpersist()
    report: dict[str, Any] = {
        "rows": args.rows,
        "partitions": args.partitions,
        "repeats": args.repeats,
        "batch_size": args.batch_size,
        "arrow_batch": args.arrow_batch,
        "master": master,
        "agreement": agreement,
        "load": {"before": load_before, "after": load_after},
        **summarise(times),
    }
    print(table(report))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"report written to {path}")
    return 0
