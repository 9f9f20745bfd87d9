"""Fixtures for the store tests, run against SQLite (a temporary file) and a real PostgreSQL.

tests/conftest.py imports these fixtures, so every test module can use them::

    from tests.functional.store_fixtures import empty_db_url, pg_server, store, store_engine

PostgreSQL: every test session creates its own databases ``tandem_test_<random>[_<n>]`` on the
server at 127.0.0.1:5432 (user postgres, trust auth) and drops them at the end, so concurrent
runs never see each other's data. Those tests carry ``@pytest.mark.postgres`` (select or deselect
with ``-m``); they fail, saying why, when no server answers (.ci/run starts it).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store import Store, create_engine, session_factory, upgrade_async
from gateway.store.models import Base

PG_HOST = "127.0.0.1"
PG_PORT = 5432
PG_USER = "postgres"
PG_ADMIN_DATABASE = "test"

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
"""Parameters of every store fixture: each test runs once per database."""


async def _admin_execute(sql: str) -> None:
    conn = await asyncpg.connect(
        host=PG_HOST, port=PG_PORT, user=PG_USER, database=PG_ADMIN_DATABASE, timeout=5
    )
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


class PgServer:
    """Creates fresh, empty PostgreSQL databases for one test session and drops them afterwards.

    Lazy: nothing is contacted until a PostgreSQL test asks for a database, so SQLite-only runs
    need no server.
    """

    def __init__(self) -> None:
        self.run = f"tandem_test_{secrets.token_hex(4)}"
        self.created: list[str] = []
        self.unreachable: str | None = None

    async def new_database(self) -> str:
        """The URL of a new empty database; fails the calling test when no server answers."""
        if self.unreachable is None and not self.created:
            try:
                await _admin_execute("SELECT 1")
            except (OSError, asyncpg.PostgresError) as exc:
                self.unreachable = f"PostgreSQL at {PG_HOST}:{PG_PORT} is not reachable: {exc}"
        if self.unreachable is not None:
            pytest.fail(self.unreachable)
        name = self.run if not self.created else f"{self.run}_{len(self.created)}"
        await _admin_execute(f'CREATE DATABASE "{name}"')
        self.created.append(name)
        return f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"

    async def drop_all(self) -> None:
        """Drops every database this session created."""
        for name in self.created:
            # FORCE: a connection a failed test left open must not keep the database alive.
            await _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.created.clear()


@pytest_asyncio.fixture(scope="session")
async def pg_server() -> AsyncIterator[PgServer]:
    """The session's PostgreSQL database factory (see PgServer)."""
    server = PgServer()
    yield server
    await server.drop_all()


async def _new_url(backend: str, sqlite_path: Path, pg: PgServer) -> str:
    if backend == "sqlite":
        return f"sqlite:///{sqlite_path}"
    return await pg.new_database()


@pytest_asyncio.fixture(params=BACKENDS)
async def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path, pg_server: PgServer) -> str:
    """The URL of a fresh database with no tables (plain sqlite:// / postgresql:// form)."""
    return await _new_url(request.param, tmp_path / "db" / "tandem.db", pg_server)


@pytest_asyncio.fixture(scope="session", params=BACKENDS)
async def store_engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pg_server: PgServer
) -> AsyncIterator[AsyncEngine]:
    """An engine on a database migrated to head, shared by the session's store tests."""
    url = await _new_url(request.param, tmp_path_factory.mktemp("store") / "tandem.db", pg_server)
    await upgrade_async(url)
    engine = create_engine(url)
    yield engine
    await engine.dispose()


@pytest_asyncio.fixture
async def store(store_engine: AsyncEngine) -> AsyncIterator[Store]:
    """A Store on the migrated database, emptied after each test."""
    yield Store(session_factory(store_engine))
    async with store_engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            await conn.execute(delete(table))
