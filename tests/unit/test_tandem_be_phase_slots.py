"""BE admissions leave a share of the engine's request slots to RT arrivals."""

from __future__ import annotations

from backend.policy.tandem.be_phase import rt_slots_kept


def test_a_finite_request_cap_keeps_slots_for_rt() -> None:
    assert rt_slots_kept(0.1, 64) == 7
    assert rt_slots_kept(0.1, 8) == 1
    assert rt_slots_kept(0.0, 64) == 0


def test_an_engine_without_a_cap_keeps_none() -> None:
    assert rt_slots_kept(0.1, 1 << 30) == 0


def test_be_admissions_stop_short_of_the_request_cap() -> None:
    from backend.policy.latency import LatencyModel, load_profile
    from backend.policy.profiles import PROFILES_DIR
    from backend.policy.registry import make_policy
    from backend.policy.types import ReqState, Snapshot

    latency = LatencyModel.fit(load_profile(PROFILES_DIR / "cpu-tiny.json").samples)
    policy = make_policy("tandem", latency, latency_budget_s=5.0, idle_budget_s=5.0)
    waiting = [
        ReqState(
            rid=f"be{i}", tier="be", arrival_s=0.0, prompt_len=8, max_new_tokens=8, prefill_len=8
        )
        for i in range(20)
    ]
    snap = Snapshot(
        now_s=1.0,
        waiting=waiting,
        running=[],
        waiting_rt=[],
        waiting_be=waiting,
        kv_capacity_tokens=100_000,
        kv_free_tokens=100_000,
        max_running=10,
        max_prefill_tokens=4096,
    )
    plan = policy.plan(snap)
    # ceil(0.1 × 10) = 1 slot stays free for an RT arrival
    assert len(plan.prefills) == 9
