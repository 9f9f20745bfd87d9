"""Tenants on SQLite and PostgreSQL: create, read, update, soft delete."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest

from gateway.store import Conflict, Quota, Slo, Store

RT_SLO = Slo(ttft_target_ms=200.0, tpot_target_ms=50.0)
BE_SLO = Slo(deadline_s=3600.0, allow_rt=True)
QUOTA = Quota(requests_per_min=600, tokens_per_min=100_000, max_concurrent=8)


async def test_create_and_get_round_trip(store: Store) -> None:
    before = datetime.now(UTC)
    tenant = await store.create_tenant("acme", "rt", RT_SLO, QUOTA)

    assert tenant.id.startswith("ten_") and len(tenant.id) == 16
    assert (tenant.name, tenant.tier, tenant.slo, tenant.quota) == ("acme", "rt", RT_SLO, QUOTA)
    assert before <= tenant.created_at <= datetime.now(UTC)
    assert tenant.created_at.tzinfo is not None and not tenant.deleted
    assert await store.get_tenant(tenant.id) == tenant


async def test_unlimited_quota_and_big_token_budgets(store: Store) -> None:
    quota = Quota(monthly_tokens=50_000_000_000)  # past 32 bits
    tenant = await store.create_tenant("bulk", "be", BE_SLO, quota)
    got = await store.get_tenant(tenant.id)
    assert got is not None
    assert got.quota == quota and got.quota.requests_per_min is None
    assert got.slo.allow_rt is True and got.slo.ttft_target_ms is None


async def test_tenant_json_has_iso_timestamps(store: Store) -> None:
    tenant = await store.create_tenant("json", "rt", RT_SLO, QUOTA)
    body = msgspec.json.decode(msgspec.json.encode(tenant))
    assert datetime.fromisoformat(body["created_at"]) == tenant.created_at
    assert body["slo"]["ttft_ms"] == 200.0


async def test_duplicate_name_is_a_conflict_naming_it(store: Store) -> None:
    await store.create_tenant("acme", "rt", RT_SLO, QUOTA)
    with pytest.raises(Conflict, match="'acme'"):
        await store.create_tenant("acme", "be", BE_SLO, Quota())
    assert [t.name for t in await store.list_tenants()] == ["acme"]


async def test_unknown_tier_is_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="tier"):
        await store.create_tenant("x", "gold", RT_SLO, QUOTA)  # type: ignore[arg-type]


async def test_list_tenants_oldest_first(store: Store) -> None:
    a = await store.create_tenant("a", "rt", RT_SLO, QUOTA)
    b = await store.create_tenant("b", "be", BE_SLO, Quota())
    assert await store.list_tenants() == [a, b]


async def test_update_changes_only_given_fields_and_replaces_slo_and_quota(store: Store) -> None:
    tenant = await store.create_tenant("acme", "rt", RT_SLO, QUOTA)

    renamed = await store.update_tenant(tenant.id, name="acme-2")
    assert renamed is not None
    assert (renamed.name, renamed.tier, renamed.slo, renamed.quota) == (
        "acme-2",
        "rt",
        RT_SLO,
        QUOTA,
    )
    assert renamed.updated_at >= tenant.updated_at

    # A new contract replaces the old one whole: fields not given are cleared, not kept.
    changed = await store.update_tenant(
        tenant.id, tier="be", slo=Slo(deadline_s=60), quota=Quota(max_concurrent=1)
    )
    assert changed is not None
    assert changed.tier == "be"
    assert changed.slo == Slo(deadline_s=60.0)
    assert changed.quota == Quota(max_concurrent=1)
    assert await store.get_tenant(tenant.id) == changed


async def test_update_to_a_taken_name_is_a_conflict(store: Store) -> None:
    await store.create_tenant("a", "rt", RT_SLO, QUOTA)
    b = await store.create_tenant("b", "rt", RT_SLO, QUOTA)
    with pytest.raises(Conflict, match="'a'"):
        await store.update_tenant(b.id, name="a")
    assert (await store.get_tenant(b.id)) == b


async def test_update_of_unknown_tenant_is_none(store: Store) -> None:
    assert await store.update_tenant("ten_000000000000", name="x") is None


async def test_soft_delete_hides_the_tenant_but_keeps_it(store: Store) -> None:
    tenant = await store.create_tenant("gone", "rt", RT_SLO, QUOTA)
    keep = await store.create_tenant("kept", "be", BE_SLO, QUOTA)

    assert await store.delete_tenant(tenant.id) is True
    assert await store.delete_tenant(tenant.id) is False
    assert await store.delete_tenant("ten_000000000000") is False

    assert await store.get_tenant(tenant.id) is None
    assert await store.list_tenants() == [keep]
    assert await store.update_tenant(tenant.id, name="back") is None
    deleted = await store.get_tenant(tenant.id, include_deleted=True)
    assert deleted is not None and deleted.deleted and deleted.name == "gone"
    assert {t.id for t in await store.list_tenants(include_deleted=True)} == {tenant.id, keep.id}


async def test_a_deleted_tenants_name_can_be_reused(store: Store) -> None:
    old = await store.create_tenant("acme", "rt", RT_SLO, QUOTA)
    await store.delete_tenant(old.id)
    new = await store.create_tenant("acme", "be", BE_SLO, QUOTA)
    assert new.id != old.id
    assert [t.id for t in await store.list_tenants()] == [new.id]
