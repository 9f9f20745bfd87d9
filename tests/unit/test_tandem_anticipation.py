"""Anticipatory scheduling (`rt_anticipation_s`): after the last RT request ends, BE waits a
moment for a closed-loop client's next request, only while such follow-ups have been coming
that soon; the simulator and the engine driver carry the wait out."""

from __future__ import annotations

import pytest

from backend.policy.placement import make_router
from backend.policy.tandem.anticipation import MIN_EPISODES, Anticipation
from backend.policy.types import Plan, PrefillChunk, Snapshot
from backend.sim.config import SimConfig
from backend.sim.engine import simulate
from backend.sim.pool import simulate_pool
from backend.sim.source import ListSource
from tests.unit import sim_factories
from tests.unit.tandem_factories import NOW, make_policy, make_request, snapshot

WINDOW_S = 0.01


def _episodes(a: Anticipation, gaps_s: list[float], start_s: float = 0.0) -> float:
    """RT requests one after another: each ends, the next arrives *gap* later; the time of
    the last end."""
    t = start_s
    for i, gap in enumerate(gaps_s):
        a.note(t, [], rt_around=True)  # request i runs
        t += 0.2
        a.note(t, [], rt_around=False)  # ... and has ended
        nxt = make_request(f"r{i}", arrival_s=t + gap)
        t += gap + 0.004  # in transit through the gateway
        a.note(t, [nxt], rt_around=True)
    t += 0.2
    a.note(t, [], rt_around=False)
    return t


def test_waits_only_after_enough_quick_follow_ups_and_only_within_the_window() -> None:
    a = Anticipation(WINDOW_S)
    end = _episodes(a, [0.001] * (MIN_EPISODES - 1))
    assert a.hold_until_s(end) is None  # too few episodes to tell a closed loop
    a = Anticipation(WINDOW_S)
    end = _episodes(a, [0.001] * MIN_EPISODES)
    assert a.hold_until_s(end + 0.002) == pytest.approx(end + WINDOW_S)
    assert a.hold_until_s(end + WINDOW_S) is None  # the window has passed: BE goes on
    assert a.holds == 1


def test_clients_that_think_turn_the_wait_off() -> None:
    a = Anticipation(WINDOW_S)
    end = _episodes(a, [0.001] * MIN_EPISODES + [2.0] * (MIN_EPISODES + 1))
    assert not a.active and a.hold_until_s(end) is None
    # a later return to quick follow-ups turns it back on
    end = _episodes(a, [0.001] * MIN_EPISODES, start_s=end + 1.0)
    assert a.active and a.hold_until_s(end) is not None


def test_no_wait_while_rt_work_is_around_or_before_any_rt_ended() -> None:
    a = Anticipation(WINDOW_S)
    end = _episodes(a, [0.0] * MIN_EPISODES)
    a.note(end + 0.001, [make_request("next", arrival_s=end)], rt_around=True)
    assert a.hold_until_s(end + 0.002) is None
    with pytest.raises(ValueError, match="window must be > 0"):
        Anticipation(0.0)


def _closed_loop_policy(window_s: float = WINDOW_S):  # type: ignore[no-untyped-def]
    """A tandem policy that has seen MIN_EPISODES quick follow-ups; the last RT request
    ended at NOW - 0.001."""
    policy = make_policy(rt_anticipation_s=window_s)
    assert policy.anticipation is not None
    _episodes(policy.anticipation, [0.001] * MIN_EPISODES, start_s=NOW - 10.0)
    policy.anticipation.note(NOW - 0.002, [], rt_around=True)
    policy.anticipation.note(NOW - 0.001, [], rt_around=False)
    return policy


def test_the_policy_holds_be_back_right_after_the_last_rt_request_ended() -> None:
    be = make_request("be", tier="be", running=True, generated=5)
    plan = _closed_loop_policy().plan(snapshot(running=[be]))
    assert plan.is_empty and plan.hold_until_s == pytest.approx(NOW - 0.001 + WINDOW_S)
    # the RT request it waited for arrives: it runs at once
    policy = _closed_loop_policy()
    rt = make_request("rt", arrival_s=NOW - 0.0005)
    plan = policy.plan(snapshot(running=[be], waiting=[rt]))
    assert plan.hold_until_s is None and "rt" in {c.rid for c in plan.prefills}
    # past the window BE runs
    plan = _closed_loop_policy().plan(snapshot(running=[be], now_s=NOW + WINDOW_S))
    assert plan.hold_until_s is None and plan.decodes == ["be"]
    # off (the default): BE runs at once
    assert make_policy().plan(snapshot(running=[be])).decodes == ["be"]


def test_nothing_to_hold_back_means_no_hold() -> None:
    assert _closed_loop_policy().plan(snapshot()).hold_until_s is None


class _HoldOnce:
    """Holds until `until_s` at its first plan, then runs every prompt and decode."""

    name = "hold-once"

    def __init__(self, until_s: float) -> None:
        self.until_s: float | None = until_s
        self.planned_at: list[float] = []

    def plan(self, snap: Snapshot) -> Plan:
        self.planned_at.append(snap.now_s)
        if self.until_s is not None:
            until, self.until_s = self.until_s, None
            return Plan(hold_until_s=until)
        return Plan(
            decodes=[r.rid for r in snap.running if r.is_decoding],
            prefills=[
                PrefillChunk(r.rid, r.prompt_left)
                for r in snap.running + snap.waiting
                if r.prompt_left > 0
            ],
        )

    def observe(self, result: object) -> None:
        pass


def test_the_simulated_engine_idles_until_the_hold_ends_then_runs() -> None:
    reqs = [sim_factories.make_request(rid="be", tier="be", prompt_len=10, output_len=3)]
    policy = _HoldOnce(until_s=0.25)
    res = simulate(
        ListSource(reqs), policy, sim_factories.LATENCY, SimConfig(kv_capacity_tokens=4000)
    )  # type: ignore[arg-type]
    assert policy.planned_at[:2] == [0.0, 0.25]
    assert res.iterations.start_s[0] == 0.25 and res.requests[0].finish_s is not None
    # an arrival during the hold ends it at once
    reqs.append(sim_factories.make_request(rid="rt", arrival_s=0.1, prompt_len=10, output_len=2))
    policy = _HoldOnce(until_s=0.25)
    simulate(ListSource(reqs), policy, sim_factories.LATENCY, SimConfig(kv_capacity_tokens=4000))  # type: ignore[arg-type]
    assert policy.planned_at[:2] == [0.0, 0.1]


def test_a_simulated_pool_wakes_a_held_replica_when_its_hold_ends() -> None:
    reqs = [sim_factories.make_request(rid="be", tier="be", prompt_len=10, output_len=3)]
    policy = _HoldOnce(until_s=0.25)
    result = simulate_pool(
        ListSource(reqs),
        [policy],  # type: ignore[list-item]
        sim_factories.LATENCY,
        SimConfig(kv_capacity_tokens=4000),
        make_router("round-robin"),
    )
    assert policy.planned_at[:2] == [0.0, 0.25]
    (rec,) = result.result.requests
    assert rec.finish_s is not None and rec.first_token_s is not None
    assert rec.first_token_s > 0.25
