"""The simulator's SGLang-compatible HTTP server, in process (aiohttp test client)."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from backend.policy.registry import make_policy
from backend.sim.config import SimConfig
from backend.sim.server import create_sim_app
from common.wire import RequestMeta, meta_to_custom_params
from gateway.engine.client import EngineClient
from tests.unit.sim_factories import LATENCY
from tests.waiting import wait_until

KV_TOKENS = 5000


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    app = create_sim_app(
        make_policy("fcfs", LATENCY),
        LATENCY,
        SimConfig(kv_capacity_tokens=KV_TOKENS),
        time_scale=0.05,
    )
    async with TestClient(TestServer(app)) as c:
        yield c


def _body(rid: str, max_new: int, *, prompt: int = 600, stream: bool = True) -> dict[str, Any]:
    meta = RequestMeta(
        tier="rt",
        tenant_id="t1",
        length_key="t1",
        arrival_unix_s=time.time(),
        ttft_target_ms=500,
        tpot_target_ms=100,
        max_tokens=max_new,
    )
    return {
        "rid": rid,
        "input_ids": list(range(prompt)),
        "stream": stream,
        "sampling_params": {
            "max_new_tokens": max_new,
            "ignore_eos": True,
            "custom_params": meta_to_custom_params(meta),
        },
        "priority": meta.sglang_priority,
    }


async def _events(resp: aiohttp.ClientResponse) -> list[Any]:
    out = []
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            data = line[5:].strip()
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


async def test_streaming_generate_is_cumulative_and_ends_with_done(
    client: TestClient[Any, Any],
) -> None:
    resp = await client.post("/generate", json=_body("s1", 5))
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
    events = await _events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    ids = [c["output_ids"] for c in chunks]
    assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(ids))
    final = chunks[-1]
    assert len(final["output_ids"]) == 5 and len(final["text"].split()) == 5
    meta = final["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == 600 and meta["completion_tokens"] == 5
    assert meta["queue_time"] is not None and meta["queue_time"] >= 0
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


async def test_the_gateway_engine_client_reads_the_stream(client: TestClient[Any, Any]) -> None:
    engine = EngineClient(str(client.make_url("")), client.session, timeout_s=30)
    chunks = [c async for c in engine.generate(_body("g1", 4))]
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 4
    assert "".join(c.text_delta for c in chunks).split() == ["lorem", "ipsum", "dolor", "sit"]


async def test_non_streaming_generate_and_the_prefix_cache(client: TestClient[Any, Any]) -> None:
    first = await (await client.post("/generate", json=_body("n1", 3, stream=False))).json()
    again = await (await client.post("/generate", json=_body("n2", 3, stream=False))).json()
    assert first["meta_info"]["completion_tokens"] == 3 and len(first["output_ids"]) == 3
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == 512  # one full block of the same input_ids
    assert again["output_ids"] == first["output_ids"]  # deterministic fake tokens


async def test_abort_ends_the_stream_and_frees_the_engine(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/generate", json=_body("a1", 100_000))
    first = await resp.content.readline()
    assert first.startswith(b"data:")
    assert (await client.post("/abort_request", json={"rid": "a1"})).status == 200
    events = await _events(resp)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    loads = (await (await client.get("/v1/loads")).json())["loads"][0]
    assert loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 0


async def test_a_client_that_hangs_up_is_aborted(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/generate", json=_body("h1", 100_000))
    await resp.content.readline()
    resp.close()

    async def idle() -> bool:
        loads = (await (await client.get("/v1/loads")).json())["loads"][0]
        return bool(loads["num_running_reqs"] == 0)

    await wait_until(idle, timeout_s=5, what="the hung-up request aborted")


async def test_loads_health_and_model_info(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/generate", json=_body("l1", 100_000))
    await resp.content.readline()
    loads = (await (await client.get("/v1/loads")).json())["loads"][0]
    assert loads["max_total_num_tokens"] == KV_TOKENS
    assert loads["num_running_reqs"] == 1 and 0 < loads["token_usage"] <= 1
    await client.post("/abort_request", json={"rid": "l1"})
    await _events(resp)
    assert (await client.get("/health")).status == 200
    assert (await client.get("/health_generate")).status == 200
    info = await (await client.get("/model_info")).json()
    assert info["policy"] == "fcfs" and info["is_generation"] is True


async def test_a_request_without_a_prompt_is_rejected(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/generate", json={"sampling_params": {"max_new_tokens": 3}})
    assert resp.status == 400
    assert "input_ids or text" in (await resp.json())["error"]["message"]
