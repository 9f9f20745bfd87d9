"""tandem's memory admission: per-key length predictions with a cold-start prior, the
Past-Future future peak under the RT and BE limits, the adaptive RT headroom."""

from __future__ import annotations

import numpy as np

from backend.policy.tandem.admission import AdmissionRound, LengthModel, RtHeadroom
from tests.unit.tandem_factories import NOW, chunks, make_policy, make_request, snapshot


def test_a_cold_key_predicts_the_cap_then_its_history() -> None:
    lengths = LengthModel(window=100, min_samples=5, seed=0)
    req = make_request("r", max_new_tokens=500, length_key="chat")
    assert lengths.sample([req], 3).tolist() == [[500], [500], [500]]
    for n in (10, 20, 30, 40, 50):
        lengths.observe(f"done{n}", "chat", n)
    draws = lengths.sample([req], 200)
    assert draws.min() >= 1 and draws.max() <= 500 and np.median(draws) < 100
    running = make_request("g", max_new_tokens=500, length_key="chat", running=True, generated=45)
    assert lengths.sample([running], 200).min() >= 46  # conditioned on what it generated


def test_a_kept_sample_is_redrawn_only_once_outgrown() -> None:
    lengths = LengthModel(window=100, min_samples=1, seed=0)
    for n in range(10, 200, 10):
        lengths.observe(f"d{n}", "k", n)
    r = make_request("r", max_new_tokens=1000, length_key="k", running=True, generated=1)
    first = int(lengths.totals([r])[0])
    assert int(lengths.totals([r])[0]) == first
    r.generated = first
    assert int(lengths.totals([r])[0]) > first


def test_admission_refuses_what_would_overflow_the_future_peak() -> None:
    lengths = LengthModel(window=100, min_samples=1, seed=0)
    held = make_request(
        "held", tier="be", prompt_len=500, running=True, generated=1, max_new_tokens=100
    )  # holds 500, predicted to grow by 99 → 599
    round_ = AdmissionRound(lengths, [], [held], page=1, rt_limit=1000, be_limit=900)
    small = make_request("small", tier="be", prompt_len=150, max_new_tokens=100)
    big = make_request("big", tier="be", prompt_len=300, max_new_tokens=100)
    assert round_.admit_be(small)  # peak 599 + 250 = 849 ≤ 900
    assert not round_.admit_be(big)  # + 400 more would pass 900
    # RT does not count BE memory (RT may evict BE): the same prompt fits the RT limit
    rt_big = make_request("rt-big", prompt_len=300, max_new_tokens=100)
    assert round_.admit_rt(rt_big)


def test_the_policy_leaves_rt_headroom_and_stops_be_admission_at_the_first_refusal() -> None:
    # capacity 2000, reserve 5 %, headroom floor 25 %: BE may plan up to 1400 tokens of peak
    first = make_request("b1", tier="be", prompt_len=600, max_new_tokens=100, order_key=0)
    second = make_request("b2", tier="be", prompt_len=800, max_new_tokens=100, order_key=1)
    third = make_request("b3", tier="be", prompt_len=10, max_new_tokens=10, order_key=2)
    policy = make_policy(rt_headroom_frac=0.25, be_order_prob=1.0, idle_budget_s=1.0)
    plan = policy.plan(snapshot(waiting=[first, second, third], kv_capacity=2000))
    assert chunks(plan) == {"b1": 600}


def test_the_rt_headroom_follows_recent_rt_growth() -> None:
    headroom = RtHeadroom(window_s=30.0, floor_frac=0.05)
    headroom.update(NOW, 5000)
    headroom.update(NOW + 1, 2000)
    assert headroom.tokens(10_000, 2000) == 3000  # RT was 3000 higher a second ago
    headroom.update(NOW + 40, 2000)
    assert headroom.tokens(10_000, 2000) == 500  # the spike left the window: the floor
