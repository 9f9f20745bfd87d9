"""Two gateway processes on one PostgreSQL database (two apps here, each with its own auth cache
and connections): a revocation or a tenant change made through one reaches the other at once,
through LISTEN/NOTIFY, not after the other's auth cache entry expires (issue 16)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from gateway.auth_sync import APPLICATION_NAME, asyncpg_dsn
from tests.functional.store_fixtures import PgServer
from tests.gateway.harness import Gateway, running_gateway
from tests.waiting import wait_until

pytestmark = pytest.mark.postgres

CACHE_TTL_S = 120.0
"""Far longer than the test waits: only a propagated invalidation can make it pass."""
PROMPT_S = 10.0
"""How long the other process may take (it takes milliseconds; generous for busy machines)."""


@pytest_asyncio.fixture
async def two_gateways(
    tmp_path: Path, tiny_model_dir: Path, sim_port: int, pg_server: PgServer
) -> AsyncIterator[tuple[Gateway, Gateway]]:
    url = await pg_server.new_database()
    ttl = str(CACHE_TTL_S)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    async with (
        running_gateway(
            tmp_path / "a",
            tiny_model_dir,
            sim_port,
            TANDEM_DATABASE__URL=url,
            TANDEM_GATEWAY__AUTH_CACHE_TTL_S=ttl,
        ) as a,
        running_gateway(
            tmp_path / "b",
            tiny_model_dir,
            sim_port,
            TANDEM_DATABASE__URL=url,
            TANDEM_GATEWAY__AUTH_CACHE_TTL_S=ttl,
        ) as b,
    ):
        a.database_url = b.database_url = url
        yield a, b


async def new_key(gw: Gateway, name: str) -> tuple[str, str, str]:
    """A tenant with a key, created through *gw*: (tenant id, key id, key)."""
    tenant = await gw.admin(
        "POST", "/tenants", {"name": name, "tier": "rt", "slo": {"ttft_ms": 10000, "tpot_ms": 2000}}
    )
    assert tenant.status == 201, tenant
    key = await gw.admin("POST", f"/tenants/{tenant.body['id']}/keys")
    assert key.status == 201, key
    return tenant.body["id"], key.body["id"], key.body["key"]


async def refused_promptly(gw: Gateway, key: str, what: str) -> float:
    """Seconds until *gw* answers 401 to *key* (fails after `PROMPT_S`)."""
    start = time.monotonic()

    async def refused() -> bool:
        return (await gw.request("GET", "/v1/models", key=key)).status == 401

    await wait_until(refused, PROMPT_S, what=what)
    return time.monotonic() - start


async def test_a_revocation_reaches_the_other_gateway_at_once(
    two_gateways: tuple[Gateway, Gateway],
) -> None:
    a, b = two_gateways
    _, key_id, key = await new_key(a, "acme")
    _, _, other_key = await new_key(a, "globex")
    for gw in (a, b):  # both have the keys cached now
        assert (await gw.request("GET", "/v1/models", key=key)).status == 200
        assert (await gw.request("GET", "/v1/models", key=other_key)).status == 200
    assert (await a.admin("DELETE", f"/keys/{key_id}")).status == 200
    assert (await a.request("GET", "/v1/models", key=key)).status == 401  # this one: at once
    took_s = await refused_promptly(b, key, "the other gateway refusing the revoked key")
    print(f"revocation reached the other gateway in {took_s * 1000:.0f} ms")
    reply = await b.request("GET", "/v1/models", key=key)
    assert reply.error["message"] == "API key has been revoked"
    assert (await b.request("GET", "/v1/models", key=other_key)).status == 200


async def test_tenant_changes_reach_the_other_gateway_at_once(
    two_gateways: tuple[Gateway, Gateway],
) -> None:
    a, b = two_gateways
    tenant_id, _, key = await new_key(a, "acme")
    assert (await b.chat(key, max_tokens=1)).status == 200
    # a contract change the cache holds: a quota of no requests at all
    patched = await a.admin("PATCH", f"/tenants/{tenant_id}", {"quota": {"requests_per_min": 0}})
    assert patched.status == 200, patched

    async def limited() -> bool:
        return (await b.chat(key, max_tokens=1)).status == 403  # requests_per_min_is_zero

    await wait_until(limited, PROMPT_S, what="the other gateway applying the new quota")
    # and a deleted tenant: the change comes from the other gateway this time
    assert (await a.request("GET", "/v1/models", key=key)).status == 200  # cached there
    assert (await b.admin("DELETE", f"/tenants/{tenant_id}")).status == 200
    await refused_promptly(a, key, "the first gateway refusing the deleted tenant's key")


async def test_revocations_still_reach_the_other_gateway_after_the_listeners_are_cut(
    two_gateways: tuple[Gateway, Gateway],
) -> None:
    """A database restart cuts the listening connections: each gateway reconnects, and one that
    may have missed a notification meanwhile drops its whole cache."""
    a, b = two_gateways
    _, key_id, key = await new_key(a, "acme")
    assert (await b.request("GET", "/v1/models", key=key)).status == 200
    conn = await asyncpg.connect(asyncpg_dsn(a.database_url))
    try:
        cut = await conn.fetch(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = $1 AND datname = current_database()",
            APPLICATION_NAME,
        )
    finally:
        await conn.close()
    assert len(cut) == 2  # one listener per gateway
    assert (await a.admin("DELETE", f"/keys/{key_id}")).status == 200
    await refused_promptly(b, key, "the other gateway refusing the revoked key after the cut")
