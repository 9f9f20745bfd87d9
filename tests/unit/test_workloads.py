"""Workloads W1…W5: deterministic by seed, and their requests match the published parameters
(means, bins, shares, arrival rates, closed-loop behaviour) within sampling tolerance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backend.policy.latency import BatchShape, LatencyModel
from bench.defaults import DEFAULT_DATA_DIR
from bench.workloads import build_workload, w1_hybrid, w2_mixed, w3_memory, w4_offline, w5_bursty
from bench.workloads.base import BuildContext, RequestSpec, WorkloadParams
from bench.workloads.sampling import BLOCK_TOKENS
from bench.workloads.sources import BatchSource, ClosedLoopSource, drain

# 5 ms per iteration + 50 ms per 1K prefill tokens + 10 ms per 1K decode context tokens
LATENCY = LatencyModel([0.005, 0.05, 0.01, 0.0, 0.0, 0.0, 0.0, 0.0])
CTX = BuildContext(latency=LATENCY, kv_capacity_tokens=400_000, max_prefill_tokens=8192)


def params(**kw: object) -> WorkloadParams:
    return WorkloadParams(data_dir=DEFAULT_DATA_DIR, **kw)  # type: ignore[arg-type]


def specs(
    name: str,
    rate: float | None = 10.0,
    *,
    include_be: bool = True,
    finish_after_s: float | None = 1.0,
    **kw: object,
) -> list[RequestSpec]:
    workload = build_workload(name, params(**kw), CTX)
    return drain(workload.source(rate, include_be), finish_after_s=finish_after_s)


@pytest.mark.parametrize("name", ["W1", "W2", "W3", "W4", "W5"])
def test_same_seed_same_requests_other_seed_others(name: str) -> None:
    kw: dict[str, Any] = {"duration_s": 20.0} if name != "W4" else {"scale": 0.01}
    first, again = specs(name, **kw), specs(name, **kw)
    other = specs(name, seed=1, **kw)
    assert first and first == again
    assert [(s.prompt_len, s.output_len) for s in first] != [
        (s.prompt_len, s.output_len) for s in other
    ]


def test_w1_rt_lengths_and_rate_match_sharegpt_fit() -> None:
    rt = w1_hybrid.rt_requests(params(), 200.0, 300.0, hetero=False)
    prompts = np.array([s.prompt_len for s in rt])
    outputs = np.array([s.output_len for s in rt])
    assert len(rt) == pytest.approx(200 * 300, rel=0.02)
    assert prompts.mean() == pytest.approx(223, rel=0.05)
    assert prompts.std() == pytest.approx(256, rel=0.15)
    assert outputs.mean() == pytest.approx(235, rel=0.05)
    assert outputs.std() == pytest.approx(269, rel=0.15)
    assert {(s.ttft_target_s, s.tpot_target_s) for s in rt} == {(0.4, 0.2)}
    assert all(s.max_new_tokens >= s.output_len for s in rt)  # a cap, never the length itself


def test_w1_requests_do_not_change_with_the_rate() -> None:
    slow = w1_hybrid.rt_requests(params(), 5.0, 60.0, hetero=False)
    fast = w1_hybrid.rt_requests(params(), 50.0, 60.0, hetero=False)
    assert [(s.prompt_len, s.output_len) for s in slow] == [
        (s.prompt_len, s.output_len) for s in fast[: len(slow)]
    ]
    assert fast[9].arrival_s == pytest.approx(slow[9].arrival_s / 10)


def test_w2_requests_do_not_change_with_the_rate() -> None:
    slow = w2_mixed.rt_requests(params(), CTX, 2.0, 120.0)
    fast = w2_mixed.rt_requests(params(), CTX, 8.0, 120.0)
    assert [(s.prompt_len, s.output_len, s.ttft_target_s) for s in slow] == [
        (s.prompt_len, s.output_len, s.ttft_target_s) for s in fast[: len(slow)]
    ]


def test_w1_hetero_slo_scales() -> None:
    rt = w1_hybrid.rt_requests(params(), 100.0, 60.0, hetero=True)
    ttft = np.array([s.ttft_target_s for s in rt])
    tpot = np.array([s.tpot_target_s for s in rt])
    assert ttft.min() >= 0.2 and ttft.max() <= 0.6 and ttft.mean() == pytest.approx(0.4, 0.05)
    assert tpot.min() >= 0.15 and tpot.max() <= 0.25


def test_w1_be_batches_wait_for_the_previous_batch() -> None:
    source = BatchSource(lambda k, t: w1_hybrid.be_batch(params(), k, t), stop_s=100.0)
    first = source.pop_due(0.0)
    assert len(first) == 256 and source.next_arrival_s() is None
    assert all(512 <= s.prompt_len <= 1024 and 32 <= s.output_len <= 128 for s in first)
    for spec in first[:-1]:
        source.on_finish(spec.rid, 5.0)
    assert source.next_arrival_s() is None  # one request of batch 0 still running
    source.on_finish(first[-1].rid, 7.0)
    second = source.pop_due(7.0)
    assert len(second) == 256 and {s.arrival_s for s in second} == {7.0}
    assert source.batches_submitted == 2


def test_w2_prompt_bins_tier_share_and_slos() -> None:
    workload = build_workload("W2", params(duration_s=600.0), CTX)
    all_specs = drain(workload.source(12.0, True), finish_after_s=None)
    prompts = np.array([s.prompt_len for s in all_specs])
    outputs = np.array([s.output_len for s in all_specs])
    n = len(all_specs)
    assert np.mean(prompts <= 512) == pytest.approx(0.34, abs=0.03)
    assert np.mean((prompts > 512) & (prompts <= 4096)) == pytest.approx(0.52, abs=0.03)
    assert np.mean(prompts > 4096) == pytest.approx(0.14, abs=0.02)
    assert np.mean(outputs == 2048) == pytest.approx(0.13, abs=0.02)
    assert np.mean(outputs <= 512) == pytest.approx(0.51, abs=0.03)
    be = [s for s in all_specs if s.tier == "be"]
    assert len(be) / n == pytest.approx(0.35, abs=0.03)
    assert all(s.prompt_len >= 512 and s.deadline_s is not None for s in be)
    for s in be[:50]:
        standalone = CTX.standalone_s(s.prompt_len, s.output_len)
        assert 2 * standalone <= s.deadline_s <= 4 * standalone  # type: ignore[operator]
    rt = [s for s in all_specs if s.tier == "rt"]
    tbt_base = w2_mixed.tbt_base_s(CTX)  # 2 × the pivot iteration time of the engine
    assert all(0.75 * tbt_base <= s.tpot_target_s <= 1.25 * tbt_base for s in rt)  # type: ignore[operator]
    for s in rt[:100]:  # 2 × the bucket top's isolated prefill × U[0.5, 1.5]: feasible alone
        top = CTX.prefill_s(512 * -(-s.prompt_len // 512))
        assert CTX.prefill_s(s.prompt_len) <= top <= s.ttft_target_s <= 3 * top  # type: ignore[operator]


def test_w2_pivot_is_where_prefill_throughput_saturates() -> None:
    size, seconds = w2_mixed.pivot(CTX)
    best = max(
        n / CTX.latency.predict(BatchShape().with_prefill(n, 0)) for n in range(64, 8193, 64)
    )
    assert size / seconds >= 0.95 * best
    smaller = size - 64
    assert smaller / CTX.latency.predict(BatchShape().with_prefill(smaller, 0)) < 0.95 * best


def test_w3_closed_loop_keeps_one_request_per_client() -> None:
    clients = w3_memory.clients_for(0.05)
    assert clients == round(0.05 * 512) and w3_memory.clients_for(1.0) == 512
    source = ClosedLoopSource(
        clients, lambda c, j, t: w3_memory.client_request(params(), "d1", c, j, t), stop_s=50.0
    )
    first = source.pop_due(0.0)
    assert len(first) == clients and source.next_arrival_s() is None
    source.on_finish(first[0].rid, 3.0)
    follow = source.pop_due(3.0)
    assert len(follow) == 1 and follow[0].rid.startswith(first[0].rid.split("-")[0])
    source.on_finish(follow[0].rid, 60.0)  # after the window: no new submission
    assert source.next_arrival_s() is None


@pytest.mark.parametrize(
    ("variant", "prompt", "output"),
    [
        ("d1", (32, 4096), (2048, 4096)),
        ("d2", (3072, 5120), (3072, 5120)),
        ("d3", (2048, 4096), (32, 4096)),
    ],
)
def test_w3_distributions(variant: str, prompt: tuple[int, int], output: tuple[int, int]) -> None:
    out = specs("W3", None, variant=variant, load=0.1, duration_s=30.0)
    p = np.array([s.prompt_len for s in out])
    o = np.array([s.output_len for s in out])
    assert p.min() >= prompt[0] and p.max() <= prompt[1]
    assert o.min() >= output[0] and o.max() <= output[1]
    assert p.mean() == pytest.approx(sum(prompt) / 2, rel=0.1)
    assert o.mean() == pytest.approx(sum(output) / 2, rel=0.1)
    assert {s.max_new_tokens for s in out} == {4096}


@pytest.mark.parametrize("variant", ["p35", "p5"])
def test_w4_prefix_share_and_mmlu_prefixes(variant: str) -> None:
    out = specs("W4", None, variant=variant, scale=0.2, finish_after_s=None)
    assert len(out) == 8000 and {s.arrival_s for s in out} == {0.0}
    assert {s.tier for s in out} == {"be"}
    mmlu = [s for s in out if s.length_key == "w4-mmlu"]
    shared = sum(len(s.prefix_hashes[:2]) * BLOCK_TOKENS for s in mmlu)
    share = shared / sum(s.prompt_len for s in out)
    assert share == pytest.approx(w4_offline.PREFIX_SHARES[variant], abs=0.03)
    assert all(s.output_len == 2 for s in mmlu)
    assert len({s.prefix_hashes[:2] for s in mmlu}) == w4_offline.SUBJECTS
    others = [h for s in out if s.length_key != "w4-mmlu" for h in s.prefix_hashes]
    assert len(others) == len(set(others))  # nothing else is shared
    assert all(len(s.prefix_hashes) == s.prompt_len // BLOCK_TOKENS for s in out)


def test_w5_modulated_rate_has_the_swing_and_mean() -> None:
    workload = build_workload("W5", params(duration_s=1200.0), CTX)
    rt = [s for s in drain(workload.source(30.0, False), finish_after_s=None)]
    times = np.array([s.arrival_s for s in rt])
    assert len(rt) / 1200.0 == pytest.approx(20.0, rel=0.1)  # mean = 2/3 of the peak
    segments = w5_bursty.rate_schedule(params(), 30.0, 1200.0)
    high = [np.sum((times >= a) & (times < b)) / (b - a) for a, b, r in segments[:-1] if r == 30.0]
    low = [np.sum((times >= a) & (times < b)) / (b - a) for a, b, r in segments[:-1] if r == 10.0]
    assert np.mean(high) / np.mean(low) == pytest.approx(3.0, rel=0.2)
    assert all(45.0 <= b - a <= 75.0 for a, b, _ in segments)


def test_w5_be_backlog_stays_full() -> None:
    workload = build_workload("W5", params(duration_s=60.0), CTX)
    depth = w5_bursty.backlog_depth(CTX)
    source = workload.source(0.0, True)
    first = source.pop_due(0.0)
    assert len(first) == depth and all(s.tier == "be" for s in first)
    assert all(512 <= s.prompt_len <= 16384 and 128 <= s.output_len <= 512 for s in first)
    source.on_finish(first[0].rid, 2.0)
    assert len(source.pop_due(2.0)) == 1


def test_w5_missing_trace_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"azure_llm_2023_conv\.csv"):
        build_workload("W5", WorkloadParams(data_dir=tmp_path), CTX)


def test_max_new_cap_hides_the_output_length() -> None:
    exact = specs("W1", 20.0, duration_s=10.0, include_be=False, max_new="exact")
    capped = specs("W1", 20.0, duration_s=10.0, include_be=False, max_new="cap")
    assert all(s.max_new_tokens == s.output_len for s in exact)
    assert {s.max_new_tokens for s in capped} == {w1_hybrid.RT_OUTPUT_MAX}


def test_unknown_workload_and_variant() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("W9", params(), CTX)
    with pytest.raises(ValueError, match="d1, d2, d3"):
        build_workload("W3", params(variant="d9"), CTX)
