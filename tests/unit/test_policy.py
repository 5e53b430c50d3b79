"""Per-layer compression policies: glob matching, first match wins, unmatched -> none."""

from __future__ import annotations

import pytest

from sparktrain.compress.policy import (
    describe_policy,
    group_by_spec,
    resolve_policy,
    unused_patterns,
)
from sparktrain.errors import ConfigError

NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]


def test_plain_string_applies_to_every_name() -> None:
    assert resolve_policy("int8+ef", NAMES) == ["int8+ef"] * len(NAMES)
    assert resolve_policy("none", []) == []


def test_first_match_wins_in_table_order() -> None:
    table = {"fc3.*": "fp16", "*.bias": "none", "*": "int8+ef"}
    assert resolve_policy(table, NAMES) == [
        "int8+ef",
        "none",
        "int8+ef",
        "none",
        "fp16",
        "fp16",  # fc3.bias: "fc3.*" comes before "*.bias"
    ]
    reordered = {"*.bias": "none", "fc3.*": "fp16", "*": "int8+ef"}
    assert resolve_policy(reordered, NAMES)[-1] == "none"


def test_unmatched_names_are_not_compressed() -> None:
    assert resolve_policy({"fc1.*": "sign+ef"}, NAMES) == ["sign+ef"] * 2 + ["none"] * 4


def test_matching_is_case_sensitive_and_whole_name() -> None:
    assert resolve_policy({"FC1.*": "fp16", "fc1": "int8"}, ["fc1.weight"]) == ["none"]


def test_groups_and_description() -> None:
    table = {"fc3.*": "fp16", "*": "int8+ef", "conv*": "sign"}
    specs = resolve_policy(table, NAMES)
    assert group_by_spec(specs) == {"int8+ef": [0, 1, 2, 3], "fp16": [4, 5]}
    assert unused_patterns(table, NAMES) == ["conv*"]
    text = describe_policy(table, NAMES, [8192, 128, 16384, 128, 1280, 10])
    lines = text.splitlines()
    assert lines[0].startswith("int8+ef: fc1.weight, fc1.bias, fc2.weight, fc2.bias (95.")
    assert lines[1] == "fp16: fc3.weight, fc3.bias (4.9 %)"
    assert lines[2] == "patterns matching no parameter: conv*"


def test_bad_tables_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match="pattern = spec"):
        resolve_policy(["int8"], NAMES)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="strings"):
        resolve_policy({"*": 8}, NAMES)  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="sizes"):
        describe_policy("fp16", NAMES, [1, 2])


def test_bench_mixed_policy_keeps_sensitive_layers_safe() -> None:
    from benchmarks.compression import layer_groups, mixed_policy, policy_label

    assert layer_groups("mlp") == [("0", 8192 + 128), ("2", 1280 + 10)]
    assert [name for name, _ in layer_groups("cnn")] == ["1", "3", "7"]
    sens = {"1": 1.11, "3": -0.44, "7": 0.22}
    table = mixed_policy(sens, "topk:0.01+ef", "fp16", 0.5)
    assert table == {"1.*": "fp16", "*": "topk:0.01+ef"}
    # the most sensitive layer stays safe even below the threshold
    assert mixed_policy({"0": 0.22, "2": -0.44}, "sign+ef", "fp16", 0.5) == {
        "0.*": "fp16",
        "*": "sign+ef",
    }
    assert mixed_policy(sens, "int8+ef", "fp16", 0.1)["7.*"] == "fp16"
    assert policy_label(table) == "{1.*: fp16, *: topk:0.01+ef}"
    assert resolve_policy(table, ["1.weight", "1.bias", "3.weight", "7.bias"]) == [
        "fp16",
        "fp16",
        "topk:0.01+ef",
        "topk:0.01+ef",
    ]
