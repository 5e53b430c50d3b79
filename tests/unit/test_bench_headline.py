"""benchmarks/headline.py's logic: contenders, links, records, summary and table.

No Spark, no training and no timing: the records are made up.
"""

from __future__ import annotations

import argparse

import pytest

from benchmarks import headline as h
from benchmarks.cli import BENCHES, build_parser
from sparktrain.compress.registry import validate_spec
from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError


def test_model_has_at_least_five_million_parameters() -> None:
    from sparktrain.models import mlp

    model = mlp(**h.MODEL_KWARGS)
    assert h.parameter_count() == sum(p.numel() for p in model.parameters())
    assert h.parameter_count() >= 5_000_000


def test_contenders_cover_the_issue() -> None:
    specs = {c.compression for c in h.CONTENDERS.values() if not c.ddp}
    assert {"none", "fp16", "int8+ef", "delta+int8+ef", "topk:0.01+ef", "powersgd:2+ef"} <= specs
    assert {c.hook for c in h.CONTENDERS.values() if c.ddp} == {"none", "fp16", "powersgd"}
    assert h.CONTENDERS["auto"].strategy == h.CONTENDERS["auto"].compression == "auto"
    assert h.CONTENDERS["delta"].strategy == "ps"  # delta+ acts on PS pulls only
    for c in h.CONTENDERS.values():
        if not c.ddp and c.compression != "auto":
            validate_spec(c.compression)


@pytest.mark.parametrize("name", [n for n, c in h.CONTENDERS.items() if not c.ddp])
def test_train_keys_build_a_config(name: str) -> None:
    link = h.parse_link("5g")
    keys = h.train_keys(h.CONTENDERS[name], link, seed=3, epochs=2)
    cfg = TrainConfig(**keys)
    assert cfg.link_profile == "5g" and cfg.seed == 3 and cfg.epochs == 2
    assert cfg.num_workers == h.WORLD
    if name == "delta":
        assert cfg.ps_mode == "sync"


def test_train_keys_on_tbf_have_no_emulation_and_ddp_has_none() -> None:
    keys = h.train_keys(h.CONTENDERS["int8+ef"], h.parse_link("tbf:100"), seed=0, epochs=1)
    assert "link_profile" not in keys
    with pytest.raises(ConfigError):
        h.train_keys(h.CONTENDERS["ddp"], h.parse_link("tbf:100"), seed=0, epochs=1)


def test_parse_link() -> None:
    assert h.parse_link("5g") == h.Link("5g", "emulated")
    assert h.parse_link("tbf:1000") == h.Link("tbf:1000", "tbf", 1000.0)
    for bad in ("tbf:", "tbf:x", "tbf:-5", "none", "6g"):
        with pytest.raises(ConfigError):
            h.parse_link(bad)


def test_ddp_runs_only_on_kernel_shaped_links() -> None:
    names = list(h.CONTENDERS)
    on_5g = [c.name for c in h.contenders_on(h.parse_link("5g"), names)]
    on_tbf = [c.name for c in h.contenders_on(h.parse_link("tbf:100"), names)]
    assert "ddp" not in on_5g and "ddp-powersgd" not in on_5g and "none" in on_5g
    assert on_tbf == names
    with pytest.raises(ConfigError):
        h.contenders_on(h.parse_link("5g"), ["nope"])


def test_rotated_lets_every_contender_lead() -> None:
    items = ["a", "b", "c"]
    assert [h.rotated(items, i)[0] for i in range(3)] == items
    assert sorted(h.rotated(items, 7)) == items
    assert h.rotated([], 2) == []


def _record(name: str, link: str, seed: int, metrics: list[float], **kw: object) -> dict:
    history = [{"epoch": i + 1, "metric": m, "seconds": 10.0} for i, m in enumerate(metrics)]
    return h.make_record(
        h.CONTENDERS[name],
        h.parse_link(link),
        seed,
        0.6,
        history,
        load1=1.5,
        wire_bytes=kw.get("wire_bytes", 1_000_000),  # type: ignore[arg-type]
        chosen=kw.get("chosen"),  # type: ignore[arg-type]
    )


def test_record_time_to_target() -> None:
    r = _record("none", "5g", 0, [0.3, 0.61, 0.7])
    assert r["time_to_s"] == 20.0 and r["reached_epoch"] == 2
    assert r["final_accuracy"] == 0.7 and r["train_s"] == 30.0 and r["load1"] == 1.5
    assert r["strategy"] == "ring" and r["compression"] == "none" and r["link"] == "5g"
    miss = _record("fp16", "5g", 0, [0.3, 0.5])
    assert miss["time_to_s"] is None and miss["reached_epoch"] is None
    ddp = _record("ddp-fp16", "tbf:100", 0, [0.7])
    assert ddp["strategy"] == "ddp" and ddp["compression"] == "hook:fp16"


def _records() -> list[dict]:
    auto = {"strategy": "ring", "compression": "int8+ef"}
    out = []
    for seed in (0, 1):
        out += [
            _record("none", "tbf:100", seed, [0.5, 0.6, 0.7]),  # 20 s
            _record("int8+ef", "tbf:100", seed, [0.6]),  # 10 s
            _record("topk+ef", "tbf:100", seed, [0.4, 0.5]),  # never
            _record("auto", "tbf:100", seed, [0.5, 0.65], chosen=auto),  # 20 s
            _record("ddp", "tbf:100", seed, [0.3, 0.4, 0.5, 0.6]),  # 40 s
        ]
    out.append({"link": "tbf:100", "contender": "fp16", "kind": "sparktrain", "seed": 0,
                "load1": 2.0, "error": "boom"})  # fmt: skip
    return out


def test_summary_ratios_and_winner() -> None:
    rows = {r["contender"]: r for r in h.summarize(_records())}
    assert rows["int8+ef"]["time_to_s"] == 10.0 and rows["int8+ef"]["reached"] == 2
    assert rows["int8+ef"]["vs_none"] == pytest.approx(0.5)
    assert rows["int8+ef"]["vs_ddp"] == pytest.approx(0.25)
    assert rows["topk+ef"]["time_to_s"] is None and rows["topk+ef"]["reached"] == 0
    assert rows["fp16"]["errors"] == 1 and rows["fp16"]["time_to_s"] is None
    assert rows["auto"]["chosen"] == ["ring + int8+ef"]
    (w,) = h.winners(list(rows.values()))
    assert w["winner"] == "int8+ef" and w["best_sparktrain_fixed"] == "int8+ef"
    assert w["auto_picks_best_fixed"] is True
    assert w["auto_vs_best_fixed"] == pytest.approx(2.0)


def test_winner_needs_every_seed_to_reach() -> None:
    recs = [
        _record("fp16", "5g", 0, [0.6]),
        _record("fp16", "5g", 1, [0.5]),  # one seed short: not a winner
        _record("none", "5g", 0, [0.5, 0.6]),
    ]
    (w,) = h.winners(h.summarize(recs))
    assert w["winner"] == "none" and w["auto_chose"] is None


def _args(**kw: object) -> argparse.Namespace:
    base = {"links": ["5g"], "seeds": [0], "target": 0.6, "epochs": 4}
    return argparse.Namespace(**{**base, **kw})


def test_report_and_table() -> None:
    data = h.build_report(_records(), _args())
    assert data["format"] == h.FORMAT and data["config"]["parameters"] >= 5_000_000
    text = h.table(data)
    assert "| tbf 100 Mbit/s (namespaces) | int8+ef | ring | `int8+ef` | 2/2 |" in text
    assert "DDP (TorchDistributor) | hook none" in text
    assert "0/1 (1 failed)" in text
    assert "| tbf:100 | int8+ef | int8+ef | ring + int8+ef | yes | 2.00x |" in text
    with pytest.raises(KeyError):
        h.table({"format": "other"})


def test_arguments() -> None:
    assert "headline" in BENCHES
    args = build_parser("headline").parse_args(
        ["headline", "--links", "5g", "tbf:100", "--seeds", "0", "1", "2", "--epochs", "3"]
    )
    assert h.check_args(args) == [h.parse_link("5g"), h.parse_link("tbf:100")]
    assert args.contenders == list(h.CONTENDERS) and args.target == h.TARGET
    bads: list[dict[str, object]] = [{"epochs": 0}, {"seeds": []}, {"target": 1.5}]
    for bad in bads:
        with pytest.raises(ConfigError):
            h.check_args(_args(**bad))


def test_merge_drops_only_what_runs_again() -> None:
    links = [h.parse_link("tbf:100")]
    args = _args(seeds=[0], contenders=["ddp-powersgd"])
    again = {"link": "tbf:100", "seed": 0, "contender": "ddp-powersgd"}
    assert h.rerun(again, links, args)
    assert not h.rerun({**again, "contender": "ddp"}, links, args)
    assert not h.rerun({**again, "seed": 1}, links, args)
    assert not h.rerun({**again, "link": "5g"}, links, args)
