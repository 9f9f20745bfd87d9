"""A pool of engines behind one gateway (issue 18), on two simulators attached through
`engine.endpoints`: each engine is watched on its own, one that dies is out of placement while
requests go on on the other, nothing that was accepted is lost, and it rejoins when it answers
again. tests/functional/test_engine_pool.py does the same with real engines and SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.gateway.harness import Gateway, metric, running_gateway, serve, sim_app
from tests.waiting import wait_until


class Freezer:
    """Makes a simulator stop answering (every request waits, the connection open) while
    frozen, as a hung or SIGSTOPped engine does."""

    def __init__(self) -> None:
        self.thawed = asyncio.Event()
        self.thawed.set()

    @web.middleware
    async def middleware(self, request: web.Request, handler: web.Handler) -> web.StreamResponse:
        await self.thawed.wait()
        return await handler(request)


@dataclass
class Pool:
    gateway: Gateway
    engines: list[str]
    """The simulators' base URLs, in the pool's order."""
    servers: list[TestServer]
    freezers: list[Freezer]


@pytest_asyncio.fixture
async def pool(tmp_path: Path, tiny_model_dir: Path, template_db: Path) -> AsyncIterator[Pool]:
    async with AsyncExitStack() as stack:
        freezers = [Freezer(), Freezer()]
        servers = []
        for freezer in freezers:
            app = sim_app()
            app.middlewares.append(freezer.middleware)
            servers.append(await stack.enter_async_context(serve(app)))
        stack.callback(lambda: [f.thawed.set() for f in freezers])  # nothing waits at the end
        urls = [f"http://127.0.0.1:{s.port}" for s in servers]
        gateway = await stack.enter_async_context(
            running_gateway(
                tmp_path,
                tiny_model_dir,
                servers[0].port or 0,
                template_db=template_db,
                TANDEM_ENGINE__ENDPOINTS=json.dumps(urls),
                TANDEM_ENGINE__HEALTH_PROBE_INTERVAL_S="0.2",
            )
        )
        yield Pool(gateway, urls, servers, freezers)


async def healthy(gw: Gateway, engine: str) -> float | None:
    return metric(await gw.metrics(), "tandem_engine_healthy", engine=engine)


async def test_each_engine_is_watched_and_shown(pool: Pool) -> None:
    gw = pool.gateway
    ready = await gw.request("GET", "/readyz")
    assert ready.status == 200, ready
    assert [e["name"] for e in ready.body["engines"]] == pool.engines
    assert all(e["serving"] for e in ready.body["engines"])
    samples = await gw.metrics()
    for url in pool.engines:
        assert metric(samples, "tandem_engine_healthy", engine=url) == 1.0
        assert metric(samples, "tandem_engine_state", engine=url, state="up") == 1.0
    dashboard = await gw.request("GET", "/admin/v1/dashboard/data?hours=1", admin=True)
    assert dashboard.status == 200, dashboard
    assert [e["name"] for e in dashboard.body["engines"]] == pool.engines
    assert [e["requests"] for e in dashboard.body["engines"]] == [0, 0]

    # each engine's row counts the requests it ran, as their usage records name it
    tenant, key = await gw.new_tenant("shown")
    for _ in range(3):
        assert (await gw.chat(key, max_tokens=2)).status == 200
    ran = [r["engine"] for r in await gw.records(tenant, count=3)]
    dashboard = await gw.request("GET", "/admin/v1/dashboard/data?hours=1", admin=True)
    rows = dashboard.body["engines"]
    assert [e["requests"] for e in rows] == [ran.count(url) for url in pool.engines]
    assert all(e["errors"] == 0 for e in rows)
    assert [e["slo_attainment"] for e in rows if e["requests"]] == [1.0] * len(set(ran))


async def test_a_dead_engine_leaves_placement_and_rejoins(pool: Pool) -> None:
    gw = pool.gateway
    tenant, key = await gw.new_tenant("pool")
    assert (await gw.chat(key, max_tokens=4)).status == 200
    dead = pool.servers[0]
    port = dead.port
    await dead.close()  # the first engine goes away: nothing listens on its port any more

    # every request is answered by the other engine, the first one included (it found the dead
    # engine refusing its connection, which never ran it, and was placed again)
    for _ in range(4):
        reply = await gw.chat(key, max_tokens=4)
        assert reply.status == 200, reply
    assert await healthy(gw, pool.engines[0]) == 0.0
    assert await healthy(gw, pool.engines[1]) == 1.0
    ready = await gw.request("GET", "/readyz")
    assert ready.status == 200, ready  # one engine serves: the gateway is ready
    records = await gw.records(tenant, count=5)
    assert [r["status"] for r in records] == ["ok"] * 5
    # each record names the engine that ran it: the four after the death, the survivor; and
    # the operator reads one engine's request log
    assert [r["engine"] for r in records[:4]] == [pool.engines[1]] * 4
    assert records[4]["engine"] in pool.engines
    on_dead = await gw.admin("GET", f"/requests?tenant={tenant}&engine={pool.engines[0]}")
    assert on_dead.status == 200, on_dead
    assert [r["request_id"] for r in on_dead.body["data"]] == [
        r["request_id"] for r in records if r["engine"] == pool.engines[0]
    ]

    # the engine comes back on its port: it is probed, and serves again
    async with serve_on(port):

        async def rejoined() -> bool:
            return await healthy(gw, pool.engines[0]) == 1.0

        await wait_until(rejoined, 20, what="the restarted engine back in placement")
        assert (await gw.chat(key, max_tokens=4)).status == 200


@asynccontextmanager
async def serve_on(port: int | None) -> AsyncIterator[TestServer]:
    """The simulator again, on *port*."""
    server = TestServer(sim_app(), host="127.0.0.1", port=port, handler_cancellation=True)
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


async def test_a_frozen_engine_leaves_placement_and_rejoins(
    pool: Pool, caplog: pytest.LogCaptureFixture
) -> None:
    gw = pool.gateway
    _, key = await gw.new_tenant("frozen")
    pool.freezers[0].thawed.clear()  # the first engine stops answering, its port still open
    frozen_at = time.monotonic()

    async def out_of_placement() -> bool:
        return await healthy(gw, pool.engines[0]) == 0.0

    await wait_until(out_of_placement, 30, what="the frozen engine out of placement")
    print(f"\nengine frozen -> out of placement after {time.monotonic() - frozen_at:.2f} s")
    # the operator's log says why (a timeout has no message of its own: its name stands in)
    outage = f"engine {pool.engines[0]} load reports unavailable (TimeoutError); retrying"
    assert outage in caplog.messages, caplog.messages
    for _ in range(3):  # served by the other engine, none waits on the frozen one
        reply = await asyncio.wait_for(gw.chat(key, max_tokens=4), 30)
        assert reply.status == 200, reply
    assert (await gw.request("GET", "/readyz")).status == 200

    pool.freezers[0].thawed.set()

    async def rejoined() -> bool:
        return await healthy(gw, pool.engines[0]) == 1.0

    await wait_until(rejoined, 30, what="the thawed engine back in placement")


class Concurrency:
    """Counts the generations the simulators of a pool run at once (together), the most they
    ran, and how many each one ran."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.served: dict[int, int] = {}

    def middleware(self, engine: int) -> Any:
        @web.middleware
        async def count(request: web.Request, handler: web.Handler) -> web.StreamResponse:
            if request.path != "/generate":
                return await handler(request)
            self.now += 1
            self.most = max(self.most, self.now)
            self.served[engine] = self.served.get(engine, 0) + 1
            try:
                return await handler(request)
            finally:
                self.now -= 1

        return count


async def test_batch_lines_in_flight_scale_with_the_engines(
    tmp_path: Path, tiny_model_dir: Path, template_db: Path
) -> None:
    """`batch.max_inflight` bounds each engine's lines: two engines run up to twice as many."""
    from tests.gateway.test_batches import chat_line, create_batch, jsonl, upload, wait_for

    bound = 2
    counter = Concurrency()
    async with AsyncExitStack() as stack:
        servers = []
        for engine in range(2):
            app = sim_app()
            app.middlewares.append(counter.middleware(engine))
            servers.append(await stack.enter_async_context(serve(app)))
        urls = [f"http://127.0.0.1:{s.port}" for s in servers]
        gw = await stack.enter_async_context(
            running_gateway(
                tmp_path,
                tiny_model_dir,
                servers[0].port or 0,
                template_db=template_db,
                TANDEM_ENGINE__ENDPOINTS=json.dumps(urls),
                TANDEM_BATCH__MAX_INFLIGHT=str(bound),
            )
        )
        _, key = await gw.new_tenant("wide", "be")
        lines = [chat_line(f"l-{i}", f"Line {i}: count to ten.", max_tokens=64) for i in range(24)]
        file = await upload(gw, key, jsonl(lines))
        assert file.status == 200, file
        created = await create_batch(gw, key, file.body["id"])
        assert created.status == 200, created
        done = await wait_for(gw, key, created.body["id"])
        assert done["request_counts"]["completed"] == len(lines), done
    assert set(counter.served) == {0, 1}, counter.served  # both engines ran lines
    assert bound < counter.most <= 2 * bound, counter.most
