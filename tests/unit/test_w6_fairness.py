"""W6 (multi-tenant fairness) and the per-tenant metrics: the workload is deterministic by seed,
has four tenants with the right tiers and weights, the burster sends 5× the steady rate in its
bursts; token shares are counted inside the tier's contended window; results.json and report.md
carry `tenants` only for workloads with tenants."""

from __future__ import annotations

import json
from array import array
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from backend.policy.latency import LatencyModel
from backend.sim.records import IterationLog, RequestRecord, SimResult
from bench.metrics import compute_metrics, tenant_metrics
from bench.report import write_outputs
from bench.runner import BenchConfig, run_bench
from bench.trace import build_trace_workload
from bench.workloads import build_workload, w6_fairness
from bench.workloads.base import BuildContext, RequestSpec, TenantSpec, WorkloadParams
from bench.workloads.sources import drain

LATENCY = LatencyModel([0.005, 0.05, 0.01, 0.0, 0.0, 0.0, 0.0, 0.0])
CTX = BuildContext(latency=LATENCY, kv_capacity_tokens=400_000, max_prefill_tokens=8192)


def w6_specs(
    seed: int = 0, rate: float = 10.0, duration_s: float = 60.0, include_be: bool = True
) -> list[RequestSpec]:
    workload = build_workload("W6", WorkloadParams(seed=seed, duration_s=duration_s), CTX)
    return drain(workload.source(rate, include_be), finish_after_s=1.0)


def test_w6_is_deterministic_by_seed() -> None:
    first, again, other = w6_specs(), w6_specs(), w6_specs(seed=1)
    assert first and first == again
    assert [(s.arrival_s, s.prompt_len) for s in first] != [
        (s.arrival_s, s.prompt_len) for s in other
    ]


def test_w6_has_four_tenants_with_tiers_and_equal_weights() -> None:
    workload = build_workload("W6", WorkloadParams(duration_s=60.0), CTX)
    assert {(t.name, t.tier, t.weight) for t in workload.tenants} == {
        ("rt-steady", "rt", 1.0),
        ("rt-burst", "rt", 1.0),
        ("be-a", "be", 1.0),
        ("be-b", "be", 1.0),
    }
    tiers = {(s.length_key, s.tenant_id, s.tier, s.tenant_weight) for s in w6_specs()}
    assert tiers == {(t.name, t.name, t.tier, t.weight) for t in workload.tenants}


def test_w6_burster_sends_five_times_the_steady_rate_in_bursts_and_its_share_overall() -> None:
    specs = w6_specs(rate=20.0, duration_s=2000.0, include_be=False)
    burst = [s for s in specs if s.length_key == "rt-burst"]
    steady = [s for s in specs if s.length_key == "rt-steady"]
    assert all(w6_fairness.in_burst(s.arrival_s) for s in burst)
    steady_in_bursts = sum(w6_fairness.in_burst(s.arrival_s) for s in steady)
    assert len(burst) / steady_in_bursts == pytest.approx(5.0, rel=0.1)
    assert len(burst) / len(steady) == pytest.approx(1.0, rel=0.05)  # same mean rate
    assert len(specs) / 2000.0 == pytest.approx(20.0, rel=0.05)  # the rate is the total


def test_w6_rt_requests_do_not_change_with_the_rate() -> None:
    low = [s for s in w6_specs(rate=5.0) if s.tier == "rt"]
    high = [s for s in w6_specs(rate=10.0) if s.tier == "rt"]
    for tenant in ("rt-steady", "rt-burst"):
        a = [(s.prompt_len, s.output_len) for s in low if s.length_key == tenant]
        b = [(s.prompt_len, s.output_len) for s in high if s.length_key == tenant]
        assert a == b[: len(a)]


def test_w6_be_tenants_each_keep_a_batch_outstanding() -> None:
    specs = [s for s in w6_specs() if s.tier == "be"]
    counts = Counter(s.length_key for s in specs)
    assert set(counts) == {"be-a", "be-b"}
    assert all(n % w6_fairness.FULL_SHAPE.be_batch_size == 0 and n > 0 for n in counts.values())
    assert {s.arrival_s for s in specs if s.rid.endswith("-0000-000")} == {0.0}


def test_w6_cpu_variant_has_w1s_cpu_lengths_batches_and_slos() -> None:
    """The real engine bench's W6 (`--engine sglang`): what the tiny model on a CPU serves."""
    params = WorkloadParams(duration_s=60.0, variant="cpu")
    workload = build_workload("W6", params, CTX)
    specs = drain(workload.source(10.0, True), finish_after_s=1.0)
    rt = [s for s in specs if s.tier == "rt"]
    be = [s for s in specs if s.tier == "be"]
    cpu = w6_fairness.CPU_SHAPE
    assert {(s.ttft_target_s, s.tpot_target_s) for s in rt} == {(1.5, 0.25)}
    assert max(s.prompt_len for s in rt) <= cpu.rt_prompt[2]
    assert all(cpu.be_prompt[0] <= s.prompt_len <= cpu.be_prompt[1] for s in be)
    assert all(n % cpu.be_batch_size == 0 for n in Counter(s.tenant_id for s in be).values())
    assert workload.params["be_batch_size"] == 32 and workload.params["rt_ttft_s"] == 1.5
    # the same tenants, arrivals and bursts as the full shape
    full = [s for s in w6_specs(rate=10.0) if s.tier == "rt"]
    assert [(s.rid, s.arrival_s) for s in rt] == [(s.rid, s.arrival_s) for s in full]
    with pytest.raises(ValueError, match="W6 has no variant 'hetero'"):
        build_workload("W6", WorkloadParams(variant="hetero"), CTX)


def rec(
    rid: str,
    tenant: str,
    tier: str = "rt",
    *,
    arrival_s: float = 0.0,
    times: tuple[float, ...] = (),
    prompt_len: int = 10,
    finished: bool = True,
) -> RequestRecord:
    return RequestRecord(
        rid=rid,
        tier=tier,  # type: ignore[arg-type]
        arrival_s=arrival_s,
        prompt_len=prompt_len,
        output_len_target=len(times),
        generated=len(times),
        first_token_s=times[0] if times else None,
        finish_s=times[-1] if finished and times else None,
        token_times=array("d", times),
        evictions=0,
        cached_tokens=0,
        ttft_target_s=0.5 if tier == "rt" else None,
        tpot_target_s=0.1 if tier == "rt" else None,
        deadline_s=None,
        length_key=tenant,
    )


TENANTS = (
    TenantSpec("a", "rt", 1.0),
    TenantSpec("b", "rt", 2.0),
    TenantSpec("x", "be", 1.0),
    TenantSpec("y", "be", 1.0),
)


def test_token_shares_count_only_the_contended_window() -> None:
    records = [
        # a: outstanding [0, 10]; prompt 10 at t=1 (in), tokens 1, 4, 10 in; 8 of a's tokens
        # before b arrives are outside the window
        rec("a1", "a", times=(0.2, 0.3)),  # [0, 0.3]: before b arrives, outside C
        rec("a2", "a", arrival_s=1.0, times=(1.0, 4.0, 10.0)),  # prompt + 3 tokens inside
        # b: outstanding [0.5, 5] ∪ [8, 12]; C = [1, 5] ∪ [8, 10]
        rec("b1", "b", arrival_s=0.5, times=(0.6, 5.0), prompt_len=20),  # prompt at 0.6: out
        rec("b2", "b", arrival_s=8.0, times=(9.0, 11.0, 12.0), prompt_len=20),  # 20 + 1 inside
    ]
    out = tenant_metrics(records, TENANTS, end_s=20.0)
    a, b = out["a"], out["b"]
    assert a["contended_s"] == pytest.approx(4.0 + 2.0)
    assert a["tokens_in_contended"] == 10 + 3
    assert b["tokens_in_contended"] == 1 + 20 + 1  # b1's token at 5.0, b2's prompt and 9.0
    assert a["token_share"] == pytest.approx(13 / 35)
    assert b["token_share"] == pytest.approx(22 / 35)
    assert (a["weight"], b["weight"], a["tier"], a["requests"]) == (1.0, 2.0, "rt", 2)
    # BE tenants without requests: no contended window, no share
    assert out["x"]["token_share"] is None and out["x"]["requests"] == 0
    assert "rt_admitted_attainment" not in out["x"]


def test_queued_shares_count_only_while_every_tenant_has_a_request_waiting() -> None:
    records = [
        # a waits [0, 2] (admitted when its first token comes: the records' fallback) and
        # [6, 7]; b waits [1, 3] and [6.5, 9]: Q = [1, 2] ∪ [6.5, 7]
        rec("a1", "a", arrival_s=0.0, times=(2.0, 2.5, 8.0)),  # prompt 10 at 2.0 in, 2.5 out
        rec("a2", "a", arrival_s=6.0, times=(7.0,)),  # prompt 10 in
        rec("b1", "b", arrival_s=1.0, times=(3.0, 6.8), prompt_len=20),  # 6.8 in
        rec("b2", "b", arrival_s=6.5, times=(9.0,), prompt_len=20),
    ]
    out = tenant_metrics(records, TENANTS, end_s=20.0)
    a, b = out["a"], out["b"]
    assert a["queued_s"] == b["queued_s"] == pytest.approx(1.0 + 0.5)
    assert (a["tokens_in_queued"], b["tokens_in_queued"]) == (10 + 1 + 10 + 1, 1)
    assert a["token_share_queued"] == pytest.approx(22 / 23)
    assert out["x"]["token_share_queued"] is None and out["x"]["queued_s"] == 0


def test_requests_belong_to_their_tenant_id_before_their_length_key() -> None:
    mine = msgspec.structs.replace(rec("r", "x-history", times=(1.0,)), tenant_id="a")
    other = rec("o", "b", times=(1.0,))
    out = tenant_metrics([mine, other], TENANTS, end_s=5.0)
    assert out["a"]["requests"] == 1 and out["b"]["requests"] == 1


def test_rt_admitted_attainment_per_tenant_and_overall() -> None:
    records = [
        rec("a1", "a", times=(0.2, 0.3, 0.4)),  # met
        rec("a2", "a", arrival_s=1.0, times=(2.0, 2.1)),  # TTFT 1.0 missed
        rec("b1", "b", times=(0.1, 0.2)),  # met
        rec("b2", "b", arrival_s=1.0, times=(1.1, 1.5)),  # TPOT 0.4 missed
        rec("b3", "b", arrival_s=1.0, times=(1.1, 1.2)),  # met
        rec("x1", "x", "be", times=(0.5, 0.6)),
        rec("y1", "y", "be", times=(0.5, 0.7), finished=False),  # outstanding until the end
    ]
    out = tenant_metrics(records, TENANTS, end_s=3.0)
    assert out["a"]["rt_admitted_attainment"] == pytest.approx(0.5)
    assert out["b"]["rt_admitted_attainment"] == pytest.approx(2 / 3)
    # x: [0, 0.6], y: [0, 3] → C = [0, 0.6]: x 10 + 2, y 10 + 1 (0.7 is outside)
    assert out["x"]["token_share"] == pytest.approx(12 / 23)
    assert out["y"]["token_share"] == pytest.approx(11 / 23)

    result = SimResult(
        policy_name="p",
        requests=records,
        iterations=IterationLog(1000),
        horizon_s=None,
        end_s=3.0,
        prefix_reuse_ratio=0.0,
    )
    metrics = compute_metrics(result, 3.0)
    assert metrics["rt_admitted_attainment"] == metrics["rt_joint_attainment"] == 0.6
    assert metrics["rt_shed_rate"] == 0.0 and metrics["rt_downgraded_rate"] == 0.0
    assert metrics["rt_goodput_req_s"] == pytest.approx(3 / 3.0)


def test_trace_tenants_become_workload_tenants(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"t_ms": 0, "input_len": 10, "output_len": 2, "tenant": "alice"}\n'
        '{"t_ms": 5, "input_len": 10, "output_len": 2, "tier": "be", "tenant": "bob"}\n'
        '{"t_ms": 9, "input_len": 10, "output_len": 2}\n'
    )
    workload = build_trace_workload(path, WorkloadParams())
    assert workload.tenants == (TenantSpec("alice", "rt", 1.0), TenantSpec("bob", "be", 1.0))
    plain = tmp_path / "p.jsonl"
    plain.write_text('{"t_ms": 0, "input_len": 10, "output_len": 2}\n')
    assert build_trace_workload(plain, WorkloadParams()).tenants == ()


@pytest.mark.parametrize(("workload", "has_tenants"), [("W6", True), ("W1", False)])
def test_results_and_report_carry_tenants_only_for_workloads_with_tenants(
    tmp_path: Path, workload: str, has_tenants: bool
) -> None:
    config = BenchConfig(
        workload=workload,
        out_dir=tmp_path,
        policies=("fcfs",),
        rt_rate_req_s=4.0,
        duration_s=20.0,  # one burst: [16, 20)
        progress=False,
        cache_dir=tmp_path,
    )
    run = run_bench(config)
    write_outputs(run, tmp_path)
    row = json.loads((tmp_path / "results.json").read_text())["policies"]["fcfs"]
    report = (tmp_path / "report.md").read_text()
    assert row["rt_shed_rate"] == 0.0 and row["rt_downgraded_rate"] == 0.0
    assert row["rt_admitted_attainment"] == row["rt_joint_attainment"]
    assert ("tenants" in row) == has_tenants
    assert ("| fcfs | rt-burst | rt | 1 |" in report) == has_tenants
    if has_tenants:
        assert set(row["tenants"]) == {"rt-steady", "rt-burst", "be-a", "be-b"}
        for tier in ("rt", "be"):
            shares = [t["token_share"] for t in row["tenants"].values() if t["tier"] == tier]
            assert sum(shares) == pytest.approx(1.0, abs=1e-5)
        assert row["tenants"]["rt-steady"]["rt_admitted_attainment"] is not None
