"""Weighted virtual token counters (backend.policy.fair_share) on hand-built states: charges
divide by the weight, the least-served backlogged tenant goes next, a tenant coming back from
idle is lifted (no banked credit), and the interleaving of per-tenant streams follows the
counters and what it offered."""

from __future__ import annotations

import pytest

from backend.policy.fair_share import FairShare, interleave


def test_charges_are_tokens_over_weight_and_the_least_served_goes_next() -> None:
    fair = FairShare()
    fair.charge("a", 300, weight=3.0)
    fair.charge("b", 150, weight=1.0)
    assert fair.counter("a") == 100 and fair.counter("b") == 150
    assert fair.counter("never-seen") == 0
    assert fair.pick(["b", "a"]) == "a"
    assert fair.pick(["b", "never-seen"]) == "never-seen"
    assert fair.pick([]) is None
    fair.charge("c", 100)
    assert fair.pick(["c", "a"]) == "c"  # a tie goes to the first one offered
    with pytest.raises(ValueError, match="weight must be > 0"):
        fair.charge("a", 1, weight=0.0)


def test_a_tenant_back_from_idle_is_lifted_to_the_least_backlogged_counter() -> None:
    fair = FairShare()
    for tenant, served in (("busy", 500), ("light", 300), ("idle", 20)):
        fair.charge(tenant, served)
    fair.set_backlogged("light")
    fair.set_backlogged("busy")  # above light's 300: kept
    assert fair.counter("busy") == 500
    fair.set_backlogged("idle")  # was not backlogged: 20 → min(300, 500)
    assert fair.counter("idle") == 300
    fair.set_backlogged("idle")  # already backlogged: no change
    assert fair.counter("idle") == 300
    fair.charge("ahead", 900)
    fair.set_backlogged("ahead")  # a counter above the floor is never lowered
    assert fair.counter("ahead") == 900
    newcomer = "new"
    fair.set_backlogged(newcomer)  # a tenant never seen starts level, not at 0
    assert fair.counter(newcomer) == 300


def test_with_nobody_backlogged_the_floor_is_the_last_tenant_to_go_idle() -> None:
    fair = FairShare()
    fair.set_backlogged("a")
    fair.charge("a", 1000)
    fair.set_idle("a")
    fair.set_idle("a")  # idempotent
    assert fair.backlogged == set()
    fair.set_backlogged("b")  # idled (or never came) while a was served: no banked credit
    assert fair.counter("b") == 1000


def test_two_backlogged_tenants_are_served_tokens_in_the_ratio_of_their_weights() -> None:
    fair = FairShare()
    weights = {"gold": 2.0, "bronze": 1.0}
    served = dict.fromkeys(weights, 0)
    for tenant in weights:
        fair.set_backlogged(tenant)
    for _ in range(300):  # unit requests of 10 tokens, both always backlogged
        tenant = fair.pick(weights)
        assert tenant is not None
        fair.charge(tenant, 10, weights[tenant])
        served[tenant] += 10
    assert served == {"gold": 2000, "bronze": 1000}


def test_interleave_counts_what_it_offered_so_a_window_is_interleaved_too() -> None:
    fair = FairShare()
    fair.charge("heavy", 50)
    streams = {"heavy": iter(["h1", "h2", "h3"]), "light": iter(["l1", "l2", "l3"])}
    # each item would cost 30: light 0 → l1 (30), light 30 < 50 → l2 (60), heavy 50 → h1
    # (80), light 60 → l3 (90), then heavy's rest in its order
    order = list(interleave(streams, fair, lambda item: 30.0))
    assert order == ["l1", "l2", "h1", "l3", "h2", "h3"]
    assert fair.counter("light") == 0  # offering charges nothing: serving does


def test_interleave_carries_the_offered_tally_across_merges() -> None:
    fair = FairShare()
    offered: dict[str, float] = {}
    first = list(interleave({"a": iter([1]), "b": iter([])}, fair, float, offered))
    assert first == [1] and offered == {"a": 1.0}
    second = interleave({"a": iter([2]), "b": iter([3])}, fair, float, offered)
    assert list(second) == [3, 2]  # a was offered 1 already: b first


def test_interleave_of_one_stream_is_that_stream() -> None:
    assert list(interleave({"only": iter([3, 1, 2])}, FairShare(), float)) == [3, 1, 2]
    assert list(interleave({}, FairShare(), float)) == []
