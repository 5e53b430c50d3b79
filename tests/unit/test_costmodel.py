"""The alpha-beta cost model against hand-computed values, and the auto choice."""

from __future__ import annotations

import pytest

from sparktrain import costmodel as cm
from sparktrain.costmodel import Choice, CompressorCost, LinkEstimate, choose
from sparktrain.errors import ConfigError

A, B, N = 1e-4, 1e-9, 1e6  # 100 us latency, 1 GB/s, 1 MB


def test_ring_formula():
    # 2 (p-1) alpha + 2 (p-1)/p n beta = 6e-4 + 1.5e-3
    assert cm.ring_allreduce_s(N, 4, A, B) == pytest.approx(2.1e-3)
    assert cm.ring_allreduce_s(N, 4, A, B, calls=3) == pytest.approx(3 * 6e-4 + 1.5e-3)
    assert cm.ring_allreduce_s(N, 1, A, B) == 0.0


def test_tree_formula_with_folding():
    assert cm.tree_rounds(1) == 0
    assert cm.tree_rounds(2) == 1
    assert cm.tree_rounds(4) == 2
    assert cm.tree_rounds(5) == 4  # 2 swaps + fold in + fold out
    assert cm.tree_rounds(8) == 3
    assert cm.tree_allreduce_s(N, 4, A, B) == pytest.approx(2 * (1e-4 + 1e-3))
    assert cm.tree_allreduce_s(N, 5, A, B) == pytest.approx(4 * (1e-4 + 1e-3))


def test_allgather_formulas():
    assert cm.ring_allgather_s(1e4, 4, A, B) == pytest.approx(3 * (1e-4 + 1e-5))
    # log2(4) latencies, 3 payloads received
    assert cm.tree_allgather_s(1e4, 4, A, B) == pytest.approx(2e-4 + 3e-5)
    # p = 5: + fold in/out latencies, + 5 payloads on the folded pair's link
    assert cm.tree_allgather_s(1e4, 5, A, B) == pytest.approx(2e-4 + 3e-5 + 2e-4 + 5e-5)


def test_parameter_server_shares_the_driver_link():
    # 4 alpha + 2 p n beta
    assert cm.ps_step_s(N, 4, A, B) == pytest.approx(4e-4 + 8e-3)
    # compressed pushes (ratio 4), exact pulls
    assert cm.ps_step_s(N, 4, A, B, push_ratio=4) == pytest.approx(4e-4 + 1e-3 + 4e-3)


def test_tree_aggregate_round():
    # J + ceil(log2 4)(alpha + n beta) + depth (alpha + ceil(4^(1/2)) n beta)
    got = cm.tree_aggregate_round_s(N, 4, A, B, job_overhead_s=0.3, depth=2)
    assert got == pytest.approx(0.3 + 2 * 1.1e-3 + 2 * (1e-4 + 2e-3))


def test_compressed_comm_paths():
    fp16 = CompressorCost("fp16", summable=True, ratio=2.0, calls=1)
    topk = CompressorCost("topk:0.01+ef", summable=False, ratio=50.0)
    # summable: the ring on n/2 bytes, plus one tiny allreduce for the sample count
    want = cm.ring_allreduce_s(N / 2, 4, A, B) + cm.ring_allreduce_s(8, 4, A, B)
    assert cm.comm_s("ring", N, 4, A, B, compressor=fp16) == pytest.approx(want)
    # all-gather: (p - 1) payloads of n / ratio
    assert cm.comm_s("ring", N, 4, A, B, compressor=topk) == pytest.approx(3 * (A + 2e4 * B))
    # latency paid per bucket
    assert cm.comm_s("tree", N, 4, A, B, buckets=3) == pytest.approx(2 * (3 * A + N * B))
    with pytest.raises(ConfigError, match="tree_aggregate"):
        cm.comm_s("tree_aggregate", N, 4, A, B)


def test_compressor_compute_grows_with_world_on_the_allgather_path():
    c = CompressorCost(
        "int8", summable=False, ratio=4, fixed_s_per_elem=2e-9, per_peer_s_per_elem=1e-9
    )
    assert c.compute_s(1000, 4) == pytest.approx(1000 * (2e-9 + 4e-9))


def test_step_time_and_overlap():
    assert cm.step_s(1.0, 0.5) == 1.5
    assert cm.step_s(1.0, 0.5, overlap=True) == 1.0
    est = LinkEstimate(A, B, world=2, compute_s=0.01)
    assert cm.predict_step_s("tree", est, N, 2) == pytest.approx(0.01 + A + N * B)
    assert cm.buckets_for(60 << 20, 25 << 20) == 3


def test_bad_inputs_are_config_errors():
    with pytest.raises(ConfigError):
        cm.ring_allreduce_s(N, 0, A, B)
    with pytest.raises(ConfigError):
        cm.tree_allreduce_s(-1, 2, A, B)
    with pytest.raises(ConfigError):
        cm.buckets_for(N, 0)


# ---------------------------------------------------------------------- the choice
FP16 = CompressorCost("fp16", summable=True, ratio=2.0, calls=1, fixed_s_per_elem=1e-9)
TOPK = CompressorCost(
    "topk:0.01+ef", summable=False, ratio=50.0, fixed_s_per_elem=5e-9, per_peer_s_per_elem=1e-9
)


def test_tiny_model_and_high_latency_picks_the_tree():
    est = LinkEstimate(alpha_s=10e-3, beta_s_per_byte=1e-8, world=8, compute_s=1e-3)
    got = choose(est, 40e3, 8, compressions=["none"])
    # ring 14 alpha = 140 ms, tree 3 (alpha + n beta) = 31 ms
    assert (got.strategy, got.compression) == ("tree", "none")
    assert got.predicted_step_s == pytest.approx(1e-3 + 3 * (10e-3 + 40e3 * 1e-8))
    assert "tree predicts" in got.reason and "ring" in got.reason


def test_large_model_and_low_bandwidth_picks_ring_and_compression():
    # 100 Mbit/s, 10 ms, 100 MB of gradients, 8 workers
    est = LinkEstimate(10e-3, 8e-8, world=8, compute_s=0.1, compressors=(FP16,))
    got = choose(est, 100e6, 8)
    assert (got.strategy, got.compression) == ("ring", "fp16")
    assert got.candidates["ring/fp16"] < 0.6 * got.candidates["ring/none"]
    # with a sparse all-gather compressor available, it wins by far
    est = LinkEstimate(10e-3, 8e-8, world=8, compute_s=0.1, compressors=(FP16, TOPK))
    got = choose(est, 100e6, 8)
    assert got.compression == "topk:0.01+ef"
    assert "topk:0.01+ef predicts" in got.reason


def test_negligible_communication_keeps_gradients_uncompressed():
    est = LinkEstimate(50e-6, 1e-9, world=2, compute_s=1.0, compressors=(FP16, TOPK))
    got = choose(est, 40e3, 2)
    assert got.compression == "none"
    assert "no compression" in got.reason


def test_a_lossy_compressor_must_win_by_the_tolerance():
    # fp16 halves a bandwidth-bound exchange, but compute dominates: < 10 % gain
    est = LinkEstimate(0.0, 1e-9, world=2, compute_s=0.1, compressors=(FP16,))
    plain = cm.predict_step_s("ring", est, 1e6, 2)
    fp16 = cm.predict_step_s("ring", est, 1e6, 2, compressor=FP16)
    assert fp16 < plain < fp16 / (1.0 - cm.DEFAULT_TOLERANCE)
    assert choose(est, 1e6, 2).compression == "none"
    assert choose(est, 1e6, 2, tolerance=0.0).compression == "fp16"


def test_only_what_is_auto_is_chosen():
    est = LinkEstimate(10e-3, 1e-8, world=8, compute_s=1e-3, compressors=(FP16,))
    got = choose(est, 40e3, 8, strategies=("ring",))
    assert got.strategy == "ring"
    got = choose(est, 100e6, 8, compressions=["fp16"])
    assert got.compression == "fp16"


def test_one_worker_needs_no_exchange():
    got = choose(LinkEstimate(0.0, 0.0, world=1, compute_s=0.01), 40e3, 1)
    assert isinstance(got, Choice)
    assert got.compression == "none" and got.predicted_step_s == pytest.approx(0.01)
    assert "one worker" in got.reason


def test_choice_is_deterministic_and_validates_its_candidates():
    est = LinkEstimate(1e-4, 1e-9, world=4, compute_s=1e-3, compressors=(FP16, TOPK))
    assert choose(est, 1e6, 4) == choose(est, 1e6, 4)
    with pytest.raises(ConfigError, match="barrier"):
        choose(est, 1e6, 4, strategies=("ps",))
    with pytest.raises(ConfigError, match="not measured"):
        choose(est, 1e6, 4, compressions=["none", "int8"])
    d = est.as_dict()
    assert d["bandwidth_mbit_s"] == pytest.approx(8000.0)
    assert d["compressors"][0]["spec"] == "fp16"


@pytest.mark.parametrize(
    "cfg",
    [
        {"strategy": "ps", "compression": "auto"},
        {"strategy": "tree_aggregate", "compression": "auto"},
        {"strategy": "ring", "compression": "auto", "parallelism_pipeline": 2},
    ],
)
def test_trainer_refuses_auto_where_no_probe_can_run(cfg):
    from sparktrain import TrainConfig, Trainer

    with pytest.raises(ConfigError, match="auto"):
        Trainer("sparktrain.models:digits_mlp", TrainConfig(**cfg))


def test_zero1_halves_add_up_to_the_ring_plus_the_row_count():
    n, a, b = 4e8, 1e-4, 1e-9
    for p in (2, 3, 8):
        scatter, after = cm.zero1_comm_s(n, p, a, b, buckets=16)
        count = cm.tree_allreduce_s(8.0, p, a, b)
        assert scatter + after == pytest.approx(cm.ring_allreduce_s(n, p, a, b, 16) + count)
        _, clipped = cm.zero1_comm_s(n, p, a, b, buckets=16, clip=True)
        assert clipped == pytest.approx(after + count)
    assert cm.zero1_comm_s(n, 1, a, b) == (0.0, 0.0)


def test_sharded_adam_state_shrinks_with_the_world():
    params = 100_000_000
    full = cm.optimizer_memory_bytes(params, 2)
    assert full == 16 * params  # params + grads + two moments, float32
    assert cm.optimizer_memory_bytes(params, 2, sharded=True) == 12 * params
    assert cm.optimizer_memory_bytes(params, 8, sharded=True) == 9 * params
    assert cm.optimizer_memory_bytes(params, 4, state_per_param=1, sharded=True) == 9 * params
