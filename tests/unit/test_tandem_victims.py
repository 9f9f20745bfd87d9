"""tandem's victim order: BE by least progress, then the least urgent RT, never urgent RT."""

from __future__ import annotations

from backend.policy.tandem.batch import TandemBatch
from backend.policy.tandem.timing import Timer
from backend.policy.tandem.victims import evict_for, victim_order
from tests.unit.tandem_factories import LATENCY, make_request, snapshot


def test_victims_are_be_by_least_progress_then_rt_by_slack_never_urgent() -> None:
    be_far = make_request("be-far", tier="be", running=True, generated=90)
    be_new = make_request("be-new", tier="be", running=True, prefilled=20, prompt_len=100)
    be_mid = make_request("be-mid", tier="be", running=True, generated=10)
    rt_relaxed = make_request("rt-relaxed", running=True, prefilled=10)
    rt_tight = make_request("rt-tight", running=True, prefilled=10)
    rt_urgent = make_request("rt-urgent", running=True, prefilled=10)
    slack = {"rt-relaxed": 2.0, "rt-tight": 0.5, "rt-urgent": 0.01}
    order = victim_order(
        [be_far, be_new, be_mid],
        [rt_tight, rt_urgent, rt_relaxed],
        lambda r: slack[r.rid],
        iteration_s=0.03,
        include_rt=True,
    )
    assert [r.rid for r in order] == ["be-new", "be-mid", "be-far", "rt-relaxed", "rt-tight"]
    order = victim_order([be_far], [rt_relaxed], lambda r: 1.0, 0.03, include_rt=False)
    assert [r.rid for r in order] == ["be-far"]


def test_eviction_takes_the_shortest_prefix_skips_scheduled_and_requeues() -> None:
    a = make_request("a", tier="be", running=True, prompt_len=100)
    b = make_request("b", tier="be", running=True, prompt_len=100)
    c = make_request("c", tier="be", running=True, prompt_len=100)
    batch = TandemBatch(snapshot(running=[a, b, c], kv_capacity=350), Timer(LATENCY))
    assert batch.add_decode(a)
    requeued: list[str] = []
    assert evict_for(batch, 200, [a, b, c], lambda r: requeued.append(r.rid))
    assert batch.evictions == ["b", "c"] == requeued  # a is scheduled: never a victim
    assert not evict_for(batch, 10_000, [a], lambda r: requeued.append(r.rid))
    assert batch.evictions == ["b", "c"]
