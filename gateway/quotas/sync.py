"""Publishing this instance's quota demand and reading everyone's, through the shared database.

One short transaction per `sync_interval_s`, off the request path: heartbeat, this instance's
demand rows, the month token counts it used since the last sync (an atomic increment), then the
live instances, their demand and the month totals. A failed sync changes nothing (the counts are
kept for the next one); the limiter keeps the shares it had.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.quotas.limiter import DemandReport, QuotaLimiter, SyncView, month_key
from gateway.store.db import uninterrupted
from gateway.store.models import GatewayInstanceRow, QuotaDemandRow, QuotaMonthlyRow
from gateway.store.outage import outage_of

log = logging.getLogger(__name__)

_instances = cast(Table, GatewayInstanceRow.__table__)
_demand = cast(Table, QuotaDemandRow.__table__)
_monthly = cast(Table, QuotaMonthlyRow.__table__)
_FORGET_INSTANCE_FACTOR = 60
"""An instance silent for this many timeouts is deleted with its rows (a crashed process)."""
_EPOCH_S = 10
"""Length of the shared epoch that rotates ties in concurrency-slot allocation, seconds."""


class QuotaSync:
    """Runs the limiter's sync with the database in the background."""

    def __init__(
        self,
        engine: AsyncEngine,
        limiter: QuotaLimiter,
        interval_s: float,
        timeout_s: float,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._engine = engine
        self._limiter = limiter
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._wall_clock = wall_clock
        self._started_at = wall_clock()
        self._task: asyncio.Task[None] | None = None
        self.failures = 0
        """Syncs that failed (the database was unreachable); counted for /metrics."""

    async def start(self) -> None:
        """Registers this instance (one sync now, so its shares are right from the first
        request), then syncs every interval in the background."""
        await self.sync_once()
        self._task = asyncio.create_task(self._run(), name="quota-sync")

    async def close(self) -> None:
        """Stops, writes the last counts, and leaves the set of live instances."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.sync_once()
        me = self._limiter.instance_id
        try:
            async with self._engine.begin() as conn:
                await conn.execute(delete(_demand).where(_demand.c.instance_id == me))
                await conn.execute(delete(_instances).where(_instances.c.id == me))
        except Exception:
            log.warning("could not remove gateway instance %s from the quota tables", me)

    @uninterrupted
    async def sync_once(self) -> bool:
        """One sync; False (and nothing changed) when the database could not be reached."""
        reports, deltas = self._limiter.sync_out()
        now = self._wall_clock()
        try:
            async with self._engine.begin() as conn:
                view = await self._exchange(conn, reports, deltas, now)
        except Exception as exc:
            self.failures += 1
            self._limiter.sync_failed(deltas)
            if not outage_of(self._engine).report(exc, "quota sync"):  # else: once per outage
                log.warning("quota sync failed (%s); keeping the current shares", exc)
            return False
        self._limiter.apply_sync(view)
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.sync_once()

    async def _exchange(
        self,
        conn: AsyncConnection,
        reports: Sequence[DemandReport],
        deltas: dict[tuple[str, str], int],
        now: datetime,
    ) -> SyncView:
        me = self._limiter.instance_id
        dialect = conn.dialect.name
        await _upsert(
            conn,
            dialect,
            _instances,
            [{"id": me, "started_at": self._started_at, "heartbeat_at": now}],
            ["id"],
            ["heartbeat_at"],
        )
        tenant_ids = [r.tenant_id for r in reports]
        await conn.execute(
            delete(_demand).where(
                _demand.c.instance_id == me, _demand.c.tenant_id.not_in(tenant_ids)
            )
        )
        if reports:
            await _upsert(
                conn,
                dialect,
                _demand,
                [
                    {
                        "instance_id": me,
                        "tenant_id": r.tenant_id,
                        "requests": r.requests,
                        "tokens": r.tokens,
                        "concurrency": r.concurrency,
                        "in_flight": r.in_flight,
                        "updated_at": now,
                    }
                    for r in reports
                ],
                ["instance_id", "tenant_id"],
                ["requests", "tokens", "concurrency", "in_flight", "updated_at"],
            )
        if deltas:
            await _increment_monthly(conn, dialect, deltas, now)
        forget = now - timedelta(seconds=self._timeout_s * _FORGET_INSTANCE_FACTOR)
        await conn.execute(delete(_instances).where(_instances.c.heartbeat_at < forget))
        await conn.execute(
            delete(_demand).where(_demand.c.instance_id.not_in(select(_instances.c.id)))
        )
        live_since = now - timedelta(seconds=self._timeout_s)
        instances = list(
            (
                await conn.execute(
                    select(_instances.c.id)
                    .where(_instances.c.heartbeat_at >= live_since)
                    .order_by(_instances.c.id)
                )
            ).scalars()
        )
        demand: dict[str, dict[str, DemandReport]] = {}
        if tenant_ids:
            rows = await conn.execute(
                select(_demand).where(
                    _demand.c.instance_id.in_(instances), _demand.c.instance_id != me
                )
            )
            for row in rows.mappings():
                demand.setdefault(row["tenant_id"], {})[row["instance_id"]] = DemandReport(
                    row["tenant_id"],
                    row["requests"],
                    row["tokens"],
                    row["concurrency"],
                    row["in_flight"],
                )
        month = month_key(now)
        totals = await conn.execute(
            select(_monthly.c.tenant_id, _monthly.c.tokens).where(_monthly.c.month == month)
        )
        return SyncView(
            instances=instances,
            demand=demand,
            monthly_tokens={t: int(n) for t, n in totals.all()},
            month=month,
            epoch=int(now.timestamp()) // _EPOCH_S,
        )


async def _increment_monthly(
    conn: AsyncConnection, dialect: str, deltas: dict[tuple[str, str], int], now: datetime
) -> None:
    rows = [
        {"tenant_id": t, "month": m, "tokens": n, "updated_at": now}
        for (t, m), n in sorted(deltas.items())
    ]
    stmt = _insert(dialect, _monthly)
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["tenant_id", "month"],
            set_={
                "tokens": _monthly.c.tokens + stmt.excluded.tokens,
                "updated_at": stmt.excluded.updated_at,
            },
        ),
        rows,
    )


async def _upsert(
    conn: AsyncConnection,
    dialect: str,
    table: Table,
    rows: list[dict[str, Any]],
    keys: list[str],
    columns: list[str],
) -> None:
    stmt = _insert(dialect, table)
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=keys, set_={c: stmt.excluded[c] for c in columns}
        ),
        rows,
    )


def _insert(dialect: str, table: Table) -> Any:
    """INSERT … ON CONFLICT for the connection's dialect (both speak the same upsert)."""
    if dialect == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)
