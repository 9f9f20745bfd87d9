"""The simulator: invariants every run keeps, and what it does on small hand-built workloads."""

from __future__ import annotations

import random

import pytest

from backend.policy.registry import POLICY_NAMES, make_policy
from backend.policy.types import IterationResult, Plan, Policy, PrefillChunk, Snapshot
from backend.sim.config import SimConfig
from backend.sim.core import InfeasiblePlanError
from backend.sim.engine import StalledPolicyError, simulate
from backend.sim.records import SimResult
from backend.sim.source import ListSource, SimRequest
from tests.unit.sim_factories import LATENCY, make_request


def _mixed_workload(seed: int, n: int = 60) -> list[SimRequest]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        tier = "rt" if rng.random() < 0.5 else "be"
        out = rng.randint(1, 120)
        reqs.append(
            make_request(
                tier=tier,
                rid=f"{tier}{i}",
                arrival_s=rng.uniform(0, 3),
                prompt_len=(p := rng.randint(1, 1300)),
                output_len=out,
                max_new_tokens=out + rng.randint(0, 60),
                prefix_hashes=tuple(rng.randint(0, 2) for _ in range(p // 512)),
                ttft_target_s=0.5 if tier == "rt" else None,
                tpot_target_s=0.1 if tier == "rt" else None,
            )
        )
    return reqs


class _Checked:
    """Wraps a policy and checks, every iteration, what its snapshot promises."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name

    def plan(self, snapshot: Snapshot) -> Plan:
        waiting, running = snapshot.waiting, snapshot.running
        assert 0 <= snapshot.kv_free_tokens <= snapshot.kv_capacity_tokens
        assert 0 <= snapshot.kv_evictable_tokens <= snapshot.kv_capacity_tokens
        assert [r.arrival_s for r in waiting] == sorted(r.arrival_s for r in waiting)
        assert snapshot.waiting_rt == [r for r in waiting if r.tier == "rt"]
        assert snapshot.waiting_be == [r for r in waiting if r.tier == "be"]
        assert all(r.is_running and r.kv_tokens >= r.prefilled for r in running)
        assert not any(r.is_running or r.kv_tokens for r in waiting)
        assert sum(r.kv_tokens - r.kv_shared_tokens for r in running) <= (
            snapshot.kv_capacity_tokens - snapshot.kv_free_tokens
        )
        return self.policy.plan(snapshot)

    def observe(self, result: IterationResult) -> None:
        self.policy.observe(result)


def _run(policy_name: str, reqs: list[SimRequest], **config: object) -> SimResult:
    policy = _Checked(make_policy(policy_name, LATENCY))
    cfg = SimConfig(
        **{
            "kv_capacity_tokens": 4000,
            "max_prefill_tokens": 2048,
            "reveal_lengths": policy_name == "oracle",
            **config,
        }
    )  # type: ignore[arg-type]
    return simulate(ListSource(reqs), policy, LATENCY, cfg)


def _check_invariants(res: SimResult, capacity: int) -> None:
    it = res.iterations
    assert len(it) > 0
    assert max(it.kv_used_tokens) <= capacity  # KV never over capacity, any iteration
    starts = list(it.start_s)
    for i in range(1, len(starts)):  # time is monotonic and iterations never overlap
        assert starts[i] >= starts[i - 1] + it.duration_s[i - 1] - 1e-12
    assert sum(r.generated for r in res.requests) == sum(len(r.token_times) for r in res.requests)
    for r in res.requests:
        times = list(r.token_times)
        assert times == sorted(times)
        if r.finish_s is not None:
            assert r.generated == r.output_len_target
            assert times[0] == r.first_token_s and times[-1] == r.finish_s
            assert r.first_token_s is not None and r.first_token_s > r.arrival_s


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_baseline_keeps_the_invariants_under_memory_pressure(name: str) -> None:
    reqs = _mixed_workload(seed=1)
    if name == "rt-only":
        reqs = [r for r in reqs if r.tier == "rt"]
    res = _run(name, reqs)
    _check_invariants(res, 4000)
    assert all(r.finish_s is not None for r in res.requests)
    assert res.policy_name == name


def test_an_idle_engine_jumps_to_the_next_arrival() -> None:
    res = _run("fcfs", [make_request(arrival_s=100.0, prompt_len=10, output_len=2)])
    assert res.iterations.start_s[0] == 100.0
    (rec,) = res.requests
    assert rec.first_token_s == pytest.approx(100.0 + LATENCY.predict(_shape(prefill=10)))


def _shape(prefill: int = 0):  # type: ignore[no-untyped-def]
    from backend.policy.latency import BatchShape

    return BatchShape(prefill_tokens=prefill, num_prefill=1, prefill_attn=prefill * prefill)


def test_the_horizon_ends_the_run_with_unfinished_requests() -> None:
    res = _run(
        "fcfs",
        [make_request(prompt_len=10, output_len=10_000), make_request(arrival_s=50.0)],
        horizon_s=5.0,
    )
    assert 5.0 <= res.end_s < 5.1
    (long,) = res.requests  # the late one never arrived
    assert long.finish_s is None and 0 < long.generated < 10_000
    assert len(long.token_times) == long.generated


def test_a_prefix_cache_hit_is_not_recomputed() -> None:
    shared = (11, 22)
    reqs = [
        make_request(rid="a", prompt_len=1100, output_len=2, prefix_hashes=shared),
        make_request(rid="b", prompt_len=1100, output_len=2, arrival_s=10.0, prefix_hashes=shared),
    ]
    cached = _run("fcfs", reqs)
    cold = _run("fcfs", reqs, prefix_cache=False)
    assert [r.cached_tokens for r in cached.requests] == [0, 1024]
    assert sum(cached.iterations.prefill_tokens) == 2200 - 1024
    assert sum(cold.iterations.prefill_tokens) == 2200
    assert cached.prefix_reuse_ratio == pytest.approx(1024 / 2200)
    assert cold.prefix_reuse_ratio == 0.0
    assert cached.iterations.duration_s[-2] < cold.iterations.duration_s[-2]  # b's prefill


def test_shared_prefix_kv_is_counted_once() -> None:
    shared = (7, 8, 9)
    a = make_request(rid="a", prompt_len=1600, output_len=50, prefix_hashes=shared)
    b = make_request(rid="b", prompt_len=1600, output_len=50, arrival_s=0.2, prefix_hashes=shared)
    res = _run("fcfs", [a, b], kv_capacity_tokens=4000)
    both_running = max(res.iterations.kv_used_tokens)
    assert both_running < 2 * 1600 + 100  # the 1536 shared tokens are held once
    assert res.requests[1].cached_tokens == 1536


class _Scripted:
    """A policy that plays back fixed plans, then decodes every running request."""

    name = "scripted"

    def __init__(self, plans: list[Plan]) -> None:
        self.plans = plans

    def plan(self, snapshot: Snapshot) -> Plan:
        if self.plans:
            return self.plans.pop(0)
        b = [r.rid for r in snapshot.running if r.is_decoding]
        p = [
            PrefillChunk(r.rid, r.prompt_left)
            for r in snapshot.running + snapshot.waiting
            if r.prompt_left > 0
        ]
        return Plan(decodes=b, prefills=p)

    def observe(self, result: IterationResult) -> None:
        pass


def test_an_evicted_request_recomputes_its_prompt_and_output() -> None:
    seen: list[int] = []

    class Spy(_Scripted):
        def plan(self, snapshot: Snapshot) -> Plan:
            for r in snapshot.waiting:
                if r.num_evictions:
                    seen.append(r.prefill_len)
            return super().plan(snapshot)

    plans = [
        Plan(prefills=[PrefillChunk("x", 100)]),
        Plan(decodes=["x"]),
        Plan(decodes=["x"]),
        Plan(evictions=["x"]),
    ]
    cfg = SimConfig(kv_capacity_tokens=1000)
    res = simulate(
        ListSource([make_request(rid="x", prompt_len=100, output_len=6)]), Spy(plans), LATENCY, cfg
    )
    (rec,) = res.requests
    assert seen and seen[0] == 103  # prompt + the 3 tokens generated before the eviction
    assert rec.evictions == 1 and rec.generated == 6 and len(rec.token_times) == 6
    assert res.num_evictions == 1


@pytest.mark.parametrize(
    "plan, message",
    [
        (Plan(prefills=[PrefillChunk("x", 600)]), "needs 600 KV slots"),
        (Plan(decodes=["x"]), "not running"),
        (Plan(prefills=[PrefillChunk("x", 700)]), "700 tokens, 600 left"),
        (Plan(prefills=[PrefillChunk("nope", 1)]), "unknown"),
    ],
)
def test_an_infeasible_plan_raises_naming_the_policy(plan: Plan, message: str) -> None:
    source = ListSource([make_request(rid="x", prompt_len=600)])
    with pytest.raises(InfeasiblePlanError, match=f"'scripted'.*{message}"):
        simulate(source, _Scripted([plan]), LATENCY, SimConfig(kv_capacity_tokens=500))


def test_a_policy_that_never_runs_anything_is_reported() -> None:
    class Idle(_Scripted):
        def plan(self, snapshot: Snapshot) -> Plan:
            return Plan()

    with pytest.raises(StalledPolicyError, match="'scripted' runs nothing"):
        simulate(ListSource([make_request()]), Idle([]), LATENCY, SimConfig(kv_capacity_tokens=500))


def test_true_lengths_reach_only_a_revealing_run() -> None:
    seen: list[int | None] = []

    class Spy(_Scripted):
        def plan(self, snapshot: Snapshot) -> Plan:
            seen.extend(r.true_output_len for r in snapshot.waiting)
            return super().plan(snapshot)

    req = make_request(output_len=5, max_new_tokens=50)
    simulate(ListSource([req]), Spy([]), LATENCY, SimConfig(kv_capacity_tokens=500))
    simulate(
        ListSource([req]), Spy([]), LATENCY, SimConfig(kv_capacity_tokens=500, reveal_lengths=True)
    )
    assert seen == [None, 5]


class _ClosedLoop:
    """Two clients, three requests each: the next one arrives when the previous finishes."""

    def __init__(self) -> None:
        self.due = [make_request(rid=f"c{i}-0", output_len=3) for i in range(2)]
        self.sent = 2

    def next_arrival_s(self) -> float | None:
        return min((r.arrival_s for r in self.due), default=None)

    def pop_due(self, now_s: float) -> list[SimRequest]:
        out = [r for r in self.due if r.arrival_s <= now_s]
        self.due = [r for r in self.due if r.arrival_s > now_s]
        return out

    def on_finish(self, rid: str, now_s: float) -> None:
        if self.sent < 6:
            self.due.append(make_request(rid=f"{rid}+", arrival_s=now_s + 0.5, output_len=3))
            self.sent += 1

    @property
    def exhausted(self) -> bool:
        return self.sent >= 6 and not self.due


def test_a_closed_loop_source_gets_every_finish() -> None:
    res = simulate(
        _ClosedLoop(), make_policy("fcfs", LATENCY), LATENCY, SimConfig(kv_capacity_tokens=1000)
    )
    assert len(res.requests) == 6
    assert all(r.finish_s is not None for r in res.requests)
    follow = [r for r in res.requests if r.rid.endswith("+")]
    assert all(r.arrival_s >= 0.5 for r in follow)


def test_page_rounding_keeps_kv_within_capacity() -> None:
    reqs = _mixed_workload(seed=3, n=30)
    res = _run("fcfs", reqs, page_size=16, prefix_block_tokens=512)
    _check_invariants(res, 4000)
    assert all(v % 16 == 0 for v in res.iterations.kv_used_tokens)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="multiple"):
        SimConfig(kv_capacity_tokens=100, page_size=16, prefix_block_tokens=500)
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        SimConfig(kv_capacity_tokens=0)


def test_a_request_without_a_tenant_is_its_length_keys_and_records_keep_it() -> None:
    named = make_request(length_key="chat", tenant_id="acme", tenant_weight=2.0, rid="named")
    keyed = make_request(length_key="chat", rid="keyed")
    seen: dict[str, tuple[str, float]] = {}

    class Spy(_Checked):
        def plan(self, snapshot: Snapshot) -> Plan:
            for r in snapshot.waiting:
                seen[r.rid] = (r.tenant_id, r.tenant_weight)
            return super().plan(snapshot)

    res = simulate(
        ListSource([named, keyed]),
        Spy(make_policy("tandem", LATENCY)),
        LATENCY,
        SimConfig(kv_capacity_tokens=4000),
    )
    assert seen == {"named": ("acme", 2.0), "keyed": ("chat", 1.0)}
    assert {r.rid: r.tenant_id for r in res.requests} == {"named": "acme", "keyed": "chat"}
