"""Auth cache invalidations across the gateway processes of one PostgreSQL database.

Every gateway process caches key lookups for ``gateway.auth_cache_ttl_s`` (gateway/auth.py). An
admin change made through one process — a revoked key, a changed or deleted tenant — drops the
entry there at once and is published here with PostgreSQL's NOTIFY on the channel
`CHANNEL`; every other process LISTENs on it and drops the entry when the notification arrives
(milliseconds), instead of accepting the revoked key until its entry expires.

Each process holds one dedicated asyncpg connection for this (a listener must stay open, so not
one of the pool's), which both listens and publishes. When it is lost (a database restart), the
process reconnects with backoff and, once connected again, drops its whole cache, since it may
have missed notifications meanwhile; invalidations it published while disconnected are sent on
reconnection. Until then ``auth_cache_ttl_s`` bounds how stale an entry can be, as it does
without this module. SQLite serves one gateway process per database, which invalidates its own
cache: nothing to tell, so this module does nothing there.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from aiohttp import web
from sqlalchemy.engine import make_url

from gateway.auth import AuthCache
from gateway.state import AUTH, CONFIG
from gateway.store.db import is_sqlite, normalize_url

log = logging.getLogger(__name__)

CHANNEL = "tandem_auth"
"""The NOTIFY channel; a payload is ``<sender id> <key prefix>``, or ``<sender id> *`` for the
whole cache (a tenant changed: every key of it, so every entry)."""
_EVERYTHING = "*"
APPLICATION_NAME = "tandem-auth-sync"
"""The listener connection's `application_name` (what pg_stat_activity shows)."""
CONNECT_WAIT_S = 5.0
"""How long the app's start waits for the listener to connect (then it goes on connecting in the
background and the TTL covers the gap), seconds."""
_CONNECT_TIMEOUT_S = 10.0
_RETRY_FIRST_S = 0.5
_RETRY_MAX_S = 10.0
_MAX_QUEUED = 1000
"""Invalidations queued while disconnected beyond which they collapse into one of everything."""


def asyncpg_dsn(url: str) -> str:
    """The plain ``postgresql://`` DSN asyncpg takes, from a database URL in any accepted form."""
    return make_url(normalize_url(url)).set(drivername="postgresql").render_as_string(False)


class AuthSync:
    """Publishes this process's cache invalidations and applies the other processes' ones."""

    def __init__(self, dsn: str, cache: AuthCache) -> None:
        self._dsn = dsn
        self._cache = cache
        self._sender = secrets.token_hex(6)
        self._outbox: collections.deque[str] = collections.deque()
        self._wake = asyncio.Event()
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.received = 0
        """Invalidations from other processes applied since start."""

    async def start(self, wait_s: float = CONNECT_WAIT_S) -> None:
        """Hooks into the cache and connects; waits up to *wait_s* for the listener."""
        self._cache.publish = self.publish
        self._task = asyncio.create_task(self._run(), name="auth-sync")
        try:
            await asyncio.wait_for(self._connected.wait(), wait_s)
        except TimeoutError:
            log.warning(
                "auth invalidations: not listening yet after %.0f s (still trying); other "
                "processes' revocations apply here after gateway.auth_cache_ttl_s meanwhile",
                wait_s,
            )

    def publish(self, prefix: str | None) -> None:
        """Queues one invalidation (a key prefix, or None: everything) for the others."""
        if len(self._outbox) >= _MAX_QUEUED:
            self._outbox.clear()
            prefix = None
        self._outbox.append(f"{self._sender} {prefix or _EVERYTHING}")
        self._wake.set()

    async def close(self) -> None:
        """Stops listening (what is still queued is sent first, if the connection is up)."""
        self._cache.publish = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        delay_s = _RETRY_FIRST_S
        while True:
            try:
                conn = await asyncpg.connect(
                    self._dsn,
                    timeout=_CONNECT_TIMEOUT_S,
                    server_settings={"application_name": APPLICATION_NAME},
                )
            except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
                log.debug("auth invalidations: cannot connect (%s); retrying", exc)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, _RETRY_MAX_S)
                continue
            try:
                lost = asyncio.Event()
                conn.add_termination_listener(lambda _conn, event=lost: event.set())
                await conn.add_listener(CHANNEL, self._on_notify)
                # whatever was published while this process was not listening is unknown here
                self._cache.drop()
                self._connected.set()
                delay_s = _RETRY_FIRST_S
                await self._send_until_lost(conn, lost)
                log.warning("auth invalidations: connection lost; reconnecting")
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("auth invalidations: connection failed (%s); reconnecting", exc)
            finally:
                self._connected.clear()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.close(), 1.0)
            await asyncio.sleep(delay_s)

    async def _send_until_lost(self, conn: asyncpg.Connection, lost: asyncio.Event) -> None:
        while not lost.is_set():
            while self._outbox:
                # removed only once sent: a failure leaves it for the next connection
                await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, self._outbox[0])
                self._outbox.popleft()
            self._wake.clear()
            wake = asyncio.ensure_future(self._wake.wait())
            gone = asyncio.ensure_future(lost.wait())
            try:
                await asyncio.wait({wake, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                wake.cancel()
                gone.cancel()

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        sender, _, prefix = payload.partition(" ")
        if sender == self._sender or not prefix:
            return  # this process's own, already applied
        self.received += 1
        self._cache.drop(None if prefix == _EVERYTHING else prefix)


async def auth_sync(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: propagates the app's auth cache invalidations on PostgreSQL (after the
    database's context, which creates the cache)."""
    url = app[CONFIG].database.url
    if is_sqlite(url):
        yield
        return
    sync = AuthSync(asyncpg_dsn(url), app[AUTH])
    await sync.start()
    yield
    await sync.close()
