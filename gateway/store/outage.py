"""The database being down, as the gateway sees it: which errors say so, and one place that
tells the operator about it once per outage instead of once per failed query.

While the database is unreachable every request that needs it fails, every background loop that
writes to it fails, and each of them used to log a traceback: hundreds of lines a second that
bury the one line that matters. `DatabaseOutage` turns those failures into an episode: the first
failure logs one line naming what failed and why, later ones are only counted, a reminder is
logged every `REMINDER_S` while it lasts, and one line says when the database is back (the first
connection the pool hands out again: with pre-ping, a working one). Requests that failed for it
are answered 503 with `Retry-After` and the code `database_unavailable` (gateway/errors.py).

`is_database_unavailable` is the classifier: a lost or refused connection, a pool that timed out
handing one out, a server shutting down or starting up — transient failures a retry may cure,
never a bad query.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import asyncpg
from aiohttp import web
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger(__name__)

REMINDER_S = 60.0
"""How often an ongoing outage is logged again, seconds."""
RETRY_AFTER_S = 5
"""`Retry-After` of a 503 `database_unavailable`, seconds."""
_DRIVER_MODULES = ("sqlalchemy", "asyncpg", "aiosqlite", "sqlite3")
_SERVER_GONE = (
    asyncpg.exceptions.PostgresConnectionError,  # SQLSTATE class 08
    asyncpg.exceptions.OperatorInterventionError,  # class 57: shutdown, starting up, cancelled
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InsufficientResourcesError,  # class 53: too many connections
)


def is_database_unavailable(exc: BaseException) -> bool:
    """Whether *exc* (or an exception it was raised from) says the database cannot be reached
    or cannot take the work now, rather than that a query was wrong."""
    for error in _chain(exc):
        if isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated:
            return True
        if isinstance(error, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError)):
            return True  # (TimeoutError: the pool had no connection to hand out in time)
        if isinstance(error, _SERVER_GONE):
            return True
        # asyncpg lets a failed connect's OSError through unwrapped (ConnectionRefusedError, a
        # timeout, an unknown host): one raised inside the driver is the database's
        if isinstance(error, OSError) and _raised_in_driver(error):
            return True
    return False


class DatabaseOutage:
    """Failures of one database, grouped into outage episodes for the log (module doc)."""

    def __init__(
        self,
        *,
        reminder_s: float = REMINDER_S,
        retry_after_s: int = RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.reminder_s = reminder_s
        """How often an ongoing outage is logged again, seconds."""
        self.retry_after_s = retry_after_s
        """`Retry-After` of the requests it failed, seconds."""
        self._clock = clock
        self.down_since: float | None = None
        """When the current outage began (on `clock`); None while the database works."""
        self.failures = 0
        """Operations that failed for it in the current outage."""
        self.episodes = 0
        """Outages since start."""
        self._logged_at: float | None = None

    def report(self, exc: BaseException, doing: str) -> bool:
        """Counts *exc* if it says the database is unavailable (logging the outage's first
        failure and a reminder now and then) and returns True; False for any other error, which
        the caller handles (and logs) as before. *doing* names the operation, for the log."""
        if not is_database_unavailable(exc):
            return False
        now = self._clock()
        if self.down_since is None:
            self.down_since, self.failures = now, 0
            self.episodes += 1
            if self._logged_at is None or now - self._logged_at >= self.reminder_s:
                self._logged_at = now
                log.error(
                    "database unavailable (%s: %s); what needs it fails with 503 "
                    "database_unavailable until it is back",
                    doing,
                    _describe(exc),
                )
        elif self._logged_at is not None and now - self._logged_at >= self.reminder_s:
            self._logged_at = now
            log.error(
                "database still unavailable after %.0f s: %d operations failed (last: %s: %s)",
                now - self.down_since,
                self.failures + 1,
                doing,
                _describe(exc),
            )
        self.failures += 1
        return True

    def recovered(self) -> None:
        """The database handed out a working connection: the outage (if any) is over."""
        if self.down_since is None:
            return
        down_s = self._clock() - self.down_since
        if self._logged_at is not None and self._logged_at >= self.down_since:
            log.warning(
                "database available again after %.1f s (%d operations failed)",
                down_s,
                self.failures,
            )
        self.down_since = None

    @property
    def is_down(self) -> bool:
        """Whether the last word on the database was a failure."""
        return self.down_since is not None


_OUTAGES: weakref.WeakKeyDictionary[Any, DatabaseOutage] = weakref.WeakKeyDictionary()


def outage_of(engine: AsyncEngine) -> DatabaseOutage:
    """The outage record of *engine*'s database, made on first use; every connection its pool
    hands out (pre-pinged on PostgreSQL) ends an outage."""
    sync_engine = engine.sync_engine
    outage = _OUTAGES.get(sync_engine)
    if outage is None:
        outage = _OUTAGES[sync_engine] = DatabaseOutage()
        event.listen(sync_engine, "checkout", lambda *_: outage.recovered())
    return outage


DATABASE_OUTAGE = web.AppKey("database_outage", DatabaseOutage)
"""The gateway database's outage record (set with the database engine)."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        if isinstance(current, sa_exc.DBAPIError) and isinstance(current.orig, BaseException):
            yield current.orig
        current = current.__cause__ or current.__context__


def _raised_in_driver(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        if module.split(".", 1)[0] in _DRIVER_MODULES:
            return True
        tb = tb.tb_next
    return False


def _describe(exc: BaseException) -> str:
    """One line: the exception's type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
