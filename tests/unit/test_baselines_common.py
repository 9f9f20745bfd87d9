"""Shared policy helpers (backend/policy/common.py) and the policy registry."""

from __future__ import annotations

import pytest

from backend.policy.baselines.fcfs import FcfsPolicy
from backend.policy.common import (
    BatchBuilder,
    align_chunk,
    choose_victims,
    future_peak,
    make_room,
    prefill_cost,
)
from backend.policy.pastfuture import PeakTracker
from backend.policy.registry import POLICY_NAMES, make_policy
from tests.unit.sim_factories import LATENCY, make_req, make_snapshot


def test_chunks_are_page_aligned_unless_they_finish_the_prompt() -> None:
    req = make_req("a", prompt_len=100)
    assert align_chunk(req, 40, 16) == 32
    assert align_chunk(req, 500, 16) == 100
    assert prefill_cost(req, 40, 16) == 48  # an admission pays whole pages


def test_the_builder_refuses_what_does_not_fit_and_tracks_the_shape() -> None:
    running = make_req("r", prompt_len=50, running=True, generated=3)
    b = BatchBuilder(
        make_snapshot(waiting=[make_req("w", prompt_len=100)], running=[running], kv_capacity=100)
    )
    assert b.add_decode(running)
    assert not b.add_prefill(make_req("w", prompt_len=100), 100)  # 47 slots left
    assert b.max_chunk(make_req("w", prompt_len=100), 1000) == 47
    shape = b.shape()
    assert shape.num_decode == 1 and shape.decode_context == 53 and shape.num_prefill == 0
    assert b.plan(LATENCY).predicted_s == pytest.approx(LATENCY.predict(shape))


def test_make_room_evicts_in_order_and_never_in_vain() -> None:
    old = make_req("old", running=True, prompt_len=100, arrival_s=0.0)
    new = make_req("new", running=True, prompt_len=100, arrival_s=1.0)
    snap = make_snapshot(running=[old, new], kv_capacity=200)
    assert choose_victims(0, 500, [new, old], page=1) is None
    b = BatchBuilder(snap)
    assert not make_room(b, 500, [new, old]) and b.evictions == []
    assert b.add_decode(old) is False  # no slot at all yet
    assert make_room(b, 1, [old, new])  # old is not scheduled, so it goes first
    assert b.evictions == ["old"]
    assert b.add_decode(new)
    assert not make_room(b, 1000, [new])  # scheduled requests are never victims


def test_future_peak_matches_a_hand_computed_trajectory() -> None:
    # (holds, grows for): at step 5 both hold 105 + 55; at step 10 only the first, 110
    assert future_peak([(100, 10), (50, 5)]) == 160
    tracker = PeakTracker([(100, 10)])
    assert tracker.peak == 110
    assert tracker.peak_with((50, 5)) == 160
    tracker.add((50, 5))
    assert tracker.peak == 160 and tracker.peak_with((0, 20)) == 165  # 105 + 55 + 5


def test_registry_names_and_errors() -> None:
    assert POLICY_NAMES == (
        "fcfs",
        "priority",
        "rr",
        "aggressive",
        "conservative",
        "fixed-offline",
        "static-chunk",
        "oracle",
        "rt-only",
        "tandem",
        "tandem-no-pastfuture",
        "tandem-no-slack",
        "tandem-no-aimd",
        "tandem-no-era",
        "tandem-tol5",
        "tandem-bicache",
        "tandem-no-bicache",
    )
    for name in POLICY_NAMES:
        assert make_policy(name, LATENCY).name == name
    with pytest.raises(ValueError, match="unknown policy 'nope'; valid: fcfs, priority"):
        make_policy("nope", LATENCY)
    with pytest.raises(ValueError, match="bad options for policy 'fcfs'"):
        make_policy("fcfs", LATENCY, no_such_option=1)
    assert make_policy("fcfs", LATENCY, token_budget=64).token_budget == 64  # type: ignore[attr-defined]


def test_rt_only_is_fcfs_marked_for_the_runner_to_drop_be() -> None:
    rt_only = make_policy("rt-only", LATENCY)
    assert isinstance(rt_only, FcfsPolicy) and rt_only.rt_only
    assert not make_policy("fcfs", LATENCY).rt_only  # type: ignore[attr-defined]
    assert make_policy("oracle", LATENCY).needs_true_lengths  # type: ignore[attr-defined]
    assert not make_policy("priority", LATENCY).needs_true_lengths  # type: ignore[attr-defined]
