"""Alembic environment: runs the revisions in migrations/versions on tandem's async engine.

Two ways in:

* programmatically, from gateway.store.migrate, which passes the URL in
  ``config.attributes["url"]`` (or an open sync ``Connection`` in
  ``config.attributes["connection"]``);
* the ``alembic`` command line with alembic.ini, where the URL comes from ``-x url=...`` or else
  tandem's configuration (config.yaml plus ``TANDEM_DATABASE__URL``).
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection, text

from common.config import load_config
from gateway.store.db import create_engine, is_sqlite, normalize_url
from gateway.store.models import Base

config = context.config
target_metadata = Base.metadata

if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    # Only for the command line; keep loggers created before this (the application's) alive.
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def database_url() -> str:
    """The URL to migrate: attributes (from code), then -x url=..., then tandem's config."""
    url = config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        url = load_config().database.url
    return normalize_url(str(url))


def run_migrations_offline() -> None:
    """`alembic upgrade --sql`: emit SQL for the configured database without connecting."""
    url = database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=is_sqlite(url),
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


MIGRATION_LOCK_KEY = 0x74616E64656D4D47  # "tandemMG"
"""PostgreSQL advisory lock held while one process migrates (a bigint; the batch leader's lock,
gateway/batch/leader.py, is another)."""


def do_run_migrations(connection: Connection) -> None:
    """Runs the migrations on an open (sync-facade) connection, in one transaction.

    On PostgreSQL the transaction first takes `MIGRATION_LOCK_KEY`, so gateways started
    together on one fresh database migrate one after the other: the second reads the revision
    the first committed and has nothing left to do (before, both created the same tables and
    one failed to start)."""
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode recreates the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
            )
        context.run_migrations()


async def run_async_migrations(url: str) -> None:
    """Opens tandem's async engine (same SQLite pragmas as the app) and migrates through it."""
    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(do_run_migrations)
            await connection.commit()
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    """Migrates a live database: a connection handed in, else a fresh engine and event loop."""
    connection = config.attributes.get("connection")
    if connection is not None:
        do_run_migrations(connection)
        return
    # asyncio.run needs a thread without a running loop: migrate.upgrade_async provides one.
    asyncio.run(run_async_migrations(database_url()))


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
