"""Fixtures of the fast gateway tier (tests/gateway): the real gateway app in front of the
simulator's SGLang-compatible HTTP server, both in this process and event loop on port 0 — no
subprocess, no SGLang, no torch.

* `sim_port`: one simulator per session (like the one engine every gateway of a deployment
  fronts); tests never rely on it being idle when they start.
* `gw`: a fresh gateway per test, on its own SQLite database (a copy of one migrated per session),
  so tenants, quotas, usage records and metrics never leak between tests.
* `gw_engine_down`: the same with nothing listening on the engine's port.
* `make_gateway(**env)`: a gateway with ``TANDEM_*`` config overrides.

The tokenizer is the built-in tiny model, built once per session (`tiny_model_dir`,
tests/functional/gateway_fixtures.py; about half a second). Every test here is marked `gateway`
(``-m gateway`` selects the tier).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
import pytest_asyncio

from tests.gateway.harness import (
    Gateway,
    closed_port,
    migrated_database,
    running_gateway,
    serve,
    sim_app,
)

GatewayFactory = Callable[..., AbstractAsyncContextManager[Gateway]]
_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gateway)


@pytest_asyncio.fixture(scope="session")
async def sim_port() -> AsyncIterator[int]:
    """The port of the session's simulator (SGLang's HTTP surface), served in this event loop."""
    async with serve(sim_app()) as server:
        assert server.port is not None
        yield server.port


@pytest_asyncio.fixture(scope="session")
async def template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database migrated to head once per session; each gateway gets a copy."""
    return await migrated_database(tmp_path_factory.mktemp("template") / "tandem.db")


@pytest.fixture
def make_gateway(
    tmp_path: Path, tiny_model_dir: Path, sim_port: int, template_db: Path
) -> GatewayFactory:
    """``async with make_gateway(**env) as gw``: a gateway with ``TANDEM_*`` overrides (its own
    database), in front of the simulator."""
    count = 0

    def make(**env: str) -> AbstractAsyncContextManager[Gateway]:
        nonlocal count
        count += 1
        folder = tmp_path / f"gateway-{count}"
        folder.mkdir()
        return running_gateway(folder, tiny_model_dir, sim_port, template_db=template_db, **env)

    return make


@pytest_asyncio.fixture
async def gw(make_gateway: GatewayFactory) -> AsyncIterator[Gateway]:
    """The gateway with the tier's default settings, in front of the simulator."""
    async with make_gateway() as gateway:
        yield gateway


@pytest_asyncio.fixture
async def gw_engine_down(
    tmp_path: Path, tiny_model_dir: Path, template_db: Path
) -> AsyncIterator[Gateway]:
    """A gateway whose engine is down (nothing listens on its port)."""
    async with (
        closed_port() as port,
        running_gateway(tmp_path, tiny_model_dir, port, template_db=template_db) as gateway,
    ):
        yield gateway
