"""Whether the gateway's database is ready (reachable, at the newest migration), checked in the
background so that `/readyz` answers from memory: a probe polled often under load must not wait
for a pooled connection behind the traffic, nor parse the migration scripts on the event loop
(about 14 ms each time) to learn the head revision, which cannot change while the process runs.

A request that found the database unavailable (``gateway.store.outage``) makes it unready at
once, without waiting for the next check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.migrate import current_revision, head_revision
from gateway.store.outage import DatabaseOutage

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 2.0
"""Time between two checks of the database's revision, seconds: how stale `/readyz`'s view of a
database that went away (with no request noticing) may be."""
CHECK_TIMEOUT_S = 5.0
"""How long one check may take before the database counts as unreachable, seconds."""


class DatabaseReadiness:
    """The database's revision as last checked, against the head revision of this code."""

    def __init__(self, head: str, outage: DatabaseOutage | None = None) -> None:
        self.head = head
        """The newest migration this gateway's code knows."""
        self.revision: str | None = None
        """The database's revision at the last check (None: never migrated, or unreachable)."""
        self.error: str | None = "not checked yet"
        """Why the last check failed (one line), None when it succeeded."""
        self._outage = outage

    @property
    def is_ready(self) -> bool:
        """Reachable at the last check, at the head revision, and no request has found it
        unavailable since."""
        is_down = self._outage is not None and self._outage.down_since is not None
        return self.error is None and self.revision == self.head and not is_down

    def describe(self) -> str:
        """ "ok", or why not, in one line (`/readyz`'s ``checks.database``)."""
        if self._outage is not None and self._outage.down_since is not None:
            return "unavailable (requests found it down)"
        if self.error is not None:
            return f"unavailable ({self.error})"
        if self.revision != self.head:
            return f"at revision {self.revision}, head is {self.head}"
        return "ok"

    async def check(self, engine: AsyncEngine) -> None:
        """Reads the database's revision now, recording it or why that failed."""
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                self.revision = await current_revision(engine)
            self.error = None
        except Exception as exc:  # any driver's failure: not ready, and say why
            self.revision = None
            self.error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]

    async def watch(self, engine: AsyncEngine, interval_s: float = CHECK_INTERVAL_S) -> None:
        """Checks every *interval_s* until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.check(engine)


DATABASE_READINESS = web.AppKey("database_readiness", DatabaseReadiness)
"""The gateway database's readiness (set with the database engine)."""


async def start_readiness(
    engine: AsyncEngine, outage: DatabaseOutage | None = None
) -> tuple[DatabaseReadiness, asyncio.Task[None]]:
    """The readiness of *engine*'s database, checked once now and then in a background task
    (the caller cancels it, see `stop_readiness`)."""
    readiness = DatabaseReadiness(await asyncio.to_thread(head_revision), outage)
    await readiness.check(engine)
    return readiness, asyncio.create_task(readiness.watch(engine), name="tandem-db-readiness")


async def stop_readiness(task: asyncio.Task[None]) -> None:
    """Cancels a `start_readiness` task and waits for it."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
