"""Gateway fixtures: the real app on a real port, in front of the session's engine.

`gateway` fronts the patched SGLang engine (`engine_server`, one per test session) and keeps its
store in a SQLite file; `gateway_without_engine` points at a closed port (engine down) and takes
the database URL as a parameter, so admin tests run on SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from backend.launch.tiny_model import ensure_tiny_model
from common.config import load_config
from common.sockets import free_port
from gateway.app import create_app
from gateway.state import USAGE
from gateway.store import upgrade_async

ADMIN_TOKEN = "test-admin-token"


@dataclass
class GatewayHandle:
    """A running gateway and helpers to drive it like an operator would."""

    base_url: str
    app: web.Application
    session: aiohttp.ClientSession

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def admin(self, method: str, path: str, json: Any = None) -> tuple[int, Any]:
        async with self.session.request(
            method, f"{self.base_url}/admin/v1{path}", json=json, headers=self.admin_headers
        ) as resp:
            return resp.status, await resp.json()

    async def new_tenant(self, name: str, tier: str, **slo: Any) -> tuple[str, str]:
        """Creates a tenant and a key; returns (tenant id, key)."""
        status, tenant = await self.admin(
            "POST", "/tenants", {"name": name, "tier": tier, "slo": slo}
        )
        assert status == 201, tenant
        status, key = await self.admin("POST", f"/tenants/{tenant['id']}/keys")
        assert status == 201, key
        return tenant["id"], key["key"]

    async def flush_usage(self) -> None:
        await self.app[USAGE].flush()

    async def latest_requests(self, tenant_id: str, limit: int = 10) -> list[dict[str, Any]]:
        await self.flush_usage()
        status, body = await self.admin("GET", f"/requests?tenant={tenant_id}&limit={limit}")
        assert status == 200, body
        return list(body["data"])


async def start_gateway(
    db_url: str, engine_port: int, model_dir: Path, **env: str
) -> tuple[TestServer, GatewayHandle]:
    environ = {
        "TANDEM_DATABASE__URL": db_url,
        "TANDEM_ENGINE__PORT": str(engine_port),
        "TANDEM_ENGINE__LAUNCH": "false",
        "TANDEM_USAGE__FLUSH_INTERVAL_S": "0.1",
        # the test client shares the gateway's loop: see tests/gateway/harness.py FAST_BACKGROUND
        "TANDEM_GATEWAY__MAX_QUEUE_WAIT_S": "60",
        **env,
    }
    config = load_config(environ=environ)
    await upgrade_async(config.database.url)
    app = create_app(config, ADMIN_TOKEN, model_dir)
    server = TestServer(app, host="127.0.0.1", port=free_port(), handler_cancellation=True)
    await server.start_server()
    session = aiohttp.ClientSession()
    return server, GatewayHandle(str(server.make_url("")).rstrip("/"), app, session)


@pytest_asyncio.fixture(scope="session")
async def gateway(engine_server: Any, tmp_path_factory: Any) -> AsyncIterator[GatewayHandle]:
    db = tmp_path_factory.mktemp("gateway") / "tandem.db"
    server, handle = await start_gateway(
        f"sqlite:///{db}", engine_server.port, engine_server.model_path
    )
    yield handle
    await handle.session.close()
    await server.close()


@pytest_asyncio.fixture(scope="session")
async def tiny_model_dir(tmp_path_factory: Any) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("model-cache"))


@pytest_asyncio.fixture
async def gateway_without_engine(
    empty_db_url: str, tiny_model_dir: Path
) -> AsyncIterator[GatewayHandle]:
    """A gateway whose engine is down (nothing listens on its port)."""
    server, handle = await start_gateway(empty_db_url, free_port(), tiny_model_dir)
    yield handle
    await handle.session.close()
    await server.close()
