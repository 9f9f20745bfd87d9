"""The batch store on SQLite and PostgreSQL: files, batches and the per-line state that makes a
batch resumable (a line exists once; running lines go back to pending after a crash)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.batch.output import build_files
from gateway.batch.store import BatchStore
from gateway.batch.types import ItemResult, NewItem
from gateway.store import Quota, Slo, Store
from gateway.store.db import session_factory
from gateway.store.models import BatchItemRow


async def tenant(store: Store, name: str) -> str:
    return (await store.create_tenant(name, "be", Slo(), Quota())).id


def items(n: int) -> list[NewItem]:
    return [
        NewItem(
            line_no=i + 1, custom_id=f"c{i}", method="POST", url="/v1/chat/completions", body="{}"
        )
        for i in range(n)
    ]


async def new_batch(batches: BatchStore, tenant_id: str, n: int) -> str:
    file = await batches.create_file(tenant_id, "batch", "in.jsonl", b"x\n" * n, n)
    batch = await batches.create_batch(
        tenant_id=tenant_id,
        key_id=None,
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        window=timedelta(hours=24),
        deadline_at=None,
        metadata={"k": "v"},
        request_total=n,
    )
    assert batch.status == "validating" and batch.metadata == {"k": "v"}
    assert await batches.start(batch.id, items(n), "tandem-tiny", None) == "in_progress"
    return batch.id


async def test_files_belong_to_their_tenant(store: Store, store_engine: AsyncEngine) -> None:
    batches = BatchStore(session_factory(store_engine))
    alice, bob = await tenant(store, "alice"), await tenant(store, "bob")
    ids = [
        (await batches.create_file(alice, "batch", f"f{i}.jsonl", b"{}\n", 1)).id for i in range(3)
    ]
    assert await batches.get_file(bob, ids[0]) is None
    assert await batches.file_content(bob, ids[0]) is None
    assert await batches.file_content(alice, ids[0]) == b"{}\n"
    first, more = await batches.list_files(alice, "batch", 2, None)
    rest, more2 = await batches.list_files(alice, "batch", 2, first[-1].id)
    assert more and not more2
    assert sorted(f.id for f in first + rest) == sorted(ids)
    assert (await batches.list_files(bob, None, 10, None)) == ([], False)
    assert not await batches.delete_file(bob, ids[0])
    assert await batches.delete_file(alice, ids[0])
    assert await batches.get_file(alice, ids[0]) is None


async def test_a_line_exists_once_and_resumes_after_a_crash(
    store: Store, store_engine: AsyncEngine
) -> None:
    batches = BatchStore(session_factory(store_engine))
    batch_id = await new_batch(batches, await tenant(store, "carol"), 4)
    assert [p.line_no for p in await batches.pending_items(batch_id)] == [1, 2, 3, 4]
    await batches.set_order(batch_id, {4: 0, 2: 1, 1: 2, 3: 3})
    async with session_factory(store_engine)() as session:
        ranks = (
            await session.execute(
                select(BatchItemRow.line_no, BatchItemRow.order_rank)
                .where(BatchItemRow.batch_id == batch_id)
                .order_by(BatchItemRow.order_rank)
            )
        ).all()
    assert [tuple(r) for r in ranks] == [(4, 0), (2, 1), (1, 2), (3, 3)]
    assert await batches.mark_running(batch_id, 1)
    assert not await batches.mark_running(batch_id, 1)  # a line runs once at a time
    await batches.finish_item(
        batch_id,
        1,
        ItemResult(
            status="succeeded",
            response={"status_code": 200, "request_id": "r", "body": {}},
            prompt_tokens=5,
            completion_tokens=7,
        ),
    )
    assert await batches.mark_running(batch_id, 2)  # in flight when the process dies
    assert await batches.reset_running() == 1  # the next process starts
    pending = await batches.pending_items(batch_id)
    assert [(p.line_no, p.attempts) for p in pending] == [(2, 1), (3, 0), (4, 0)]
    assert await batches.finished_lengths(batch_id) == {1: 7}
    info = await batches.get_batch(batch_id)
    assert info is not None and info.request_counts.completed == 1
    assert (info.prompt_tokens, info.completion_tokens) == (5, 7)
    # the same custom_id cannot be inserted twice into one batch
    with pytest.raises(IntegrityError):
        async with session_factory(store_engine).begin() as session:
            session.add(
                BatchItemRow(
                    batch_id=batch_id,
                    line_no=9,
                    custom_id="c0",
                    method="POST",
                    url="/v1/chat/completions",
                    body="{}",
                    status="pending",
                    attempts=0,
                )
            )
    assert await batches.start(batch_id, items(4), None, None) == "in_progress"  # no re-insert


async def test_attempts_are_counted_at_dispatch_and_survive_a_restart(
    store: Store, store_engine: AsyncEngine
) -> None:
    batches = BatchStore(session_factory(store_engine))
    batch_id = await new_batch(batches, await tenant(store, "dave"), 2)
    assert await batches.mark_running(batch_id, 1) == 1  # counted before the request is sent
    await batches.requeue_item(batch_id, 1)  # the engine went away with it: the attempt stays
    assert await batches.mark_running(batch_id, 1) == 2
    await batches.requeue_item(batch_id, 1, is_attempt_refunded=True)  # engine never reached
    assert await batches.mark_running(batch_id, 1) == 2
    # the gateway dies with the line in flight; a new process, with a new store, resumes it
    restarted = BatchStore(session_factory(store_engine))
    assert await restarted.reset_running() == 1
    assert [(p.line_no, p.attempts) for p in await restarted.pending_items(batch_id)] == [
        (1, 2),
        (2, 0),
    ]
    assert await restarted.mark_running(batch_id, 1) == 3
    assert await restarted.mark_running(batch_id, 1) is None  # running: not taken twice
    assert await restarted.mark_running(batch_id, 2) == 1  # each line has its own count


async def test_finalize_writes_each_line_once_into_output_or_error_file(
    store: Store, store_engine: AsyncEngine
) -> None:
    batches = BatchStore(session_factory(store_engine))
    owner = await tenant(store, "dave")
    batch_id = await new_batch(batches, owner, 3)
    await batches.mark_running(batch_id, 1)
    await batches.finish_item(
        batch_id,
        1,
        ItemResult(
            status="succeeded", response={"status_code": 200, "request_id": "r1", "body": {}}
        ),
    )
    await batches.mark_running(batch_id, 2)
    await batches.finish_item(
        batch_id,
        2,
        ItemResult(
            status="failed",
            response={
                "status_code": 400,
                "request_id": None,
                "body": {"error": {"message": "bad"}},
            },
        ),
    )
    assert await batches.end_pending(batch_id, "cancelled") == 1
    lines = await batches.result_lines(batch_id)
    out, n_out, err, n_err = build_files(batch_id, lines)
    assert (n_out, n_err) == (1, 2)
    expires = datetime.now(UTC) + timedelta(days=1)
    assert await batches.set_status(batch_id, "cancelling", expect=("in_progress",))
    assert await batches.finalize(batch_id, "cancelled", out, err, n_out, n_err, expires)
    assert not await batches.finalize(batch_id, "cancelled", out, err, n_out, n_err, expires)
    info = await batches.get_batch(batch_id, owner)
    assert info is not None and info.status == "cancelled" and info.cancelled_at is not None
    assert info.request_counts.completed == 1 and info.request_counts.failed == 1
    assert info.output_file_id and info.error_file_id
    error_text = await batches.file_content(owner, info.error_file_id)
    assert error_text is not None and b"batch_cancelled" in error_text
    assert await batches.get_batch(batch_id, await tenant(store, "eve")) is None
    page, more = await batches.list_batches(owner, 10, None)
    assert [b.id for b in page] == [batch_id] and not more


async def test_validation_failure_keeps_the_errors(store: Store, store_engine: AsyncEngine) -> None:
    batches = BatchStore(session_factory(store_engine))
    owner = await tenant(store, "frank")
    file = await batches.create_file(owner, "batch", "in.jsonl", b"x\n", 1)
    batch = await batches.create_batch(
        tenant_id=owner,
        key_id=None,
        input_file_id=file.id,
        endpoint="/v1/completions",
        completion_window="1h",
        window=timedelta(hours=1),
        deadline_at=None,
        metadata=None,
        request_total=1,
    )
    errors = [{"code": "invalid_json", "message": "no", "param": None, "line": 1}]
    assert await batches.start(batch.id, [], None, errors) == "failed"
    info = await batches.get_batch(batch.id)
    assert info is not None and info.errors == errors and info.failed_at is not None
    assert info.to_openai()["errors"] == {"object": "list", "data": errors}


async def test_lines_the_database_refuses_fail_their_batch_with_the_reason(
    store: Store, store_engine: AsyncEngine
) -> None:
    """Defence in depth behind validation (issue 16): a line the database cannot store (a NUL
    in a custom_id, which PostgreSQL refuses) fails its batch with the database's reason instead
    of raising at every poll of the runner; the other batches start as usual."""
    batches = BatchStore(session_factory(store_engine))
    owner = await tenant(store, "grace")
    file = await batches.create_file(owner, "batch", "in.jsonl", b"x\n" * 3, 3)
    bad = await batches.create_batch(
        tenant_id=owner,
        key_id=None,
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        window=timedelta(hours=24),
        deadline_at=None,
        metadata=None,
        request_total=3,
    )
    lines = items(3)
    lines[1] = NewItem(line_no=2, custom_id="c\x00", method="POST", url=lines[1].url, body="{}")
    lines[2] = NewItem(line_no=3, custom_id="x" * 600, method="POST", url=lines[2].url, body="{}")
    status = await batches.start(bad.id, lines, "tandem-tiny", None)
    info = await batches.get_batch(bad.id)
    assert info is not None and info.status == status
    if store_engine.dialect.name == "postgresql":  # SQLite stores both
        assert status == "failed" and info.errors is not None
        [error] = info.errors
        assert error["code"] == "invalid_file" and "could not be stored" in error["message"]
        assert info.request_counts.total == 3  # no line was stored
    assert await new_batch(batches, owner, 2)  # the next batch starts
