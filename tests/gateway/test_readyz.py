"""`/readyz` answers from memory (issue 17): it never waits for the engine (an engine whose
`/health` stalls is reported truthfully from the gateway's cached probe) nor for the database
(no query per probe: the revision is checked in the background, and the head revision is not
re-read from the migration scripts on every call, which cost about 14 ms of event loop each)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from sqlalchemy import event
from sqlalchemy.engine import Engine

from gateway.store.readiness import CHECK_INTERVAL_S
from tests.gateway.harness import Gateway, running_gateway, serve, sim_app
from tests.waiting import wait_until

PROBE_TIMEOUT_S = 1.0
"""The gateway's health probe gives up on the stalled engine after this long, seconds."""


class StallingHealth:
    """The engine's `/health`, which can be made to hang until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.release.set()
        self.pending = 0
        """`/health` requests being held right now."""

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/health" and not self.release.is_set():
            self.pending += 1
            try:
                await self.release.wait()
            finally:
                self.pending -= 1
        return await handler(request)


async def readyz(gw: Gateway) -> tuple[int, dict[str, Any]]:
    reply = await gw.request("GET", "/readyz")
    return reply.status, reply.body


async def test_readyz_answers_while_the_engine_stalls_and_tells_the_truth(
    tmp_path: Path, tiny_model_dir: Path, template_db: Path
) -> None:
    health = StallingHealth()
    engine_app = sim_app()
    engine_app.middlewares.append(health.middleware)
    async with serve(engine_app) as engine:
        assert engine.port is not None
        async with running_gateway(
            tmp_path,
            tiny_model_dir,
            engine.port,
            template_db=template_db,
            TANDEM_ENGINE__HEALTH_PROBE_INTERVAL_S="0.1",
            TANDEM_ENGINE__HEALTH_PROBE_TIMEOUT_S=str(PROBE_TIMEOUT_S),
        ) as gw:
            assert (await readyz(gw))[0] == 200
            health.release.clear()  # the engine stops answering its health probe
            await wait_until(lambda: health.pending > 0, 10, what="a health probe held")
            # the probe hangs: /readyz answers all the same, from what it last knew
            status, _ = await readyz(gw)
            assert health.pending > 0 and status == 200
            # once the probe has given up, it says so
            status, body = await wait_until(
                lambda: _not_ready(gw), 10 + PROBE_TIMEOUT_S, what="/readyz 503"
            )
            assert body["checks"]["engine"] == "unavailable"
            assert body["engine"]["state"] == "unreachable"
            assert "did not answer its health probe" in body["engine"]["detail"]
            health.release.set()
            await wait_until(lambda: _ready(gw), 10, what="/readyz 200 again")


async def test_readyz_does_not_query_the_database(gw: Gateway) -> None:
    revision_queries = 0

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        nonlocal revision_queries
        revision_queries += "alembic_version" in statement

    event.listen(Engine, "before_cursor_execute", count)
    try:
        started = time.monotonic()
        for _ in range(30):
            assert (await readyz(gw))[0] == 200
        elapsed_s = time.monotonic() - started
    finally:
        event.remove(Engine, "before_cursor_execute", count)
    # the background check's, one per interval at most (before: one per /readyz, 30)
    assert revision_queries <= 1 + elapsed_s / CHECK_INTERVAL_S, revision_queries


async def _not_ready(gw: Gateway) -> tuple[int, dict[str, Any]] | None:
    status, body = await readyz(gw)
    return (status, body) if status == 503 else None


async def _ready(gw: Gateway) -> bool:
    return (await readyz(gw))[0] == 200
