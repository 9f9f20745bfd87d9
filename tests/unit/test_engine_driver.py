"""The in-engine driver's decisions and the hooks that carry them out, on plain stand-ins for
SGLang's objects (no SGLang here): which rows sit out, which prompts go first, who is retracted
first, what the policy is told."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from backend.policy.common import eviction_gain
from backend.policy.types import IterationResult, Plan, PrefillChunk, Snapshot
from backend.sglang_ext import driver
from backend.sglang_ext.directive import Directive
from backend.sglang_ext.driver import EngineDriver
from backend.sglang_ext.hooks import SchedulerHooks
from backend.sglang_ext.request_meta import REQ_ATTR, meta_of
from common.wire import RequestMeta, meta_to_custom_params


class FakeReq(SimpleNamespace):
    __hash__ = object.__hash__  # SGLang's Req is hashable (the in-flight set holds them)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def reset_for_retract(self) -> None:  # SGLang's, the part the driver reads back
        self.retraction_count += 1
        self.prefix_len = 0
        self.inflight_middle_chunks = 0


class FINISH_ABORT:  # SGLang's class name: the driver matches it by name
    pass


class FINISH_LENGTH:
    pass


def req(
    rid: str,
    tier: str,
    *,
    prompt: int = 10,
    out: int = 0,
    ttft_target_ms: float | None = None,
    tpot_target_ms: float | None = None,
    arrived_s_ago: float = 0.0,
    key: str = "k",
    tenant_weight: float = 1.0,
) -> FakeReq:
    meta = RequestMeta(
        tier=tier,
        tenant_id="t",
        tenant_weight=tenant_weight,
        length_key=key,  # type: ignore[arg-type]
        arrival_unix_s=time.time() - arrived_s_ago,
        ttft_target_ms=ttft_target_ms,
        tpot_target_ms=tpot_target_ms,
        max_tokens=100,
    )
    r = FakeReq(
        rid=rid,
        origin_input_ids=[1] * prompt,
        output_ids=[2] * out,
        sampling_params=SimpleNamespace(max_new_tokens=100),
        kv=SimpleNamespace(kv_allocated_len=prompt + out, cache_protected_len=0),
        prefix_len=0,
        finished_reason=None,
        retraction_count=0,
        inflight_middle_chunks=0,
    )
    setattr(r, REQ_ATTR, meta_of(meta_to_custom_params(meta)))
    return r


class FakeBatch:
    """ScheduleBatch's row operations the driver and the hooks use."""

    def __init__(self, reqs: list[Any]) -> None:
        self.reqs = list(reqs)
        self.sampling_info = None
        self.batch_is_full = True
        self.released: list[tuple[str, int]] = []  # (rid, rows left) per release_req

    def filter_batch(self, keep_indices: list[int]) -> None:
        self.reqs = [self.reqs[i] for i in keep_indices]

    def merge_batch(self, other: FakeBatch) -> None:
        self.reqs += other.reqs

    def is_empty(self) -> bool:
        return not self.reqs

    def release_req(self, idx: int, remaing_req_count: int) -> bool:
        self.released.append((self.reqs[idx].rid, remaing_req_count))
        return True


def sched(waiting: list[Any]) -> SimpleNamespace:
    s = SimpleNamespace(
        waiting_queue=list(waiting),
        requeued=[],
        chunked_req=None,
        max_total_num_tokens=10_000,
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 9_000),
        tree_cache=SimpleNamespace(evictable_size=lambda: 0, supports_prefix_sharing=lambda: True),
        chunked_prefill_size=512,
        max_prefill_tokens=16384,
        is_mixed_chunk=True,
        max_running_requests=64,
        page_size=1,
    )
    s._add_request_to_queue = lambda req, is_retracted=False: (
        s.requeued.append((req.rid, is_retracted)),
        s.waiting_queue.append(req),
    )
    return s


def plan_and_carry_out(
    drv: EngineDriver, s: SimpleNamespace, batch: FakeBatch
) -> tuple[SchedulerHooks, bool]:
    """The planning seam as SGLang calls it: the hooks around *drv*, and whether SGLang skips
    its prefill pass."""
    hooks = SchedulerHooks(drv)
    return hooks, hooks.replace_should_defer_prefill(s, batch)  # type: ignore[arg-type]


class ScriptedPolicy:
    """Returns a fixed plan; records what it was shown and told."""

    name = "scripted"

    def __init__(self, plan: Plan) -> None:
        self.next_plan = plan
        self.snapshots: list[Snapshot] = []
        self.results: list[IterationResult] = []
        self.lengths = SimpleNamespace(replaced={})
        self.lengths.replace_history = lambda key, values: self.lengths.replaced.update(
            {key: list(values)}
        )

    def plan(self, snapshot: Snapshot) -> Plan:
        self.snapshots.append(snapshot)
        return self.next_plan

    def observe(self, result: IterationResult) -> None:
        self.results.append(result)


def test_decodes_left_out_of_the_plan_sit_out_and_come_back() -> None:
    rt, be1, be2 = req("rt", "rt", out=3), req("be1", "be", out=5), req("be2", "be", out=9)
    policy = ScriptedPolicy(Plan(decodes=["rt", "be2"]))
    drv = EngineDriver(policy)  # type: ignore[arg-type]
    batch = FakeBatch([rt, be1, be2])
    s = sched([])
    s.running_batch = batch
    hooks, skip_prefill = plan_and_carry_out(drv, s, batch)
    assert skip_prefill  # the plan prefills nothing
    assert [r.rid for r in batch.reqs] == ["rt", "be2"]
    assert [r.rid for r in hooks.parked_reqs()] == ["be1"]
    assert drv.stats.parked_decodes == 1
    # parked rows are in flight (aborts find them) and keep the engine busy
    assert hooks.after_collect_inflight_reqs(set(), s) == {be1}  # type: ignore[arg-type]
    assert not hooks.after_is_fully_idle(True, s)  # type: ignore[arg-type]
    hooks.after_process_batch_result(None, s, batch)  # type: ignore[arg-type]
    assert sorted(r.rid for r in s.running_batch.reqs) == ["be1", "be2", "rt"]
    assert not hooks.parked_reqs() and hooks.after_is_fully_idle(True, s)  # type: ignore[arg-type]


def test_a_row_being_aborted_is_never_parked() -> None:
    # its client went away (or its batch was cancelled): SGLang ends it at its next decode,
    # which frees its KV and its slot; parked, it would hold them while RT keeps BE out
    rt, gone, be = req("rt", "rt", out=3), req("gone", "be", out=5), req("be", "be", out=9)
    gone.to_finish = FINISH_ABORT()
    drv = EngineDriver(ScriptedPolicy(Plan(decodes=["rt"])))  # type: ignore[arg-type]
    batch = FakeBatch([rt, gone, be])
    hooks, _ = plan_and_carry_out(drv, sched([]), batch)
    assert [r.rid for r in batch.reqs] == ["rt", "gone"]
    assert [r.rid for r in hooks.parked_reqs()] == ["be"]


def test_the_kv_layout_is_told_which_rows_are_parked() -> None:
    rt, be = req("rt", "rt", out=3), req("be", "be", out=5)
    told: list[list[str]] = []
    drv = EngineDriver(ScriptedPolicy(Plan(decodes=["rt"])))  # type: ignore[arg-type]
    hooks = SchedulerHooks(drv, on_park=lambda reqs: told.append([r.rid for r in reqs]))
    batch = FakeBatch([rt, be])
    s = sched([])
    s.running_batch = batch
    hooks.replace_should_defer_prefill(s, batch)  # type: ignore[arg-type]
    hooks.after_process_batch_result(None, s, batch)  # type: ignore[arg-type]
    assert told == [["be"], []]


def test_parked_rows_come_back_even_when_every_other_row_left() -> None:
    a, b = req("a", "be", out=2), req("b", "rt", out=7)
    drv = EngineDriver(ScriptedPolicy(Plan(decodes=["b"])))  # type: ignore[arg-type]
    batch = FakeBatch([a, b])
    s = sched([])
    hooks, _ = plan_and_carry_out(drv, s, batch)
    batch.filter_batch(keep_indices=[])  # b finished and left the batch
    s.running_batch = batch
    hooks.after_process_batch_result(None, s, batch)  # type: ignore[arg-type]
    assert [r.rid for r in s.running_batch.reqs] == ["a"]  # the parked batch took its place


def test_an_evicted_request_that_cannot_resume_is_not_requeued(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt, be = req("rt", "rt", out=3), req("be", "be", out=5)
    drv = EngineDriver(ScriptedPolicy(Plan(decodes=["rt"], evictions=["be"])))  # type: ignore[arg-type]
    batch, s = FakeBatch([rt, be]), sched([])
    batch.release_req = lambda idx, remaining: False  # type: ignore[method-assign]
    plan_and_carry_out(drv, s, batch)
    assert [r.rid for r in batch.reqs] == ["rt"] and s.requeued == []
    assert "1 evicted requests had no way to resume" in caplog.text


def test_the_directive_names_rows_by_rid_and_is_frozen() -> None:
    rt, be1, be2 = req("rt", "rt", out=3), req("be1", "be", out=5), req("be2", "be", out=9)
    waiting = req("w", "rt")
    plan = Plan(decodes=["rt"], evictions=["be2", "gone"], prefills=[PrefillChunk("w", 4)])
    drv = EngineDriver(ScriptedPolicy(plan))  # type: ignore[arg-type]
    batch = FakeBatch([rt, be1, be2])
    directive = drv.plan_iteration(sched([waiting]), batch)  # type: ignore[arg-type]
    assert directive == Directive(
        evict=("be2",),  # a rid no longer running is dropped
        park=("be1",),
        prefill_first=("w",),
        prefill_tokens={"w": 4},
        skip_prefill=False,
    )
    assert len(batch.reqs) == 3  # planning changes nothing; the hooks carry it out
    with pytest.raises(AttributeError):
        directive.skip_prefill = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        directive.prefill_tokens["w"] = 5  # type: ignore[index]
    assert directive.chunk_for_continuing("w") == 4
    assert directive.chunk_for_continuing("other") is None  # left out: it sits the pass out


def test_an_empty_plan_parks_nothing_and_a_prompt_can_run_alone() -> None:
    a, b = req("a", "be", out=2), req("b", "be", out=7)
    drv = EngineDriver(ScriptedPolicy(Plan()))  # type: ignore[arg-type]
    batch = FakeBatch([a, b])
    hooks, _ = plan_and_carry_out(drv, sched([]), batch)
    assert len(batch.reqs) == 2 and not hooks.parked_reqs()
    waiting = req("w", "rt")
    drv = EngineDriver(ScriptedPolicy(Plan(prefills=[PrefillChunk("w", 10)])))  # type: ignore[arg-type]
    batch = FakeBatch([a, b])
    hooks, _ = plan_and_carry_out(drv, sched([waiting]), batch)
    # the plan runs the prompt and no decode: every row sits out, SGLang runs the prompt alone
    # (no mixed batch), as it does before any decode
    assert batch.reqs == [] and [r.rid for r in hooks.parked_reqs()] == ["a", "b"]
    # with no prompt SGLang decodes the running batch, which must not be empty: the most
    # advanced row stays
    drv = EngineDriver(ScriptedPolicy(Plan(decodes=["gone"])))  # type: ignore[arg-type]
    batch = FakeBatch([a, b])
    hooks, _ = plan_and_carry_out(drv, sched([]), batch)
    assert [r.rid for r in batch.reqs] == ["b"] and [r.rid for r in hooks.parked_reqs()] == ["a"]


def test_a_prompt_not_admitted_after_a_full_park_leaves_a_row_decoding_next_time() -> None:
    # every row sat out for a prompt that SGLang then did not admit (the KV the decodes hold):
    # nothing ran. Parking every row again would stall for good; the next plan keeps one.
    a, b = req("a", "be", out=2), req("b", "be", out=7)
    waiting = req("w", "rt")
    drv = EngineDriver(ScriptedPolicy(Plan(prefills=[PrefillChunk("w", 10)])))  # type: ignore[arg-type]
    batch = FakeBatch([a, b])
    hooks, _ = plan_and_carry_out(drv, sched([waiting]), batch)
    assert batch.reqs == []
    drv.batch_started(False, 0.0)  # no batch ran this iteration
    batch = FakeBatch([a, b])
    drv.begin_iteration()
    hooks, _ = plan_and_carry_out(drv, sched([waiting]), batch)
    assert [r.rid for r in batch.reqs] == ["b"] and [r.rid for r in hooks.parked_reqs()] == ["a"]
    drv.batch_started(True, 0.0)  # it ran: a full park is allowed again
    batch = FakeBatch([a, b])
    drv.begin_iteration()
    hooks, _ = plan_and_carry_out(drv, sched([waiting]), batch)
    assert batch.reqs == []


def test_a_hold_runs_nothing_and_may_hold_again() -> None:
    # the policy waits for an RT request on its way (anticipation): every row sits out, no
    # prompt runs, SGLang's own admission does not step in, and the next plan may hold again
    a, b = req("a", "be", out=2), req("b", "be", out=7)
    waiting = req("w", "be")
    drv = EngineDriver(ScriptedPolicy(Plan(hold_until_s=1.0)))  # type: ignore[arg-type]
    for _ in range(2):
        batch = FakeBatch([a, b])
        drv.begin_iteration()
        hooks, skip_prefill = plan_and_carry_out(drv, sched([waiting]), batch)
        assert skip_prefill and batch.reqs == []
        assert [r.rid for r in hooks.parked_reqs()] == ["a", "b"]
        drv.batch_started(False, 0.0)
    assert drv.stats.held_plans == 2 and drv.stats.holds == 1  # one wait, asked twice
    assert drv.stats.parked_decodes == 0  # no iteration ran: no row sat one out
    # nothing running, only waiting work: still a hold, not a stall
    hooks, skip_prefill = plan_and_carry_out(drv, sched([waiting]), FakeBatch([]))
    assert skip_prefill and not hooks._directive.own_admission
    assert drv.stats.stall_fallbacks == 0


def test_a_batch_with_penalizers_decodes_whole() -> None:
    a, b = req("a", "be", out=2), req("b", "rt", out=7)
    drv = EngineDriver(ScriptedPolicy(Plan(decodes=["b"])))  # type: ignore[arg-type]
    batch = FakeBatch([a, b])
    batch.sampling_info = SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=True))
    hooks, _ = plan_and_carry_out(drv, sched([]), batch)
    assert len(batch.reqs) == 2 and not hooks.parked_reqs() and drv.stats.parked_decodes == 0


def test_planned_prompts_go_first_whole_ones_before_the_cut_one() -> None:
    w = [req(name, "be", prompt=100) for name in ("x", "y", "z", "v")]
    s = sched(w)
    plan = Plan(prefills=[PrefillChunk("x", 40), PrefillChunk("z", 100)])
    drv = EngineDriver(ScriptedPolicy(plan))  # type: ignore[arg-type]
    hooks, skip_prefill = plan_and_carry_out(drv, s, FakeBatch([]))
    assert not skip_prefill
    assert [r.rid for r in s.waiting_queue] == ["z", "x", "y", "v"]
    assert dict(hooks._directive.prefill_tokens) == {"x": 40, "z": 100}


def test_the_plans_evictions_are_carried_out() -> None:
    rt, be = req("rt", "rt", out=3), req("be", "be", out=5)
    drv = EngineDriver(ScriptedPolicy(Plan(decodes=["rt"], evictions=["be"])))  # type: ignore[arg-type]
    batch, s = FakeBatch([rt, be]), sched([])
    plan_and_carry_out(drv, s, batch)
    # released like SGLang's own retraction (one row left after it), re-queued as retracted
    assert batch.released == [("be", 1)] and s.requeued == [("be", True)]
    assert [r.rid for r in batch.reqs] == ["rt"] and not batch.batch_is_full
    assert drv.stats.evictions == 1


def test_retraction_takes_be_least_progress_first_and_never_urgent_rt() -> None:
    urgent = req("urgent", "rt", out=4, ttft_target_ms=100, tpot_target_ms=50)
    relaxed = req("relaxed", "rt", out=4, ttft_target_ms=100, tpot_target_ms=60_000)
    young = req("young", "be", out=1)
    old = req("old", "be", out=80)
    reqs = [young, urgent, old, relaxed]
    drv = EngineDriver(ScriptedPolicy(Plan()))  # type: ignore[arg-type]
    now = drv.clock()  # both RT requests emitted their last token just now
    drv.mirror.running(urgent, now)
    drv.mirror.running(relaxed, now)
    order = [reqs[i].rid for i in drv.retraction_order(reqs)]
    # SGLang retracts from the end of the list: BE least progress first, then the RT request
    # with a minute of slack; the one due in 50 ms is the last to go.
    assert order[::-1] == ["young", "old", "relaxed", "urgent"]


def test_finished_lengths_reach_the_policy_but_aborted_ones_do_not() -> None:
    policy = ScriptedPolicy(Plan(decodes=["a", "b"]))
    drv = EngineDriver(policy)  # type: ignore[arg-type]
    a, b = req("a", "be", out=30), req("b", "be", out=7)
    drv.begin_iteration()
    drv.plan_iteration(sched([]), FakeBatch([a, b]))  # type: ignore[arg-type]
    drv.batch_started(True, drv.clock())
    a.finished_reason, b.finished_reason = FINISH_LENGTH(), FINISH_ABORT()
    drv.note_finished([a, b])
    drv.note_finished([a])  # processed twice: reported once
    drv.begin_iteration()
    (result,) = policy.results
    assert [(f.rid, f.output_len) for f in result.finished] == [("a", 30)]
    assert result.duration_s >= 0 and drv.stats.iterations == 1 and len(drv.mirror) == 0


def test_a_length_history_push_replaces_the_keys_history_at_the_next_iteration() -> None:
    policy = ScriptedPolicy(Plan())
    drv = EngineDriver(policy)  # type: ignore[arg-type]
    drv.push_lengths({"tenant-a": [5, 6, 7]})
    assert policy.lengths.replaced == {}  # applied by the scheduler loop, not the caller
    drv.begin_iteration()
    assert policy.lengths.replaced == {"tenant-a": [5, 6, 7]}
    assert drv.stats.history_updates == 1 and drv.stats.history_lengths == 3


def test_the_snapshot_carries_deadlines_on_the_engine_clock() -> None:
    policy = ScriptedPolicy(Plan())
    drv = EngineDriver(policy)  # type: ignore[arg-type]
    w = req("w", "rt", ttft_target_ms=500, tpot_target_ms=50, arrived_s_ago=0.2, tenant_weight=3)
    chunked = req("c", "be", prompt=300)
    chunked.prefix_len = 120
    s = sched([w])
    s.chunked_req = chunked
    drv.plan_iteration(s, FakeBatch([]))  # type: ignore[arg-type]
    (snap,) = policy.snapshots
    (state,) = snap.waiting
    assert state.ttft_due_s is not None
    assert abs((state.ttft_due_s - snap.now_s) - 0.3) < 0.05
    assert state.tpot_target_s == 0.05 and snap.waiting_rt == [state]
    assert (state.tenant_id, state.tenant_weight) == ("t", 3.0)  # the fair-share unit
    (partial,) = snap.running
    assert partial.prefilled == 120 and partial.prompt_left == 180
    assert snap.max_prefill_tokens == 512 and snap.kv_free_tokens == 9_000


def test_an_idle_engine_with_queued_work_never_stays_idle() -> None:
    drv = EngineDriver(ScriptedPolicy(Plan()))  # type: ignore[arg-type]
    s = sched([req("w", "be")])
    directive = drv.plan_iteration(s, FakeBatch([]))  # type: ignore[arg-type]
    assert directive == Directive(own_admission=True) and drv.stats.stall_fallbacks == 1
    hooks, skip_prefill = plan_and_carry_out(drv, s, FakeBatch([]))
    assert not skip_prefill and hooks._directive.own_admission
    # one iteration at a time: the next one starts with nothing planned
    hooks.around_get_next_batch_to_run(
        lambda sched, running_batch, last_batch: SimpleNamespace(batch_to_run=None),
        s,  # type: ignore[arg-type]
        FakeBatch([]),
        None,
    )
    assert hooks._directive == Directive()


def run_one_iteration(
    policy: Any, batch: FakeBatch, waiting: list[Any], duration_s: float
) -> EngineDriver:
    now = [100.0]
    drv = EngineDriver(policy, clock=lambda: now[0])
    drv.begin_iteration()
    drv.plan_iteration(sched(waiting), batch)
    drv.batch_started(True, now[0])
    now[0] += duration_s
    drv.begin_iteration()
    return drv


def test_rt_time_share_counts_what_the_rt_work_alone_would_take() -> None:
    from backend.policy.time_share import plan_times_s
    from tests.unit.sim_factories import LATENCY

    rt, be = req("rt", "rt", prompt=100, out=3), req("be", "be", prompt=200, out=5)
    new_be = req("new", "be", prompt=300)
    plan = Plan(decodes=["rt", "be"], prefills=[PrefillChunk("new", 300)])
    policy = ScriptedPolicy(plan)
    policy.latency = LATENCY  # type: ignore[attr-defined]
    drv = run_one_iteration(policy, FakeBatch([rt, be]), [new_be], duration_s=0.05)
    states = {r.rid: r for r in policy.snapshots[0].running + policy.snapshots[0].waiting}
    full_s, rt_s = plan_times_s(LATENCY, plan, states)
    assert 0 < rt_s < full_s  # the fixed cost is RT's; the BE prompt and decode are not
    assert drv.stats.rt_busy_s == pytest.approx(0.05 * rt_s / full_s)
    assert drv.stats.summary()["rt_time_frac"] == pytest.approx(rt_s / full_s)


def test_rt_time_share_is_all_or_nothing_for_single_tier_iterations() -> None:
    from tests.unit.sim_factories import LATENCY

    for tier, share in (("rt", 1.0), ("be", 0.0)):
        policy = ScriptedPolicy(Plan(decodes=["a"]))
        policy.latency = LATENCY  # type: ignore[attr-defined]
        drv = run_one_iteration(policy, FakeBatch([req("a", tier, out=2)]), [], 0.02)
        assert drv.stats.rt_time_frac == pytest.approx(share)
    # a policy without a latency model (none of tandem's) counts no RT time
    drv = run_one_iteration(
        ScriptedPolicy(Plan(decodes=["a"])), FakeBatch([req("a", "rt", out=2)]), [], 0.02
    )
    assert drv.stats.rt_time_frac == 0.0 and drv.stats.busy_s == pytest.approx(0.02)


def test_each_completed_iteration_publishes_the_load_it_plans_from() -> None:
    rt = req("rt", "rt", prompt=100, out=3)
    new_rt = req("new", "rt", prompt=40)
    policy = ScriptedPolicy(Plan(decodes=["rt"], predicted_s=0.02))
    policy.calibration = SimpleNamespace(  # type: ignore[attr-defined]
        factors=(1.5, 1.0, 2.0), samples=0, last_error=None
    )
    # the policy's RT fair-share counters go out with the load, per tenant
    policy.rt_fair = SimpleNamespace(counters={"t": 1234.0})  # type: ignore[attr-defined]  # "t": FakeReq's tenant
    drv = run_one_iteration(policy, FakeBatch([rt]), [], duration_s=0.05)
    assert drv.loads.latest.iteration == 0  # closed, but not reported before the next plan
    s = sched([new_rt])
    drv.plan_iteration(s, FakeBatch([rt]))
    load = drv.loads.latest
    assert load.iteration == 1
    assert load.iteration_s == pytest.approx(0.05)
    assert load.predicted_iteration_s == pytest.approx(0.02)
    # the one iteration, 50 ms for 20 predicted (the profile's: the scripted policy scales
    # nothing), against the calibrated pace the report carries (decode ×1.5)
    assert load.pace_ratio_p90 == pytest.approx(0.05 / (0.02 * 1.5))
    assert (load.num_rt_running, load.rt_context_tokens) == (1, 103)
    assert (load.num_rt_waiting, load.rt_waiting_prompt_tokens) == (1, 40)
    assert load.latency_factors == (1.5, 1.0, 2.0)
    assert [(t.tenant_id, t.fair_counter) for t in load.rt_by_tenant] == [("t", 1234.0)]
    assert load.kv_capacity_tokens == 10_000 and load.kv_used_tokens == 1_000
    # the iteration it starts now: what its plan predicts (the admission waits for its rest)
    assert load.inflight_predicted_s == pytest.approx(0.02)
    drv.plan_iteration(s, FakeBatch([rt]))  # no iteration ran since (an idle loop): no report
    assert drv.loads.latest is load


def test_the_load_says_when_nothing_runs_and_when_what_runs_is_unknown() -> None:
    idle_policy = ScriptedPolicy(Plan())
    drv = run_one_iteration(idle_policy, FakeBatch([]), [req("w", "rt")], duration_s=0.05)
    drv.plan_iteration(sched([]), FakeBatch([]))  # nothing left to run
    assert drv.loads.latest.inflight_predicted_s == 0.0
    # SGLang admits on its own after an empty plan for queued work: nothing predicted it
    drv = run_one_iteration(idle_policy, FakeBatch([]), [req("w", "rt")], duration_s=0.05)
    drv.plan_iteration(sched([req("w2", "rt")]), FakeBatch([]))
    assert drv.loads.latest.inflight_predicted_s is None


def test_the_iteration_log_carries_the_token_mix_of_the_plan_that_ran() -> None:
    """The live bench fits its twin's engine to the real one's iterations: each logged one
    says what it ran (the latency model's input), not only how long it took."""
    from backend.policy.time_share import shape_of

    rt, be = req("rt", "rt", prompt=100, out=3), req("be", "be", prompt=200, out=5)
    new_be = req("new", "be", prompt=300)
    plan = Plan(decodes=["rt", "be"], prefills=[PrefillChunk("new", 120)], predicted_s=0.03)
    drv = run_one_iteration(ScriptedPolicy(plan), FakeBatch([rt, be]), [new_be], 0.04)
    drv.plan_iteration(sched([]), FakeBatch([rt, be]))  # publishes the iteration that ran
    (record,) = drv.loads.iterations_after(0, 0.0).iterations
    assert record.iteration_s == pytest.approx(0.04) and record.mix is not None
    expected = shape_of([103, 205], [(120, 0)])  # contexts: prompt + generated
    assert msgspec.structs.asdict(record.mix) == msgspec.structs.asdict(expected)


def test_a_request_whose_grammar_compiled_is_planned_for_at_once() -> None:
    # A json_schema request waits in SGLang's grammar queue until its grammar compiles; SGLang
    # moves it to the waiting queue at the start of its prefill pass, which tandem's plan skips
    # when nothing waits: without moving it before planning, it waited forever (issue 17).
    constrained = req("json", "rt", out=4)
    queue = [constrained]
    policy = ScriptedPolicy(Plan(prefills=[PrefillChunk("json", 4)]))
    drv = EngineDriver(policy)  # type: ignore[arg-type]
    batch = FakeBatch([])
    s = sched([])
    s.running_batch = batch
    s.grammar_manager = SimpleNamespace(
        has_waiting_grammars=lambda: bool(queue),
        get_ready_grammar_requests=lambda: [queue.pop()],
    )
    _, skip_prefill = plan_and_carry_out(drv, s, batch)
    assert not skip_prefill
    assert [r.rid for r in s.waiting_queue] == ["json"] and not queue
    assert [r.rid for r in policy.snapshots[0].waiting] == ["json"]


def test_kv_the_layout_already_counts_as_free_is_never_freed_twice() -> None:
    """A parked BE request's slots under the bicache layout are in the allocator's available
    count already: the policy must not count them again as what evicting it frees (it did, and
    the allocation that followed killed SGLang's scheduler)."""
    policy = ScriptedPolicy(Plan())
    drv = EngineDriver(
        policy,  # type: ignore[arg-type]
        kv_unfreeable=lambda rid: 10_000 if rid == "parked" else 3,
    )
    parked, live = req("parked", "be", prompt=300, out=5), req("live", "be", prompt=50)
    drv.plan_iteration(sched([]), FakeBatch([parked, live]))  # type: ignore[arg-type]
    (snap,) = policy.snapshots
    by_rid = {r.rid: r for r in snap.running}
    assert by_rid["parked"].kv_shared_tokens == 305  # all of it, never more than it holds
    assert eviction_gain(by_rid["parked"], 1) == 0
    assert eviction_gain(by_rid["live"], 1) == 50 - 3


def test_a_request_without_tandem_metadata_is_served_as_an_rt_probe() -> None:
    """SGLang's /health generation (and a client talking to the engine directly) carries no
    RequestMeta: the policy sees it as RT, so it is never starved behind BE, but as a probe,
    so it never makes the policy think RT users are active."""
    health = req("HEALTH_CHECK_1", "rt", prompt=1)
    delattr(health, REQ_ATTR)
    tenant = req("rt", "rt", prompt=20, ttft_target_ms=500)
    policy = ScriptedPolicy(Plan())
    drv = EngineDriver(policy)  # type: ignore[arg-type]
    s = sched([health, tenant])
    s.running_batch = FakeBatch([])
    plan_and_carry_out(drv, s, s.running_batch)
    seen = {r.rid: r for r in policy.snapshots[-1].waiting}
    assert (seen["HEALTH_CHECK_1"].tier, seen["HEALTH_CHECK_1"].is_probe) == ("rt", True)
    assert (seen["rt"].tier, seen["rt"].is_probe) == ("rt", False)


def mid_prefill(s: SimpleNamespace, rid: str = "c", prompt: int = 3000, done: int = 2048) -> Any:
    """A BE prompt SGLang is computing in chunks, *done* tokens of it so far."""
    chunked = req(rid, "be", prompt=prompt)
    chunked.prefix_len = done
    s.chunked_req = chunked
    return chunked


def test_a_chunked_prompt_the_plan_leaves_out_sits_the_pass_out() -> None:
    s = sched([req("w", "rt", prompt=50)])
    chunked = mid_prefill(s)
    drv = EngineDriver(ScriptedPolicy(Plan(prefills=[PrefillChunk("w", 50)])))  # type: ignore[arg-type]
    hooks, skip_prefill = plan_and_carry_out(drv, s, FakeBatch([]))
    assert not skip_prefill and not hooks._directive.release_chunked  # the RT prompt fits whole
    assert hooks._directive.chunk_for_continuing("c") is None
    assert s.chunked_req is chunked  # still SGLang's chunked request, its KV kept

    def prefill_pass(sched: Any, running_batch: Any, last_batch: Any) -> SimpleNamespace:
        # What SGLang does in a pass that builds a batch: the adder parks the chunk, then the
        # scheduler counts one more chunk in flight for whatever is its chunked request.
        hooks._chunk_parked(sched.chunked_req)
        sched.chunked_req.inflight_middle_chunks += 1
        return SimpleNamespace(batch_to_run=object())

    hooks.around_get_next_batch_to_run(prefill_pass, s, FakeBatch([]), None)  # type: ignore[arg-type]
    # put back: its next real chunk's result must count it done, or its first token is lost
    assert chunked.inflight_middle_chunks == 0
    assert drv.stats.parked_chunks == 1 and drv.stats.released_chunks == 0


def test_a_chunked_prompt_goes_back_to_the_queue_when_a_planned_prompt_must_be_cut() -> None:
    long_rt = req("w", "rt", prompt=1500)
    s = sched([long_rt])
    chunked = mid_prefill(s)
    released: list[str] = []
    drv = EngineDriver(ScriptedPolicy(Plan(prefills=[PrefillChunk("w", 512)])))  # type: ignore[arg-type]
    hooks = SchedulerHooks(drv, release_kv=lambda sched, r: released.append(r.rid))
    skip_prefill = hooks.replace_should_defer_prefill(s, FakeBatch([]))  # type: ignore[arg-type]
    assert not skip_prefill and hooks._directive.release_chunked
    # SGLang cuts one prompt at a time: the BE prompt makes way, its KV kept in the prefix cache
    assert released == ["c"] and s.chunked_req is None
    assert s.requeued == [("c", True)] and chunked.retraction_count == 1
    assert [r.rid for r in s.waiting_queue] == ["w", "c"]  # the planned prompt still first
    assert drv.stats.released_chunks == 1
    # the next plan sees it waiting with the 2,048 tokens it computed in the prefix cache: its
    # chunks are planned and predicted from there, as the simulator marks a prefix-cache hit
    policy = drv.policy
    drv.plan_iteration(s, FakeBatch([]))  # type: ignore[arg-type]
    waiting = {r.rid: r for r in policy.snapshots[-1].waiting}  # type: ignore[attr-defined]
    assert (waiting["c"].prefilled, waiting["c"].cached_len) == (2048, 2048)
    assert waiting["c"].prompt_left == 3000 - 2048
    assert (waiting["w"].prefilled, waiting["w"].cached_len) == (0, 0)


@pytest.mark.parametrize("case", ["prompt fits", "chunk planned too", "nothing planned"])
def test_a_chunked_prompt_stays_where_releasing_it_gains_nothing(case: str) -> None:
    s = sched([req("w", "rt", prompt=50 if case == "prompt fits" else 1500)])
    chunked = mid_prefill(s)
    prefills = [PrefillChunk("w", 50 if case == "prompt fits" else 512)]
    if case == "chunk planned too":
        prefills.append(PrefillChunk("c", 64))
    if case == "nothing planned":
        prefills = []
    drv = EngineDriver(ScriptedPolicy(Plan(prefills=prefills)))  # type: ignore[arg-type]
    released: list[str] = []
    hooks = SchedulerHooks(drv, release_kv=lambda sched, r: released.append(r.rid))
    hooks.replace_should_defer_prefill(s, FakeBatch([]))  # type: ignore[arg-type]
    assert not hooks._directive.release_chunked
    assert released == [] and s.chunked_req is chunked and s.requeued == []


def test_without_a_prefix_cache_the_chunked_prompt_runs_to_its_end_for_a_prompt_to_cut() -> None:
    # Released, its KV would be lost (computed again); left out, the planned prompt would wait
    # for it pass after pass while it sits out: it runs to its end, and the planned prompt is
    # cut after it (in the same pass when the chunk budget has room).
    s = sched([req("w", "rt", prompt=1500)])
    s.tree_cache.supports_prefix_sharing = lambda: False
    chunked = mid_prefill(s, prompt=3000, done=2048)
    drv = EngineDriver(ScriptedPolicy(Plan(prefills=[PrefillChunk("w", 512)])))  # type: ignore[arg-type]
    hooks, skip_prefill = plan_and_carry_out(drv, s, FakeBatch([]))
    directive = hooks._directive
    assert not skip_prefill and not directive.release_chunked and s.chunked_req is chunked
    assert directive.chunk_for_continuing("c") == 3000 - 2048
    assert directive.prefill_first == ("w",)  # the waiting queue holds only the planned prompt


def test_a_waiting_prompt_is_planned_from_the_prefix_the_cache_holds() -> None:
    # A conversation's next turn: its 2,000-token history is in the prefix cache, 50 tokens are
    # new. The plan (and so the latency model and its calibration) sees the 50 tokens SGLang
    # will compute, not 2,050.
    turn, fresh = req("turn", "rt", prompt=2050), req("fresh", "rt", prompt=300)
    s = sched([turn, fresh])
    held = {"turn": 2000, "fresh": 0}
    matched: list[str] = []

    def cached_prefix(sched: Any, r: Any) -> int:
        matched.append(r.rid)
        return held[r.rid]

    policy = ScriptedPolicy(Plan())
    drv = EngineDriver(policy, cached_prefix=cached_prefix)  # type: ignore[arg-type]
    drv.plan_iteration(s, FakeBatch([]))  # type: ignore[arg-type]
    waiting = {r.rid: r for r in policy.snapshots[-1].waiting}
    assert (waiting["turn"].prefilled, waiting["turn"].cached_len) == (2000, 2000)
    assert waiting["turn"].prompt_left == 50
    assert (waiting["fresh"].prefilled, waiting["fresh"].prompt_left) == (0, 300)
    assert sorted(matched) == ["fresh", "turn"]
    assert drv.stats.prefix_matches == 2 and drv.stats.waiting_cached_tokens == 2000


def test_prefix_matches_are_renewed_a_few_at_a_time_and_never_without_a_prefix_cache() -> None:
    clock = [100.0]
    waiting = [req(f"b{i}", "be", prompt=400) for i in range(100)]
    s = sched(waiting)
    held = dict.fromkeys((r.rid for r in waiting), 0)
    matched: list[str] = []

    def cached_prefix(sched: Any, r: Any) -> int:
        matched.append(r.rid)
        return held[r.rid]

    policy = ScriptedPolicy(Plan())
    drv = EngineDriver(policy, clock=lambda: clock[0], cached_prefix=cached_prefix)  # type: ignore[arg-type]
    drv.plan_iteration(s, FakeBatch([]))  # type: ignore[arg-type]
    assert len(matched) == driver.PREFIX_NEW_MATCHES  # a flood is matched over several plans
    drv.plan_iteration(s, FakeBatch([]))  # type: ignore[arg-type]
    assert len(set(matched)) == len(matched) == 100  # the rest, each once
    # another line computed the shared instructions: the renewed matches find them, in queue
    # order, a few a plan once the last match is old enough
    held.update(dict.fromkeys(held, 300))
    matched.clear()
    drv.plan_iteration(s, FakeBatch([]))  # type: ignore[arg-type]
    assert matched == []  # matched just now
    clock[0] += driver.PREFIX_RECHECK_S
    drv.plan_iteration(s, FakeBatch([]))  # type: ignore[arg-type]
    assert matched == [f"b{i}" for i in range(driver.PREFIX_RECHECKS)]
    planned = {r.rid: r.prefilled for r in policy.snapshots[-1].waiting}
    assert planned["b0"] == 300 and planned[f"b{driver.PREFIX_RECHECKS}"] == 0

    s.tree_cache.supports_prefix_sharing = lambda: False  # the bicache layout: no radix cache
    matched.clear()
    clock[0] += 10 * driver.PREFIX_RECHECK_S
    drv.plan_iteration(s, FakeBatch([]))  # type: ignore[arg-type]
    assert matched == []


def test_a_waiting_requests_state_follows_every_change_while_it_waits() -> None:
    # The mirror refreshes a waiting request only when something its state is made of changed:
    # each change below must still reach the plan.
    a, b, c = req("a", "rt", prompt=100), req("b", "be", prompt=200), req("c", "be", prompt=300)
    s = sched([a, b, c])
    held = {"a": 0, "b": 0, "c": 0}
    policy = ScriptedPolicy(Plan())
    drv = EngineDriver(policy, cached_prefix=lambda sched, r: held[r.rid])  # type: ignore[arg-type]
    drv.plan_iteration(s, FakeBatch([]))  # type: ignore[arg-type]
    first = policy.snapshots[-1]
    assert [r.rid for r in first.waiting_rt or ()] == ["a"]
    assert [r.rid for r in first.waiting_be or ()] == ["b", "c"]

    # a is admitted and decodes; b ran, was retracted with 7 tokens out and waits again; c's
    # prompt went back to the queue with 128 tokens of KV cached
    s.waiting_queue = [b, c]
    a.output_ids = [2] * 3
    b.output_ids, b.retraction_count = [2] * 7, 1
    drv.note_chunk_released("c", 128)
    drv.plan_iteration(s, FakeBatch([a]))  # type: ignore[arg-type]
    snap = policy.snapshots[-1]
    waiting = {r.rid: r for r in snap.waiting}
    assert set(waiting) == {"b", "c"} and [r.rid for r in snap.waiting_be or ()] == ["b", "c"]
    assert snap.waiting_rt == []
    assert (waiting["b"].prefill_len, waiting["b"].generated, waiting["b"].num_evictions) == (
        207,
        7,
        1,
    )
    assert (waiting["c"].prefilled, waiting["c"].prompt_left) == (128, 172)
    assert [(r.rid, r.is_running, r.generated) for r in snap.running] == [("a", True, 3)]

    # a is retracted (its outputs kept, to recompute) and waits behind the others
    s.waiting_queue = [b, c, a]
    a.retraction_count = 1
    drv.plan_iteration(s, FakeBatch([]))  # type: ignore[arg-type]
    again = {r.rid: r for r in policy.snapshots[-1].waiting}
    assert (again["a"].is_running, again["a"].prefill_len, again["a"].num_evictions) == (
        False,
        103,
        1,
    )
    assert again["b"] is waiting["b"]  # unchanged, not rebuilt
