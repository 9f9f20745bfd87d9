"""The batch runner's feed: pilot first, re-plans, bounds, and resuming after a restart."""

from __future__ import annotations

import random

import pytest

from backend.policy.batch_order.feed import BatchFeed, FeedSettings, choose_pilot
from backend.policy.batch_order.tree import OrderItem


def items(n: int, seed: int = 0) -> tuple[list[OrderItem], dict[int, int]]:
    rng = random.Random(seed)
    out: list[OrderItem] = []
    lengths: dict[int, int] = {}
    for i in range(n):
        kind = rng.choice(("short", "long", "shared"))
        if kind == "shared":
            path = [1, 2, 3] * 50 + [i]
            cap, d = 4, 2
        elif kind == "long":
            path = [1000 + i, 7]
            cap, d = 8192, rng.randint(2000, 6000)
        else:
            path = [5000 + i] * 40
            cap, d = 512, rng.randint(20, 300)
        out.append(OrderItem(index=i, path=path, prompt_len=len(path), max_output_len=cap))
        lengths[i] = d
    return out, lengths


def drain(feed: BatchFeed, lengths: dict[int, int], rng: random.Random) -> list[int]:
    """Runs the feed to the end, finishing random in-flight lines; returns the send order."""
    sent: list[int] = []
    running: list[int] = []
    while True:
        while (index := feed.next()) is not None:
            sent.append(index)
            running.append(index)
        if not running:
            assert feed.exhausted
            return sent
        done = running.pop(rng.randrange(len(running)))
        feed.finished(done, lengths[done])


@pytest.mark.parametrize("ordering", ["fcfs", "dfs", "blend"])
def test_every_line_is_sent_exactly_once(ordering: str) -> None:
    lines, lengths = items(300)
    feed = BatchFeed(
        lines,
        FeedSettings(
            ordering=ordering,
            memory_tokens=5_000,  # type: ignore[arg-type]
            max_inflight=16,
            pilot_fraction=0.05,
        ),
    )
    sent = drain(feed, lengths, random.Random(1))
    assert sorted(sent) == list(range(300))
    assert feed.in_flight == 0


def test_the_pilot_goes_first_covers_every_cap_class_and_triggers_re_plans() -> None:
    lines, lengths = items(300)
    feed = BatchFeed(
        lines,
        FeedSettings(
            memory_tokens=50_000, max_inflight=400, pilot_fraction=0.05, pilot_max_lines=32
        ),
    )
    pilot = feed.pilot
    assert len(pilot) == 15
    assert {lines[i].max_output_len for i in pilot} == {4, 512, 8192}
    first = [feed.next() for _ in range(len(pilot))]
    assert sorted(i for i in first if i is not None) == pilot
    assert feed.plans == 1
    for index in pilot:
        feed.finished(index, lengths[index])
    assert feed.plans == 4  # re-planned at a quarter, half and all of the pilot
    # the long class is now estimated from its samples, not from its cap
    long_lines = [i for i, it in enumerate(lines) if it.max_output_len == 8192 and i not in pilot]
    sampled = [lengths[i] for i in pilot if lines[i].max_output_len == 8192]
    assert feed.estimate(long_lines[0]) == pytest.approx(sum(sampled) / len(sampled))


def test_in_flight_lines_never_exceed_the_bound() -> None:
    lines, _ = items(200)
    feed = BatchFeed(lines, FeedSettings(memory_tokens=1e9, max_inflight=7))
    sent = [feed.next() for _ in range(20)]
    assert len([s for s in sent if s is not None]) == 7
    assert feed.in_flight == 7


def test_blend_starts_both_compute_and_memory_heavy_lines_early() -> None:
    lines, lengths = items(300)
    feed = BatchFeed(
        lines,
        FeedSettings(ordering="blend", memory_tokens=60_000, max_inflight=40, pilot_fraction=0.05),
    )
    sent = drain(feed, lengths, random.Random(2))
    early = sent[len(feed.pilot) : len(feed.pilot) + 25]
    caps = {lines[i].max_output_len for i in early}
    assert 8192 in caps and (4 in caps or 512 in caps)
    dfs = BatchFeed(
        lines,
        FeedSettings(ordering="dfs", memory_tokens=60_000, max_inflight=40, pilot_fraction=0.05),
    )
    assert sorted(drain(dfs, lengths, random.Random(2))) == sorted(sent)


def test_after_a_restart_finished_lines_are_samples_not_work() -> None:
    lines, lengths = items(100)
    finished = {i: lengths[i] for i in range(40)}
    rest = [it for it in lines if it.index >= 40]
    feed = BatchFeed(rest, FeedSettings(memory_tokens=1e6, max_inflight=200), known_output=finished)
    assert feed.pilot == []  # the finished lines already sampled the batch
    sent = drain(feed, lengths, random.Random(3))
    assert sorted(sent) == list(range(40, 100))


def test_choose_pilot_is_small_spread_and_deterministic() -> None:
    lines, _ = items(1000)
    pilot = choose_pilot(lines, 0.01, 32)
    assert len(pilot) == 10 and pilot == choose_pilot(lines, 0.01, 32)
    assert choose_pilot(lines, 0.0, 32) == [] and choose_pilot([], 0.5, 32) == []
    assert len(choose_pilot(lines, 0.5, 32)) == 32


@pytest.mark.parametrize("ordering", ["fcfs", "dfs", "blend"])
def test_a_deferred_re_plan_drafted_while_lines_go_out_sends_every_line_once(
    ordering: str,
) -> None:
    """The runner drafts re-plans in a worker thread (`defer_replans`): the feed keeps handing
    out lines from its current plan meanwhile, and the adopted plan skips those."""
    lines, lengths = items(300)
    settings = FeedSettings(
        ordering=ordering,  # type: ignore[arg-type]
        memory_tokens=50_000,
        max_inflight=16,
        pilot_fraction=0.05,
    )
    feed = BatchFeed(lines, settings, defer_replans=True)
    rng = random.Random(2)
    sent: list[int] = []
    running: list[int] = []
    drafts = 0
    while True:
        while (index := feed.next()) is not None:
            sent.append(index)
            running.append(index)
        if not running:
            break
        done = running.pop(rng.randrange(len(running)))
        feed.finished(done, lengths[done])
        if feed.replan_due:
            draft = feed.draft_replan()  # the snapshot is taken now...
            while len(running) < 8 and (index := feed.next()) is not None:
                sent.append(index)  # ...lines go out while the draft is computed...
                running.append(index)
            feed.adopt(draft())  # ...and the adopted plan leaves them out
            drafts += 1
    assert drafts == 3  # a quarter, half and all of the pilot
    assert sorted(sent) == list(range(300)) and feed.exhausted and feed.in_flight == 0


def test_a_deferred_re_plan_is_the_plan_the_feed_would_make_at_once() -> None:
    lines, lengths = items(200)
    settings = FeedSettings(memory_tokens=50_000, max_inflight=400, pilot_fraction=0.05)
    at_once, deferred = BatchFeed(lines, settings), BatchFeed(lines, settings, defer_replans=True)
    pilot = [at_once.next() for _ in at_once.pilot]
    assert pilot == [deferred.next() for _ in deferred.pilot]
    for index in pilot:
        assert index is not None
        at_once.finished(index, lengths[index])
        deferred.finished(index, lengths[index])
    assert deferred.replan_due and deferred.plans == 1 and at_once.plans == 4  # 3 re-plans
    deferred.adopt(deferred.draft_replan()())
    assert deferred.planned_order() == at_once.planned_order()
