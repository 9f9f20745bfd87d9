"""SQL of a batch's lines (batch_items): the per-line state that makes a batch resumable.

A line's life is pending → running → succeeded | failed (or expired / cancelled if it never
ran); every transition is one short transaction guarded by the expected current status, so a
line runs once at a time and a crash leaves at most `running` lines, which `reset_running`
turns back to pending at the next start.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import cast

import msgspec
from sqlalchemy import Table, bindparam, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.batch.types import ItemResult, NewItem, PendingItem
from gateway.store.db import uninterrupted
from gateway.store.models import BatchItemRow, BatchRow

_json = msgspec.json.Encoder()

SQL_CHUNK_LINES = 1000
"""Lines per statement when many lines are written or read at once (a batch starts, is ordered
or loaded): the event loop serves other requests between two chunks (50,000 ORM objects
flushed at once held it for seconds)."""


async def insert_lines(session: AsyncSession, batch_id: str, items: Sequence[NewItem]) -> None:
    """The batch's lines as `pending` rows, inside the caller's transaction, in chunks."""
    table = cast(Table, BatchItemRow.__table__)
    for start in range(0, len(items), SQL_CHUNK_LINES):
        rows = [
            {
                "batch_id": batch_id,
                "line_no": it.line_no,
                "custom_id": it.custom_id,
                "method": it.method,
                "url": it.url,
                "body": it.body,
                "status": "pending",
                "attempts": 0,
            }
            for it in items[start : start + SQL_CHUNK_LINES]
        ]
        await session.execute(insert(table), rows)


def now_utc() -> datetime:
    """The current time, timezone-aware UTC (what every timestamp column stores)."""
    return datetime.now(UTC)


class LineQueries:
    """The line-level half of :class:`gateway.batch.store.BatchStore`."""

    _sessions: async_sessionmaker[AsyncSession]

    @uninterrupted
    async def reset_running(self) -> int:
        """After a restart: lines left `running` by a dead process go back to `pending`."""
        async with self._sessions.begin() as session:
            result = await session.execute(
                update(BatchItemRow)
                .where(BatchItemRow.status == "running")
                .values(status="pending", started_at=None)
            )
            return int(getattr(result, "rowcount", 0) or 0)

    @uninterrupted
    async def reset_batch_running(self, batch_id: str) -> int:
        """One batch's running lines back to pending (their engine requests were stopped)."""
        async with self._sessions.begin() as session:
            result = await session.execute(
                update(BatchItemRow)
                .where(BatchItemRow.batch_id == batch_id, BatchItemRow.status == "running")
                .values(status="pending", started_at=None)
            )
            return int(getattr(result, "rowcount", 0) or 0)

    async def pending_items(self, batch_id: str) -> list[PendingItem]:
        """The batch's lines still to run, in file order (read a page at a time, so the event
        loop serves other requests between two pages of a large batch)."""
        items: list[PendingItem] = []
        async with self._sessions() as session:
            while True:
                after = items[-1].line_no if items else -1
                rows = (
                    await session.execute(
                        select(
                            BatchItemRow.line_no,
                            BatchItemRow.custom_id,
                            BatchItemRow.body,
                            BatchItemRow.attempts,
                        )
                        .where(
                            BatchItemRow.batch_id == batch_id,
                            BatchItemRow.status == "pending",
                            BatchItemRow.line_no > after,
                        )
                        .order_by(BatchItemRow.line_no)
                        .limit(SQL_CHUNK_LINES)
                    )
                ).all()
                items.extend(
                    PendingItem(line_no=r[0], custom_id=r[1], body=r[2], attempts=r[3])
                    for r in rows
                )
                if len(rows) < SQL_CHUNK_LINES:
                    return items

    async def finished_lengths(self, batch_id: str) -> dict[int, int]:
        """Output lengths of the batch's succeeded lines, by line (samples after a restart)."""
        async with self._sessions() as session:
            rows = (
                await session.execute(
                    select(BatchItemRow.line_no, BatchItemRow.completion_tokens).where(
                        BatchItemRow.batch_id == batch_id,
                        BatchItemRow.status == "succeeded",
                        BatchItemRow.completion_tokens.is_not(None),
                    )
                )
            ).all()
            return {int(r[0]): int(r[1]) for r in rows}

    @uninterrupted
    async def set_order(self, batch_id: str, ranks: dict[int, int]) -> None:
        """Stores each pending line's place in the planned order."""
        if not ranks:
            return
        table = cast(Table, BatchItemRow.__table__)
        statement = (
            update(table)
            .where(table.c.batch_id == batch_id, table.c.line_no == bindparam("b_line_no"))
            .values(order_rank=bindparam("b_rank"))
        )
        rows = [{"b_line_no": n, "b_rank": r} for n, r in ranks.items()]
        async with self._sessions.begin() as session:
            await session.connection()
            # an executemany per chunk, not one round trip per line, nor one for 50,000 lines
            # (building its parameters alone held the event loop for most of a second)
            for start in range(0, len(rows), SQL_CHUNK_LINES):
                await session.execute(statement, rows[start : start + SQL_CHUNK_LINES])

    @uninterrupted
    async def mark_running(self, batch_id: str, line_no: int) -> int | None:
        """pending → running, counting one attempt more before the request is sent (so a crash
        of the engine or of the gateway during it still counts); returns the line's attempts
        with this one, or None if the line is no longer pending."""
        async with self._sessions.begin() as session:
            result = await session.execute(
                update(BatchItemRow)
                .where(
                    BatchItemRow.batch_id == batch_id,
                    BatchItemRow.line_no == line_no,
                    BatchItemRow.status == "pending",
                )
                .values(status="running", started_at=now_utc(), attempts=BatchItemRow.attempts + 1)
            )
            if not getattr(result, "rowcount", 0):
                return None
            attempts = await session.scalar(
                select(BatchItemRow.attempts).where(
                    BatchItemRow.batch_id == batch_id, BatchItemRow.line_no == line_no
                )
            )
            return int(attempts or 0)

    @uninterrupted
    async def finish_item(self, batch_id: str, line_no: int, result: ItemResult) -> None:
        """running → its final status with the response or error, and the batch's usage."""
        async with self._sessions.begin() as session:
            await session.execute(
                update(BatchItemRow)
                .where(
                    BatchItemRow.batch_id == batch_id,
                    BatchItemRow.line_no == line_no,
                    BatchItemRow.status == "running",
                )
                .values(
                    status=result.status,
                    finished_at=now_utc(),
                    response=_json.encode(result.response).decode()
                    if result.response is not None
                    else None,
                    error=_json.encode(result.error).decode() if result.error is not None else None,
                    prompt_tokens=result.prompt_tokens,
                    completion_tokens=result.completion_tokens,
                )
            )
            if result.prompt_tokens or result.completion_tokens:
                await session.execute(
                    update(BatchRow)
                    .where(BatchRow.id == batch_id)
                    .values(
                        prompt_tokens=BatchRow.prompt_tokens + (result.prompt_tokens or 0),
                        completion_tokens=BatchRow.completion_tokens
                        + (result.completion_tokens or 0),
                    )
                )

    @uninterrupted
    async def requeue_item(
        self, batch_id: str, line_no: int, *, is_attempt_refunded: bool = False
    ) -> None:
        """running → pending (it runs again). *is_attempt_refunded*: the request never reached
        the engine (it was unreachable), so this run does not count as an attempt."""
        values: dict[str, object] = {"status": "pending", "started_at": None}
        if is_attempt_refunded:
            values["attempts"] = BatchItemRow.attempts - 1
        async with self._sessions.begin() as session:
            await session.execute(
                update(BatchItemRow)
                .where(
                    BatchItemRow.batch_id == batch_id,
                    BatchItemRow.line_no == line_no,
                    BatchItemRow.status == "running",
                )
                .values(**values)
            )

    @uninterrupted
    async def end_pending(self, batch_id: str, status: str) -> int:
        """Every pending line of the batch → `status` (expired or cancelled)."""
        async with self._sessions.begin() as session:
            result = await session.execute(
                update(BatchItemRow)
                .where(BatchItemRow.batch_id == batch_id, BatchItemRow.status == "pending")
                .values(status=status, finished_at=now_utc())
            )
            return int(getattr(result, "rowcount", 0) or 0)

    async def count_unfinished(self, batch_id: str) -> int:
        """Lines pending or running."""
        async with self._sessions() as session:
            return int(
                await session.scalar(
                    select(func.count())
                    .select_from(BatchItemRow)
                    .where(
                        BatchItemRow.batch_id == batch_id,
                        BatchItemRow.status.in_(("pending", "running")),
                    )
                )
                or 0
            )

    async def result_lines(
        self, batch_id: str
    ) -> list[tuple[int, str, str, str | None, str | None]]:
        """(line_no, custom_id, status, response JSON, error JSON) of every line, file order."""
        async with self._sessions() as session:
            rows = (
                await session.execute(
                    select(
                        BatchItemRow.line_no,
                        BatchItemRow.custom_id,
                        BatchItemRow.status,
                        BatchItemRow.response,
                        BatchItemRow.error,
                    )
                    .where(BatchItemRow.batch_id == batch_id)
                    .order_by(BatchItemRow.line_no)
                )
            ).all()
            return [(int(r[0]), r[1], r[2], r[3], r[4]) for r in rows]
