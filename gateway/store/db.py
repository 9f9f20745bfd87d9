"""Engine and session set-up: URL normalisation, SQLite pragmas, the session factory."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.ext.asyncio import create_async_engine as _create_async_engine

# Dialect → the async driver we use for it (and the scheme aliases accepted for the dialect).
_ASYNC_DRIVERS = {"sqlite": "aiosqlite", "postgresql": "asyncpg", "postgres": "asyncpg"}
_CANONICAL = {"postgres": "postgresql"}

_P = ParamSpec("_P")
_T = TypeVar("_T")

SQLITE_BUSY_TIMEOUT_MS = 10_000
"""How long a SQLite writer waits for another's lock before failing, ms."""


def normalize_url(url: str) -> str:
    """The URL with its async driver: ``sqlite://`` → ``sqlite+aiosqlite://``,
    ``postgresql://`` / ``postgres://`` → ``postgresql+asyncpg://``.

    Raises ValueError naming the scheme for any other database or driver.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(
            f"database URL {url!r} has no scheme (expected sqlite:// or postgresql://)"
        )
    dialect, _, driver = scheme.partition("+")
    wanted = _ASYNC_DRIVERS.get(dialect.lower())
    if wanted is None:
        raise ValueError(f"unsupported database scheme {scheme!r} (use sqlite or postgresql)")
    if driver and driver.lower() != wanted:
        raise ValueError(
            f"unsupported database driver in scheme {scheme!r} (use {dialect}+{wanted} or plain "
            f"{dialect})"
        )
    return f"{_CANONICAL.get(dialect.lower(), dialect.lower())}+{wanted}://{rest}"


def is_sqlite(url: str) -> bool:
    """Whether *url* names a SQLite database."""
    return normalize_url(url).startswith("sqlite")


def create_engine(url: str, echo: bool = False) -> AsyncEngine:
    """An async engine for *url* (any form :func:`normalize_url` accepts).

    SQLite: creates the file's parent directory and sets, on every new connection, foreign keys
    on (off by default in SQLite), WAL (readers do not block the writer) and a busy timeout (a
    second writer waits instead of failing at once). The caller disposes the engine.
    """
    normalized = normalize_url(url)
    if not normalized.startswith("sqlite"):
        # pre_ping: a restarted PostgreSQL must not surface as one failed request per pooled
        # connection.
        return _create_async_engine(normalized, echo=echo, pool_pre_ping=True)
    database = make_url(normalized).database
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = _create_async_engine(normalized, echo=echo)
    event.listen(engine.sync_engine, "connect", _set_sqlite_pragmas)
    return engine


def _set_sqlite_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions whose objects stay readable after commit (the repo converts them afterwards)."""
    return async_sessionmaker(engine, expire_on_commit=False)


async def run_to_end(work: Coroutine[Any, Any, _T]) -> _T:
    """Runs *work* (a database write) to its end even when the caller is cancelled meanwhile;
    the caller's cancellation is raised once the write has committed or failed.

    Why: a task cancelled inside a SQLAlchemy transaction on aiosqlite can leave the connection
    abandoned mid-transaction; SQLite keeps that connection's write lock until it is garbage
    collected, and every other writer fails "database is locked" meanwhile. A client that goes
    away or a batch being cancelled must never cut a write in two.
    """
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                continue  # cancelled again while the write ends: still honoured below
        raise


def uninterrupted(
    method: Callable[_P, Coroutine[Any, Any, _T]],
) -> Callable[_P, Awaitable[_T]]:
    """Decorates a store method that writes: it runs to its end (`run_to_end`)."""

    @functools.wraps(method)
    async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        return await run_to_end(method(*args, **kwargs))

    return wrapper
