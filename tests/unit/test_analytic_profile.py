"""The analytic H100 roofline profile: its arithmetic, its regimes, and how well it is fitted."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from backend.policy.latency import holdout_mape, load_profile, save_profile
from bench.profiler.analytic import (
    DEFAULT_OUT,
    Hardware,
    ModelShape,
    build_profile,
    iteration,
    kv_capacity_tokens,
)

MODEL = ModelShape()
HW = Hardware()


def test_profile_is_deterministic_and_the_committed_file_is_current(tmp_path: Path) -> None:
    first, second = build_profile(), build_profile()
    assert msgspec.json.encode(first) == msgspec.json.encode(second)
    save_profile(first, tmp_path / "a.json")
    assert (tmp_path / "a.json").read_text() == DEFAULT_OUT.read_text(), (
        "backend/policy/profiles/h100-llama8b-analytic.json is stale: "
        "python -m bench.profiler.analytic"
    )


def test_llama8b_shape_arithmetic() -> None:
    assert MODEL.total_params == pytest.approx(8.03e9, rel=0.002)
    assert MODEL.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072


def test_kv_capacity_is_memory_minus_weights_minus_reserve() -> None:
    free = 80e9 - MODEL.weight_bytes - 8e9
    assert kv_capacity_tokens(MODEL, HW) == int(free // 131072)
    assert 420_000 < kv_capacity_tokens(MODEL, HW) < 430_000
    profile = load_profile(DEFAULT_OUT)
    assert profile.kv_capacity_tokens == kv_capacity_tokens(MODEL, HW)
    assert profile.kv_bytes_per_token == 131072 and profile.host_copy_gb_s == 25.0
    # No sampled iteration holds more KV than the pool.
    for sample in profile.samples:
        prefix_kv = sample.shape.prefill_attn / max(1, sample.shape.prefill_tokens)
        assert sample.shape.decode_context + prefix_kv <= profile.kv_capacity_tokens


def test_decode_heavy_batches_are_memory_bound() -> None:
    for batch, context in [(1, 128), (64, 1024), (256, 1024), (32, 8192)]:
        roof = iteration(MODEL, HW, [], [context] * batch)
        assert not roof.is_compute_bound, (batch, context)
    # Batch 64 at 1K context: 15 GB of weights + 8.6 GB of KV at 3 TB/s, plus overhead.
    roof = iteration(MODEL, HW, [], [1024] * 64)
    assert roof.memory_s == pytest.approx((15.0e9 + 64 * 1025 * 131072) / 3e12, rel=0.01)
    assert 0.009 < roof.seconds < 0.012


def test_big_prefills_are_compute_bound() -> None:
    for chunk, prefix in [(1024, 0), (2048, 0), (8192, 0), (2048, 32768)]:
        assert iteration(MODEL, HW, [(chunk, prefix)], []).is_compute_bound, (chunk, prefix)
    roof = iteration(MODEL, HW, [(2048, 0)], [])
    # 2·7.5e9 FLOPs per token for 2048 tokens at 800 TFLOP/s ≈ 37 ms.
    assert roof.compute_s == pytest.approx(0.037, rel=0.03)
    assert 0.035 < roof.seconds < 0.045


def test_the_fit_of_the_analytic_profile_is_close() -> None:
    model, error = holdout_mape(build_profile())
    assert error < 0.03
    assert model.second_weights is not None  # the roofline knee needs both pieces
