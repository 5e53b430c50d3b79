"""Overlap bench: training step time with the gradient exchange overlapped with backward
(``overlap = true``, gradient hooks as in DDP) and after it (``overlap = false``), for
the ring and the parameter server.

    sparktrain bench overlap --out docs/results/ --steps 20 --repeats 5
    sparktrain bench overlap --link lan        # an emulated slow link (wire/link.py)

Ranks are separate processes (``spawn``), not threads, so backward and the exchange do
not share one GIL; they talk over loopback through sparktrain's own transport, and the
parameter server runs in this (the driver's) process, as in training. Each strategy
gets one set of processes that build the same MLP (a few million parameters) on
synthetic data and time windows of ``steps`` real steps (``begin_step``, forward,
backward, ``step``) in three modes: ``compute`` (no exchange at all, local SGD steps:
the floor overlap can at best reach), ``off`` and ``on``. The modes take turns window
by window (``repeats`` rounds, the order rotated each round), so the load of anything
else on the machine falls on all three alike; a step's time is the slowest rank's.

Records are ``{strategy, mode, median_s, min_s, max_s, windows, steps, ...}`` with
``median_s`` the median of the per-window median step times and ``min_s``/``max_s``
their spread; ``saving`` per strategy is ``1 - median(on) / median(off)``, and
``hidden`` the share of the exposed exchange time (off - compute) that overlap hid.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.plots import pyplot, save_figure
from sparktrain.errors import ConfigError

HOST = "127.0.0.1"
JOB_ID = "bench-overlap"
STRATEGIES = ("ring", "tree", "ps")


def _train_config(job: dict[str, Any], strategy: str, overlap: bool) -> Any:
    from sparktrain.config import TrainConfig

    return TrainConfig(
        strategy=strategy if strategy != "compute" else "ring",
        overlap=overlap,
        bucket_mb=job["bucket_mb"],
        batch_size=job["batch"],
        lr=1e-3,
        optimizer="sgd",
        ps_shards=job["ps_shards"],
        comm_timeout=job["timeout"],
        num_workers=job["world"],
        link_profile=job["link"],
        progress=False,
    )


def _model(job: dict[str, Any]) -> Any:
    from sparktrain.models import mlp

    return mlp(job["inputs"], tuple(job["hidden"]), job["outputs"])


MODES = ("compute", "off", "on")
"""Per strategy, in one set of rank processes: no exchange at all (local SGD steps: the
floor overlap can at best reach), the exchange after backward, and overlapped."""


def _rank(rank: int, job: dict[str, Any], strategy: str, to_parent: Any, inbox: Any) -> None:
    """One rank's process: rendezvous through the parent, then time the modes' windows."""
    try:
        import torch

        from sparktrain.task.context import JobSpec, WorkerContext
        from sparktrain.task.step_sync import make_sync
        from sparktrain.wire import Mesh, address_of, open_listener
        from sparktrain.wire.link import link_from_config

        torch.set_num_threads(job["threads"])
        cfg = _train_config(job, strategy, True)
        world = job["world"]
        listener = open_listener(HOST)
        to_parent.put(("address", rank, address_of(listener)))
        addresses, ps_addresses = inbox.get(timeout=job["timeout"])
        secret = bytes.fromhex(job["secret"])
        mesh = Mesh(
            rank,
            world,
            listener,
            addresses,
            secret=secret,
            job_id=JOB_ID,
            attempt=0,
            timeout=job["timeout"],
            link=link_from_config(cfg),
        )
        try:
            torch.manual_seed(0)
            model = _model(job)
            gen = torch.Generator().manual_seed(rank + 1)
            x = torch.randn(job["batch"], job["inputs"], generator=gen)
            y = torch.randint(0, job["outputs"], (job["batch"],), generator=gen)
            spec = JobSpec(
                job_id=JOB_ID,
                attempt=0,
                secret=secret,
                config=cfg,
                model_fn=lambda: model,
                model_kwargs={},
                feature_width=job["inputs"],
                num_outputs=job["outputs"],
                threads=job["threads"],
                ps_addresses=tuple(ps_addresses),
            )

            def no_collective(*_: Any) -> Any:
                raise RuntimeError("the overlap bench rendezvous is done by its parent")

            ctx = WorkerContext(rank, world, HOST, no_collective, no_collective, spec)
            sync: Any = make_sync(ctx, model, mesh)
            local = torch.optim.SGD(model.parameters(), lr=1e-3)
            loss_fn = torch.nn.CrossEntropyLoss()
            times: dict[str, list[list[float]]] = {m: [] for m in MODES}
            active: dict[str, bool] = {}

            def window(mode: str, steps: int) -> list[float]:
                if mode != "compute":
                    sync.set_overlap(mode == "on")  # a single PS shard stays off
                    active[mode] = bool(sync.overlap)
                out = []
                for _ in range(steps):
                    started = time.perf_counter()
                    if mode != "compute":
                        sync.begin_step(job["batch"])
                    loss = loss_fn(model(x), y)
                    loss.backward()
                    if mode != "compute":
                        sync.step(job["batch"])
                    else:
                        local.step()
                        local.zero_grad(set_to_none=False)
                    out.append(time.perf_counter() - started)
                return out

            try:
                for mode in MODES:
                    window(mode, job["warmup"])
                before = sync.stats()
                for r in range(job["repeats"]):
                    # rotate the order: no mode always runs first (or after another)
                    for mode in MODES[r % 3 :] + MODES[: r % 3]:
                        times[mode].append(window(mode, job["steps"]))
                stats = sync.stats()
            finally:
                sync.close()
            key = (
                "buckets_launched_in_backward"
                if "buckets_launched_in_backward" in stats
                else "ps_shards_launched_in_backward"
            )
            report = {
                "times": times,
                "active": active,
                "groups": stats.get("buckets", job["ps_shards"]),
                "launched_in_backward": stats.get(key, 0) - before.get(key, 0),
            }
            to_parent.put(("times", rank, report))
        finally:
            mesh.close()
    except BaseException as exc:  # reported to the parent, which raises it
        to_parent.put(("error", rank, f"{type(exc).__name__}: {exc}"))


def run_strategy(job: dict[str, Any], strategy: str) -> list[dict[str, Any]]:
    """Time the three modes of one strategy in one set of fresh rank processes; one
    record per mode."""
    import multiprocessing as mp
    import queue as queue_mod

    world = job["world"]
    server = None
    ps_addresses: list[str] = []
    if strategy == "ps":
        import torch

        from sparktrain.strategies.ps.server import start_parameter_server

        torch.manual_seed(0)
        server = start_parameter_server(
            _model(job),
            _train_config(job, strategy, True),
            host=HOST,
            secret=bytes.fromhex(job["secret"]),
            job_id=JOB_ID,
            attempt=0,
            world_size=world,
        )
        ps_addresses = list(server.addresses)
    mpctx = mp.get_context("spawn")
    to_parent = mpctx.Queue()
    inboxes = [mpctx.Queue() for _ in range(world)]
    procs = [
        mpctx.Process(target=_rank, args=(r, job, strategy, to_parent, inboxes[r]), daemon=True)
        for r in range(world)
    ]
    deadline = time.monotonic() + job["budget_s"]
    results: dict[int, dict[str, Any]] = {}
    try:
        for p in procs:
            p.start()
        addresses: dict[int, str] = {}
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"overlap bench {strategy}: ranks did not finish in {job['budget_s']:.0f} s "
                    "(raise --budget or lower --steps)"
                )
            try:
                kind, rank, payload = to_parent.get(timeout=min(left, 5.0))
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a rank process died without a report") from None
                continue
            if kind == "error":
                raise RuntimeError(f"rank {rank}: {payload}")
            if kind == "address":
                addresses[rank] = payload
                if len(addresses) == world:
                    for box in inboxes:
                        box.put(([addresses[r] for r in range(world)], ps_addresses))
            else:
                results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if server is not None:
            server.stop()
    records = []
    for mode in MODES:
        windows = []
        steps = 0
        for w in range(job["repeats"]):
            # a step's time is the slowest rank's
            per_step = [
                max(ts)
                for ts in zip(*(results[r]["times"][mode][w] for r in range(world)), strict=True)
            ]
            windows.append(statistics.median(per_step))
            steps += len(per_step)
        rank0 = results[0]
        records.append(
            {
                "strategy": strategy,
                "mode": mode,
                "overlap": mode == "on",
                "overlap_active": rank0["active"].get(mode, False),
                "median_s": statistics.median(windows),
                "min_s": min(windows),
                "max_s": max(windows),
                "windows": windows,
                "steps": steps,
                # buckets (ring/tree) or shards (ps) handed over from a gradient hook
                "groups": rank0["groups"],
                "launched_in_backward": rank0["launched_in_backward"] if mode == "on" else 0,
            }
        )
    return records


def savings(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per strategy: step time off and on, the saving, and the share of the exposed
    exchange time (off minus the same processes' compute-only floor) that overlap hid."""
    by = {(r["strategy"], r["mode"]): r["median_s"] for r in records}
    out: dict[str, dict[str, float]] = {}
    for strategy in dict.fromkeys(r["strategy"] for r in records):
        off, on = by.get((strategy, "off")), by.get((strategy, "on"))
        floor = by.get((strategy, "compute"))
        if off is None or on is None:
            continue
        row = {"off_s": off, "on_s": on, "saving": 1.0 - on / off}
        if floor is not None:
            row["compute_s"] = floor
            if off > floor:
                row["exposed_comm_s"] = off - floor
                row["hidden"] = (off - on) / (off - floor)
                # overlap hides at most the exchange or the compute, whichever is shorter
                # (in fact only backward's share of the compute)
                row["hidden_of_bound"] = (off - on) / min(off - floor, floor)
        out[strategy] = row
    return out


def table(records: list[dict[str, Any]]) -> str:
    """A Markdown table of step times."""
    lines = [
        "| strategy | mode | step median | spread (window medians) "
        "| buckets/shards started in backward |",
        "|---|---|---:|---:|---:|",
    ]
    for r in records:
        hooks = (
            f"{r['launched_in_backward']} of {r['groups'] * r['steps']}"
            if r["mode"] == "on" and r["overlap_active"]
            else "-"
        )
        lines.append(
            f"| {r['strategy']} | {r['mode']} "
            f"| {r['median_s'] * 1e3:.1f} ms | {r['min_s'] * 1e3:.1f}–{r['max_s'] * 1e3:.1f} ms "
            f"| {hooks} |"
        )
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bars of the median step time per strategy: compute only, overlap off, overlap
    on; the spread of the window medians as error bars."""
    plt = pyplot()

    strategies = list(dict.fromkeys(r["strategy"] for r in records))
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    width = 0.27
    labels = {"compute": "compute only", "off": "overlap off", "on": "overlap on"}
    colors = {"compute": "0.7", "off": "C0", "on": "C1"}
    for k, mode in enumerate(MODES):
        rows = [
            next((r for r in records if r["strategy"] == s and r["mode"] == mode), None)
            for s in strategies
        ]
        xs = [i + (k - 1) * width for i, r in enumerate(rows) if r is not None]
        med = [r["median_s"] * 1e3 for r in rows if r is not None]
        err = [
            [(r["median_s"] - r["min_s"]) * 1e3 for r in rows if r is not None],
            [(r["max_s"] - r["median_s"]) * 1e3 for r in rows if r is not None],
        ]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=labels[mode], color=colors[mode])
    ax.set_xticks(range(len(strategies)))
    ax.set_xticklabels(strategies)
    ax.set_ylabel("step time (ms, median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="docs/results/", help="folder for JSON and PNG")
    parser.add_argument("--name", default="bench_overlap", help="file name stem")
    parser.add_argument("--strategies", nargs="+", default=["ring", "ps"], choices=STRATEGIES)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--inputs", type=int, default=512)
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024, 1024])
    parser.add_argument("--outputs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=2.0)
    parser.add_argument("--ps-shards", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed window")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--link", default="none", help="emulated link profile (wire/link.py)")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds per configuration")


def main(args: argparse.Namespace) -> int:
    import secrets

    for name in ("world", "steps", "repeats", "batch", "threads", "ps_shards"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if args.world < 2:
        raise ConfigError("--world must be >= 2: overlap needs someone to talk to")
    job = {
        "world": args.world,
        "inputs": args.inputs,
        "hidden": list(args.hidden),
        "outputs": args.outputs,
        "batch": args.batch,
        "bucket_mb": args.bucket_mb,
        "ps_shards": args.ps_shards,
        "threads": args.threads,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "link": args.link,
        "timeout": 120.0,
        "budget_s": args.budget,
        "secret": secrets.token_hex(32),
    }
    params = sum(
        a * b + b
        for a, b in zip([args.inputs, *args.hidden], [*args.hidden, args.outputs], strict=True)
    )
    records = []
    for strategy in args.strategies:
        rows = run_strategy(job, strategy)
        records += rows
        for r in rows:
            print(
                f"{strategy:5s} {r['mode']:8s} {r['median_s'] * 1e3:8.1f} ms  "
                f"({r['min_s'] * 1e3:.1f}–{r['max_s'] * 1e3:.1f})",
                flush=True,
            )
    summary = savings(records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = {
        **{k: v for k, v in job.items() if k != "secret"},
        "parameters": params,
        "gradient_mb": params * 4 / (1 << 20),
    }
    (out / f"{args.name}.json").write_text(
        json.dumps({"setup": setup, "records": records, "savings": summary}, indent=2) + "\n"
    )
    title = (
        f"{params / 1e6:.1f} M params, world {args.world}, batch {args.batch}, "
        f"{args.threads} thread(s)/rank, link {args.link}"
    )
    plot(records, out / f"{args.name}.png", title)
    print(table(records))
    for strategy, row in summary.items():
        hidden = (
            f", {row['hidden']:.0%} of the exposed exchange hidden, "
            f"{row['hidden_of_bound']:.0%} of what compute could cover"
            if "hidden" in row
            else ""
        )
        print(
            f"{strategy}: {row['off_s'] * 1e3:.1f} -> {row['on_s'] * 1e3:.1f} ms per step "
            f"({row['saving']:.1%} saved{hidden})"
        )
    print(f"wrote {out / (args.name + '.json')} and {out / (args.name + '.png')}")
    return 0
