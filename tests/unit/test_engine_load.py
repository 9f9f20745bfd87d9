"""The engine's live state: the report an engine builds from its snapshot (feasibility.load_of), the
scheduler's hand-off to the long polls (LoadBoard), the query both engines read, and the
gateway watcher's bookkeeping (backlog of sent requests, restarts, missed iterations)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import msgspec
import pytest

from backend.policy.feasibility import Backlog, load_of
from backend.policy.load_report import NO_CALIBRATION, policy_factors
from backend.policy.types import ReqState, Snapshot
from backend.sglang_ext.load_board import LoadBoard
from common.wire import (
    ITERATION_LOG_SIZE,
    MAX_LOAD_WAIT_S,
    EngineLoad,
    RecentIterations,
    TenantLoad,
    load_query,
)
from gateway.engine.load import SENT_KEPT_S, LoadWatcher


def state(
    rid: str,
    tier: str,
    *,
    prompt: int,
    prefilled: int,
    out: int = 0,
    tenant: str = "",
    weight: float = 1.0,
) -> ReqState:
    running = prefilled > 0
    return ReqState(
        rid=rid,
        tier=tier,  # type: ignore[arg-type]
        arrival_s=0.0,
        prompt_len=prompt,
        max_new_tokens=100,
        prefill_len=prompt,
        prefilled=prefilled,
        generated=out,
        kv_tokens=prefilled + out,
        is_running=running,
        tenant_id=tenant,
        tenant_weight=weight,
    )


def test_report_sums_the_snapshot_by_tier_and_state() -> None:
    waiting = [
        state("w1", "rt", prompt=100, prefilled=0, tenant="a"),
        state("w3", "rt", prompt=30, prefilled=0, tenant="b", weight=2.0),
        state("w2", "be", prompt=50, prefilled=0),
    ]
    running = [
        state("r1", "rt", prompt=10, prefilled=10, out=5, tenant="a"),  # decoding: context 15
        # mid-prefill: 136 left, counts as waiting
        state("r2", "rt", prompt=200, prefilled=64, tenant="b", weight=2.0),
        state("b1", "be", prompt=20, prefilled=20, out=2),  # decoding: context 22, KV 22
        state("b2", "be", prompt=40, prefilled=8),  # mid-prefill BE: KV 8
    ]
    snap = Snapshot(
        now_s=1.0,
        waiting=waiting,
        running=running,
        kv_capacity_tokens=1000,
        kv_free_tokens=700,
        kv_evictable_tokens=100,
        last_iteration_s=0.02,
        max_running=64,
        max_prefill_tokens=512,
    )
    load = load_of(
        snap, iteration=7, at_unix_s=123.0, iteration_s=0.02, latency_factors=(1.1, 1.2, 1.3)
    )
    assert load == EngineLoad(
        iteration=7,
        at_unix_s=123.0,
        iteration_s=0.02,
        num_rt_waiting=3,
        rt_waiting_prompt_tokens=100 + 30 + 136,
        num_rt_running=1,
        rt_context_tokens=15,
        num_rt_prefilling=1,  # r2: holds a slot
        max_running_requests=64,
        num_be_waiting=2,
        be_waiting_prompt_tokens=50 + 32,
        num_be_running=1,
        be_context_tokens=22,
        kv_used_tokens=300,
        kv_capacity_tokens=1000,
        be_kv_tokens=30,
        max_prefill_tokens=512,
        latency_factors=(1.1, 1.2, 1.3),
        rt_by_tenant=(  # in the order first seen: running, then waiting
            TenantLoad(
                tenant_id="a", weight=1.0, num_waiting=1, waiting_prompt_tokens=100, num_running=1
            ),
            TenantLoad(tenant_id="b", weight=2.0, num_waiting=2, waiting_prompt_tokens=166),
        ),
    )


def test_factors_come_from_the_policys_calibration_or_default_to_one() -> None:
    assert policy_factors(SimpleNamespace()) == NO_CALIBRATION
    calibrated = SimpleNamespace(calibration=SimpleNamespace(factors=(1.5, 0.9, 1.1)))
    assert policy_factors(calibrated) == (1.5, 0.9, 1.1)


def test_load_query_defaults_caps_and_refuses() -> None:
    assert load_query(None, None) == (-1, 0.0)
    assert load_query("12", "0.5") == (12, 0.5)
    assert load_query("3", "1e9") == (3, MAX_LOAD_WAIT_S)
    for after, wait in (("x", "1"), ("1", "soon"), ("1", "-1"), ("1", "nan")):
        with pytest.raises(ValueError):
            load_query(after, wait)


def test_board_answers_at_once_when_newer_else_after_the_wait() -> None:
    board = LoadBoard(EngineLoad(iteration=0, at_unix_s=0.0))
    assert board.wait_after(-1, 10.0).iteration == 0  # already past: no wait
    assert board.wait_after(0, 0.0).iteration == 0  # nothing newer, no wait asked: current
    got: list[EngineLoad] = []
    waiter = threading.Thread(target=lambda: got.append(board.wait_after(0, 30.0)))
    waiter.start()
    board.publish(EngineLoad(iteration=1, at_unix_s=1.0))
    waiter.join(timeout=30.0)
    assert not waiter.is_alive()
    assert got[0].iteration == 1


def test_board_keeps_every_iteration_for_an_observer_that_falls_behind() -> None:
    """A `/load` poll sees only the newest iteration; `/iterations` hands over each one since
    the caller's last, and says how many it no longer keeps."""
    board = LoadBoard(EngineLoad(iteration=0, at_unix_s=0.0))
    assert board.iterations_after(-1, 0.0).iterations == []  # nothing has run yet
    for i in range(1, 6):  # a long iteration, then four short ones
        board.publish(
            EngineLoad(
                iteration=i,
                at_unix_s=float(i),
                iteration_s=0.8 if i == 1 else 0.02,
                predicted_iteration_s=0.1,
            )
        )
    log = board.iterations_after(2, 0.0)
    assert [r.iteration for r in log.iterations] == [3, 4, 5]
    assert [r.iteration_s for r in log.iterations] == [0.02, 0.02, 0.02]
    assert log.missed == 0
    assert board.iterations_after(5, 0.0).iterations == []
    for i in range(6, 6 + ITERATION_LOG_SIZE + 10):
        board.publish(EngineLoad(iteration=i, at_unix_s=float(i)))
    behind = board.iterations_after(5, 0.0)
    assert len(behind.iterations) == ITERATION_LOG_SIZE
    assert behind.missed == 10
    encoded = msgspec.json.encode(behind)  # what the control endpoint sends
    assert msgspec.json.decode(encoded, type=RecentIterations) == behind


def load(iteration: int, at_unix_s: float) -> EngineLoad:
    return EngineLoad(iteration=iteration, at_unix_s=at_unix_s)


def totals(backlog: Backlog) -> tuple[int, int]:
    return backlog.num_requests, backlog.prompt_tokens


def test_backlog_counts_sends_until_a_later_report_two_iterations_on() -> None:
    now = time.time()
    watcher = LoadWatcher("e")
    watcher.sent(100, now - 1.0)  # before any report: counted
    assert totals(watcher.backlog()) == (1, 100)
    watcher.update(load(5, now - 0.5))
    # Taken after the send, but the engine may not have queued it yet: iteration 5 ≥ -1 + 2
    # holds (the first send saw no report), so it is dropped.
    assert totals(watcher.backlog()) == (0, 0)

    watcher.sent(30, now - 0.4)  # seen: iteration 5
    watcher.update(load(6, now - 0.3))  # one iteration later: maybe not queued yet
    assert totals(watcher.backlog()) == (1, 30)
    watcher.update(load(7, now - 0.2))  # two later and taken after the send: shown
    assert totals(watcher.backlog()) == (0, 0)

    watcher.sent(40, now - 0.1)  # seen: iteration 7
    watcher.update(load(9, now - 0.15))  # two iterations on, but taken before the send
    assert totals(watcher.backlog()) == (1, 40)
    assert watcher.missed_iterations == 1  # iteration 8 never reported


def test_a_request_that_ran_and_finished_on_an_idle_engine_leaves_the_backlog() -> None:
    """A one-token chat on an idle engine runs one iteration; the engine then runs none, so
    two iterations on never come (it stayed in the backlog for SENT_KEPT_S, and the idle
    engine's forecasts saw a request ahead)."""
    now = time.time()
    watcher = LoadWatcher("e")
    watcher.update(load(10, now - 5.0))
    watcher.sent(20, now - 1.0)  # seen: iteration 10
    ran = EngineLoad(iteration=11, at_unix_s=now - 0.9, iteration_s=0.05)  # started after it
    watcher.update(ran)  # and left the engine idle: it ran in it and finished
    assert totals(watcher.backlog()) == (0, 0)

    watcher.sent(20, now - 0.5)  # seen: 11
    # one iteration on, idle, but started before the send: it may not have been queued yet
    watcher.update(EngineLoad(iteration=12, at_unix_s=now - 0.45, iteration_s=0.1))
    assert totals(watcher.backlog()) == (1, 20)
    # one iteration on and started after the send, but the engine is not idle: it may be the
    # one waiting, or not queued yet — two iterations on tell
    watcher.sent(30, now - 0.4)  # seen: 12
    busy = EngineLoad(iteration=13, at_unix_s=now - 0.3, iteration_s=0.05, num_rt_waiting=1)
    watcher.update(busy)
    assert totals(watcher.backlog()) == (1, 30)  # the first is two iterations on: shown
    watcher.update(EngineLoad(iteration=14, at_unix_s=now - 0.2, iteration_s=0.05))
    assert totals(watcher.backlog()) == (0, 0)


def test_restart_and_outage_forget_the_backlog_and_old_sends_expire() -> None:
    now = time.time()
    watcher = LoadWatcher("e")
    watcher.update(load(50, now - 1.0))
    watcher.sent(10, now)
    watcher.update(load(50, now))  # an idle poll's answer: same iteration, nothing new
    assert watcher.reports == 1
    watcher.update(load(2, now))  # the counter went back: a new engine
    assert watcher.latest is not None and watcher.latest.iteration == 2
    assert totals(watcher.backlog()) == (0, 0)
    assert watcher.outages == 1
    watcher.sent(10, now)
    watcher.lost()
    assert watcher.latest is None and totals(watcher.backlog()) == (0, 0)
    watcher.sent(10, now - SENT_KEPT_S - 1.0)  # no report for a minute: forgotten
    watcher.sent(20, now)
    assert totals(watcher.backlog()) == (1, 20)


def test_backlog_is_split_by_tenant_with_its_weight() -> None:
    now = time.time()
    watcher = LoadWatcher("e")
    assert watcher.backlog(now) == Backlog()
    watcher.sent(100, now, "a", 1.0)
    watcher.sent(30, now, "b", 2.0)
    watcher.sent(50, now, "a", 1.0)
    assert watcher.backlog(now) == Backlog(
        3,
        180,
        (
            TenantLoad(tenant_id="a", weight=1.0, num_waiting=2, waiting_prompt_tokens=150),
            TenantLoad(tenant_id="b", weight=2.0, num_waiting=1, waiting_prompt_tokens=30),
        ),
    )


def test_the_split_travels_on_the_wire_and_older_reports_still_decode() -> None:
    load = EngineLoad(
        iteration=3,
        at_unix_s=1.0,
        num_rt_waiting=1,
        rt_waiting_prompt_tokens=40,
        rt_by_tenant=(
            TenantLoad(
                tenant_id="a", weight=2.0, num_waiting=1, waiting_prompt_tokens=40, num_running=2
            ),
        ),
    )
    assert msgspec.json.decode(msgspec.json.encode(load), type=EngineLoad) == load
    older = b'{"iteration": 3, "at_unix_s": 1.0, "num_rt_waiting": 1}'
    assert msgspec.json.decode(older, type=EngineLoad).rt_by_tenant == ()
