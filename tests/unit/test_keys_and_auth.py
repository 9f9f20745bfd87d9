"""API keys and the authentication cache (a fake store counts lookups)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gateway import keys
from gateway.auth import AuthCache
from gateway.errors import ApiError
from gateway.store.types import AuthRecord, Quota, Slo, Tenant

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def make_tenant(deleted: bool = False) -> Tenant:
    return Tenant(
        id="ten_000000000001",
        name="acme",
        tier="rt",
        slo=Slo(ttft_target_ms=200, tpot_target_ms=50),
        quota=Quota(),
        created_at=NOW,
        updated_at=NOW,
        deleted=deleted,
    )


class FakeStore:
    def __init__(self) -> None:
        self.records: dict[str, AuthRecord] = {}
        self.lookups = 0

    def add(self, material: keys.KeyMaterial, revoked: bool = False, deleted: bool = False) -> None:
        self.records[material.prefix] = AuthRecord(
            key_id="key_1",
            prefix=material.prefix,
            secret_sha256=material.sha256,
            revoked=revoked,
            tenant=make_tenant(deleted),
        )

    async def lookup_key(self, prefix: str) -> AuthRecord | None:
        self.lookups += 1
        return self.records.get(prefix)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_generated_keys_parse_and_verify() -> None:
    material = keys.generate_key()
    assert material.key.startswith("tdm_")
    assert keys.parse_prefix(material.key) == material.prefix
    assert keys.digest_matches(material.key, material.sha256)
    assert not keys.digest_matches(material.key + "x", material.sha256)
    assert material.key not in repr(material)


@pytest.mark.parametrize(
    "bad",
    ["", "sk-123", "tdm_short_x", "tdm_ZZZZZZZZZZZZ_" + "a" * 40, "tdm_0123456789ab_tooshort"],
)
def test_malformed_keys_have_no_prefix(bad: str) -> None:
    assert keys.parse_prefix(bad) is None


async def test_valid_key_authenticates_and_is_cached() -> None:
    store, clock = FakeStore(), Clock()
    material = keys.generate_key()
    store.add(material)
    auth = AuthCache(store, ttl_s=5.0, clock=clock)  # type: ignore[arg-type]
    principal = await auth.authenticate(material.key)
    assert principal.tenant.name == "acme" and principal.key_prefix == material.prefix
    await auth.authenticate(material.key)
    assert store.lookups == 1
    clock.now = 6.0
    await auth.authenticate(material.key)
    assert store.lookups == 2


async def test_wrong_secret_with_a_known_prefix_is_refused() -> None:
    store = FakeStore()
    material = keys.generate_key()
    store.add(material)
    auth = AuthCache(store, ttl_s=5.0)  # type: ignore[arg-type]
    forged = f"tdm_{material.prefix}_{'A' * 43}"
    with pytest.raises(ApiError) as info:
        await auth.authenticate(forged)
    assert info.value.status == 401


@pytest.mark.parametrize(("revoked", "deleted"), [(True, False), (False, True)])
async def test_revoked_key_or_deleted_tenant_is_refused(revoked: bool, deleted: bool) -> None:
    store = FakeStore()
    material = keys.generate_key()
    store.add(material, revoked=revoked, deleted=deleted)
    with pytest.raises(ApiError, match="revoked") as info:
        await AuthCache(store, ttl_s=5.0).authenticate(material.key)  # type: ignore[arg-type]
    assert info.value.status == 401


async def test_invalidate_makes_revocation_immediate() -> None:
    store = FakeStore()
    material = keys.generate_key()
    store.add(material)
    auth = AuthCache(store, ttl_s=60.0)  # type: ignore[arg-type]
    await auth.authenticate(material.key)
    store.add(material, revoked=True)
    await auth.authenticate(material.key)  # still cached
    auth.invalidate(material.prefix)
    with pytest.raises(ApiError):
        await auth.authenticate(material.key)


async def test_unknown_and_malformed_keys_never_hammer_the_store() -> None:
    store = FakeStore()
    auth = AuthCache(store, ttl_s=5.0)  # type: ignore[arg-type]
    for _ in range(3):
        with pytest.raises(ApiError):
            await auth.authenticate("not-a-key")
    unknown = keys.generate_key().key
    for _ in range(3):
        with pytest.raises(ApiError):
            await auth.authenticate(unknown)
    assert store.lookups == 1
