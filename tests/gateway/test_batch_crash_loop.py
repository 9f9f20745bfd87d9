"""A batch line that takes the engine down is tried a bounded number of times, counted across
gateway restarts, then fails with a reason in the error file — it never crash-loops the engine —
while the batch's other lines complete, each exactly once and in file order (issue 16)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from tests.gateway.harness import Gateway, running_gateway, serve, sim_app
from tests.gateway.test_batches import chat_line, create_batch, jsonl, read_lines, upload, wait_for
from tests.waiting import wait_until

POISON_MAX_TOKENS = 13
"""A line asking for this many tokens is the poison: the engine dies of it (the other lines ask
for 6)."""
MAX_ATTEMPTS = 3


@dataclass
class CrashingEngine:
    """The simulator, except that a poison request takes the engine's connection down with it:
    the first one hangs (the gateway is stopped while it is in flight), every later one drops the
    connection before answering, as an engine process that dies of it does."""

    poison_seen: int = 0
    """Poison requests that reached the engine."""
    _never: asyncio.Event = field(default_factory=asyncio.Event)

    @web.middleware
    async def middleware(self, request: web.Request, handler: web.Handler) -> web.StreamResponse:
        if request.path != "/generate":
            return await handler(request)
        body = json.loads(await request.read())  # read() caches: the simulator reads it again
        if body["sampling_params"]["max_new_tokens"] != POISON_MAX_TOKENS:
            return await handler(request)
        self.poison_seen += 1
        if self.poison_seen == 1:
            await self._never.wait()  # cancelled when the gateway drops the connection
        assert request.transport is not None
        request.transport.abort()
        return web.Response(status=500)  # never sent: the connection is gone


async def test_a_line_that_kills_the_engine_fails_after_the_bound_across_restarts(
    tmp_path: Path, tiny_model_dir: Path, template_db: Path
) -> None:
    engine = CrashingEngine()
    app = sim_app()
    app.middlewares.append(engine.middleware)
    env = {"TANDEM_BATCH__MAX_ATTEMPTS": str(MAX_ATTEMPTS)}
    lines = [chat_line(f"line-{i}", f"question {i}") for i in range(5)]
    lines[2] = chat_line("poison", "crash the engine", max_tokens=POISON_MAX_TOKENS)
    async with serve(app) as engine_server:
        port = engine_server.port
        assert port is not None
        async with running_gateway(
            tmp_path,
            tiny_model_dir,
            port,
            template_db=template_db,
            TANDEM_GATEWAY__SHUTDOWN_TIMEOUT_S="0",  # the hung poison line: no drain to wait out
            **env,
        ) as first:
            _, key = await first.new_tenant("poisoned", "be")
            file_id = (await upload(first, key, jsonl(lines))).body["id"]
            batch_id = (await create_batch(first, key, file_id)).body["id"]
            await wait_until(lambda: engine.poison_seen >= 1, timeout_s=30, what="the poison sent")
        # The gateway stopped with the poison line in flight (its first attempt); a new gateway
        # process on the same database takes the batch over, with the attempt already counted.
        async with running_gateway(tmp_path, tiny_model_dir, port, **env) as second:
            done = await wait_for(second, key, batch_id)
            await check_results(second, key, done, [line["custom_id"] for line in lines])
    assert engine.poison_seen == MAX_ATTEMPTS  # 1 before the restart + 2 after, never more


async def check_results(gw: Gateway, key: str, done: dict[str, object], ids: list[str]) -> None:
    assert done["status"] == "completed", done
    out = await read_lines(gw, key, str(done["output_file_id"]))
    errors = await read_lines(gw, key, str(done["error_file_id"]))
    assert [line["custom_id"] for line in out] == [i for i in ids if i != "poison"]  # file order
    assert all(line["response"]["status_code"] == 200 for line in out)
    assert [line["custom_id"] for line in errors] == ["poison"]
    response = errors[0]["response"]
    assert response["status_code"] == 500
    error = response["body"]["error"]
    assert error["code"] == "batch_attempts_exhausted"
    assert f"{MAX_ATTEMPTS} attempts" in error["message"], error
