"""tandem's `rt_stretch` on hand-built snapshots (LATENCY: 10 ms + 20 ms per 1K prefill tokens +
1 ms per 1K decode context): BE may lengthen an iteration that carries RT work by at most that
fraction of the RT work's own time, so RT tokens beside BE come about as fast as alone."""

from __future__ import annotations

import pytest

from backend.policy.latency import LatencyModel
from backend.policy.tandem.config import TandemConfig
from backend.policy.tandem.context import split_running
from backend.policy.tandem.policy import TandemPolicy
from backend.policy.tandem.rt_phase import run_rt_decodes
from tests.unit.tandem_factories import NOW, chunks, make_policy, make_request, snapshot

WIDE_OPEN = {"latency_budget_s": 0.04, "be_frac_init": 1.0, "be_min_share": 0.0}
"""BE may take all the time RT leaves under τ (no AIMD share, no floor) unless stretch caps it."""


def test_be_adds_at_most_the_stretch_to_an_iteration_that_emits_a_first_token() -> None:
    rt = make_request("rt", prompt_len=500, ttft_target_s=5.0)  # alone: 10 + 10 = 20 ms
    be = make_request("be", tier="be", prompt_len=5000)
    unbounded = make_policy(**WIDE_OPEN).plan(snapshot(waiting=[rt, be]))
    assert chunks(unbounded) == {"rt": 500, "be": 1000}  # BE fills τ = 40 ms
    plan = make_policy(**WIDE_OPEN, rt_stretch=0.3).plan(snapshot(waiting=[rt, be]))
    assert chunks(plan)["rt"] == 500
    assert chunks(plan)["be"] == pytest.approx(300, abs=1)  # 30 % of 20 ms = 6 ms of prefill


def test_the_first_token_share_scales_the_stretch() -> None:
    rt = make_request("rt", prompt_len=500, ttft_target_s=5.0)  # alone: 20 ms
    be = make_request("be", tier="be", prompt_len=5000)
    policy = make_policy(**WIDE_OPEN, rt_stretch=0.5, first_token_be_frac=0.2)
    assert chunks(policy.plan(snapshot(waiting=[rt, be])))["be"] == pytest.approx(100, abs=1)


def test_the_iteration_after_a_first_token_counts_as_a_first_token_one() -> None:
    just_prefilled = make_request("d", prompt_len=999, running=True, generated=1)  # 11 ms
    be = make_request("be", tier="be", prompt_len=5000)
    policy = make_policy(**WIDE_OPEN, rt_stretch=1.0, first_token_be_frac=0.5)
    plan = policy.plan(snapshot(waiting=[be], running=[just_prefilled]))
    assert chunks(plan)["be"] == pytest.approx(275, abs=1)  # 50 % of 11 ms, not 100 %


def test_be_adds_at_most_the_stretch_to_rt_decodes() -> None:
    decoding = [
        make_request(f"d{i}", prompt_len=999, running=True, generated=1, tpot_target_s=1.0)
        for i in range(4)
    ]  # 10 ms + 4 × 1000 tokens of context at 1 ms per 1K = 14 ms
    be = make_request("be", tier="be", prompt_len=5000)
    plan = make_policy(**WIDE_OPEN, rt_stretch=0.5).plan(snapshot(waiting=[be], running=decoding))
    assert chunks(plan)["be"] == pytest.approx(350, abs=1)  # 7 ms of prefill, not 26 ms
    assert len(plan.decodes) == 4


def test_an_iteration_without_rt_work_is_not_stretch_bound() -> None:
    be = make_request("be", tier="be", prompt_len=5000)
    plan = make_policy(**WIDE_OPEN, rt_stretch=0.0, idle_budget_s=0.05).plan(snapshot(waiting=[be]))
    assert chunks(plan)["be"] == 2000  # BE alone fills the idle budget: 10 + 40 ms


def test_the_starvation_floor_still_holds_under_a_zero_stretch() -> None:
    rt = make_request("rt", prompt_len=500, ttft_target_s=5.0)
    be = make_request("be", tier="be", prompt_len=5000)
    plan = make_policy(**{**WIDE_OPEN, "be_min_share": 0.05}, rt_stretch=0.0).plan(
        snapshot(waiting=[rt, be])
    )
    assert chunks(plan)["be"] == pytest.approx(50, abs=1)  # 5 % of the RT work's 20 ms


def test_a_negative_stretch_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match="rt_stretch"):
        TandemConfig(rt_stretch=-0.1)


def test_be_alone_iterations_stay_short_while_rt_is_active_and_grow_after() -> None:
    policy = make_policy(
        latency_budget_s=0.04, idle_budget_s=0.05, rt_stretch=0.3, rt_active_window_s=10.0
    )
    rt = make_request("rt", prompt_len=500, ttft_target_s=5.0)  # its first iteration: 20 ms
    policy.plan(snapshot(waiting=[rt]))  # an RT request was here at NOW
    be = make_request("be", tier="be", prompt_len=5000)
    soon = policy.plan(snapshot(waiting=[be], now_s=NOW + 1.0))
    assert chunks(soon)["be"] == pytest.approx(500, abs=1)  # as long as the RT one: 10 + 10 ms
    later = policy.plan(snapshot(waiting=[be], now_s=NOW + 11.0))
    assert chunks(later)["be"] == 2000  # the window passed: the idle budget, 50 ms


def test_a_health_probe_does_not_make_rt_active() -> None:
    # SGLang's /health sends a 1-token generation with no tandem metadata: the engine mirrors it
    # as RT (served at once) but as a probe; BE-alone iterations after it keep the idle budget
    # (before: a 1-token "typical RT prompt" held them to ~10 ms for the next 10 s)
    policy = make_policy(
        latency_budget_s=0.04, idle_budget_s=0.05, rt_stretch=0.3, rt_active_window_s=10.0
    )
    probe = make_request("HEALTH_CHECK_1", prompt_len=1, ttft_target_s=None, tpot_target_s=None)
    probe.is_probe = True
    be = make_request("be", tier="be", prompt_len=5000)
    policy.plan(snapshot(waiting=[probe, be]))
    assert chunks(policy.plan(snapshot(waiting=[be], now_s=NOW + 1.0)))["be"] == 2000
    # a tenant's RT request does open the window, and the probe did not shrink its prompt size
    policy.plan(snapshot(waiting=[make_request("rt", prompt_len=500, ttft_target_s=5.0)]))
    policy.plan(snapshot(waiting=[probe], now_s=NOW + 0.5))
    soon = policy.plan(snapshot(waiting=[be], now_s=NOW + 1.0))
    assert chunks(soon)["be"] == pytest.approx(500, abs=1)  # as long as the RT one: 10 + 10 ms


def test_be_alone_iterations_of_the_active_window_scale_by_their_fraction() -> None:
    policy = make_policy(
        latency_budget_s=0.04, idle_budget_s=0.05, rt_stretch=0.3, rt_active_be_frac=0.75
    )
    policy.plan(snapshot(waiting=[make_request("rt", prompt_len=500, ttft_target_s=5.0)]))
    be = make_request("be", tier="be", prompt_len=5000)
    soon = policy.plan(snapshot(waiting=[be], now_s=NOW + 1.0))
    assert chunks(soon)["be"] == pytest.approx(250, abs=1)  # 0.75 × 20 ms = 10 + 5 ms
    with pytest.raises(ValueError, match="rt_active_be_frac"):
        TandemConfig(rt_active_be_frac=0.0)


def test_without_stretch_be_alone_iterations_use_the_idle_budget_at_once() -> None:
    policy = make_policy(latency_budget_s=0.04, idle_budget_s=0.05)
    policy.plan(snapshot(waiting=[make_request("rt", prompt_len=500, ttft_target_s=5.0)]))
    be = make_request("be", tier="be", prompt_len=5000)
    assert chunks(policy.plan(snapshot(waiting=[be], now_s=NOW + 1.0)))["be"] == 2000


def test_be_keeps_its_time_share_when_rt_first_tokens_fill_every_iteration() -> None:
    # sustained RT load: a new RT prompt (20 ms alone) in every iteration; the first-token
    # share alone would leave BE nothing but the 5 % floor
    options = {**WIDE_OPEN, "be_min_share": 0.05, "rt_stretch": 0.3, "first_token_be_frac": 0.0}
    starved, kept = make_policy(**options), make_policy(**options, be_min_time_share=0.25)
    got = {"starved": 0, "kept": 0}
    for i in range(40):  # fresh requests each time: what the last plan took is out of the way
        rt = make_request(f"rt{i}", prompt_len=500, ttft_target_s=5.0)
        be = make_request(f"be{i}", tier="be", prompt_len=3000)
        for name, policy in (("starved", starved), ("kept", kept)):
            got[name] += chunks(policy.plan(snapshot(waiting=[rt, be])))[f"be{i}"]
    assert got["starved"] == pytest.approx(40 * 50, abs=40)  # 5 % of 20 ms = 50 tokens
    # 25 % of the time: 1/0.75 × 20 ms → 6.7 ms, 333 tokens, in the iterations where BE is behind
    assert got["kept"] > 3 * got["starved"]
    share = kept._be_time_share()
    assert 0.2 <= share <= 0.3


def test_a_zero_stretch_keeps_be_decodes_out_even_when_the_model_calls_them_free() -> None:
    # A fitted model may give decode rows no weight (NNLS zeroes it on a CPU engine whose fixed
    # cost dwarfs them): BE decodes then look free beside an RT prefill. With no stretch and no
    # floor the operator asked for RT iterations that carry nothing of BE's; the bicache layout
    # relies on that to park BE rows and lend their slots to the RT prompt.
    free_decodes = LatencyModel([0.010, 0.020, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    rt = make_request("rt", prompt_len=500, ttft_target_s=5.0)
    be = [
        make_request(f"be{i}", tier="be", prompt_len=300, running=True, generated=5)
        for i in range(3)
    ]

    def be_decodes(**options: float) -> list[str]:
        config = TandemConfig(**{**WIDE_OPEN, **options})
        plan = TandemPolicy(free_decodes, config=config).plan(snapshot(waiting=[rt], running=be))
        assert chunks(plan) == {"rt": 500}
        return sorted(plan.decodes)

    assert be_decodes(rt_stretch=0.0) == []
    assert be_decodes(rt_stretch=0.3) == ["be0", "be1", "be2"]  # free riders within the stretch


def test_be_is_paused_to_its_floor_while_rt_prompts_wait_for_time() -> None:
    """RT prompt work left over after the RT part of the plan: BE's time share and the stretch
    give way, and BE gets only its starvation floor before an RT request waits for it; the
    share comes back once the RT prompts fit."""
    options = {**WIDE_OPEN, "be_min_share": 0.05, "rt_stretch": 0.3, "be_min_time_share": 0.25}
    policy = make_policy(**options)

    def backlog(i: int) -> dict[str, int]:
        # 500 + 3000 prompt tokens, 10 + 70 ms alone: the second is cut at τ = 40 ms and waits
        short = make_request(f"a{i}", prompt_len=500, ttft_target_s=5.0)
        long = make_request(f"b{i}", prompt_len=3000, ttft_target_s=5.0, arrival_s=NOW - 0.001)
        be = make_request(f"be{i}", tier="be", prompt_len=5000)
        got = chunks(policy.plan(snapshot(waiting=[short, long, be])))
        assert got[f"a{i}"] + got[f"b{i}"] < 3500  # RT prompt work is left over
        return got

    for i in range(10):
        # 5 % of the RT work's 40 ms (2 ms), though BE fell far behind its 25 % share (which
        # would give it 40 / 0.75 − 40 = 13 ms)
        assert backlog(i)[f"be{i}"] == pytest.approx(100, abs=1)
    assert policy._be_time_share() < 0.25
    # RT's prompt fits (10 + 10 ms): BE is behind, and gets its share of the time back
    rt = make_request("rt", prompt_len=500, ttft_target_s=5.0)
    be = make_request("be", tier="be", prompt_len=5000)
    got = chunks(policy.plan(snapshot(waiting=[rt, be])))
    assert got["rt"] == 500 and got["be"] == pytest.approx(333, abs=2)  # 20 / 0.75 − 20 ms


def test_the_rider_cost_learns_what_be_riders_really_take_and_ignores_tiny_ones() -> None:
    from backend.policy.tandem.feedback import RIDER_FACTOR_RANGE, RiderCost

    riders = RiderCost()
    for _ in range(200):  # RT part 8 ms, BE riders predicted 1.5 ms, the iteration took 11.5
        riders.observe(0.008, 0.0095, 0.0115)
    assert riders.factor == pytest.approx(3.5 / 1.5, rel=0.02)
    for _ in range(200):  # back to what the model says
        riders.observe(0.008, 0.0095, 0.0095)
    assert riders.factor == pytest.approx(1.0, rel=0.02)
    samples = riders.samples
    riders.observe(0.008, 0.00801, 0.02)  # a rider of 0.1 %: noise, not measured
    assert riders.samples == samples
    for _ in range(500):  # an iteration faster than its RT part alone: bounded, never 0
        riders.observe(0.008, 0.0095, 0.004)
    assert riders.factor == pytest.approx(RIDER_FACTOR_RANGE[0], rel=0.02)


def test_be_riders_costlier_than_predicted_get_less_of_an_rt_iteration() -> None:
    from backend.policy.tandem.be_phase import be_time_limit

    def limit(rider_cost: float) -> float:
        policy = make_policy(rt_stretch=0.3, be_min_time_share=0.0)
        rt = make_request("rt", running=True, generated=3, tpot_target_s=0.5)
        be = make_request("be", tier="be", running=True, generated=3)
        snap = snapshot(running=[rt, be])
        view = split_running(snap.running, 4096)
        ctx = policy._context(snap, view)
        ctx.rider_cost = rider_cost
        run_rt_decodes(ctx)
        return be_time_limit(ctx) - ctx.batch.time_s()

    assert limit(2.0) == pytest.approx(limit(1.0) / 2.0)


def test_an_rt_iteration_with_be_riders_is_measured_and_shrinks_their_allowance() -> None:
    from backend.policy.types import IterationResult

    policy = make_policy(rt_stretch=0.3)
    rt = make_request("rt", running=True, generated=3, tpot_target_s=0.5)
    be = make_request("be", tier="be", running=True, generated=3, prompt_len=3000)
    plan = policy.plan(snapshot(running=[rt, be]))
    assert plan.decodes == ["rt", "be"] and plan.predicted_s is not None
    rt_alone_s = make_policy(rt_stretch=0.3).plan(snapshot(running=[rt])).predicted_s
    assert rt_alone_s is not None
    rider_s = plan.predicted_s - rt_alone_s
    # the iteration took the RT part and three times what the model gave the BE decode
    policy.observe(IterationResult(start_s=NOW, duration_s=rt_alone_s + 3 * rider_s, plan=plan))
    assert policy.riders.samples == 1 and policy.riders.factor > 1.0
    # off without rt_stretch: the simulator's default runs are unchanged
    policy = make_policy()
    plan = policy.plan(snapshot(running=[rt, be]))
    policy.observe(IterationResult(start_s=NOW, duration_s=1.0, plan=plan))
    assert policy.riders.samples == 0
