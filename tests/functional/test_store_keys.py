"""API keys on SQLite and PostgreSQL: create, look up, revoke; the secret is never stored."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, column, inspect, select, table
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.expression import ColumnClause

from gateway.keys import digest_matches, parse_prefix
from gateway.store import NotFound, Quota, Slo, Store, Tenant


async def make_tenant(store: Store, name: str = "acme") -> Tenant:
    return await store.create_tenant(
        name, "rt", Slo(ttft_target_ms=100.0, tpot_target_ms=20.0), Quota()
    )


async def test_created_key_authenticates_through_lookup(store: Store) -> None:
    tenant = await make_tenant(store)
    key, full_key = await store.create_key(tenant.id, name="ci")

    assert key.id.startswith("key_") and key.tenant_id == tenant.id and key.name == "ci"
    assert parse_prefix(full_key) == key.prefix
    assert key.revoked_at is None and key.last_used_at is None

    auth = await store.lookup_key(key.prefix)
    assert auth is not None
    assert (auth.key_id, auth.prefix, auth.revoked) == (key.id, key.prefix, False)
    assert digest_matches(full_key, auth.secret_sha256)
    assert not digest_matches(full_key + "x", auth.secret_sha256)
    assert auth.tenant == tenant


async def test_unknown_prefix_is_none(store: Store) -> None:
    assert await store.lookup_key("0123456789ab") is None


async def test_key_for_unknown_or_deleted_tenant_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound, match="ten_000000000000"):
        await store.create_key("ten_000000000000")
    tenant = await make_tenant(store)
    await store.delete_tenant(tenant.id)
    with pytest.raises(NotFound):
        await store.create_key(tenant.id)


async def test_revoke_is_seen_by_the_next_lookup(store: Store) -> None:
    tenant = await make_tenant(store)
    key, _ = await store.create_key(tenant.id)

    revoked = await store.revoke_key(key.id)
    assert revoked is not None and revoked.revoked_at is not None
    auth = await store.lookup_key(key.prefix)
    assert auth is not None and auth.revoked

    again = await store.revoke_key(key.id)  # idempotent: the first revocation time stays
    assert again is not None and again.revoked_at == revoked.revoked_at
    assert await store.revoke_key("key_000000000000") is None


async def test_deleting_a_tenant_revokes_all_its_keys(store: Store) -> None:
    tenant = await make_tenant(store)
    other = await make_tenant(store, "other")
    keys = [(await store.create_key(tenant.id))[0] for _ in range(3)]
    other_key, _ = await store.create_key(other.id)

    await store.delete_tenant(tenant.id)

    for key in keys:
        auth = await store.lookup_key(key.prefix)
        assert auth is not None and auth.revoked and auth.tenant.deleted
    assert all(k.revoked_at is not None for k in await store.list_keys(tenant.id))
    other_auth = await store.lookup_key(other_key.prefix)
    assert other_auth is not None and not other_auth.revoked


async def test_list_keys_shows_prefixes_oldest_first(store: Store) -> None:
    tenant = await make_tenant(store)
    first, _ = await store.create_key(tenant.id, "one")
    second, _ = await store.create_key(tenant.id, "two")
    await store.revoke_key(first.id)
    listed = await store.list_keys(tenant.id)
    assert [k.id for k in listed] == [first.id, second.id]
    assert listed[0].revoked_at is not None and listed[1].revoked_at is None
    assert await store.list_keys("ten_000000000000") == []


async def test_touch_keys_sets_last_used_and_never_goes_back(store: Store) -> None:
    tenant = await make_tenant(store)
    a, _ = await store.create_key(tenant.id)
    b, _ = await store.create_key(tenant.id)
    c, _ = await store.create_key(tenant.id)
    when = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)

    await store.touch_keys([a.id, b.id, a.id], when)
    await store.touch_keys(iter([a.id]), when - timedelta(minutes=5))  # a late, older batch
    await store.touch_keys([], when)

    used = {k.id: k.last_used_at for k in await store.list_keys(tenant.id)}
    assert used == {a.id: when, b.id: when, c.id: None}


def _every_value(conn: Connection) -> dict[str, list[str]]:
    """Every non-NULL value of every column of every table (reflected, not from our models)."""
    inspector = inspect(conn)
    values: dict[str, list[str]] = {}
    for name in inspector.get_table_names():
        columns: list[ColumnClause[Any]] = [column(c["name"]) for c in inspector.get_columns(name)]
        rows = conn.execute(select(*columns).select_from(table(name, *columns))).all()
        values[name] = [str(v) for row in rows for v in row if v is not None]
    return values


async def test_the_secret_is_nowhere_in_the_database(
    store: Store, store_engine: AsyncEngine
) -> None:
    tenant = await make_tenant(store)
    key, full_key = await store.create_key(tenant.id, name="scan")
    secret = full_key.split("_", 2)[2]

    async with store_engine.connect() as conn:
        values = await conn.run_sync(_every_value)

    assert values.keys() >= {"api_keys", "tenants", "usage_records", "alembic_version"}
    assert key.prefix in values["api_keys"]  # the scan does see the key's row
    leaks = [(t, v) for t, vs in values.items() for v in vs if secret in v or full_key in v]
    assert leaks == []
