"""Typed model inputs without Spark: how columns are named and checked
(:mod:`sparktrain.data.columns`), and how their rows become a batch and a model call
(:mod:`sparktrain.data.batch`)."""

from __future__ import annotations

import json
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from sparktrain.data.batch import Batch, Collator, forward, pad, sample_batch
from sparktrain.data.columns import (
    Column,
    Layout,
    check_dtype,
    check_options,
    check_shape,
    option_for,
    parse_columns,
    parse_labels,
    row_shape_error,
)
from sparktrain.errors import ConfigError, DataError

from .typed_hooks import decode_pixels

BIG_ID = 2**53 + 1  # neither float32 nor float64 holds it exactly


# ---------------------------------------------------------------------- naming the inputs
def test_features_col_as_a_name_a_list_or_a_mapping():
    assert parse_columns("features") == ("single", [("features", "features")])
    assert parse_columns(["ids", "dense"]) == ("positional", [("ids", "ids"), ("dense", "dense")])
    assert parse_columns(("a",)) == ("positional", [("a", "a")])
    assert parse_columns({"user": "user_id", "item": "item_id"}) == (
        "keyword",
        [("user", "user_id"), ("item", "item_id")],
    )


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("", "features_col is empty"),
        ([], "needs one or more column names"),
        ({}, "empty mapping"),
        (["a", ""], "needs one or more column names"),
        (["a", 3], "needs one or more column names"),
        (["a", "b", "a"], "names a column twice"),
        ({"1st": "a"}, "'1st' is not a Python identifier"),
        ({"a-b": "a"}, "'a-b' is not a Python identifier"),
        ({3: "a"}, "3 is not a Python identifier"),
        ({"a": ""}, "'a' maps to ''"),
        ({"a": 3}, "'a' maps to 3"),
        (3, "got int"),
        (None, "got NoneType"),
        (b"features", "got bytes"),
        ({"a", "b"}, "got set"),
    ],
)
def test_bad_features_col_is_refused(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_columns(spec)


def test_the_option_name_appears_in_the_error():
    with pytest.raises(ConfigError, match="featuresCols is empty"):
        parse_columns("", what="featuresCols")


def test_label_col_as_a_name_or_a_list():
    assert parse_labels("label") == ["label"]
    assert parse_labels(["a", "b"]) == ["a", "b"]
    assert parse_labels(("a",)) == ["a"]
    with pytest.raises(ConfigError, match="names a column twice"):
        parse_labels(["a", "b", "a"])
    for bad in ("", [], ["a", ""], ["a", 1], None, 3, b"label", {"a": "b"}):
        with pytest.raises(ConfigError, match="label_col must be a column name or a list"):
            parse_labels(bad)


def test_feature_shapes_entries():
    assert check_shape("x", [3]) == (3,)
    assert check_shape("x", (1, 28, 28)) == (1, 28, 28)
    assert check_shape("x", [-1]) == (-1,)
    for bad in ([], "3", 3, None, [0], [-2], [2, 0], [True], [2.0], [np.int64(2)]):
        with pytest.raises(ConfigError, match=r"feature_shapes\['x'\]"):
            check_shape("x", bad)
    for bad in ([-1, 3], [3, -1], [-1, -1]):
        with pytest.raises(ConfigError, match=r"only one-dimensional variable-length.*\[-1\]"):
            check_shape("x", bad)


def test_feature_dtypes_entries():
    for ok in ("float32", "float64", "float16", "bfloat16", "int64"):
        assert check_dtype("x", ok) == ok
    for bad in ("int32", "float", "double", None, 32, torch.float32):
        with pytest.raises(ConfigError, match=r"feature_dtypes\['x'\] = .* is not supported"):
            check_dtype("x", bad)


def test_per_column_options_name_an_input_by_argument_or_column():
    keys, sources = ["user", "x"], ["user_id", "x"]
    check_options(keys, sources, {"user": [1]}, {"user_id": "int64"}, {}, {"x": "m:f"})
    for option in ("feature_shapes", "feature_dtypes", "decode", "collate"):
        tables: dict[str, dict[str, Any]] = {
            "feature_shapes": {},
            "feature_dtypes": {},
            "decode": {},
            "collate": {},
        }
        tables[option] = {"item": 1}
        with pytest.raises(ConfigError, match=f"{option} names 'item', which is not a model input"):
            check_options(keys, sources, *tables.values())
    # the model argument's entry wins over the column's
    assert option_for({"user": 1, "user_id": 2}, "user", "user_id") == 1
    assert option_for({"user_id": 2}, "user", "user_id") == 2
    assert option_for({}, "user", "user_id") is None
    # {"a": "b", "b": "c"}: an entry "b" is argument b's, not column b's (argument a's)
    assert option_for({"b": [-1]}, "a", "b", ["a", "b"]) is None
    assert option_for({"b": [-1]}, "b", "c", ["a", "b"]) == [-1]


def _typed_layout() -> Layout:
    return Layout(
        (
            Column("ids", "user_id", "features_0", "dense", "int64"),
            Column("x", "x", "features_1", "dense", "float32", (2, 3)),
            Column(
                "tokens",
                "tokens",
                "features_2",
                "ragged",
                "int64",
                (-1,),
                None,
                "tests.unit.typed_hooks:collate_lengths",
            ),
            Column(
                "image",
                "png",
                "features_3",
                "binary",
                "binary",
                (),
                "tests.unit.typed_hooks:decode_pixels",
            ),
        ),
        "keyword",
        2,
        ("a", "b"),
    )


def test_a_layout_round_trips_through_json():
    layout = _typed_layout()
    text = json.dumps(layout.to_dict())
    back = Layout.from_dict(json.loads(text))
    assert back == layout
    # hooks are not part of equality: compare them by hand
    assert [(c.decode, c.collate) for c in back.columns] == [
        (c.decode, c.collate) for c in layout.columns
    ]
    assert back.columns[1].shape == (2, 3) and back.label_sources == ("a", "b")
    assert back.label_width == 2 and back.call == "keyword"
    plain = Layout.plain(7)
    assert Layout.from_dict(json.loads(json.dumps(plain.to_dict()))) == plain
    # a callable hook is shown by name (and reads back as that text)
    called = Layout((Column("img", "img", "features", "binary", "binary", (), decode_pixels),))
    assert called.to_dict()["columns"][0]["decode"] == "tests.unit.typed_hooks:decode_pixels"


def test_the_plain_layout_and_what_is_not_plain():
    plain = Layout.plain(5)
    assert plain.is_plain and plain.width == 5 and plain.keys == ["features"]
    assert plain.columns[0].stored_dtype == "float32"
    f32 = Column("features", "features", "features", "dense", "float32", (5,))
    assert Layout((f32,)).is_plain
    not_plain = [
        Layout((f32,), "positional"),
        Layout((f32,), "keyword"),
        Layout((f32, f32)),
        Layout((f32,), label_width=2),
        Layout((Column("f", "f", "features", "dense", "float64", (5,)),)),
        Layout((Column("f", "f", "features", "dense", "int64", (5,)),)),
        Layout((Column("f", "f", "features", "dense", "float32", ()),)),
        Layout((Column("f", "f", "features", "dense", "float32", (1, 5)),)),
        Layout((Column("f", "f", "features", "ragged", "float32", (-1,)),)),
        Layout((Column("f", "f", "features", "binary", "binary", (), decode_pixels),)),
    ]
    for layout in not_plain:
        assert not layout.is_plain, layout.describe()


def test_columns_describe_themselves():
    layout = _typed_layout()
    assert [c.width for c in layout.columns[:2]] == [1, 6]
    assert Column("b", "b", "w", "dense", "bfloat16", (3,)).stored_dtype == "float32"
    text = layout.describe()
    assert "ids=user_id (dense, int64, scalar)" in text and "x (dense, float32, 2x3)" in text
    assert "tokens (ragged, int64, variable length)" in text
    assert "image=png (binary, binary, bytes, decoded)" in text
    assert text.endswith("called keyword; labels 2 per row")


def test_a_row_of_the_wrong_width_names_the_column_and_a_way_out():
    flat = Column("emb", "embedding", "features_0", "dense", "float32", (4,))
    message = str(row_shape_error(flat, 3, partition=5))
    assert "column 'embedding', partition 5: a row has 3 values, the first row had 4" in message
    assert "feature_shapes={'emb': [-1]}" in message
    shaped = Column("img", "img", "features_0", "dense", "float32", (2, 3))
    message = str(row_shape_error(shaped, 5, partition=0))
    assert "its feature_shapes entry [2, 3] needs 6 values a row" in message


# ---------------------------------------------------------------------- padding and batches
def test_pad_ragged_int64_rows_to_the_longest_with_a_mask():
    rows = [np.array([1, 2, 3]), np.array([], np.int64), np.array([BIG_ID]), np.array([7, 8])]
    values, mask = pad(rows, "int64")
    assert values.dtype == torch.int64 and mask.dtype == torch.bool
    assert values.tolist() == [[1, 2, 3], [0, 0, 0], [BIG_ID, 0, 0], [7, 8, 0]]
    assert mask.tolist() == [
        [True, True, True],
        [False, False, False],
        [True, False, False],
        [True, True, False],
    ]
    # no rows, or only empty ones: one padded column, nothing real
    values, mask = pad([], "int64")
    assert values.shape == (0, 1) and mask.shape == (0, 1)
    values, mask = pad([np.zeros(0, np.int64)] * 2, "int64")
    assert values.tolist() == [[0], [0]] and not mask.any()
    values, _ = pad([np.array([0.5, 1.5], np.float32), np.array([2.5], np.float32)], "bfloat16")
    assert values.dtype == torch.bfloat16 and values.float().tolist() == [[0.5, 1.5], [2.5, 0.0]]
    values, _ = pad([np.array([0.1])], "float64")
    assert values.dtype == torch.float64 and values.item() == 0.1


def _dense_layout(call: str = "keyword") -> Layout:
    return Layout(
        (
            Column("ids", "ids", "features_0", "dense", "int64"),
            Column("vec", "vec", "features_1", "dense", "float32", (3,)),
            Column("img", "img", "features_2", "dense", "float32", (2, 3)),
            Column("wide", "wide", "features_3", "dense", "float64", (2,)),
            Column("half", "half", "features_4", "dense", "bfloat16", (1,)),
        ),
        call,  # type: ignore[arg-type]
    )


def test_dense_columns_keep_their_shapes_and_dtypes():
    layout = _dense_layout()
    n = 4
    ids = np.array([[0], [2**24 + 1], [BIG_ID], [-(2**62)]], np.int64)  # stored (n, 1)
    vec = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    img = np.arange(n * 6, dtype=np.float32).reshape(n, 6)
    wide = np.array([[0.1, 1e-300]] * n)
    half = np.array([[1.0 + 2**-10]] * n, np.float32)  # not a bfloat16 value: rounded
    labels = np.array([0.0, 1.0, 2.0, 1.0])
    weights = np.array([0.5, 1.0, 1.5, 1.0])
    batch = Collator(layout).batch([ids, vec, img, wide, half], labels, weights, partition=3)
    got = batch.inputs
    assert list(got) == ["ids", "vec", "img", "wide", "half"] and len(batch) == n
    assert got["ids"].dtype == torch.int64 and got["ids"].shape == (n,)
    assert got["ids"].tolist() == [0, 2**24 + 1, BIG_ID, -(2**62)]  # exactly
    assert got["vec"].dtype == torch.float32 and got["vec"].shape == (n, 3)
    assert got["img"].shape == (n, 2, 3) and got["img"][1].tolist() == [[6, 7, 8], [9, 10, 11]]
    assert got["wide"].dtype == torch.float64 and got["wide"][0].tolist() == [0.1, 1e-300]
    assert got["half"].dtype == torch.bfloat16 and got["half"].shape == (n, 1)
    assert got["half"][0].item() == 1.0
    assert batch.masks == {}
    assert batch.labels is not None and batch.labels.dtype == torch.float64
    assert batch.weights is not None and batch.weights.dtype == torch.float32
    assert batch.weights.tolist() == [0.5, 1.0, 1.5, 1.0]
    unweighted = Collator(layout).batch([ids, vec, img, wide, half], None, None, partition=0)
    assert unweighted.labels is None and unweighted.weights is None
    moved = batch.to("cpu")
    assert moved.call == "keyword" and torch.equal(moved.inputs["ids"], got["ids"])


def _binary(decode: Any, collate: Any = None) -> Layout:
    return Layout((Column("img", "png", "features", "binary", "binary", (), decode, collate),))


@pytest.mark.parametrize("decode", [decode_pixels, "tests.unit.typed_hooks:decode_pixels"])
def test_binary_rows_are_decoded_and_stacked(decode):
    rows = [bytes([1, 2, 3, 4]), bytes([5, 6, 7, 8])]
    batch = Collator(_binary(decode)).batch([rows], np.zeros(2), None, partition=0)
    image = batch.inputs["img"]
    assert image.dtype == torch.float32 and image.shape == (2, 2, 2)
    assert image.tolist() == [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]


def test_read_only_decoded_rows_reach_torch_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = Collator(_binary("tests.unit.typed_hooks:decode_view")).batch(
            [[b"ab", b"cd"]], None, None, partition=0
        )
    image = batch.inputs["img"]
    assert image.dtype == torch.uint8 and image.tolist() == [[97, 98], [99, 100]]
    image += 1  # the batch's own memory, not the decoded views'


def test_decoded_tensors_are_stacked_too():
    batch = Collator(_binary(lambda b: torch.tensor([len(b)]))).batch(
        [[b"a", b"bcd"]], None, None, partition=0
    )
    assert batch.inputs["img"].tolist() == [[1], [3]]


def test_a_decode_giving_rows_of_different_shapes_names_the_column():
    collator = Collator(_binary("tests.unit.typed_hooks:decode_view"))
    with pytest.raises(DataError, match=r"column 'png', partition 4: decode .*different shapes"):
        collator.batch([[b"ab", b"abc"]], None, None, partition=4)
    with pytest.raises(DataError, match=r"give a collate for 'img'"):
        collator.batch([[b"ab", b"abc"]], None, None, partition=4)


def test_a_decode_that_fails_names_the_column_and_partition():
    collator = Collator(_binary("tests.unit.typed_hooks:decode_strict"))
    with pytest.raises(
        DataError,
        match=r"column 'png', partition 2: decode 'tests.unit.typed_hooks:decode_strict' "
        r"failed on a row \(ValueError: an empty value\)",
    ) as info:
        collator.batch([[b"ab", b""]], None, None, partition=2)
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("made", ["text", {"a": 1}, [[1, 2], [3]], None])
def test_a_decode_giving_something_else_than_arrays_names_the_column(made):
    collator = Collator(_binary(lambda b: made))
    with pytest.raises(DataError, match=r"column 'png', partition 1: decode .* not numeric arrays"):
        collator.batch([[b"a", b"b"]], None, None, partition=1)


def test_an_unimportable_hook_is_a_config_error():
    with pytest.raises(ConfigError, match=r"decode\['img'\] 'nowhere_at_all:f'"):
        Collator(_binary("nowhere_at_all:f"))
    with pytest.raises(ConfigError, match=r"decode\['img'\] must be 'module:function'"):
        Collator(_binary(3))


def _ragged(collate: Any) -> Layout:
    return Layout((Column("tok", "tok", "features", "ragged", "int64", (-1,), None, collate),))


def test_a_collate_returns_a_tensor_or_a_tensor_and_mask():
    rows = [np.array([1, 2, 3]), np.array([4])]
    batch = Collator(_ragged("tests.unit.typed_hooks:collate_lengths")).batch(
        [rows], None, None, partition=0
    )
    assert batch.inputs["tok"].tolist() == [[3.0], [1.0]] and batch.masks == {}
    batch = Collator(_ragged("tests.unit.typed_hooks:collate_shift")).batch(
        [rows], None, None, partition=0
    )
    assert batch.inputs["tok"].tolist() == [[2, 3, 4], [5, 0, 0]]
    assert batch.masks["tok"].tolist() == [[True, True, True], [True, False, False]]
    # the collate wrote to copies: the rows it was handed are the store's
    assert rows[0].tolist() == [1, 2, 3] and rows[1].tolist() == [4]
    batch = Collator(_ragged(lambda rows: (torch.ones(len(rows)), None))).batch(
        [rows], None, None, partition=0
    )
    assert batch.masks == {} and batch.inputs["tok"].tolist() == [1.0, 1.0]
    # a binary column's collate gets the decoded rows
    lengths = Collator(_binary(decode_pixels, lambda rows: torch.tensor([r.size for r in rows])))
    assert lengths.batch([[b"abcd", b"ab"]], None, None, 0).inputs["img"].tolist() == [4, 2]


@pytest.mark.parametrize(
    ("made", "needle"),
    [
        ([1, 2], "returned list; it must return a tensor or a \\(tensor, mask\\) pair"),
        ((torch.zeros(2), "mask"), "returned tuple"),
        ((torch.zeros(2), torch.zeros(2), None), "returned tuple"),
        (np.zeros(2), "returned ndarray"),
        (torch.zeros(3), r"a tensor of shape \(3,\) for 2 rows"),
        (torch.tensor(1.0), r"a tensor of shape \(\) for 2 rows"),
        ((torch.zeros(2, 4), torch.ones(1, 4, dtype=torch.bool)), r"a mask of shape \(1, 4\)"),
    ],
)
def test_a_bad_collate_return_names_the_column(made, needle):
    collator = Collator(_ragged(lambda rows: made))
    with pytest.raises(DataError, match=f"column 'tok', partition 6: collate .*{needle}"):
        collator.batch([[np.array([1]), np.array([2])]], None, None, partition=6)


def test_a_sample_batch_for_the_driver_s_probe():
    layout = Layout(
        (
            *_dense_layout().columns,
            Column("tok", "tok", "features_5", "ragged", "int64", (-1,)),
            Column("png", "png", "features_6", "binary", "binary", (), decode_pixels),
        ),
        "keyword",
    )
    batch = sample_batch(layout, {"png": b"wxyz"}, rows=3)
    assert {k: tuple(v.shape) for k, v in batch.inputs.items()} == {
        "ids": (3,),
        "vec": (3, 3),
        "img": (3, 2, 3),
        "wide": (3, 2),
        "half": (3, 1),
        "tok": (3, 1),
        "png": (3, 2, 2),
    }
    assert batch.inputs["ids"].dtype == torch.int64 and batch.inputs["half"].dtype == torch.bfloat16
    assert batch.masks["tok"].all() and batch.labels is None
    with pytest.raises(DataError, match="column 'png' has no non-null value to decode"):
        sample_batch(layout, {})


# ---------------------------------------------------------------------- calling the model
class _Single(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().sum(1, keepdim=True)


class _Positional(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.float() * 10 + b.float().sum(1)


class _Keyword(nn.Module):
    seen: dict[str, Any]

    def forward(self, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # order differs
        return a.float() * 10 + b.float().sum(1)


class _WantsMask(nn.Module):
    seen: dict[str, Any]

    def forward(self, a: torch.Tensor, b: torch.Tensor, b_mask: torch.Tensor) -> torch.Tensor:
        self.seen = {"b_mask": b_mask}
        return a.float() + b_mask.sum(1)


class _TakesKwargs(nn.Module):
    seen: dict[str, Any]

    def forward(self, *inputs: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        self.seen = dict(extra)
        return inputs[0].float()


def _two_column_batch(call: str, masked: bool) -> Batch:
    inputs = {"a": torch.tensor([1, 2]), "b": torch.tensor([[1, 0], [2, 3]])}
    masks = {"b": torch.tensor([[True, False], [True, True]])} if masked else {}
    return Batch(inputs, call, masks)


def test_forward_calls_the_model_as_the_layout_says():
    single = Batch({"features": torch.ones(2, 3)})
    assert forward(_Single(), single).tolist() == [[3.0], [3.0]]
    assert forward(_Positional(), _two_column_batch("positional", False)).tolist() == [11.0, 25.0]
    # by keyword: the argument names matter, not their order
    assert forward(_Keyword(), _two_column_batch("keyword", False)).tolist() == [11.0, 25.0]
    # positionally: in the layout's order, whatever the keys
    swapped = Batch({"b": torch.tensor([5]), "a": torch.tensor([[2]])}, "positional")
    assert forward(_Positional(), swapped).tolist() == [52.0]


def test_masks_go_only_to_a_forward_that_takes_them():
    # no b_mask parameter: the mask stays out of the call (a padding_idx model)
    assert forward(_Keyword(), _two_column_batch("keyword", True)).tolist() == [11.0, 25.0]
    assert forward(_Positional(), _two_column_batch("positional", True)).tolist() == [11.0, 25.0]
    wants = _WantsMask()
    for call in ("keyword", "positional"):
        assert forward(wants, _two_column_batch(call, True)).tolist() == [2.0, 4.0]
        assert wants.seen["b_mask"].tolist() == [[True, False], [True, True]]
    anything = _TakesKwargs()
    forward(anything, _two_column_batch("positional", True))
    assert list(anything.seen) == ["b_mask"]
    forward(anything, _two_column_batch("positional", False))
    assert anything.seen == {}
    # a model without a signature (a builtin's forward) gets no masks
    linear = nn.Linear(2, 1)
    out = forward(linear, Batch({"b": torch.ones(2, 2)}, "single", {"b": torch.ones(2, 2) > 0}))
    assert out.shape == (2, 1)
