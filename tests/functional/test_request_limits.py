"""Issue 16 against the real engine: the two inputs a fuzzing campaign found to kill SGLang's
scheduler — `top_k` = 2³¹ (its int32 tensor overflows) and a prompt token id beyond the
vocabulary (the embedding lookup reads past the table) — are refused by the gateway with a 400
naming the field, and the engine still serves the next request. The values at the edges of the
ranges the gateway accepts reach the engine and run."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.functional.engine_fixtures import EngineServer, get_json
from tests.functional.gateway_fixtures import GatewayHandle

pytestmark = pytest.mark.slow
MODEL = "tandem-tiny"
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


async def post(gw: GatewayHandle, key: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with gw.session.post(
        f"{gw.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        return resp.status, await resp.json()


async def serves_a_normal_request(gw: GatewayHandle, key: str) -> bool:
    status, body = await post(
        gw,
        key,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3},
    )
    return status == 200 and body["usage"]["completion_tokens"] >= 1


async def test_crashing_inputs_are_refused_and_the_engine_keeps_serving(
    gateway: GatewayHandle, engine_server: EngineServer
) -> None:
    _, key = await gateway.new_tenant("fuzzer", "be", deadline_s=3600)
    assert await serves_a_normal_request(gateway, key)

    status, body = await post(
        gateway,
        key,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_k": 2**31},
    )
    assert status == 400, body
    assert body["error"]["param"] == "top_k" and str(INT32_MAX) in body["error"]["message"]

    status, body = await post(
        gateway, key, "/v1/completions", {"model": MODEL, "prompt": [1_000_000], "max_tokens": 2}
    )
    assert status == 400, body
    assert body["error"]["param"] == "prompt[0]", body

    assert get_json(engine_server.base_url, "/health")[0] == 200
    assert await serves_a_normal_request(gateway, key)


async def test_the_edges_of_the_accepted_ranges_run_on_the_engine(
    gateway: GatewayHandle, engine_server: EngineServer
) -> None:
    _, key = await gateway.new_tenant("edges", "be", deadline_s=3600)
    vocab_size = json.loads((engine_server.model_path / "config.json").read_text())["vocab_size"]
    # a seed is accepted with greedy decoding only (docs/API.md): the widest seed there, and
    # the hottest temperature without one
    for extremes in ({"seed": INT64_MAX, "temperature": 0}, {"temperature": 2}):
        status, body = await post(
            gateway,
            key,
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": [0, vocab_size - 1],
                "max_tokens": 3,
                "min_tokens": 3,
                "top_k": INT32_MAX,
                "repetition_penalty": 2,
                **extremes,
            },
        )
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 3
    assert get_json(engine_server.base_url, "/health")[0] == 200
    assert await serves_a_normal_request(gateway, key)
