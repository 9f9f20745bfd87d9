"""Running the Alembic migrations from code (``tandem db upgrade``, ``tandem serve``, tests).

The migrations live in ``<repo root>/migrations``, found relative to this package so the working
directory does not matter. The URL is handed to migrations/env.py through
``Config.attributes["url"]`` (no alembic.ini is read, so the application's logging is untouched).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.db import create_engine, normalize_url

REPO_ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS_DIR = REPO_ROOT / "migrations"
"""Alembic's script directory (env.py, versions/)."""
ALEMBIC_INI = REPO_ROOT / "alembic.ini"
"""The ini file the `alembic` command line uses."""


def alembic_config(url: str | None = None) -> Config:
    """An Alembic Config for our migrations; with *url*, env.py migrates that database."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        config.attributes["url"] = normalize_url(url)
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Upgrades the database at *url* to *revision* (default: the newest).

    Synchronous and blocking; it runs its own event loop, so call it from a thread (or use
    :func:`upgrade_async`) when a loop is already running in this one.
    """
    command.upgrade(alembic_config(url), revision)


async def upgrade_async(url: str, revision: str = "head") -> None:
    """:func:`upgrade` in a worker thread, for callers inside a running event loop."""
    await asyncio.to_thread(upgrade, url, revision)


def head_revision() -> str:
    """The newest revision in migrations/versions."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:  # only if migrations/versions were empty
        raise RuntimeError(f"no Alembic revisions found in {MIGRATIONS_DIR}")
    return head


async def current_revision(url_or_engine: str | AsyncEngine) -> str | None:
    """The database's current revision; None for a database never migrated."""
    if isinstance(url_or_engine, AsyncEngine):
        return await _current_revision(url_or_engine)
    engine = create_engine(url_or_engine)
    try:
        return await _current_revision(engine)
    finally:
        await engine.dispose()


async def is_at_head(url_or_engine: str | AsyncEngine) -> bool:
    """Whether the database is at the newest migration (what /readyz asks)."""
    return await current_revision(url_or_engine) == head_revision()


async def _current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(_read_revision)


def _read_revision(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()
