"""L follows the engine's learned pace (`latency_budget_pace_max`): an engine slower than its
profile computes as many tokens per iteration as the profile says fit in L (hand-built
snapshots on LATENCY: 10 ms + 20 ms per 1K prefill tokens), and the SLO forecast chunks the
same way."""

from __future__ import annotations

import pytest

from backend.policy.calibration import budget_pace
from backend.policy.feasibility import SloAsk, SloForecaster, load_of
from backend.policy.tandem.policy import TandemPolicy
from tests.unit.tandem_factories import LATENCY, chunks, make_policy, make_request, snapshot


def test_budget_pace_is_the_geometric_mean_of_the_factors_within_its_bounds() -> None:
    assert budget_pace((2.0, 2.0, 2.0), 4.0) == pytest.approx(2.0)
    assert budget_pace((1.0, 4.0, 16.0), 8.0) == pytest.approx(4.0)
    assert budget_pace((100.0, 100.0, 100.0), 4.0) == 4.0  # at most pace_max
    assert budget_pace((0.5, 0.5, 0.5), 4.0) == 1.0  # a faster engine keeps L in wall seconds
    assert budget_pace((3.0, 3.0, 3.0), 1.0) == 1.0  # 1: L in wall seconds


def _slowed(policy: TandemPolicy, factor: float) -> TandemPolicy:
    """The policy once its calibration has learned that the engine runs ×factor."""
    policy.timer.scale = (factor, factor, factor)
    return policy


def test_a_slower_engine_gets_the_same_tokens_per_iteration_up_to_the_bound() -> None:
    rt = make_request("rt", prompt_len=8000, ttft_target_s=60.0)  # far from urgent
    options = {"latency_budget_s": 0.03, "be_min_share": 0.0}
    at_profile = chunks(make_policy(**options).plan(snapshot(waiting=[rt])))["rt"]
    assert at_profile == pytest.approx(1000, abs=1)  # 10 ms + 20 ms of prefill in 30 ms
    slowed = _slowed(make_policy(**options), 2.0).plan(snapshot(waiting=[rt]))
    assert chunks(slowed)["rt"] == pytest.approx(at_profile, abs=1)
    wall = _slowed(make_policy(**options, latency_budget_pace_max=1.0), 2.0)
    assert chunks(wall.plan(snapshot(waiting=[rt])))["rt"] == pytest.approx(250, abs=1)
    capped = _slowed(make_policy(**options, latency_budget_pace_max=1.5), 2.0)
    # 1.5 × 30 ms = 45 ms at ×2: 22.5 ms of the profile's time, 12.5 ms of it prefill
    assert chunks(capped.plan(snapshot(waiting=[rt])))["rt"] == pytest.approx(625, abs=1)


def test_the_slo_forecast_chunks_as_the_policy_does() -> None:
    ask = SloAsk(prompt_tokens=4000, ttft_target_s=10.0, tpot_target_s=None)
    slowed = load_of(
        snapshot(waiting=[]),
        iteration=1,
        at_unix_s=0.0,
        iteration_s=0.0,
        latency_factors=(2.0, 2.0, 2.0),
    )
    wall = SloForecaster(LATENCY, iteration_budget_s=0.03, budget_pace_max=1.0, min_chunk_tokens=1)
    paced = SloForecaster(LATENCY, iteration_budget_s=0.03, budget_pace_max=4.0, min_chunk_tokens=1)
    # 4000 tokens: 16 chunks of 250 at 30 ms each in wall seconds, 4 of 1000 at 60 ms when L
    # follows the pace — fewer fixed costs, an earlier first token
    assert wall.forecast(slowed, ask).ttft_s == pytest.approx(16 * 0.03, rel=1e-3)
    assert paced.forecast(slowed, ask).ttft_s == pytest.approx(4 * 0.06, rel=1e-3)
