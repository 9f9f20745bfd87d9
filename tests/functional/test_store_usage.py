"""Usage records and output-length history on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import random
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from gateway.store import Store, UsageRecord

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def make_usage(
    request_id: str, tenant_id: str = "ten_a", *, start_s: float = 0.0, **fields: object
) -> UsageRecord:
    created = T0 + timedelta(seconds=start_s)
    values: dict[str, object] = {
        "request_id": request_id,
        "tenant_id": tenant_id,
        "tier": "rt",
        "model": "tandem-tiny",
        "endpoint": "chat",
        "status": "ok",
        "http_status": 200,
        "created_at": created,
        "finished_at": created + timedelta(seconds=1),
    }
    values.update(fields)
    return UsageRecord(**values)  # type: ignore[arg-type]


async def test_usage_round_trips_every_field(store: Store) -> None:
    record = make_usage(
        "r1",
        key_id="key_1",
        tier="be",
        endpoint="completions",
        stream=True,
        prompt_tokens=512,
        completion_tokens=128,
        queue_ms=3.5,
        ttft_ms=120.0,
        tbt_max_ms=80.0,
        tpot_ms=22.0,
        e2e_ms=2900.0,
        status="aborted",
        http_status=499,
        error="client went away",
        slo_met=False,
        admission="admitted",
        engine="http://10.0.0.11:30000#dp1",
    )
    await store.insert_usage([record])
    [got] = await store.latest_requests("ten_a", 10)
    assert got.id is not None
    assert got == msgspec.structs.replace(record, id=got.id)
    assert got.tbt_mean_ms == 22.0  # not a column: derived from tpot_ms
    assert got.created_at.tzinfo is not None


async def test_latest_requests_newest_first_with_limit_and_tenant(store: Store) -> None:
    await store.insert_usage(
        [make_usage(f"a{i}", "ten_a", start_s=i) for i in range(5)]
        + [make_usage(f"b{i}", "ten_b", start_s=i + 0.5) for i in range(3)]
    )
    assert [r.request_id for r in await store.latest_requests("ten_a", 3)] == ["a4", "a3", "a2"]
    assert [r.request_id for r in await store.latest_requests("ten_b", 10)] == ["b2", "b1", "b0"]
    assert [r.request_id for r in await store.latest_requests(None, 4)] == ["a4", "a3", "b2", "a2"]
    assert await store.latest_requests("ten_c", 10) == []
    assert await store.latest_requests(None, 0) == []


async def test_latest_requests_of_one_engine(store: Store) -> None:
    """The request log of one replica (`GET /admin/v1/requests?engine=`), with the tenant's
    filter or without."""
    engines = ("http://127.0.0.1:30000", "http://127.0.0.1:30001")
    await store.insert_usage(
        [make_usage(f"a{i}", "ten_a", start_s=i, engine=engines[i % 2]) for i in range(6)]
        + [make_usage("b0", "ten_b", start_s=2.5, engine=engines[1])]
        + [make_usage("refused", "ten_a", start_s=9)]  # never placed: no engine
    )
    latest = await store.latest_requests(None, 10, engines[1])
    assert [r.request_id for r in latest] == ["a5", "a3", "b0", "a1"]
    assert {r.engine for r in latest} == {engines[1]}
    assert [r.request_id for r in await store.latest_requests("ten_a", 2, engines[0])] == [
        "a4",
        "a2",
    ]
    assert await store.latest_requests(None, 10, "http://10.9.9.9:30000") == []
    assert (await store.latest_requests("ten_a", 1))[0].engine is None


async def test_bulk_insert_of_many_records_and_of_none(store: Store) -> None:
    await store.insert_usage([])
    await store.insert_usage([make_usage(f"r{i}", start_s=i) for i in range(500)])
    latest = await store.latest_requests(None, 1000)
    assert len(latest) == 500 and latest[0].request_id == "r499"
    assert len({r.id for r in latest}) == 500


async def test_length_window_keeps_the_newest_per_key(store: Store) -> None:
    await store.append_lengths([("a", n, 10) for n in range(1, 6)], window=3)
    assert await store.length_history("a", 10) == [3, 4, 5]

    # Another key in the same batch is pruned on its own; "a" keeps only its newest 3.
    await store.append_lengths([("b", 100, None), ("a", 6, None), ("b", 200, 7)], window=3)
    assert await store.length_history("a", 10) == [4, 5, 6]
    assert await store.length_history("b", 10) == [100, 200]
    assert await store.length_history("a", 2) == [5, 6]
    assert await store.length_history("nobody", 5) == []


async def test_length_window_prunes_a_batch_larger_than_itself(store: Store) -> None:
    await store.append_lengths([("k", n, None) for n in range(50)], window=4)
    assert await store.length_history("k", 100) == [46, 47, 48, 49]


async def test_untouched_keys_are_not_pruned_by_a_smaller_window(store: Store) -> None:
    await store.append_lengths([("old", n, None) for n in range(5)], window=10)
    await store.append_lengths([("new", 1, None)], window=2)
    assert await store.length_history("old", 100) == [0, 1, 2, 3, 4]


async def test_length_sync_reads_changed_keys_and_their_windows(store: Store) -> None:
    # What gateway.engine.control.LengthSync sends: every key for a new engine (after id 0),
    # then only the keys with rows newer than the last sync.
    await store.append_lengths([("x", n, None) for n in range(6)], window=100)
    await store.append_lengths([("y", 9, None)], window=100)
    keys, newest = await store.length_keys_changed(0)
    assert keys == {"x", "y"}
    assert await store.length_histories(keys, 3) == {"x": [3, 4, 5], "y": [9]}
    assert await store.length_keys_changed(newest) == (set(), newest)
    await store.append_lengths([("y", 4, None)], window=100)
    keys, _ = await store.length_keys_changed(newest)
    assert keys == {"y"}
    assert await store.length_histories(keys, 100) == {"y": [9, 4]}


async def test_window_must_be_positive(store: Store) -> None:
    with pytest.raises(ValueError, match="window"):
        await store.append_lengths([("x", 1, None)], window=0)


async def test_concurrent_writers_lose_nothing(store: Store) -> None:
    # The usage writer, the length writer and admin calls share one pool; on SQLite they must
    # wait for each other (busy timeout), not fail with "database is locked".
    async def writer(i: int) -> None:
        await store.insert_usage([make_usage(f"r{i}-{j}", start_s=j) for j in range(50)])
        await store.append_lengths([(f"k{i % 2}", j, None) for j in range(30)], window=10)

    await asyncio.gather(*(writer(i) for i in range(12)))
    assert len(await store.latest_requests(None, 10_000)) == 12 * 50
    # Appends running at once on PostgreSQL draw row ids from one sequence in turn, so their
    # rows interleave (seen in CI: [21, 29, 22, …]); the window holds ten of them all the same
    history = await store.length_history("k0", 10)
    assert len(history) == 10 and set(history) <= set(range(30))
    # and the next append's rows are the newest, in order
    await store.append_lengths([("k0", j, None) for j in range(100, 110)], window=10)
    assert await store.length_history("k0", 10) == list(range(100, 110))


async def test_a_write_cancelled_midway_never_leaves_the_database_locked(store: Store) -> None:
    """A request handler whose client goes away, or a batch line being cancelled, cancels its
    task while the store writes; before writes ran to their end, about one such cancel in 20 on
    SQLite left a connection holding the write lock, and every later write failed "database is
    locked"."""
    records = [make_usage(f"bulk{i}", start_s=i) for i in range(2000)]
    rng = random.Random(7)
    for trial in range(40):
        batch = [msgspec.structs.replace(r, request_id=f"{r.request_id}-{trial}") for r in records]
        writer = asyncio.create_task(store.insert_usage(batch))
        await asyncio.sleep(rng.random() * 0.03)  # cancelled anywhere: before, in, after commit
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
        # the next write gets the lock (a held one fails it after the busy timeout)
        await store.insert_usage([make_usage(f"next-{trial}")])
    assert len(await store.latest_requests("ten_a", 1000)) >= 40
