"""`tandem_be_backlog_requests` counts every piece of BE work once: a batch line is either waiting
to be sent or in flight, never both (issue 17: each running line was counted twice)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from tests.gateway.harness import metric, running_gateway, serve, sim_app
from tests.gateway.test_batches import chat_line, create_batch, jsonl, upload, wait_for
from tests.waiting import wait_until

LINES = 4


@dataclass
class HeldEngine:
    """The simulator, except that every generation waits until the test releases it: what the
    gateway sent stays in flight for as long as the test looks."""

    held: int = 0
    """Generation requests waiting at the engine."""
    release: asyncio.Event = field(default_factory=asyncio.Event)

    @web.middleware
    async def middleware(self, request: web.Request, handler: web.Handler) -> web.StreamResponse:
        if request.path == "/generate" and not self.release.is_set():
            self.held += 1
            try:
                await self.release.wait()
            finally:
                self.held -= 1
        return await handler(request)


async def test_each_batch_line_and_be_request_counts_once(
    tmp_path: Path, tiny_model_dir: Path, template_db: Path
) -> None:
    engine = HeldEngine()
    app = sim_app()
    app.middlewares.append(engine.middleware)
    async with serve(app) as engine_server:
        assert engine_server.port is not None
        async with running_gateway(
            tmp_path, tiny_model_dir, engine_server.port, template_db=template_db
        ) as gw:
            tenant_id, key = await gw.new_tenant("backlog", "be")
            lines = [chat_line(f"l{i}", f"line {i}") for i in range(LINES)]
            file_id = (await upload(gw, key, jsonl(lines))).body["id"]
            batch = (await create_batch(gw, key, file_id)).body
            last: dict[str, float | None] = {}

            async def counted() -> bool:
                # everything the gateway sent is held at the engine and the sampler's
                # reading saw it so (the batch's lines split into running and pending, in
                # the same reading as the backlog)
                m = await gw.metrics()
                running = metric(m, "tandem_batch_lines", status="running") or 0
                pending = metric(m, "tandem_batch_lines", status="pending") or 0
                in_flight = metric(m, "tandem_requests_in_flight", tenant=tenant_id, tier="be")
                last.update(
                    backlog=metric(m, "tandem_be_backlog_requests"),
                    running=running,
                    pending=pending,
                    in_flight=in_flight,
                )
                steady = (
                    running >= 1
                    and running + pending == LINES
                    and engine.held == running + 1
                    and in_flight == engine.held
                )
                return steady and last["backlog"] == LINES + 1  # 4 lines + 1 request

            interactive = asyncio.create_task(gw.chat(key, max_tokens=4))
            try:
                await wait_until(
                    counted,
                    what=lambda: (
                        f"the backlog at {LINES + 1} (last scrape: {last}, "
                        f"held at the engine: {engine.held})"
                    ),
                )
            finally:
                engine.release.set()
                reply = await interactive
            assert reply.status == 200, reply
            assert (await wait_for(gw, key, batch["id"]))["status"] == "completed"

            async def drained() -> bool:
                return metric(await gw.metrics(), "tandem_be_backlog_requests") == 0

            await wait_until(drained, what="the backlog back at 0")
