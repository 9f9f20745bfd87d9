"""SQL of the Files and Batch API: files, batches and their lines (batch_items).

Every public method is one short transaction. Tenant isolation lives here: every client-facing
read takes the tenant id and answers None for another tenant's object (the API turns that into
404, so ids of other tenants' objects are not even confirmed to exist).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

import msgspec
from sqlalchemy import func, select, update
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.batch.lines import LineQueries, insert_lines, now_utc
from gateway.batch.types import (
    BatchInfo,
    FileInfo,
    NewItem,
    RequestCounts,
)
from gateway.store.db import uninterrupted
from gateway.store.models import BatchItemRow, BatchRow, FileRow

_json = msgspec.json.Encoder()
log = logging.getLogger(__name__)


def new_id(prefix: str) -> str:
    """`file-…` / `batch_…` ids: 24 random hex digits, as long as OpenAI's."""
    return f"{prefix}{secrets.token_hex(12)}"


def request_id(batch_id: str, line_no: int) -> str:
    """The output line's stable `id` (the same after a restart)."""
    digest = hashlib.sha256(f"{batch_id}:{line_no}".encode()).hexdigest()[:24]
    return f"batch_req_{digest}"


def _file(row: FileRow) -> FileInfo:
    return FileInfo(
        id=row.id,
        tenant_id=row.tenant_id,
        purpose=row.purpose,
        filename=row.filename,
        bytes=row.size_bytes,
        line_count=row.line_count,
        created_at=row.created_at,
        expires_at=row.expires_at,
    )


def _batch(row: BatchRow, counts: RequestCounts) -> BatchInfo:
    return BatchInfo(
        id=row.id,
        tenant_id=row.tenant_id,
        key_id=row.key_id,
        input_file_id=row.input_file_id,
        endpoint=row.endpoint,
        completion_window=row.completion_window,
        status=row.status,
        model=row.model,
        output_file_id=row.output_file_id,
        error_file_id=row.error_file_id,
        errors=msgspec.json.decode(row.errors) if row.errors else None,
        metadata=msgspec.json.decode(row.metadata_json) if row.metadata_json else None,
        request_counts=counts,
        prompt_tokens=row.prompt_tokens,
        completion_tokens=row.completion_tokens,
        deadline_at=row.deadline_at,
        created_at=row.created_at,
        in_progress_at=row.in_progress_at,
        expires_at=row.expires_at,
        finalizing_at=row.finalizing_at,
        completed_at=row.completed_at,
        failed_at=row.failed_at,
        expired_at=row.expired_at,
        cancelling_at=row.cancelling_at,
        cancelled_at=row.cancelled_at,
    )


class BatchStore(LineQueries):
    """Async access to files, batches and (through LineQueries) their lines; shares the
    gateway's session factory."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    # ------------------------------------------------------------------ files

    @uninterrupted
    async def create_file(
        self,
        tenant_id: str,
        purpose: str,
        filename: str,
        content: bytes,
        line_count: int | None,
        expires_at: datetime | None = None,
    ) -> FileInfo:
        """Stores a file; returns it (without content)."""
        row = FileRow(
            id=new_id("file-"),
            tenant_id=tenant_id,
            purpose=purpose,
            filename=filename,
            size_bytes=len(content),
            line_count=line_count,
            sha256=hashlib.sha256(content).hexdigest(),
            content=content,
            created_at=now_utc(),
            expires_at=expires_at,
        )
        async with self._sessions.begin() as session:
            session.add(row)
        return _file(row)

    async def get_file(self, tenant_id: str, file_id: str) -> FileInfo | None:
        """The tenant's live file, or None (unknown, deleted, or another tenant's)."""
        async with self._sessions() as session:
            row = await session.get(FileRow, file_id)
            if row is None or row.tenant_id != tenant_id or row.deleted_at is not None:
                return None
            return _file(row)

    async def file_content(self, tenant_id: str, file_id: str) -> bytes | None:
        """The content of the tenant's live file, or None."""
        async with self._sessions() as session:
            result = await session.execute(
                select(FileRow.content).where(
                    FileRow.id == file_id,
                    FileRow.tenant_id == tenant_id,
                    FileRow.deleted_at.is_(None),
                )
            )
            content = result.scalar_one_or_none()
            return bytes(content) if content is not None else None

    async def list_files(
        self, tenant_id: str, purpose: str | None, limit: int, after: str | None
    ) -> tuple[list[FileInfo], bool]:
        """The tenant's live files, newest first, after the file `after`; and whether more
        follow."""
        async with self._sessions() as session:
            query = select(FileRow).where(
                FileRow.tenant_id == tenant_id, FileRow.deleted_at.is_(None)
            )
            if purpose is not None:
                query = query.where(FileRow.purpose == purpose)
            if after is not None:
                anchor = await session.get(FileRow, after)
                if anchor is not None and anchor.tenant_id == tenant_id:
                    query = query.where(
                        (FileRow.created_at < anchor.created_at)
                        | ((FileRow.created_at == anchor.created_at) & (FileRow.id < anchor.id))
                    )
            rows = (
                await session.scalars(
                    query.order_by(FileRow.created_at.desc(), FileRow.id.desc()).limit(limit + 1)
                )
            ).all()
            return [_file(r) for r in rows[:limit]], len(rows) > limit

    @uninterrupted
    async def delete_file(self, tenant_id: str, file_id: str) -> bool:
        """Soft-deletes the tenant's file (batches keep referring to it); False if not found."""
        async with self._sessions.begin() as session:
            row = await session.get(FileRow, file_id)
            if row is None or row.tenant_id != tenant_id or row.deleted_at is not None:
                return False
            row.deleted_at = now_utc()
            return True

    # ------------------------------------------------------------------ batches

    @uninterrupted
    async def create_batch(
        self,
        *,
        tenant_id: str,
        key_id: str | None,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        window: timedelta,
        deadline_at: datetime | None,
        metadata: dict[str, str] | None,
        request_total: int,
    ) -> BatchInfo:
        """A new batch in status `validating` (the runner validates its lines)."""
        created = now_utc()
        row = BatchRow(
            id=new_id("batch_"),
            tenant_id=tenant_id,
            key_id=key_id,
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=completion_window,
            status="validating",
            metadata_json=_json.encode(metadata).decode() if metadata else None,
            request_total=request_total,
            prompt_tokens=0,
            completion_tokens=0,
            deadline_at=deadline_at,
            created_at=created,
            expires_at=created + window,
        )
        async with self._sessions.begin() as session:
            session.add(row)
        return _batch(row, RequestCounts(total=request_total))

    async def get_batch(self, batch_id: str, tenant_id: str | None = None) -> BatchInfo | None:
        """The batch (only if it is `tenant_id`'s, when given), with its line counts."""
        async with self._sessions() as session:
            row = await session.get(BatchRow, batch_id)
            if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
                return None
            counts = await _counts(session, [row])
            return _batch(row, counts[row.id])

    async def list_batches(
        self, tenant_id: str, limit: int, after: str | None
    ) -> tuple[list[BatchInfo], bool]:
        """The tenant's batches, newest first, after the batch `after`; and whether more
        follow."""
        async with self._sessions() as session:
            query = select(BatchRow).where(BatchRow.tenant_id == tenant_id)
            if after is not None:
                anchor = await session.get(BatchRow, after)
                if anchor is not None and anchor.tenant_id == tenant_id:
                    query = query.where(
                        (BatchRow.created_at < anchor.created_at)
                        | ((BatchRow.created_at == anchor.created_at) & (BatchRow.id < anchor.id))
                    )
            rows = list(
                (
                    await session.scalars(
                        query.order_by(BatchRow.created_at.desc(), BatchRow.id.desc()).limit(
                            limit + 1
                        )
                    )
                ).all()
            )
            page = rows[:limit]
            counts = await _counts(session, page)
            return [_batch(r, counts[r.id]) for r in page], len(rows) > limit

    async def batches_with_status(self, statuses: Iterable[str]) -> list[BatchInfo]:
        """Every batch in one of `statuses` (the runner's scan), oldest first."""
        async with self._sessions() as session:
            rows = list(
                (
                    await session.scalars(
                        select(BatchRow)
                        .where(BatchRow.status.in_(list(statuses)))
                        .order_by(BatchRow.created_at)
                    )
                ).all()
            )
            counts = await _counts(session, rows)
            return [_batch(r, counts[r.id]) for r in rows]

    @uninterrupted
    async def set_status(
        self,
        batch_id: str,
        status: str,
        *,
        expect: Iterable[str],
        errors: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Moves a batch to `status` (stamping `<status>_at`) if it is in one of `expect`."""
        values: dict[str, Any] = {"status": status, f"{status}_at": now_utc()}
        if errors is not None:
            values["errors"] = _json.encode(errors).decode()
        async with self._sessions.begin() as session:
            result = await session.execute(
                update(BatchRow)
                .where(BatchRow.id == batch_id, BatchRow.status.in_(list(expect)))
                .values(**values)
            )
            return bool(getattr(result, "rowcount", 0))

    async def start(
        self,
        batch_id: str,
        items: Sequence[NewItem],
        model: str | None,
        errors: list[dict[str, Any]] | None,
    ) -> str:
        """Ends validation in one transaction: the lines and `in_progress`, or `failed` with the
        errors. Returns the new status (the current one if the batch left `validating`). Lines
        the database refuses to store (validation missed something) fail the batch with the
        database's reason, so it cannot stop the runner's other batches."""
        try:
            return await self._start(batch_id, items, model, errors)
        except (DBAPIError, UnicodeEncodeError) as exc:
            if not _is_bad_data(exc):
                raise  # e.g. the database is down: not this batch's fault
            log.warning("batch %s: its lines cannot be stored: %s", batch_id, exc)
            reason = str(getattr(exc, "orig", None) or exc).splitlines()[0][:500]
            error = {
                "code": "invalid_file",
                "message": f"the input file's lines could not be stored: {reason}",
                "param": None,
                "line": None,
            }
            await self.set_status(batch_id, "failed", expect=("validating",), errors=[error])
            current = await self.get_batch(batch_id)
            return current.status if current is not None else "failed"

    @uninterrupted
    async def _start(
        self,
        batch_id: str,
        items: Sequence[NewItem],
        model: str | None,
        errors: list[dict[str, Any]] | None,
    ) -> str:
        async with self._sessions.begin() as session:
            row = await session.get(BatchRow, batch_id, with_for_update=True)
            if row is None or row.status != "validating":
                return row.status if row is not None else "failed"
            stamp = now_utc()
            if errors:
                row.status, row.failed_at = "failed", stamp
                row.errors = _json.encode(errors).decode()
                return row.status
            await insert_lines(session, batch_id, items)
            row.status, row.in_progress_at, row.model = "in_progress", stamp, model
            row.request_total = len(items)
            return row.status

    @uninterrupted
    async def finalize(
        self,
        batch_id: str,
        final_status: str,
        output: bytes | None,
        errors_file: bytes | None,
        output_lines: int,
        error_lines: int,
        expires_at: datetime,
    ) -> bool:
        """Writes the output and error files and the final status in one transaction (a crash
        before it commits leaves the batch `finalizing`, and the runner finalizes it again)."""
        async with self._sessions.begin() as session:
            row = await session.get(BatchRow, batch_id, with_for_update=True)
            if row is None or row.status in ("completed", "failed", "expired", "cancelled"):
                return False
            stamp = now_utc()
            for content, lines, attr in (
                (output, output_lines, "output_file_id"),
                (errors_file, error_lines, "error_file_id"),
            ):
                if content is None:
                    continue
                suffix = "output" if attr == "output_file_id" else "error"
                file_row = FileRow(
                    id=new_id("file-"),
                    tenant_id=row.tenant_id,
                    purpose="batch_output",
                    filename=f"{batch_id}_{suffix}.jsonl",
                    size_bytes=len(content),
                    line_count=lines,
                    sha256=hashlib.sha256(content).hexdigest(),
                    content=content,
                    created_at=stamp,
                    expires_at=expires_at,
                )
                session.add(file_row)
                await session.flush()  # no ORM relationship orders the file before the batch
                setattr(row, attr, file_row.id)
            row.status = final_status
            setattr(row, f"{final_status}_at", stamp)
            return True


def _is_bad_data(exc: Exception) -> bool:
    """Whether the database refused *exc*'s statement for the data it carried (SQLSTATE class
    22, data exception, or 23, integrity violation; asyncpg's reach SQLAlchemy as a plain
    DBAPIError), not for its own state (down, or out of connections)."""
    if isinstance(exc, (DataError, IntegrityError, UnicodeEncodeError)):
        return True
    orig = getattr(exc, "orig", None)
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return isinstance(sqlstate, str) and sqlstate[:2] in ("22", "23")


async def _counts(session: AsyncSession, rows: Sequence[BatchRow]) -> dict[str, RequestCounts]:
    """Line counts per batch in one GROUP BY."""
    ids = [r.id for r in rows]
    by_batch: dict[str, dict[str, int]] = {i: {} for i in ids}
    if ids:
        result = await session.execute(
            select(BatchItemRow.batch_id, BatchItemRow.status, func.count())
            .where(BatchItemRow.batch_id.in_(ids))
            .group_by(BatchItemRow.batch_id, BatchItemRow.status)
        )
        for batch_id, status, count in result.all():
            by_batch[batch_id][status] = int(count)
    return {
        r.id: RequestCounts(
            total=r.request_total,
            completed=by_batch[r.id].get("succeeded", 0),
            failed=by_batch[r.id].get("failed", 0),
        )
        for r in rows
    }
