"""Decode triage (`use_decode_triage`): when the engine can no longer run every RT decode at the
pace its TPOT target needs (an engine suddenly slower than the one the streams were admitted
on), the streams hardest to save wait so that the others keep their mean TPOT."""

from __future__ import annotations

from backend.policy.latency import LatencyModel
from backend.policy.tandem.config import TandemConfig
from backend.policy.tandem.policy import TandemPolicy
from backend.policy.types import ReqState
from tests.unit.tandem_factories import NOW, make_request, snapshot

PER_DECODE = LatencyModel([0.010, 0.0, 0.0, 0.0, 0.0, 0.0, 0.010, 0.0, 0.0])
"""10 ms an iteration and 10 ms per decode: ten decodes take 110 ms, over a 100 ms TPOT."""


def policy(**options: object) -> TandemPolicy:
    return TandemPolicy(PER_DECODE, config=TandemConfig(**options))  # type: ignore[arg-type]


def stream(rid: str, *, generated: int, ran_s: float, max_new_tokens: int = 100) -> ReqState:
    """An RT stream (TPOT target 100 ms) that emitted `generated` tokens over the last
    `ran_s` seconds, its last one just now."""
    r = make_request(
        rid, running=True, generated=generated, max_new_tokens=max_new_tokens, arrival_s=0.0
    )
    r.first_token_s = NOW - ran_s
    return r


def banked(rid: str) -> ReqState:
    """Half way, at 50 ms a token so far: the rest may take 149 ms a token."""
    return stream(rid, generated=50, ran_s=49 * 0.05)


def fresh(rid: str) -> ReqState:
    """Its first token just now: the rest must keep 100 ms a token."""
    return stream(rid, generated=1, ran_s=0.0)


def decoded(plan_decodes: list[str]) -> set[str]:
    return set(plan_decodes)


def test_streams_that_keep_their_pace_all_run() -> None:
    running = [banked(f"b{i}") for i in range(5)] + [fresh(f"f{i}") for i in range(3)]
    assert len(policy().plan(snapshot(running=running)).decodes) == 8  # 90 ms: all in pace


def test_the_hardest_streams_wait_so_that_the_others_keep_their_mean() -> None:
    # ten decodes take 110 ms: no fresh stream keeps 100 ms a token beside them all
    running = [banked(f"b{i}") for i in range(5)] + [fresh(f"f{i}") for i in range(5)]
    plan = policy(eps_init=0.1).plan(snapshot(running=running))
    kept = decoded(plan.decodes)
    # two fresh ones wait: eight decodes take 90 ms, within (1 − ε) of 100
    assert len(kept) == 8 and {f"b{i}" for i in range(5)} <= kept
    assert plan.predicted_s is not None and plan.predicted_s <= 0.9 * 0.1 + 1e-9
    # off: every stream runs, and every fresh one falls behind
    assert len(policy(use_decode_triage=False).plan(snapshot(running=running)).decodes) == 10


def test_a_stream_no_iteration_can_save_rides_only_where_the_others_keep_pace() -> None:
    # 90 of 100 tokens left with 0.9 s to go: 10 ms a token, less than its own decode alone
    lost = stream("lost", generated=10, ran_s=9.0)
    crowded = [banked(f"b{i}") for i in range(5)] + [fresh(f"f{i}") for i in range(3)]
    kept = decoded(policy(eps_init=0.1).plan(snapshot(running=[lost, *crowded])).decodes)
    assert kept == {r.rid for r in crowded}  # with it, 100 ms: the fresh ones would fall behind
    roomy = [banked(f"b{i}") for i in range(5)]
    kept = decoded(policy(eps_init=0.1).plan(snapshot(running=[lost, *roomy])).decodes)
    assert "lost" in kept  # 70 ms with it: no one falls behind, so it runs
    # nothing left to save: every stream runs, as fast as the engine can
    hopeless = [stream(f"l{i}", generated=10, ran_s=9.0) for i in range(12)]
    assert len(policy().plan(snapshot(running=hopeless)).decodes) == 12
