"""The tier queues' count (gateway/pipeline/tier_queue.py): per engine and tier, bounded, each
place given back exactly once."""

from __future__ import annotations

import pytest

from common.config import GatewayConfig
from gateway.pipeline.tier_queue import TierQueues, tier_bounds, tier_queue_full


def test_each_tier_is_bounded_on_its_own_per_engine_and_a_place_is_given_back_once() -> None:
    queues = TierQueues({"rt": 2, "be": 1})
    be = queues.try_take("e1", "be")
    assert be is not None and queues.try_take("e1", "be") is None  # BE full
    assert queues.try_take("e2", "be") is not None  # another engine's queue is its own
    rt = [queues.try_take("e1", "rt") for _ in range(3)]
    assert rt[2] is None and queues.inflight("e1", "rt") == 2  # RT has its own, larger bound
    be.release(0)
    be.release(0)  # a second release changes nothing
    assert queues.inflight("e1", "be") == 0
    assert queues.try_take("e1", "be") is not None


def test_bounds_come_from_the_gateway_config_and_must_be_positive() -> None:
    config = GatewayConfig()
    assert tier_bounds(config) == {"rt": config.max_inflight_rt, "be": config.max_inflight_be}
    assert config.max_inflight_rt > config.max_inflight_be  # BE is shed first
    with pytest.raises(ValueError, match="be tier's in-flight bound"):
        TierQueues({"rt": 1, "be": 0})


def test_the_refusal_names_the_tier_and_its_bound() -> None:
    refused = tier_queue_full("be", 64)
    assert (refused.http_status, refused.code, refused.kind) == (
        429,
        "tier_queue_full",
        "rate_limited",
    )
    assert "BE queue is full" in refused.message and "64" in refused.message
    assert "gateway.max_inflight_be" in refused.message
    assert refused.retryable and refused.retry_after_s is not None and refused.retry_after_s >= 1
