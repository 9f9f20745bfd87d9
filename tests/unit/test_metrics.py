"""bench.metrics on hand-built records with known answers, and the λ* search on a known curve."""

from __future__ import annotations

from array import array
from pathlib import Path

import numpy as np
import pytest

from backend.sim.records import IterationLog, RequestRecord, SimResult
from bench.capacity import (
    CODE_PACKAGES,
    CapacityKey,
    code_digest,
    search_capacity,
    search_capacity_sustained,
)
from bench.metrics import compute_metrics, interference, rounded, time_share_metrics

WINDOW_S = 10.0
END_S = 12.0


def make_record(
    rid: str,
    tier: str = "rt",
    *,
    arrival_s: float = 0.0,
    times: tuple[float, ...] = (),
    target: int | None = None,
    finished: bool = True,
    ttft: float | None = 0.5,
    tpot: float | None = 0.1,
    deadline_s: float | None = None,
    prompt_len: int = 100,
    admitted_s: float | None = None,
    evictions: int = 0,
) -> RequestRecord:
    return RequestRecord(
        rid=rid,
        tier=tier,
        arrival_s=arrival_s,
        prompt_len=prompt_len,  # type: ignore[arg-type]
        output_len_target=target if target is not None else len(times),
        generated=len(times),
        first_token_s=times[0] if times else None,
        finish_s=times[-1] if finished and times else None,
        token_times=array("d", times),
        evictions=evictions,
        cached_tokens=0,
        ttft_target_s=ttft if tier == "rt" else None,
        tpot_target_s=tpot if tier == "rt" else None,
        deadline_s=deadline_s,
        length_key=tier,
        admitted_s=admitted_s,
    )


def records() -> list[RequestRecord]:
    return [
        # A: TTFT 0.2 ≤ 0.5, gaps 0.1 0.1 ≤ 0.1 → every SLO met, 3 tokens in deadline
        make_record("a", times=(0.2, 0.3, 0.4)),
        # B: TTFT 1.0 > 0.5, gap 0.5 > 0.1 → all missed, 0 tokens in deadline; evicted once
        make_record("b", arrival_s=1.0, times=(2.0, 2.5), evictions=1),
        # C: never started (4 tokens expected): TTFT censored at END_S − 3.0 = 9.0
        make_record("c", arrival_s=3.0, times=(), target=4, finished=False),
        # D: BE, admitted after 0.5 s, done inside the window
        make_record("d", "be", times=(1.0, 2.0, 3.0), admitted_s=0.5),
        # E: BE with an absolute deadline 10.0, admitted after 4 s, finishes at 11 (late)
        make_record("e", "be", times=(5.0, 11.0), admitted_s=4.0, deadline_s=10.0),
    ]


def iteration_log() -> IterationLog:
    log = IterationLog(kv_capacity_tokens=100)
    for start, dur, pred, kv, plan, dec in (
        (0.0, 0.1, 0.1, 10, 1.0, 1),
        (0.1, 0.3, 0.2, 30, 3.0, 0),
    ):
        log.append(
            start_s=start,
            duration_s=dur,
            predicted_s=pred,
            plan_ms=plan,
            num_prefill=1,
            num_decode=dec,
            prefill_tokens=10,
            kv_used_tokens=kv,
            num_running=1,
            num_waiting=0,
            num_evictions=0,
        )
    return log


def result() -> SimResult:
    return SimResult(
        policy_name="x",
        requests=records(),
        iterations=iteration_log(),
        horizon_s=None,
        end_s=END_S,
        prefix_reuse_ratio=0.25,
    )


def test_rt_attainment_and_latency() -> None:
    m = compute_metrics(result(), WINDOW_S)
    assert m["rt_requests"] == 3 and m["rt_finished"] == 2
    assert m["rt_ttft_attainment"] == pytest.approx(1 / 3)
    assert m["rt_tpot_attainment"] == pytest.approx(1 / 3)
    assert m["rt_joint_attainment"] == pytest.approx(1 / 3)
    assert m["rt_strict_attainment"] == pytest.approx(1 / 3)
    assert m["rt_token_attainment"] == pytest.approx(3 / 9)
    ttft = [0.2, 1.0, 9.0]
    assert m["rt_ttft_mean_s"] == pytest.approx(np.mean(ttft))
    assert m["rt_ttft_p50_s"] == pytest.approx(1.0)
    assert m["rt_ttft_p99_s"] == pytest.approx(np.percentile(ttft, 99))
    assert m["rt_tpot_mean_s"] == pytest.approx((0.1 + 0.5) / 2)
    assert m["rt_tbt_mean_s"] == pytest.approx((0.1 + 0.1 + 0.5) / 3)
    assert m["rt_tbt_p99_s"] == pytest.approx(np.percentile([0.1, 0.1, 0.5], 99))
    assert m["rt_mtpot_p99_s"] == pytest.approx(np.percentile([0.1, 0.5], 99))
    assert m["rt_normalized_latency_s"] == pytest.approx((0.4 / 3 + 1.5 / 2) / 2)
    assert m["rt_token_goodput_tok_s"] == pytest.approx(3 / WINDOW_S)


def test_the_admitted_ttft_tail_leaves_the_shed_out() -> None:
    res = result()
    shed = make_record("s", arrival_s=0.0, times=(), target=4, finished=False)
    shed.admission = "shed"  # refused: its TTFT is censored at the end (END_S), not a wait
    res.requests.append(shed)
    m = compute_metrics(res, WINDOW_S)
    assert m["rt_ttft_p99_s"] == pytest.approx(np.percentile([0.2, 1.0, 9.0, END_S], 99))
    admitted = [0.2, 1.0, 9.0]  # C was admitted and never started: it waited to the end
    assert m["rt_admitted_ttft_max_s"] == pytest.approx(9.0)
    assert m["rt_admitted_ttft_p99_s"] == pytest.approx(np.percentile(admitted, 99))
    assert m["rt_shed_rate"] == pytest.approx(1 / 4)


def test_be_throughput_waits_and_deadlines() -> None:
    m = compute_metrics(result(), WINDOW_S)
    assert m["be_throughput_tok_s"] == pytest.approx(4 / WINDOW_S)  # token at 11 s is late
    assert m["be_throughput_req_s"] == pytest.approx(1 / WINDOW_S)
    assert m["be_total_tok_s"] == pytest.approx((100 + 3) / WINDOW_S)
    assert m["be_max_wait_s"] == pytest.approx(4.0)
    assert m["be_jct_attainment"] == 0.0
    assert m["be_makespan_s"] == pytest.approx(11.0)
    assert m["goodput_req_s"] == pytest.approx((1 + 1) / WINDOW_S)  # A and D


def test_system_metrics() -> None:
    m = compute_metrics(result(), WINDOW_S)
    assert m["eviction_rate"] == pytest.approx(1 / 5)
    assert m["rt_eviction_rate"] == pytest.approx(1 / 3) and m["be_eviction_rate"] == 0.0
    assert m["kv_utilization_mean"] == pytest.approx((0.1 * 0.1 + 0.3 * 0.3) / 0.4)
    assert m["kv_utilization_peak"] == pytest.approx(0.3)
    assert m["plan_ms_p50"] == pytest.approx(2.0)
    assert m["over_predicted_frac"] == pytest.approx(0.5)
    assert m["latency_mape"] == pytest.approx((0 + 0.1 / 0.3) / 2)
    assert m["iterations"] == 2 and m["decode_steps"] == 1
    assert m["prefix_reuse_ratio"] == 0.25 and m["window_s"] == WINDOW_S


def test_no_window_uses_the_run_end_and_empty_tiers_are_none() -> None:
    be_only = SimResult(
        policy_name="x",
        requests=records()[3:4],
        iterations=IterationLog(1),
        horizon_s=None,
        end_s=4.0,
        prefix_reuse_ratio=0.0,
    )
    m = compute_metrics(be_only, None)
    assert m["window_s"] == 4.0 and m["be_throughput_tok_s"] == pytest.approx(3 / 4.0)
    assert m["rt_ttft_attainment"] is None and m["rt_ttft_p99_s"] is None
    assert m["kv_utilization_mean"] is None and m["latency_mape"] is None


def test_interference_ratios() -> None:
    ratios = interference(
        {"rt_tbt_p99_s": 0.2, "rt_tbt_mean_s": 0.1, "rt_ttft_mean_s": None, "rt_ttft_p99_s": 1.0},
        {"rt_tbt_p99_s": 0.1, "rt_tbt_mean_s": 0.1, "rt_ttft_mean_s": 0.3, "rt_ttft_p99_s": 0.0},
    )
    assert ratios == {
        "rt_interference_tbt_p99": 2.0,
        "rt_interference_tbt_mean": 1.0,
        "rt_interference_ttft_mean": None,
        "rt_interference_ttft_p99": None,
    }


def test_rounded_makes_valid_json_numbers() -> None:
    assert rounded({"a": 1 / 3, "b": float("nan"), "c": 2, "d": None}) == {
        "a": 0.333333,
        "b": None,
        "c": 2,
        "d": None,
    }


@pytest.mark.parametrize("knee", [0.3, 37.3, 900.0])
def test_capacity_search_finds_the_knee(knee: float) -> None:
    probes: list[float] = []
    found = search_capacity(
        lambda r: 1.0 if r <= knee else 0.5, on_probe=lambda r, _: probes.append(r)
    )
    assert found <= knee and found == pytest.approx(knee, rel=0.02)
    assert len(probes) < 25


@pytest.mark.parametrize(("short_knee", "long_knee"), [(16.5, 11.7), (37.3, 37.3), (0.9, 0.3)])
def test_the_sustained_capacity_is_the_long_probes_and_costs_few_of_them(
    short_knee: float, long_knee: float
) -> None:
    # a short probe passes rates up to short_knee, a long one only up to long_knee (an
    # overloaded engine's queue needs time to grow past the TTFT target)
    probes: list[tuple[float, bool]] = []
    found = search_capacity_sustained(
        lambda r: 1.0 if r <= short_knee else 0.5,
        lambda r: 1.0 if r <= long_knee else 0.5,
        rel_tolerance=0.15,
        on_probe=lambda r, _, is_long: probes.append((r, is_long)),
    )
    assert found <= long_knee and found > long_knee * (1 - 0.15)
    long_rates = [r for r, is_long in probes if is_long]
    # the long probes start where the short ones last passed: none at the low rates
    assert min(long_rates) >= long_knee / 2 and len(long_rates) <= 6
    # the short ones only bracket (doubling from 1 req/s), the long ones decide
    assert [r for r, is_long in probes if not is_long] == sorted(
        r for r, is_long in probes if not is_long
    )


def test_a_capacity_measured_with_fewer_request_slots_is_cached_apart() -> None:
    def key(max_running: int) -> str:
        return str(CapacityKey("W1", "cpu", "p", "d" * 64, 0, 16384, 60.0, max_running=max_running))

    assert key(1024) != key(64)


def test_code_digest_changes_with_the_code(tmp_path: Path) -> None:
    for package in CODE_PACKAGES:
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "a.py").write_text("x = 1\n")
    before = code_digest(tmp_path)
    assert code_digest(tmp_path) == before
    (tmp_path / CODE_PACKAGES[0] / "a.py").write_text("x = 2\n")
    assert code_digest(tmp_path) != before


def test_time_shares_split_the_window_into_rt_be_and_idle() -> None:
    log = IterationLog(kv_capacity_tokens=100)
    # 0–0.1 s RT alone; 0.1–0.4 s mixed (RT part 0.1 s); idle until 0.9; 0.9–1.1 s BE alone,
    # of which only 0.1 s lies inside the 1-s window
    for start, dur, rt_part in ((0.0, 0.1, 0.1), (0.1, 0.3, 0.1), (0.9, 0.2, 0.0)):
        log.append(
            start_s=start,
            duration_s=dur,
            predicted_s=dur,
            plan_ms=0.1,
            num_prefill=1,
            num_decode=1,
            prefill_tokens=1,
            kv_used_tokens=1,
            num_running=1,
            num_waiting=0,
            num_evictions=0,
            rt_part_s=rt_part,
        )
    m = time_share_metrics(log, 1.0)
    assert m["engine_busy_frac"] == pytest.approx(0.5)
    assert m["rt_busy_frac"] == pytest.approx(0.2)
    assert m["be_busy_frac"] == pytest.approx(0.3)


def test_time_shares_without_rt_parts_leave_the_split_open() -> None:
    m = time_share_metrics(iteration_log(), 1.0)  # logged without rt_part_s
    assert m["engine_busy_frac"] == pytest.approx(0.4)
    assert m["rt_busy_frac"] is None and m["be_busy_frac"] is None


def test_iteration_attainment_counts_iterations_with_any_late_rt_token() -> None:
    # five iterations ending at 0.1 … 0.5 s; the third emits nothing for RT
    log = IterationLog(kv_capacity_tokens=100)
    for start in (0.0, 0.1, 0.2, 0.3, 0.4):
        log.append(
            start_s=start,
            duration_s=0.1,
            predicted_s=0.1,
            plan_ms=0.1,
            num_prefill=0,
            num_decode=1,
            prefill_tokens=0,
            kv_used_tokens=1,
            num_running=1,
            num_waiting=0,
            num_evictions=0,
        )
    rt = [
        # on time in every iteration it emits in (0.1, 0.2, 0.4)
        make_record("a", times=(0.1, 0.2, 0.4), tpot=0.25),
        # first token on time at 0.1; the next one 0.4 s later, at 0.5, is late
        make_record("b", times=(0.1, 0.5), tpot=0.25),
        make_record("c", "be", times=(0.3,)),  # BE tokens do not count
    ]
    result = SimResult(
        policy_name="x",
        requests=rt,
        iterations=log,
        horizon_s=None,
        end_s=0.5,
        prefix_reuse_ratio=0.0,
    )
    m = compute_metrics(result, 1.0)
    # RT tokens came out of iterations ending 0.1, 0.2, 0.4, 0.5; only 0.5 had a late one
    assert m["rt_iteration_attainment"] == pytest.approx(3 / 4)
    assert m["rt_token_attainment"] == pytest.approx(4 / 5)


def test_iteration_attainment_needs_an_iteration_log() -> None:
    result = SimResult(
        policy_name="x",
        requests=records(),
        iterations=IterationLog(1),
        horizon_s=None,
        end_s=END_S,
        prefix_reuse_ratio=0.0,
    )
    assert compute_metrics(result, WINDOW_S)["rt_iteration_attainment"] is None
