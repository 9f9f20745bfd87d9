"""The latency model: fit, prediction, inversion, fit error, profile files."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from backend.policy.latency import (
    FEATURES,
    BatchShape,
    LatencyModel,
    Profile,
    ProfileSample,
    features,
    holdout_mape,
    load_profile,
    mape,
    save_profile,
)

# Seconds per feature unit (tokens in thousands): 3 ms + 10 ms/Ktok prefill + ...
TRUE_WEIGHTS = [3e-3, 10e-3, 2e-3, 1e-3, 0.5e-3, 0.4e-3, 0.05e-3, 0.8e-3, 0.3e-3]


def make_shape(rng: random.Random) -> BatchShape:
    """A random iteration: 0-3 prefill chunks after random prefixes, 0-40 decodes."""
    shape = BatchShape()
    for _ in range(rng.randint(0, 3)):
        shape = shape.with_prefill(rng.randint(1, 2048), rng.choice([0, 0, 512, 4096]))
    for _ in range(rng.randint(0 if shape.num_prefill else 1, 40)):
        shape = shape.with_decode(rng.randint(16, 4096))
    return shape


def synthetic(weights: list[float], n: int = 200, seed: int = 0) -> list[ProfileSample]:
    """Noiseless samples of the linear model with *weights*."""
    rng = random.Random(seed)
    shapes = [make_shape(rng) for _ in range(n)]
    return [
        ProfileSample(
            shape=s, seconds=sum(w * f for w, f in zip(weights, features(s), strict=True))
        )
        for s in shapes
    ]


def test_fit_recovers_known_weights() -> None:
    model = LatencyModel.fit(synthetic(TRUE_WEIGHTS))
    assert model.second_weights is None  # nothing to gain from a second piece
    assert model.weights == pytest.approx(TRUE_WEIGHTS, rel=1e-6)
    assert set(model.to_dict()) == set(FEATURES)


def test_weights_stay_non_negative_when_the_data_would_push_one_negative() -> None:
    weights = list(TRUE_WEIGHTS)
    weights[FEATURES.index("N_d")] = -0.2e-3  # more decodes would be *faster*
    model = LatencyModel.fit(synthetic(weights))
    assert all(w >= 0 for piece in model.pieces for w in piece)
    # ... so adding a decode never predicts a faster iteration.
    rng = random.Random(1)
    for _ in range(50):
        shape = make_shape(rng)
        assert model.predict(shape.with_decode(16)) >= model.predict(shape)


def test_holdout_mape_is_zero_for_noiseless_data() -> None:
    profile = Profile(name="synthetic", samples=synthetic(TRUE_WEIGHTS))
    _, error = holdout_mape(profile)
    assert error == pytest.approx(0.0, abs=1e-9)


def test_a_roofline_shaped_profile_gets_two_pieces() -> None:
    compute = [2e-3, 20e-3, 0, 0, 0, 0, 0.02e-3, 0.5e-3, 0]
    memory = [7e-3, 0, 30e-3, 0, 0, 0, 0.01e-3, 0, 0]
    rng = random.Random(2)
    shapes = [make_shape(rng) for _ in range(300)]
    samples = [
        ProfileSample(
            shape=s,
            seconds=max(
                sum(w * f for w, f in zip(piece, features(s), strict=True))
                for piece in (compute, memory)
            ),
        )
        for s in shapes
    ]
    linear = LatencyModel.fit(samples, max_pieces=1)
    model = LatencyModel.fit(samples)
    assert model.second_weights is not None
    assert mape(model, samples) < 0.01 < mape(linear, samples)


def test_eight_weights_are_the_form_without_the_full_square_term() -> None:
    model = LatencyModel(TRUE_WEIGHTS[:8])
    assert model.to_dict()["F_p"] == 0.0
    shape = BatchShape().with_prefill(16, prefix=3072)
    assert shape.prefill_attn_full == 3088**2
    assert LatencyModel(TRUE_WEIGHTS).predict(shape) > model.predict(shape)
    with pytest.raises(ValueError, match="expected 9 weights"):
        LatencyModel(TRUE_WEIGHTS[:7])


def test_decodes_count_in_the_full_square_term_only_beside_a_prefill() -> None:
    f_p = FEATURES.index("F_p")
    decodes = BatchShape().with_decode(2000).with_decode(1000)
    assert decodes.decode_context_sq == 2000**2 + 1000**2
    assert features(decodes)[f_p] == 0.0  # a decode-only batch never recomputes its context
    mixed = decodes.with_prefill(10, prefix=0)
    assert features(mixed)[f_p] == pytest.approx((2000**2 + 1000**2 + 10**2) / 1e6)


def test_fit_needs_three_samples() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        LatencyModel.fit(synthetic(TRUE_WEIGHTS, n=2))


def test_empty_batch_takes_no_time() -> None:
    assert LatencyModel(TRUE_WEIGHTS).predict(BatchShape()) == 0.0


def test_max_chunk_is_exact_at_the_boundary() -> None:
    model = LatencyModel(TRUE_WEIGHTS)
    base = BatchShape().with_decode(1000).with_decode(300)
    limit = model.predict(base.with_prefill(300, prefix=128))
    assert model.max_chunk(base, limit, prefix=128, cap=2048) == 300
    # One token more does not fit; a hair less time and 300 does not either.
    assert model.predict(base.with_prefill(301, prefix=128)) > limit
    assert model.max_chunk(base, limit * (1 - 1e-9), prefix=128, cap=2048) == 299


def test_max_chunk_respects_cap_and_page_size() -> None:
    model = LatencyModel(TRUE_WEIGHTS)
    base = BatchShape().with_decode(500)
    assert model.max_chunk(base, 10.0, prefix=0, cap=700) == 700  # everything fits: the cap
    assert model.max_chunk(base, 10.0, prefix=0, cap=700, page_size=16) == 700  # cap as is
    limit = model.predict(base.with_prefill(300, prefix=0))
    assert model.max_chunk(base, limit, prefix=0, cap=2048, page_size=16) == 288
    assert model.max_chunk(base, model.predict(base) * 0.5, prefix=0, cap=2048) == 0
    assert model.max_chunk(base, 10.0, prefix=0, cap=0) == 0


def test_profile_round_trips_through_a_file(tmp_path: Path) -> None:
    profile = Profile(
        name="rt",
        description="test",
        model={"hidden_size": 256},
        hardware={"device": "cpu"},
        kv_capacity_tokens=16384,
        page_size=1,
        max_prefill_tokens=512,
        host_copy_gb_s=25.0,
        kv_bytes_per_token=8192,
        samples=synthetic(TRUE_WEIGHTS, n=10),
    )
    path = tmp_path / "rt.json"
    save_profile(profile, path)
    assert load_profile(path) == profile


@pytest.mark.parametrize("content", ["not json", '{"name": 3}', '{"samples": []}'])
def test_a_bad_profile_file_is_a_value_error_naming_it(tmp_path: Path, content: str) -> None:
    path = tmp_path / "broken.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"broken\.json"):
        load_profile(path)


def test_a_missing_profile_file_is_a_value_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"absent\.json"):
        load_profile(tmp_path / "absent.json")


def test_one_point_read_near_zero_does_not_sink_the_fit() -> None:
    # a black-box probe once read a small prefill as 10 µs (its TTFT minus an overestimated
    # round trip); weighed by its relative error, that one point made the fit predict ~0
    samples = synthetic(TRUE_WEIGHTS)
    smallest = min(range(len(samples)), key=lambda i: samples[i].seconds)
    misread = list(samples)
    misread[smallest] = ProfileSample(shape=samples[smallest].shape, seconds=1e-5)
    model = LatencyModel.fit(misread)
    errors = sorted(
        abs(model.predict(s.shape) - s.seconds) / s.seconds
        for i, s in enumerate(samples)
        if i != smallest
    )
    assert errors[len(errors) // 2] < 0.1
