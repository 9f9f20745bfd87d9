"""The planner's pieces (bench/plan.py): the sub-pool a large replica count is judged on, a
tenant's attainment over every request it offered, the search over counts and the early stop
(the same answer as every count run to the end)."""

from __future__ import annotations

import json
import math
import random
from array import array
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import bench.plan
from backend.sim.records import RequestRecord
from bench.plan import (
    PlanConfig,
    Trial,
    busiest_window,
    search_replicas,
    sub_pool,
    tenant_attainment,
    window_specs,
)
from bench.workloads.base import RequestSpec


def spec(i: int, group: int | None) -> RequestSpec:
    hashes = () if group is None else (group, 10_000 + i)
    return RequestSpec(f"r{i}", "rt", float(i), 1024, 10, 10, prefix_hashes=hashes)


def test_sub_pool_takes_an_even_share_and_keeps_prefix_groups_whole() -> None:
    # conversations of four turns (group ids spread as hashes are), and single requests
    specs = [spec(i, group=(i // 4) * 7919 if i % 5 else None) for i in range(4000)]
    chosen = sub_pool(specs, replicas=64, sample=8)
    assert abs(len(chosen) - 4000 * 8 / 64) < 4000 * 0.02
    groups_in = {s.prefix_hashes[0] for s in chosen if s.prefix_hashes}
    for s in specs:  # a group is in the sample whole, or not at all
        if s.prefix_hashes and s.prefix_hashes[0] in groups_in:
            assert s in chosen
    assert sub_pool(specs, replicas=4, sample=8) == specs


def record(rid: str, tenant: str, *, ttft_s: float | None, admission: str = "admitted",
           tier: str = "rt") -> RequestRecord:  # fmt: skip
    times = array("d", [] if ttft_s is None else [ttft_s, ttft_s + 0.05, ttft_s + 0.1])
    return RequestRecord(
        rid=rid,
        tier=tier,  # type: ignore[arg-type]
        arrival_s=0.0,
        prompt_len=100,
        output_len_target=3,
        generated=len(times),
        first_token_s=ttft_s,
        finish_s=None if ttft_s is None else ttft_s + 0.1,
        token_times=times,
        evictions=0,
        cached_tokens=0,
        ttft_target_s=0.4 if tier == "rt" else None,
        tpot_target_s=0.2 if tier == "rt" else None,
        deadline_s=None,
        length_key=tenant,
        tenant_id=tenant,
        admission=admission,  # type: ignore[arg-type]
    )


def test_attainment_counts_shed_downgraded_and_late_requests_as_missed() -> None:
    records = [
        record("a", "chat", ttft_s=0.1),
        record("b", "chat", ttft_s=0.9),  # late
        record("c", "chat", ttft_s=None, admission="shed"),
        record("d", "chat", ttft_s=0.1, admission="downgraded", tier="be"),  # ran as BE
        record("e", "chat", ttft_s=0.2),
    ]
    rows = tenant_attainment(records, {"chat": ("rt", 5)}, end_s=10.0)
    assert rows["chat"]["attainment"] == 2 / 5
    assert rows["chat"]["shed"] == 1 and rows["chat"]["met"] == 2
    # stopped early: only what the sheds allow is known, an upper bound
    stopped = tenant_attainment(records[:3], {"chat": ("rt", 5)}, end_s=1.0, stopped=True)
    assert stopped["chat"]["attainment"] == 4 / 5 and stopped["chat"]["upper_bound"]


def test_sub_pool_spreads_conversations_numbered_in_blocks() -> None:
    # bench.trace numbers a conversation's blocks conversation × 4096 + j: a plain modulo by a
    # power-of-two count would put every conversation in the first share
    specs = [spec(i, group=(i // 4) * 4096) for i in range(4000)]
    for replicas in (16, 64, 256):
        chosen = sub_pool(specs, replicas=replicas, sample=8)
        assert abs(len(chosen) - 4000 * 8 / replicas) < 4000 * 8 / replicas * 0.35, replicas


class FakeTrial:
    """A count's outcome when *needed* replicas meet the target, with a guess that is *bias*
    replicas off (None: no guess) — and above the count, as `Trial.guess` always is (a failure
    missed more than the target allows)."""

    missed_share: float | None = None  # nothing for the curve guesses to go by

    def __init__(self, n: int, needed: int, bias: int | None) -> None:
        self.meets = n >= needed
        self._guess = None if bias is None else max(n + 1, needed + bias)

    def guess(self, target: float) -> int | None:
        return None if self.meets else self._guess


@pytest.mark.parametrize("bias", [None, 0, -1, -5, 3, 40, -100])
def test_search_finds_the_same_count_as_trying_every_count(bias: int | None) -> None:
    for max_replicas in (1, 7, 64):
        for needed in range(1, 80):
            tried: list[int] = []

            def trial(
                n: int, needed: int = needed, tried: list[int] = tried, top: int = max_replicas
            ) -> FakeTrial:
                assert 1 <= n <= top and n not in tried
                tried.append(n)
                return FakeTrial(n, needed, bias)

            exhaustive = needed if needed <= max_replicas else None
            assert search_replicas(trial, max_replicas) == exhaustive, (needed, max_replicas)
            assert len(tried) <= 5 * math.log2(max_replicas) + 3  # bisection's 2 log2 at best


def test_a_good_guess_runs_one_count_that_meets() -> None:
    # counts that meet run their whole trace: with the guess right, only the answer does
    for needed in (3, 45, 61):
        tried: list[int] = []

        def trial(n: int, needed: int = needed, tried: list[int] = tried) -> FakeTrial:
            tried.append(n)
            return FakeTrial(n, needed, bias=-1)

        assert search_replicas(trial, 64) == needed
        assert [n for n in tried if n >= needed] == [needed]


class CurveTrial:
    """A count's outcome on a pool whose miss share at n replicas is *share(n)*: it meets where
    the share is within the target's 1 %, and guesses as `Trial.guess` does."""

    def __init__(self, n: int, share: float) -> None:
        self.replicas = n
        self.missed_share = share
        self.meets = share <= 0.01

    guess = Trial.guess


# The one-hour fleet plan's miss shares (bench/results/placement/plan-fleet256-1h/plan.json):
# shed load far below the answer, queueing near it, ln share falling ever faster towards 41.
FLEET_1H = {1: 0.9966, 2: 0.992, 4: 0.968, 8: 0.899, 16: 0.659, 32: 0.114, 36: 0.047}
FLEET_1H |= {38: 0.0265, 40: 0.0126, 41: 0.0059, 47: 9.4e-5}


def fleet_share(n: int) -> float:
    """`FLEET_1H` drawn through in ln share (and on past its last point)."""
    known = sorted(FLEET_1H)
    below = max((k for k in known if k <= n), default=known[0])
    above = min((k for k in known if k > n), default=None)
    if above is None:
        return FLEET_1H[known[-1]] * 0.5 ** (n - known[-1])
    w = (n - below) / (above - below)
    return math.exp((1 - w) * math.log(FLEET_1H[below]) + w * math.log(FLEET_1H[above]))


def test_the_miss_shares_bring_the_search_to_the_answer_and_the_count_under_it() -> None:
    # near the answer every count costs about a whole run: the one-hour fleet plan tried 38,
    # 40, 41 and 47 there; drawing the shares as curves it lands on 41, then 40
    tried: list[int] = []

    def trial(n: int) -> CurveTrial:
        tried.append(n)
        return CurveTrial(n, fleet_share(n))

    assert search_replicas(trial, 64) == 41
    assert tried == [1, 2, 4, 8, 16, 32, 36, 41, 40]


@pytest.mark.parametrize("seed", range(6))
def test_the_curve_guesses_never_change_the_answer(seed: int) -> None:
    # shares that fall with the count at any pace, or jump about (early stops read them over
    # different stretches of the trace): the answer is still the first count that meets
    rng = random.Random(seed)
    for _ in range(200):
        max_replicas = rng.choice([1, 7, 64])
        needed = rng.randint(1, 80)
        decay = rng.uniform(0.02, 2.0)
        noise = rng.choice([0.0, 0.5, 3.0])

        def share(
            n: int, needed: int = needed, decay: float = decay, noise: float = noise
        ) -> float:
            f = 0.01 * math.exp(decay * (needed - n) + noise * rng.uniform(-1, 1))
            return min(max(f, 0.0101), 0.999) if n < needed else min(f, 0.01)  # meets from needed

        tried: list[int] = []

        def trial(n: int, tried: list[int] = tried, top: int = max_replicas) -> CurveTrial:
            assert 1 <= n <= top and n not in tried
            tried.append(n)
            return CurveTrial(n, share(n))

        exhaustive = needed if needed <= max_replicas else None
        assert search_replicas(trial, max_replicas) == exhaustive, (needed, decay, noise)
        assert len(tried) <= 5 * math.log2(max_replicas) + 3


def dense_trace(path: Path) -> Path:
    """240 requests in 2.4 s of two RT tenants and a BE one with a deadline: one simulated
    H100 replica is too few (as in tests/functional/test_bench_pool.py)."""
    lines = [
        {
            "t_ms": 10 * i,
            "input_len": 900 + (37 * i) % 600,
            "output_len": 20 + i % 30,
            "tier": "be" if i % 6 == 0 else "rt",
            "tenant": "batch" if i % 6 == 0 else ("chat" if i % 2 else "search"),
        }
        for i in range(240)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def dense_plan(tmp_path: Path, contracts: str, max_replicas: int) -> PlanConfig:
    """A plan of `dense_trace` for the tenants' *contracts* (a YAML text)."""
    path = tmp_path / "contracts.yaml"
    path.write_text(contracts)
    return PlanConfig(
        trace_file=dense_trace(tmp_path / "t.jsonl"),
        out_dir=tmp_path / "out",
        tenants_file=path,
        max_replicas=max_replicas,
    )


def test_the_plan_with_early_stops_answers_as_every_count_run_to_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    contracts = (
        "chat: {tier: rt, ttft_ms: 300, tpot_ms: 100}\n"
        "search: {tier: rt, ttft_ms: 150, tpot_ms: 50, weight: 2}\n"
        "batch: {tier: be, deadline_s: 60}\n"
    )
    config = dense_plan(tmp_path, contracts, max_replicas=6)
    run_trial = bench.plan.run_trial
    args: list[Any] = []

    def both(*a: Any, judge_from_s: float = 0.0) -> Trial:
        assert judge_from_s == 0.0  # a trace this short is judged whole
        args[:] = a
        stopped, whole = run_trial(*a), run_trial(*a, early_stop=False)
        assert stopped.meets == whole.meets
        if stopped.stopped_early:  # a stopped run reports an upper bound
            assert stopped.min_attainment is not None and whole.min_attainment is not None
            assert stopped.min_attainment >= whole.min_attainment
        return stopped

    monkeypatch.setattr(bench.plan, "run_trial", both)
    result = bench.plan.plan(config)
    assert any(t.stopped_early for t in result.trials.values())
    every = {}
    for n in range(1, config.max_replicas + 1):
        args[2] = n
        every[n] = run_trial(*args, early_stop=False).meets
    assert result.replicas_needed == min(n for n, meets in every.items() if meets) > 1


def test_each_tenants_contract_says_what_its_forecast_misses_get(tmp_path: Path) -> None:
    """Tenants whose `on_unattainable` differ plan together: each RT request carries its own
    tenant's outcome into the simulator's front door, a BE one none."""
    contracts = (
        "chat: {tier: rt, ttft_ms: 300, tpot_ms: 100, on_unattainable: accept}\n"
        "search: {tier: rt, ttft_ms: 150, tpot_ms: 50, on_unattainable: downgrade}\n"
        "batch: {tier: be, deadline_s: 60}\n"
    )
    config = dense_plan(tmp_path, contracts, max_replicas=1)
    specs, _ = bench.plan.trace_specs(config)
    outcomes = {(s.tenant_id, s.on_unattainable) for s in specs}
    assert outcomes == {("chat", "accept"), ("search", "downgrade"), ("batch", None)}
    trial = bench.plan.plan(config).trials[1]
    assert set(trial.tenants) == {"chat", "search", "batch"}


def test_the_quick_check_of_a_finished_request_agrees_with_the_exact_one() -> None:
    rng = random.Random(0)
    for i in range(3000):
        ttft = rng.choice([0.1, 0.4, 0.4 + 1e-12, 0.39999999, 0.9])
        gap = rng.choice([0.05, 0.2, 0.2 + 1e-13, 0.2 - 1e-13, 0.3])
        times = array("d", [ttft + k * gap for k in range(rng.randint(1, 40))])
        rec = record(f"r{i}", "chat", ttft_s=ttft)
        rec.token_times, rec.finish_s = times, times[-1]
        quick = bench.plan._clearly_met(rec, "rt")
        assert not quick or bench.plan.is_met(rec, "rt", 100.0)  # never a wrong "met"
        if ttft == 0.1 and (gap == 0.05 or len(times) == 1):
            assert quick  # and it answers the requests well inside their targets


def steady_with_a_burst(path: Path) -> Path:
    """400 s of one RT tenant at 5 req/s with a minute at 40 req/s from 210 s, and a BE tenant
    without a deadline (no contract) sending long prompts in its own burst at 60–120 s: one
    simulated H100 replica is plenty outside the RT burst, not within it."""
    lines = []
    t_ms = 0.0
    while t_ms < 400_000:
        lines.append(
            {"t_ms": t_ms, "input_len": 2400, "output_len": 24, "tier": "rt", "tenant": "chat"}
        )
        t_ms += 25.0 if 210_000 <= t_ms < 270_000 else 200.0
    lines += [
        {"t_ms": t, "input_len": 6000, "output_len": 100, "tier": "be", "tenant": "batch"}
        for t in range(60_000, 120_000, 100)
    ]
    lines.sort(key=lambda line: line["t_ms"])
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_the_busiest_window_is_the_judged_tenants_peak() -> None:
    def rt(t_s: float, tokens: int = 100, tenant: str = "chat") -> RequestSpec:
        return RequestSpec(f"r{t_s}", "rt", t_s, tokens - 10, 10, 10, tenant_id=tenant)

    steady = [rt(float(t)) for t in range(3600)]
    burst = [rt(2100.0 + t / 10) for t in range(3000)]  # 10/s over 2100–2400 s
    flood = [rt(500.0 + t / 10, tenant="bulk") for t in range(6000)]  # an unjudged tenant
    judged = {"chat": True, "bulk": False}
    window = busiest_window(steady + burst + flood, judged, 300.0, 60.0)
    assert window is not None
    assert (window.start_s, window.end_s, window.warmup_s) == (2100.0, 2400.0, 60.0)
    assert window.tokens == (300 + 3000) * 100
    assert window.row()["peak_to_mean"] == pytest.approx(3300 / (3600 / 12 + 3000 / 12), rel=0.01)
    # a peak at the very start has the trace's own cold start before it
    early = busiest_window(steady + [rt(t / 10) for t in range(3000)], judged, 300.0, 60.0)
    assert early is not None and (early.start_s, early.warmup_s) == (0.0, 0.0)
    # a trace no longer than the window and its warm-up, or window 0: judged whole
    assert busiest_window(steady[:360], judged, 300.0, 60.0) is None
    assert busiest_window(steady, judged, 0.0, 60.0) is None
    # the window's requests on a clock starting at its warm-up
    shifted = window_specs(steady, window)
    assert [s.arrival_s for s in shifted] == [float(t) for t in range(360)]


@pytest.mark.slow  # two plans, one of them of the whole trace (about 10 s)
def test_a_long_trace_is_planned_on_its_peak_with_the_answer_of_the_whole_trace(
    tmp_path: Path,
) -> None:
    trace = steady_with_a_burst(tmp_path / "t.jsonl")
    contracts = tmp_path / "contracts.yaml"
    contracts.write_text("chat: {tier: rt, ttft_ms: 400, tpot_ms: 200}\nbatch: {tier: be}\n")
    config = PlanConfig(
        trace_file=trace,
        out_dir=tmp_path / "out",
        tenants_file=contracts,
        window_s=60.0,
        warmup_s=20.0,
    )
    peak = bench.plan.plan(config)
    whole = bench.plan.plan(replace(config, window_s=0.0))
    assert peak.window is not None and peak.window.start_s == 210.0  # the RT burst, not BE's
    assert whole.window is None
    assert peak.replicas_needed == whole.replicas_needed > 1
    answer = peak.replicas_needed
    # simulated: the window and its warm-up (20 s at 5 req/s), not the 400 s of the trace
    assert (peak.trials[answer].requests, whole.trials[answer].requests) == (2500, 4700)
    # judged: the window's requests; its warm-up's are served, not counted
    assert peak.trials[answer].tenants["chat"]["requests"] == 60 * 40
