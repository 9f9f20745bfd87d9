"""The SLO forecaster's chunk search: started from a recent answer it finds exactly what the
latency model's binary search finds, and a forecaster's memo never changes a forecast."""

from __future__ import annotations

import random

import pytest

from backend.policy.feasibility import Backlog, SloAsk, SloForecaster, largest_chunk
from backend.policy.latency import BatchShape, LatencyModel, load_profile
from backend.policy.profiles import resolve_profile
from common.wire import EngineLoad


@pytest.fixture(scope="module", params=["h100-llama8b-analytic", "cpu-tiny"])
def latency(request: pytest.FixtureRequest) -> LatencyModel:
    return LatencyModel.fit(load_profile(resolve_profile(request.param)).samples)


def decodes(count: int, context: int) -> BatchShape:
    mean = context / count if count else 0.0
    return BatchShape(decode_context=context, num_decode=count, decode_context_sq=count * mean**2)


def test_the_hinted_search_finds_what_the_binary_search_finds(latency: LatencyModel) -> None:
    rng = random.Random(7)
    for _ in range(300):
        count = rng.choice([0, 1, 4, 32, 256])
        running = decodes(count, count * rng.randint(10, 4000))
        limit_s = rng.choice([0.001, 0.01, 0.03, 0.05, 0.2, 2.0])
        cap = rng.choice([1, 64, 512, 8192])
        hint = rng.choice([None, 1, 2, cap, rng.randint(1, 20_000)])
        expected = latency.max_chunk(running, limit_s, prefix=0, cap=cap)
        assert largest_chunk(latency, running, limit_s, cap, hint) == expected, (
            count,
            limit_s,
            cap,
            hint,
        )


def test_a_forecasters_memo_never_changes_a_forecast(latency: LatencyModel) -> None:
    rng = random.Random(11)
    warm = SloForecaster(latency)
    for i in range(200):
        load = EngineLoad(
            iteration=i,
            at_unix_s=0.0,
            iteration_s=0.02,
            num_rt_waiting=rng.randint(0, 10),
            rt_waiting_prompt_tokens=rng.randint(0, 20_000),
            num_rt_running=(running := rng.randint(0, 64)),
            rt_context_tokens=running * rng.randint(10, 3000),
        )
        ask = SloAsk(rng.randint(1, 4000), 0.5, rng.choice([None, 0.02, 0.1]))
        fresh = SloForecaster(latency)  # nothing memoised
        assert warm.forecast(load, ask, Backlog()) == fresh.forecast(load, ask, Backlog())
