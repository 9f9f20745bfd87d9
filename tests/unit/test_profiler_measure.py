"""The profiler's measurement loop against a fake engine that streams tokens at a fixed pace:
a machine so busy that one mixed-prefill probe takes longer than the decode streams' slack
(seen on CI: a 16-token prefill took 0.6 s) is measured again with more slack, and a mixed
probe around which the decodes' tokens came several to a chunk is probed again, not failed."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.profiler.measure import ProfileGrid, profile_engine

TOKEN_GAP_S = 0.002
"""The fake engine's pace: one token per stream every 2 ms."""
MIXED_TOKENS = 96
"""The mixed-prefill probe's size in the grid below (no other prompt has this length)."""

GRID = ProfileGrid(
    decode_batches=(1,),
    decode_contexts=(32,),
    prefill_tokens=(16,),
    prefill_prefixes=(0,),
    mixed_prefill_tokens=(MIXED_TOKENS,),
    repeats=1,
    decode_steps=8,
)
"""One decode point (1 stream of 32 tokens of context) with one mixed probe, and a prefill."""


@dataclass
class FakeEngine:
    """Streams `max_new_tokens` tokens per request, one every `TOKEN_GAP_S`; the first
    `stalls` mixed-prefill probes send their token only once every other stream has ended (a
    machine stalled for longer than the decodes' slack, however fast this one runs)."""

    stalls: int = 1
    coalesced: int = 0
    """From each of the first `coalesced` mixed probes to the next probe, every decode stream
    sends its tokens two to a chunk (a machine whose detokenizer or client fell behind); the
    probe's own token comes once every decode stream has sent two such chunks."""
    coalescing: bool = False
    decode_chunks: dict[str, int] = field(default_factory=dict)
    """Chunks each open decode stream (by rid) has sent."""
    chunk_sent: asyncio.Condition = field(default_factory=asyncio.Condition)
    aborted: set[str] = field(default_factory=set)
    mixed_probes: int = 0
    streams: int = 0
    """Streams of other requests open now."""
    stalled_s: float = 0.0
    """How long the stalled probes waited, seconds."""
    stream_ended: asyncio.Condition = field(default_factory=asyncio.Condition)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/flush_cache", self.ok)
        app.router.add_post("/abort_request", self.abort)
        app.router.add_post("/generate", self.generate)
        return app

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "max_total_num_tokens": 100_000,
                "max_running_requests": 16,
                "chunked_prefill_size": 512,
                "page_size": 1,
            }
        )

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def abort(self, request: web.Request) -> web.Response:
        self.aborted.add((await request.json())["rid"])
        return web.json_response({})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        prompt = len(body["input_ids"])
        if prompt == MIXED_TOKENS:
            self.mixed_probes += 1
            self.coalescing = False  # the previous probe's pairs end here
            if self.coalesced:
                self.coalesced -= 1
                self.coalescing = True
                sent = dict(self.decode_chunks)
                async with self.chunk_sent:  # pairs on every decode stream before its token
                    await self.chunk_sent.wait_for(
                        lambda: all(n - sent.get(r, 0) >= 2 for r, n in self.decode_chunks.items())
                    )
                return await self._stream(request, resp, body)
            if self.stalls:
                self.stalls -= 1
                start_s = time.monotonic()
                async with self.stream_ended:
                    await self.stream_ended.wait_for(lambda: self.streams == 0)
                self.stalled_s += time.monotonic() - start_s
            return await self._stream(request, resp, body)
        self.streams += 1
        self.decode_chunks[body["rid"]] = 0
        try:
            return await self._stream(request, resp, body)
        finally:
            self.streams -= 1
            del self.decode_chunks[body["rid"]]
            async with self.stream_ended:
                self.stream_ended.notify_all()

    async def _stream(
        self, request: web.Request, resp: web.StreamResponse, body: dict[str, Any]
    ) -> web.StreamResponse:
        await asyncio.sleep(0.001 + len(body["input_ids"]) * 2e-6)  # the prefill's pace
        rid, max_new, last = body["rid"], body["sampling_params"]["max_new_tokens"], 0
        for n in range(1, max_new + 1):
            if rid in self.aborted:
                break
            if not (self.coalescing and n - last < 2 and n < max_new):  # else: with the next
                chunk = {"text": "x", "meta_info": {"completion_tokens": n, "cached_tokens": 0}}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                last = n
                if rid in self.decode_chunks:
                    self.decode_chunks[rid] += 1
                    async with self.chunk_sent:
                        self.chunk_sent.notify_all()
            await asyncio.sleep(TOKEN_GAP_S)  # the decode pace
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def test_decodes_that_run_out_during_a_stalled_mixed_probe_are_measured_again() -> None:
    engine = FakeEngine()
    server = TestServer(engine.app(), host="127.0.0.1", port=0)
    await server.start_server()
    said: list[str] = []
    try:
        profile = await profile_engine(
            str(server.make_url("")),
            grid=GRID,
            name="fake",
            progress=said.append,
        )
    finally:
        await server.close()
    # the stalled probe outlasted the decodes' 160 tokens of slack; the point was measured
    # again with 4× the slack, and the profile has every point
    retried = [line for line in said if "ran out of tokens during a mixed probe" in line]
    assert len(retried) == 1 and "again with 640 tokens of slack" in retried[0], said
    assert engine.mixed_probes == 2
    assert len(profile.samples) == 3  # one prefill, one decode, one mixed point
    mixed = [s for s in profile.samples if s.shape.prefill_tokens and s.shape.num_decode]
    assert len(mixed) == 1 and mixed[0].seconds < engine.stalled_s  # re-measured, not the stall


async def test_a_mixed_probe_whose_decode_gaps_cannot_be_read_is_probed_again() -> None:
    """Around the first mixed probe the decodes' tokens come two to a chunk (a loaded 2-core
    CI machine): no iteration's time can be read, and the profile failed as if the engine had
    aborted the streams. The probe is sent again and the point measured."""
    engine = FakeEngine(stalls=0, coalesced=1)
    server = TestServer(engine.app(), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        profile = await profile_engine(
            str(server.make_url("")),
            grid=GRID,
            name="fake",
        )
    finally:
        await server.close()
    assert engine.mixed_probes == 2
    mixed = [s for s in profile.samples if s.shape.prefill_tokens and s.shape.num_decode]
    assert len(mixed) == 1
