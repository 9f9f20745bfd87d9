"""Two gateways on one PostgreSQL database in front of one engine hold each tenant's limits
together: two apps in this process (two quota limiters, two connection pools), and `tandem serve`
in a child process next to a gateway in this one."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import func, select

from common.sockets import free_port
from gateway.state import DB_ENGINE, QUOTAS
from gateway.store.models import GatewayInstanceRow, QuotaMonthlyRow
from tests.functional.gateway_fixtures import ADMIN_TOKEN, GatewayHandle, start_gateway
from tests.functional.store_fixtures import PgServer
from tests.functional.test_quotas import assert_rate_limited, chat
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
SYNC_S = 0.2


@pytest_asyncio.fixture
async def two_gateways(
    engine_server: Any, pg_server: PgServer
) -> AsyncIterator[tuple[GatewayHandle, GatewayHandle]]:
    url = await pg_server.new_database()
    env = {"TANDEM_QUOTA__SYNC_INTERVAL_S": str(SYNC_S), "TANDEM_GATEWAY__AUTH_CACHE_TTL_S": "0.5"}
    started = [
        await start_gateway(url, engine_server.port, engine_server.model_path, **env)
        for _ in range(2)
    ]
    yield started[0][1], started[1][1]
    for server, handle in started:
        await handle.session.close()
        await server.close()


async def new_tenant(gw: GatewayHandle, name: str, **quota: int) -> tuple[str, str]:
    status, tenant = await gw.admin(
        "POST",
        "/tenants",
        {"name": name, "tier": "rt", "slo": {"ttft_ms": 5000, "tpot_ms": 1000}, "quota": quota},
    )
    assert status == 201, tenant
    status, key = await gw.admin("POST", f"/tenants/{tenant['id']}/keys")
    assert status == 201, key
    return tenant["id"], key["key"]


async def live_instances(gw: GatewayHandle) -> int:
    async with gw.app[DB_ENGINE].connect() as conn:
        return int(
            (await conn.execute(select(func.count()).select_from(GatewayInstanceRow))).scalar_one()
        )


async def heartbeats(gw: GatewayHandle) -> dict[str, datetime]:
    """Every gateway instance's last quota-sync heartbeat, as the shared database has it."""
    async with gw.app[DB_ENGINE].connect() as conn:
        rows = await conn.execute(select(GatewayInstanceRow.id, GatewayInstanceRow.heartbeat_at))
        return {row.id: row.heartbeat_at for row in rows}


async def all_synced(gw: GatewayHandle, instances: int = 2) -> None:
    """Waits until *instances* gateways are registered and every one of them has applied a quota
    sync that began after this call saw them all (and whatever the caller saw before calling).

    Each sync writes the instance's heartbeat and reads everyone's rows in one transaction, and an
    instance's syncs run one after another. A heartbeat newer than the ones seen now is a sync
    that committed later but may have begun earlier; the next one began after that commit; and a
    third means the second one's view has been applied."""
    seen = await wait_until(
        lambda: _if_count(heartbeats(gw), instances), what=f"{instances} gateways registered"
    )
    for _ in range(3):

        async def advanced(before: dict[str, datetime] = seen) -> dict[str, datetime] | None:
            now = await heartbeats(gw)
            moved = all(now.get(i, before[i]) > before[i] for i in before)
            return now if moved else None

        seen = await wait_until(advanced, what="every gateway's next quota sync")


async def _if_count(
    found: Awaitable[dict[str, datetime]], count: int
) -> dict[str, datetime] | None:
    rows = await found
    return rows if len(rows) == count else None


async def monthly_tokens(gw: GatewayHandle, tenant_id: str) -> int:
    """Tokens the shared database counts for the tenant (all months)."""
    async with gw.app[DB_ENGINE].connect() as conn:
        total = await conn.execute(
            select(func.coalesce(func.sum(QuotaMonthlyRow.tokens), 0)).where(
                QuotaMonthlyRow.tenant_id == tenant_id
            )
        )
        return int(total.scalar_one())


async def test_both_instances_register_and_see_each_other(
    two_gateways: tuple[GatewayHandle, GatewayHandle],
) -> None:
    a, b = two_gateways
    await all_synced(a)
    assert await live_instances(a) == 2
    ids = {a.app[QUOTAS].instance_id, b.app[QUOTAS].instance_id}
    assert len(ids) == 2


async def test_requests_per_min_holds_across_two_gateways(
    two_gateways: tuple[GatewayHandle, GatewayHandle],
) -> None:
    a, b = two_gateways
    _, key = await new_tenant(a, "shared-rpm", requests_per_min=10)
    await all_synced(a)  # both know of each other
    started = time.monotonic()
    served = {id(a): 0, id(b): 0}
    refusals: list[tuple[int, dict[str, str], Any]] = []
    for gw in (a, b) * 15:
        status, headers, body = await chat(gw, key)
        if status == 200:
            served[id(gw)] += 1
        else:
            refusals.append((status, headers, body))
    elapsed = time.monotonic() - started
    total = sum(served.values())
    # one bucket of 10 (+ what 10/min refills while the test runs), whichever gateway serves
    assert 8 <= total <= 10 + int(elapsed * 10 / 60) + 1, served
    assert all(n >= 3 for n in served.values()), served  # each got its share
    assert_rate_limited(*refusals[0], "requests_per_min")


async def test_max_concurrent_holds_across_two_gateways(
    two_gateways: tuple[GatewayHandle, GatewayHandle],
) -> None:
    a, b = two_gateways
    _, key = await new_tenant(a, "shared-conc", max_concurrent=2)
    await all_synced(a)
    results = await asyncio.gather(*(chat(gw, key, max_tokens=120) for gw in (a, b, a, b, a, b)))
    statuses = sorted(r[0] for r in results)
    assert statuses.count(200) <= 2 and statuses.count(200) >= 1, statuses
    for status, headers, body in results:
        if status != 200:
            assert_rate_limited(status, headers, body, "max_concurrent")
    # with the slots free again, each gateway serves (a client honouring Retry-After: a
    # gateway whose share moved to the other may refuse until its next sync)
    for gw in (a, b):
        for _ in range(5):
            status, headers, body = await chat(gw, key)
            if status != 429:
                break
            # the behaviour under test: a client that waits as long as Retry-After says
            await asyncio.sleep(int(headers["Retry-After"]))
        assert status == 200, body


async def test_monthly_budget_is_shared(two_gateways: tuple[GatewayHandle, GatewayHandle]) -> None:
    a, b = two_gateways
    tenant_id, key = await new_tenant(a, "shared-month", monthly_tokens=100)
    status, _, body = await chat(a, key, max_tokens=110)  # uses the whole month on gateway a
    assert status == 200, body
    # a adds its tokens to the shared count at its next sync; then b reads it at one of its own
    await wait_until(lambda: _at_least(monthly_tokens(a, tenant_id), 110), what="a's tokens shared")
    await all_synced(a)
    status, headers, body = await chat(b, key)
    assert_rate_limited(status, headers, body, "monthly_tokens")
    assert "have been used in" in body["error"]["message"]


async def test_a_limit_changed_on_one_gateway_applies_on_the_other(
    two_gateways: tuple[GatewayHandle, GatewayHandle],
) -> None:
    a, b = two_gateways
    tenant_id, key = await new_tenant(a, "shared-patch", max_concurrent=0)
    status, _, body = await chat(b, key)  # suspended: refused for good, no retry
    assert status == 403 and body["error"]["code"] == "max_concurrent_is_zero", body
    status, _ = await a.admin("PATCH", f"/tenants/{tenant_id}", {"quota": {"max_concurrent": 4}})
    assert status == 200

    async def served_by_b() -> bool:
        status, _, body = await chat(b, key)
        if status != 200:  # until b's auth cache (0.5 s here) picks up the new quota
            assert status == 403 and body["error"]["code"] == "max_concurrent_is_zero", body
        return status == 200

    await wait_until(served_by_b, timeout_s=5, what="the new limit applied on gateway b")


async def test_a_stopped_gateway_leaves_the_set(engine_server: Any, pg_server: PgServer) -> None:
    url = await pg_server.new_database()
    env = {"TANDEM_QUOTA__SYNC_INTERVAL_S": str(SYNC_S)}
    server_a, a = await start_gateway(url, engine_server.port, engine_server.model_path, **env)
    server_b, b = await start_gateway(url, engine_server.port, engine_server.model_path, **env)
    try:
        assert await live_instances(a) == 2
        await b.session.close()
        await server_b.close()
        assert await live_instances(a) == 1
    finally:
        await a.session.close()
        await server_a.close()


@pytest_asyncio.fixture
async def gateway_pair_in_two_processes(
    engine_server: Any, pg_server: PgServer, tmp_path: Path
) -> AsyncIterator[tuple[GatewayHandle, GatewayHandle]]:
    """`tandem serve` (gateway only) in a child process, and a gateway in this one, on one
    PostgreSQL database in front of the same engine."""
    url = await pg_server.new_database()
    port = free_port()
    env = dict(
        os.environ,
        TANDEM_ADMIN_TOKEN=ADMIN_TOKEN,
        TANDEM_GATEWAY__PORT=str(port),
        TANDEM_DATABASE__URL=url,
        TANDEM_ENGINE__LAUNCH="false",
        TANDEM_ENGINE__PORT=str(engine_server.port),
        TANDEM_MODEL__PATH=str(engine_server.model_path),
        TANDEM_QUOTA__SYNC_INTERVAL_S=str(SYNC_S),
    )
    log_path = tmp_path / "child-gateway.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server, local = await start_gateway(
        url, engine_server.port, engine_server.model_path, TANDEM_QUOTA__SYNC_INTERVAL_S=str(SYNC_S)
    )
    child = GatewayHandle(f"http://127.0.0.1:{port}", local.app, local.session)

    async def child_ready() -> bool:
        assert proc.poll() is None, f"the child gateway exited at start-up:\n{log_path.read_text()}"
        try:
            async with local.session.get(f"{child.base_url}/readyz") as resp:
                return resp.status == 200
        except OSError:
            return False

    try:
        await wait_until(child_ready, timeout_s=60, what="the child gateway ready")
        yield local, child
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        await local.session.close()
        await server.close()


async def test_requests_per_min_holds_across_two_processes(
    gateway_pair_in_two_processes: tuple[GatewayHandle, GatewayHandle],
) -> None:
    local, child = gateway_pair_in_two_processes
    _, key = await new_tenant(child, "two-process-rpm", requests_per_min=10)
    await all_synced(local)
    assert await live_instances(local) == 2
    started = time.monotonic()
    served = {"local": 0, "child": 0}
    for name, gw in (("local", local), ("child", child)) * 15:
        status, headers, body = await chat(gw, key)
        if status == 200:
            served[name] += 1
        else:
            assert_rate_limited(status, headers, body, "requests_per_min")
    elapsed = time.monotonic() - started
    assert 8 <= sum(served.values()) <= 10 + int(elapsed * 10 / 60) + 1, served
    assert min(served.values()) >= 3, served


async def _at_least(value: Awaitable[int], floor: int) -> bool:
    return await value >= floor
