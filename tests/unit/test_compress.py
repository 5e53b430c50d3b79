"""Compressors against numpy references: round trips, error feedback, summability,
malformed payloads, the spec grammar and the wire message."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparktrain.compress import BucketState, Ctx, build, decode_message, encode_message
from sparktrain.compress.collective import EXACT_BUDGET, bytes_per_rank, path_bytes
from sparktrain.compress.registry import parse_spec
from sparktrain.compress.sign import pack_bits, unpack_bits
from sparktrain.errors import ConfigError, FrameError

SPECS = ["fp16", "bf16", "int8", "int8:chunk=7,stochastic", "topk:0.1", "topk:0.05,sampled",
         "randomk:0.2", "sign", "powersgd:2", "powersgd:1,cold"]  # fmt: skip
EF_SPECS = [s + "+ef" for s in SPECS]


def _x(n: int = 5003, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _roundtrip(spec: str, x: np.ndarray, state: BucketState | None = None) -> np.ndarray:
    comp = build(spec)
    assert comp is not None
    payload, ctx = comp.compress(torch.from_numpy(x.copy()), state or BucketState())
    # through the wire message, as between ranks
    payload2, ctx2, count = decode_message(encode_message(payload, ctx, 3.0), x.size)
    assert count == 3.0 and ctx2 == ctx
    return comp.decompress(payload2, ctx2).numpy()


# ---------------------------------------------------------------- error bounds
def test_fp16_bf16_within_relative_rounding():
    x = _x() * 100
    np.testing.assert_allclose(_roundtrip("fp16", x), x.astype(np.float16), rtol=0, atol=0)
    np.testing.assert_allclose(_roundtrip("fp16", x), x, rtol=2**-11, atol=1e-7)
    np.testing.assert_allclose(_roundtrip("bf16", x), x, rtol=2**-8, atol=0)
    assert np.isfinite(_roundtrip("fp16", np.array([1e6, -1e6], np.float32))).all()


@pytest.mark.parametrize("chunk", [1, 7, 1024])
@pytest.mark.parametrize("stochastic", [False, True])
def test_int8_per_chunk_bound(chunk, stochastic):
    x = _x(3001)
    x[:50] *= 1000  # one loud chunk must not wreck the others
    spec = f"int8:chunk={chunk}" + (",stochastic" if stochastic else "")
    got = _roundtrip(spec, x)
    pad = np.pad(x, (0, -x.size % chunk)).reshape(-1, chunk)
    scale = np.repeat(np.abs(pad).max(1) / 127, chunk)[: x.size]
    bound = scale * (1.0 if stochastic else 0.5) * (1 + 1e-5) + 1e-30
    assert (np.abs(got - x) <= bound).all()


def test_int8_stochastic_is_unbiased():
    x = np.full(20000, 0.3, np.float32)
    x[0] = 1.0  # scale 1/127: 0.3 sits between two codes
    got = _roundtrip("int8:chunk=20000,stochastic", x)
    assert abs(got[1:].mean() - 0.3) < 2e-4
    assert len(np.unique(got[1:])) == 2


@pytest.mark.parametrize("spec", ["topk:0.01", "topk:0.2", "topk:0.01,sampled"])
def test_topk_keeps_the_largest_and_returns_them_exactly(spec):
    x = _x(20000, seed=3)
    got = _roundtrip(spec, x)
    kept = got != 0
    np.testing.assert_array_equal(got[kept], x[kept])
    k = math.ceil(float(spec.split(":")[1].split(",")[0]) * x.size)
    if "sampled" in spec:
        assert 0.5 * k <= kept.sum() <= 1.25 * k + 1
        # what was kept is (nearly) the top: the smallest kept beats most dropped values
        assert np.abs(x[kept]).min() >= np.quantile(np.abs(x), 1 - 3 * k / x.size)
    else:
        assert kept.sum() == k
        assert np.abs(x[kept]).min() >= np.abs(x[~kept]).max()


def test_randomk_positions_are_shared_and_values_exact():
    x = _x(1000)
    state = BucketState(key=2, seed=5, step=7)
    got = _roundtrip("randomk:0.1", x, state)
    kept = got != 0
    assert 90 <= kept.sum() <= 100  # k draws, duplicates dropped
    np.testing.assert_array_equal(got[kept], x[kept])
    again = _roundtrip("randomk:0.1", _x(1000, seed=1), BucketState(key=2, seed=5, step=7))
    np.testing.assert_array_equal(again != 0, kept)  # same positions on every rank


def test_sign_is_scaled_sign_and_bits_pack_8_per_byte():
    x = _x(1001)
    got = _roundtrip("sign", x)
    scale = np.abs(x).mean()
    np.testing.assert_allclose(got, np.where(x >= 0, scale, -scale), rtol=1e-6)
    bits = torch.from_numpy(np.random.default_rng(0).random(77) > 0.5)
    packed = pack_bits(bits)
    assert packed.numel() == 10
    assert torch.equal(unpack_bits(packed, 77), bits)
    np.testing.assert_array_equal(packed.numpy(), np.packbits(bits.numpy()))


@pytest.mark.parametrize("chunk", [1, 7, 32, 1000])
def test_chunked_sign_has_one_scale_per_chunk(chunk):
    x = _x(1001) * np.linspace(0.01, 10, 1001, dtype=np.float32)  # uneven magnitudes
    got = _roundtrip(f"sign:chunk={chunk}", x)
    m = -(-x.size // chunk)
    pad = np.concatenate([np.abs(x), np.full(m * chunk - x.size, np.nan, np.float32)])
    scale = np.repeat(np.nanmean(pad.reshape(m, chunk), axis=1), chunk)[: x.size]
    np.testing.assert_allclose(got, np.where(x >= 0, scale, -scale), rtol=1e-5)
    comp = build(f"sign:chunk={chunk}")
    assert comp is not None and comp.payload_nbytes(1001) == 126 + 4 * m


def test_powersgd_is_exact_for_low_rank_matrices_and_passes_vectors():
    rng = np.random.default_rng(0)
    m = (rng.standard_normal((40, 2)) @ rng.standard_normal((2, 30))).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    x = np.concatenate([m.ravel(), b])
    state = BucketState(shapes=((40, 30), (40,)))
    got = _roundtrip("powersgd:2", x, state)
    np.testing.assert_allclose(got, x, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(got[1200:], b)


def test_powersgd_error_is_the_rank_r_truncation():
    rng = np.random.default_rng(1)
    m = rng.standard_normal((50, 40)).astype(np.float32)
    state = BucketState(shapes=((50, 40),))
    comp = build("powersgd:4")
    assert comp is not None
    for _ in range(30):  # warm start: power iteration converges to the top subspace
        payload, ctx = comp.compress(torch.from_numpy(m.ravel().copy()), state)
    got = comp.decompress(payload, ctx).numpy().reshape(50, 40)
    u, s, vt = np.linalg.svd(m)
    best = (u[:, :4] * s[:4]) @ vt[:4]
    assert np.linalg.norm(m - got) <= 1.02 * np.linalg.norm(m - best)


# ---------------------------------------------------------------- error feedback
@pytest.mark.parametrize("spec", [*EF_SPECS, "topk:0.01+ef:reset=1000"])
def test_error_feedback_sum_of_updates_equals_sum_of_inputs_minus_residual(spec):
    comp = build(spec)
    assert comp is not None
    state = BucketState(shapes=((30, 40), (80,)))
    rng = np.random.default_rng(2)
    sent = np.zeros(1280, np.float64)
    seen = np.zeros(1280, np.float64)
    for step in range(25):
        g = rng.standard_normal(1280).astype(np.float32)
        seen += g
        payload, ctx = comp.compress(torch.from_numpy(g), state)
        sent += comp.decompress(payload, ctx).numpy()
        state.step = step + 1
    residual = state.slots["ef.residual"].numpy()
    np.testing.assert_allclose(sent + residual, seen, rtol=1e-4, atol=1e-3)


def test_error_feedback_reset_zeroes_the_residual():
    comp = build("sign+ef:reset=3")
    assert comp is not None
    state = BucketState()
    g = torch.from_numpy(_x(100))
    comp.compress(g, state)
    before = state.slots["ef.residual"].clone()
    state.step = 3
    comp.compress(g, state)
    # with the residual zeroed, step 3 compresses g alone, as step 0 did
    torch.testing.assert_close(state.slots["ef.residual"], before)


# ---------------------------------------------------------------- summability
@pytest.mark.parametrize("spec", ["fp16", "bf16", "randomk:0.1", "powersgd:2", "fp16+ef"])
def test_summable_payloads_reduce_like_decompress_then_sum(spec):
    world = 3
    xs = [_x(1200 + 40, seed=s) * (s + 1) for s in range(world)]
    shapes = ((30, 40), (40,))
    comps = [build(spec) for _ in range(world)]
    states = [BucketState(shapes=shapes, seed=1) for _ in range(world)]
    assert all(c is not None and c.summable for c in comps)
    # powersgd is two rounds: run the ranks as threads so they can meet in the middle
    import threading

    barrier = threading.Barrier(world)
    bufs: list[list[np.ndarray]] = [[] for _ in range(world)]
    results: list = [None] * world

    def sum_for(rank: int):
        def sum_(buf: np.ndarray, add=None) -> None:
            bufs[rank].append(buf)
            barrier.wait()
            if rank == 0:
                k = len(bufs[0]) - 1
                total = bufs[0][k].copy()
                for r in range(1, world):
                    (add or np.add)(total, bufs[r][k], total)
                for r in range(world):
                    bufs[r][k][...] = total
            barrier.wait()

        return sum_

    def run(rank: int) -> None:
        results[rank] = comps[rank].allreduce(
            torch.from_numpy(xs[rank]), states[rank], sum_for(rank)
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    totals = [r[0].numpy() for r in results]
    for t in totals[1:]:
        np.testing.assert_array_equal(t, totals[0])  # identical bits everywhere
    locals_ = sum(r[1].numpy().astype(np.float64) for r in results)
    tol = {"fp16": 3e-3, "bf16": 2e-2}.get(spec.split("+")[0], 1e-4)
    np.testing.assert_allclose(totals[0], locals_, rtol=tol, atol=tol * 10)
    if spec == "randomk:0.1":
        # and the same as decompressing each rank's payload and summing
        ref = sum(
            build(spec)
            .decompress(
                *build(spec).compress(torch.from_numpy(x), BucketState(shapes=shapes, seed=1))
            )
            .numpy()  # type: ignore[union-attr]
            for x in xs
        )
        np.testing.assert_allclose(totals[0], ref, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- malformed input
@pytest.mark.parametrize("spec", SPECS)
def test_malformed_payloads_raise_frame_error(spec):
    comp = build(spec)
    assert comp is not None
    x = torch.from_numpy(_x(1240))
    state = BucketState(shapes=((30, 40), (40,)))
    payload, ctx = comp.compress(x, state)
    bad_inputs = [
        (payload[:-1], ctx),
        (tuple(p.astype(np.float64) for p in payload), ctx),
        (payload, Ctx(ctx.numel, (*ctx.meta, 1.0))),
        (payload, Ctx(-1, ctx.meta)),
        ((payload[0][:-1], *payload[1:]), ctx),
    ]
    if not spec.startswith("topk"):  # top-k payloads vary in length legitimately
        bad_inputs += [
            (tuple(p[:-1] if p.size else np.zeros(3, p.dtype) for p in payload), ctx),
            (payload, Ctx(ctx.numel + 5, ctx.meta)),
        ]
    for p, c in bad_inputs:
        with pytest.raises(FrameError):
            comp.decompress(p, c)
    blob = encode_message(payload, ctx, 2.0)
    for mutated in (blob[:-8], blob[:10], np.concatenate([blob, np.zeros(8, np.uint8)])):
        with pytest.raises(FrameError):
            decode_message(mutated, 1240)
    with pytest.raises(FrameError):
        decode_message(blob, 1241)


def test_fuzzed_messages_never_crash():
    comp = build("topk:0.1")
    assert comp is not None
    payload, ctx = comp.compress(torch.from_numpy(_x(500)), BucketState())
    blob = encode_message(payload, ctx, 1.0)
    rng = np.random.default_rng(0)
    for _ in range(300):
        b = blob.copy()
        pos = rng.integers(0, b.size, 3)
        b[pos] = rng.integers(0, 256, 3)
        try:
            p, c, _ = decode_message(b, 500)
            out = torch.zeros(500)
            comp.add_into(out, p, c)
        except FrameError:
            pass


def test_bad_indices_and_scales_are_caught():
    topk = build("topk:0.1")
    int8 = build("int8")
    assert topk is not None and int8 is not None
    vals, idx = topk.compress(torch.from_numpy(_x(100)), BucketState())[0]
    idx = idx.copy()
    idx[0] = 100
    with pytest.raises(FrameError, match="out of range"):
        topk.decompress((vals, idx), Ctx(100))
    codes, scales = int8.compress(torch.from_numpy(_x(100)), BucketState())[0]
    with pytest.raises(FrameError, match="not finite"):
        int8.decompress((codes, np.full_like(scales, np.nan)), Ctx(100))
    with pytest.raises(FrameError, match="whole number"):
        decode_message(encode_message((codes, scales), Ctx(100), 1.5), 100)


# ---------------------------------------------------------------- spec grammar
@pytest.mark.parametrize(
    ("spec", "canonical"),
    [
        ("none", None),
        ("fp16", "fp16"),
        (" TopK:0.01 + EF ", "topk:0.01+ef"),
        ("topk:ratio=0.01,sampled+ef:reset=100", "topk:0.01,sampled+ef:reset=100"),
        ("int8:chunk=256,stochastic+ef", "int8:chunk=256,stochastic+ef"),
        ("powersgd:2+ef", "powersgd:2+ef"),
        ("delta+int8", "delta+int8"),
        ("delta", "delta"),
        ("sign+ef", "sign+ef"),
    ],
)
def test_specs_parse_to_canonical_compressors(spec, canonical):
    comp = build(spec)
    assert (comp.spec if comp is not None else None) == canonical


@pytest.mark.parametrize(
    "spec",
    ["zip", "topk", "topk:0", "topk:1.5", "topk:x", "int8:chunk=0", "int8:foo=1", "int8:fast",
     "ef+int8", "int8+delta", "int8+sign", "fp16+ef+ef", "+ef", "int8+", "ef", "ef:x=1",
     "delta:1+int8", "powersgd:0", "topk:0.1,0.2"],
)  # fmt: skip
def test_bad_specs_raise_config_error_naming_the_forms(spec):
    with pytest.raises(ConfigError, match="allowed values: none, fp16"):
        build(spec)


def test_parse_spec_stages():
    stages = parse_spec("delta+int8:chunk=64+ef")
    assert [s.name for s in stages] == ["delta", "int8", "ef"]
    assert stages[1].option("chunk") == "64"


def test_a_registered_compressor_builds_and_unknown_names_list_the_registry(monkeypatch):
    from sparktrain.compress import registry
    from sparktrain.compress.cast import Half

    monkeypatch.setitem(registry._REGISTRY, "mine", lambda stage: Half())
    assert isinstance(build("mine+ef").inner, Half)
    with pytest.raises(ConfigError) as err:
        build("zip")
    assert "unknown compressor 'zip' (registered: " in str(err.value)
    listed = str(err.value).partition("registered: ")[2].partition(")")[0].split(", ")
    assert listed == registry.registered()
    assert {"fp16", "int8", "topk", "powersgd", "mine"} <= set(listed)


# ---------------------------------------------------------------- bytes
def test_honest_byte_figures():
    n = 1_000_000
    topk = build("topk:0.01+ef")
    assert topk is not None
    assert topk.payload_nbytes(n) == n // 100 * 8  # 50x, not 100x (int32 indices)
    assert topk.payload_nbytes(50_000) == 500 * 6  # uint16 indices up to 65,536 elements
    assert 4 * n / topk.payload_nbytes(n) == 50
    # a sparse all-gather grows with the world (plain top-k); the resparsify ring
    # (top-k+ef) and a summable reduce do not. top-k+ef keeps the exact all-gather while
    # it is within twice the cheapest path's bytes (world 4), then fewer re-encodings
    plain = build("topk:0.01")
    assert plain is not None
    assert bytes_per_rank(plain, n, 4) == 3 * bytes_per_rank(plain, n, 2)
    assert bytes_per_rank(topk, n, 4) == bytes_per_rank(plain, n, 4)
    ring = path_bytes(topk, n, 4)["resparsify"]
    assert ring == pytest.approx(1.5 * bytes_per_rank(topk, n, 2))
    assert bytes_per_rank(topk, n, 4) <= EXACT_BUDGET * ring
    assert bytes_per_rank(topk, n, 8) == path_bytes(topk, n, 8)["resparsify_tree"]
    fp16 = build("fp16")
    assert fp16 is not None
    assert bytes_per_rank(fp16, n, 4) == pytest.approx(1.5 * 2 * n)
    sign, int8 = build("sign"), build("int8")
    assert sign is not None and int8 is not None
    assert sign.payload_nbytes(n) == n // 8 + 4  # bits and one fp32 scale
    assert int8.payload_nbytes(n) == n + 4 * math.ceil(n / 1024)


# ---------------------------------------------------------------- path choice
def test_path_choice_moves_the_fewest_bytes():
    from sparktrain.compress.collective import choose_path, path_bytes, path_for

    def comp(spec: str):
        c = build(spec)
        assert c is not None
        return c

    for spec in ("fp16", "bf16", "randomk:0.01", "powersgd:2+ef"):
        assert {path_for(comp(spec), w, a) for w in (2, 3, 4) for a in ("ring", "tree")} == {
            "reduce"
        }
    for spec in ("int8", "int8+ef", "sign", "sign+ef"):
        assert path_for(comp(spec), 2) == "allgather"  # a tie: the exact path
        want = "allgather" if spec.startswith("sign") else "recompress"  # collective.COARSE
        assert path_for(comp(spec), 3) == path_for(comp(spec), 4) == want
        assert path_for(comp(spec), 4, "tree") == "allgather"  # the tree has no ring hops
    assert choose_path(comp("sign+ef"), 4, "ring", "recompress") == "recompress"
    assert {path_for(comp("topk:0.01"), w) for w in (2, 3, 4)} == {"allgather"}
    assert path_for(comp("topk:0.01,sampled+ef"), 2) == "allgather"
    assert path_for(comp("topk:0.01,sampled+ef"), 4) == "allgather"  # test_compress_gtopk
    assert path_for(comp("topk:0.01,sampled+ef"), 8) == "resparsify_tree"
    n = 1 << 20
    int8 = comp("int8")
    b = path_bytes(int8, n, 4)
    assert b["allgather"] == 3 * int8.payload_nbytes(n)
    assert b["recompress"] == pytest.approx(1.5 * int8.payload_nbytes(n), rel=1e-3)
    assert bytes_per_rank(int8, n, 4) == b["recompress"]


def _ring_reduce(world: int, spec: str, inputs: list[np.ndarray], steps: int = 1):
    """Reduce ``inputs[r]`` (the same each step) ``steps`` times on a world-sized ring in
    threads; per rank: outputs, final residual, count, path and byte deltas."""
    from sparktrain.compress.collective import CompressedAllreduce
    from sparktrain.compress.feedback import RESIDUAL
    from sparktrain.wire import make_allreduce

    from .fixtures import raise_first, run_mesh_ranks

    def body(rank: int, mesh):
        comp = build(spec)
        assert comp is not None
        # sign takes the all-gather unless told (collective.COARSE): force the ring here
        path = "recompress" if spec.startswith("sign") else "auto"
        red = CompressedAllreduce(comp, make_allreduce("ring", mesh), path=path)
        before = mesh.stats.as_dict()
        outs, counts = [], []
        for _ in range(steps):
            grads = torch.from_numpy(inputs[rank].copy())
            counts.append(red.reduce_(0, grads, float(rank + 1)))
            outs.append(grads.numpy().copy())
        after = mesh.stats.as_dict()
        residual = red.states[0].slots.get(RESIDUAL)
        return {
            "outs": outs,
            "counts": counts,
            "path": red.path,
            "residual": None if residual is None else residual.numpy().copy(),
            "wire": after["wire_bytes_sent"] - before["wire_bytes_sent"],
        }

    results = run_mesh_ranks(world, body, timeout=20.0, join_timeout=120.0)
    raise_first(results)
    return results


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("spec", ["int8", "int8:chunk=64", "sign"])
def test_recompress_ring_matches_the_numpy_sum_within_the_bound(world, spec):
    n = 10_007
    inputs = [_x(n, seed=r) * (r + 1) for r in range(world)]
    results = _ring_reduce(world, spec, inputs)
    total = np.sum(inputs, axis=0, dtype=np.float64)
    outs = [r["outs"][0] for r in results]
    for out in outs[1:]:
        assert out.tobytes() == outs[0].tobytes()  # every rank holds the same bits
    assert {r["path"] for r in results} == {"recompress"}
    assert {r["counts"][0] for r in results} == {world * (world + 1) / 2}
    if spec.startswith("int8"):
        # each segment is encoded `world` times (n - 1 hops and the final one), each
        # time off by at most half a step of its chunk's scale: max |partial| / 254
        bound = world * np.sum(np.abs(inputs), axis=0).max() / 254 * (1 + 1e-5)
        assert np.abs(outs[0] - total).max() <= bound
    else:  # sign keeps the sign where the sum is not tiny, and one magnitude per segment
        big = np.abs(total) > 0.5 * np.abs(total).mean()
        agree = np.mean(np.sign(outs[0][big]) == np.sign(total[big]))
        assert agree > 0.8
    # fewer bytes than the all-gather would have sent: 2 (n - 1) / n against n - 1
    comp = build(spec)
    assert comp is not None
    for r in results:
        assert r["wire"] < (world - 1) * comp.payload_nbytes(n)


@pytest.mark.parametrize("spec", ["int8+ef", "sign+ef"])
def test_recompress_ring_error_feedback_loses_nothing(spec):
    """Every rank feeds back the error of every encoding it made (its own segment and the
    partial sums it re-encoded), so over T steps sum(outputs) = T sum(inputs) - sum of
    the final residuals, over all ranks."""
    world, n, steps = 3, 4099, 6
    inputs = [_x(n, seed=10 + r) for r in range(world)]
    results = _ring_reduce(world, spec, inputs, steps)
    sent = np.sum(results[0]["outs"], axis=0, dtype=np.float64)
    # the ring reduces count * gradient; the residual is kept per sample (ef.scale)
    want = steps * np.sum(inputs, axis=0, dtype=np.float64) - sum(
        (rank + 1) * r["residual"].astype(np.float64) for rank, r in enumerate(results)
    )
    np.testing.assert_allclose(sent, want, rtol=0, atol=1e-3 * np.abs(want).max())


def test_ef_momentum_masks_only_for_sparse_compressors():
    """Dense compressors send every coordinate, so masking would erase the momentum; they
    keep it (EF on the momentum update), sparse ones forget what they sent (DGC)."""
    from sparktrain.compress.feedback import MOMENTUM

    x = torch.from_numpy(_x(1000))
    for spec, masked in (
        ("sign:chunk=32+ef:momentum=0.9", False),
        ("topk:0.1+ef:momentum=0.9", True),
    ):
        comp = build(spec)
        assert comp is not None
        state = BucketState()
        payload, ctx = comp.compress(x, state)
        sent = comp.decompress(payload, ctx)
        u = state.slots[MOMENTUM]
        if masked:
            assert torch.all(u[sent != 0] == 0) and torch.equal(u[sent == 0], x[sent == 0])
        else:
            assert torch.equal(u, x)


@pytest.mark.parametrize("n", [1000, 65_536 * 2 + 5, 300_017])
@pytest.mark.parametrize("threshold", [0.0, 1.5, 3.0, 100.0])
def test_striped_threshold_search_finds_exactly_the_survivors(n, threshold):
    from sparktrain.compress.topk import above

    x = _x(n, seed=n)
    got = np.sort(above(torch.from_numpy(x), torch.tensor(threshold)).numpy())
    np.testing.assert_array_equal(got, np.flatnonzero(np.abs(x) >= threshold))


@pytest.mark.parametrize("n", [0, 1, 1000, 1024, 1025, 3 * 1024 + 7])
def test_int8_sizes_around_the_chunk(n):
    x = _x(n, seed=3) if n else np.zeros(0, np.float32)
    got = _roundtrip("int8", x)
    assert got.shape == x.shape
    if n:
        m = -(-n // 1024)
        pad = np.concatenate([np.abs(x), np.zeros(m * 1024 - n, np.float32)]).reshape(m, 1024)
        bound = np.repeat(pad.max(1) / 254, 1024)[:n] * (1 + 1e-5)
        assert np.all(np.abs(got - x) <= bound)
