"""The profiler's probes against an engine with SGLang data parallelism: `/server_info`'s
`dp_size` is read, and every probe goes to DP rank 0 — a batch the DP controller split between
the ranks would be measured as if one scheduler ran it whole."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.profiler.probe import Prober, discover

DP_SIZE = web.AppKey("dp_size", int)


async def test_probes_of_a_data_parallel_engine_all_go_to_rank_0() -> None:
    bodies: list[dict[str, Any]] = []

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response(
            {"max_total_num_tokens": 4096, "dp_size": request.app[DP_SIZE], "page_size": 1}
        )

    async def generate(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"text": "x", "meta_info": {"completion_tokens": 1}}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    for dp_size, routed in ((2, 0), (1, None)):
        app = web.Application()
        app[DP_SIZE] = dp_size
        app.router.add_get("/server_info", server_info)
        app.router.add_post("/generate", generate)
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        try:
            url = str(server.make_url("")).rstrip("/")
            async with aiohttp.ClientSession() as session:
                facts = await discover(session, url)
                assert facts.dp_size == dp_size
                stream, task = Prober(session, url, facts, seed=0).start([20, 21, 22], 1)
                await task
                assert stream.tokens == 1
        finally:
            await server.close()
        assert bodies.pop().get("routed_dp_rank") == routed
