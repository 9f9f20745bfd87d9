"""Alembic migrations on SQLite and PostgreSQL: from code, from the command line, and in step
with the ORM models."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, inspect, text

from gateway.store import create_engine, current_revision, head_revision, upgrade, upgrade_async
from gateway.store.migrate import ALEMBIC_INI, alembic_config, is_at_head
from gateway.store.models import Base
from tests.functional.store_fixtures import PgServer

TABLES = {"tenants", "api_keys", "slo_contracts", "quotas", "usage_records", "length_history"}
TABLES |= {"files", "batches", "batch_items"}  # 0002
TABLES |= {"gateway_instances", "quota_demand", "quota_monthly"}  # 0003; 0004-0007 add none


async def table_names(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
    finally:
        await engine.dispose()


async def test_upgrade_from_empty_creates_every_table_at_head(empty_db_url: str) -> None:
    assert await current_revision(empty_db_url) is None
    assert not await is_at_head(empty_db_url)

    await upgrade_async(empty_db_url)

    assert await table_names(empty_db_url) == TABLES | {"alembic_version"}
    assert await current_revision(empty_db_url) == head_revision()
    assert await is_at_head(empty_db_url)


async def test_upgrading_twice_is_a_no_op_that_keeps_data(empty_db_url: str) -> None:
    await upgrade_async(empty_db_url)
    engine = create_engine(empty_db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO length_history (length_key, output_len, created_at) "
                    "VALUES ('k', 7, CURRENT_TIMESTAMP)"
                )
            )
        await upgrade_async(empty_db_url)
        assert await current_revision(engine) == head_revision()
        async with engine.connect() as conn:
            kept = await conn.scalars(text("SELECT output_len FROM length_history"))
            assert list(kept) == [7]
    finally:
        await engine.dispose()


async def test_sync_upgrade_runs_in_a_worker_thread(empty_db_url: str) -> None:
    # upgrade() owns an event loop, so a thread is the way to call it from async code.
    await asyncio.to_thread(upgrade, empty_db_url)
    assert await current_revision(empty_db_url) == head_revision()


async def test_downgrade_to_base_drops_everything_and_upgrade_restores_it(
    empty_db_url: str,
) -> None:
    await upgrade_async(empty_db_url)
    await asyncio.to_thread(command.downgrade, alembic_config(empty_db_url), "base")
    assert await table_names(empty_db_url) <= {"alembic_version"}
    assert await current_revision(empty_db_url) is None
    await upgrade_async(empty_db_url)
    assert await table_names(empty_db_url) == TABLES | {"alembic_version"}


async def _columns(url: str, table: str) -> set[str]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(
                lambda c: {col["name"] for col in inspect(c).get_columns(table)}
            )
    finally:
        await engine.dispose()


async def test_0004_drops_the_copied_columns_and_downgrade_restores_them(
    empty_db_url: str,
) -> None:
    await upgrade_async(empty_db_url, "0003")
    engine = create_engine(empty_db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO tenants (id, name, tier, created_at, updated_at) "
                    "VALUES ('ten_1', 'a', 'rt', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            await conn.execute(
                text(
                    "INSERT INTO slo_contracts (tenant_id, ttft_ms, tpot_ms, token_group, "
                    "allow_rt, updated_at) VALUES ('ten_1', 200, 50, 16, false, CURRENT_TIMESTAMP)"
                )
            )
            await conn.execute(
                text(
                    "INSERT INTO usage_records (request_id, tenant_id, tier, model, endpoint, "
                    "stream, prompt_tokens, completion_tokens, ttft_ms, tbt_mean_ms, tpot_ms, "
                    "status, http_status, created_at, finished_at) VALUES ('r1', 'ten_1', 'rt', "
                    "'m', 'chat', false, 3, 4, 120, 21, 21, 'ok', 200, CURRENT_TIMESTAMP, "
                    "CURRENT_TIMESTAMP)"
                )
            )
        await upgrade_async(empty_db_url)
        assert "tbt_mean_ms" not in await _columns(empty_db_url, "usage_records")
        assert "token_group" not in await _columns(empty_db_url, "slo_contracts")
        async with engine.connect() as conn:
            kept = await conn.execute(text("SELECT ttft_ms, tpot_ms FROM slo_contracts"))
            assert [tuple(r) for r in kept] == [(200.0, 50.0)]
            kept = await conn.execute(text("SELECT request_id, tpot_ms FROM usage_records"))
            assert [tuple(r) for r in kept] == [("r1", 21.0)]

        await asyncio.to_thread(command.downgrade, alembic_config(empty_db_url), "0003")
        async with engine.connect() as conn:
            back = await conn.execute(text("SELECT tbt_mean_ms, tpot_ms FROM usage_records"))
            assert [tuple(r) for r in back] == [(21.0, 21.0)]  # refilled from tpot_ms
            back = await conn.execute(text("SELECT token_group, ttft_ms FROM slo_contracts"))
            assert [tuple(r) for r in back] == [(None, 200.0)]  # the column, not its values
    finally:
        await engine.dispose()


async def test_0005_gives_existing_contracts_the_defaults_and_downgrade_drops_the_columns(
    empty_db_url: str,
) -> None:
    await upgrade_async(empty_db_url, "0004")
    engine = create_engine(empty_db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO tenants (id, name, tier, created_at, updated_at) "
                    "VALUES ('ten_1', 'a', 'rt', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            await conn.execute(
                text(
                    "INSERT INTO slo_contracts (tenant_id, ttft_ms, tpot_ms, allow_rt, "
                    "updated_at) VALUES ('ten_1', 200, 50, false, CURRENT_TIMESTAMP)"
                )
            )
        await upgrade_async(empty_db_url)
        assert "admission" in await _columns(empty_db_url, "usage_records")
        async with engine.connect() as conn:
            kept = await conn.execute(
                text("SELECT ttft_ms, on_unattainable, weight FROM slo_contracts")
            )
            assert [tuple(r) for r in kept] == [(200.0, "reject", 1.0)]

        await asyncio.to_thread(command.downgrade, alembic_config(empty_db_url), "0004")
        assert "admission" not in await _columns(empty_db_url, "usage_records")
        columns = await _columns(empty_db_url, "slo_contracts")
        assert "weight" not in columns and "on_unattainable" not in columns
    finally:
        await engine.dispose()


async def test_0007_keeps_existing_usage_records_without_an_engine_and_downgrade_drops_it(
    empty_db_url: str,
) -> None:
    await upgrade_async(empty_db_url, "0006")
    engine = create_engine(empty_db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO usage_records (request_id, tenant_id, tier, model, endpoint, "
                    "stream, prompt_tokens, completion_tokens, status, http_status, created_at, "
                    "finished_at) VALUES ('r1', 'ten_1', 'rt', 'tandem-tiny', 'chat', false, 5, "
                    "7, 'ok', 200, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
        await upgrade_async(empty_db_url)
        async with engine.connect() as conn:
            kept = await conn.execute(
                text("SELECT request_id, completion_tokens, engine FROM usage_records")
            )
            assert [tuple(r) for r in kept] == [("r1", 7, None)]

        await asyncio.to_thread(command.downgrade, alembic_config(empty_db_url), "0006")
        assert "engine" not in await _columns(empty_db_url, "usage_records")
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM usage_records"))).scalar() == 1
    finally:
        await engine.dispose()


def _model_diff(connection: Connection) -> list[object]:
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    return list(compare_metadata(context, Base.metadata))


async def test_migrations_match_the_orm_models(empty_db_url: str) -> None:
    await upgrade_async(empty_db_url)
    engine = create_engine(empty_db_url)
    try:
        async with engine.connect() as conn:
            assert await conn.run_sync(_model_diff) == []
    finally:
        await engine.dispose()


async def test_alembic_command_line_uses_tandem_database_url(
    empty_db_url: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["TANDEM_DATABASE__URL"] = empty_db_url
    # Run from an unrelated directory: nothing may depend on the working directory.
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "alembic", "-c", str(ALEMBIC_INI), "upgrade", "head"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Running upgrade  -> 0001" in result.stderr
    assert await current_revision(empty_db_url) == head_revision()


async def test_sqlite_parent_directories_are_created(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a' / 'b' / 'tandem.db'}"
    await upgrade_async(url)
    assert (tmp_path / "a" / "b" / "tandem.db").is_file()
    assert await current_revision(url) == head_revision()


@pytest.mark.postgres
async def test_gateways_started_together_on_one_fresh_postgres_database_both_migrate(
    pg_server: PgServer,
) -> None:
    """Gateway replicas starting at once each migrate the database first (three processes, as
    `tandem serve` does): the later ones wait for the first's transaction and find nothing left
    to do (before, they created the same tables and all but one exited at start-up)."""
    for _ in range(2):
        url = await pg_server.new_database()
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                "import sys; from gateway.store import upgrade; upgrade(sys.argv[1])",
                url,
                stderr=asyncio.subprocess.PIPE,
            )
            for _ in range(3)
        ]
        for proc in procs:
            _, err = await asyncio.wait_for(proc.communicate(), 120)
            assert proc.returncode == 0, err.decode()[-2000:]
        assert await current_revision(url) == head_revision()
        assert await table_names(url) == TABLES | {"alembic_version"}
