"""The OpenAI-compatible API end to end: the official `openai` client → gateway → the real
patched SGLang engine on CPU → usage records in SQL."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.state import STORE
from tests.functional.gateway_fixtures import GatewayHandle
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
MODEL = "tandem-tiny"


def client(gw: GatewayHandle, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
async def rt_tenant(gateway: GatewayHandle) -> tuple[str, str]:
    return await gateway.new_tenant("rt-chat", "rt", ttft_ms=5000, tpot_ms=1000)


@pytest.fixture(scope="module")
async def be_tenant(gateway: GatewayHandle) -> tuple[str, str]:
    return await gateway.new_tenant("be-batch", "be", deadline_s=3600)


def assert_timed(record: dict[str, Any], completion_tokens: int) -> None:
    assert record["status"] == "ok" and record["http_status"] == 200
    assert record["completion_tokens"] == completion_tokens
    assert record["prompt_tokens"] > 0
    assert record["ttft_ms"] is not None and record["ttft_ms"] > 0
    assert record["tpot_ms"] is not None and record["tpot_ms"] > 0
    assert record["tbt_max_ms"] >= record["tbt_mean_ms"] > 0
    assert record["e2e_ms"] >= record["ttft_ms"]
    assert record["queue_ms"] is not None and record["queue_ms"] >= 0


async def test_chat_non_streaming(
    gateway: GatewayHandle, rt_tenant: tuple[str, str], engine_server: Any
) -> None:
    tenant_id, key = rt_tenant
    reply = await client(gateway, key).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello to tandem."}],
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    record = (await gateway.latest_requests(tenant_id, 1))[0]
    assert record["endpoint"] == "chat" and record["tier"] == "rt" and not record["stream"]
    assert reply.id == f"chatcmpl-{record['request_id']}"  # one id: response, record, engine
    assert_timed(record, 12)
    assert record["prompt_tokens"] == reply.usage.prompt_tokens
    assert record["slo_met"] is True  # generous targets on purpose
    assert record["engine"] == f"http://127.0.0.1:{engine_server.port}"  # where it ran
    # the finished output length joined the tenant's length history (Past-Future's input)
    assert 12 in await gateway.app[STORE].length_history(tenant_id, 100)


async def test_chat_streaming_with_usage(
    gateway: GatewayHandle, rt_tenant: tuple[str, str]
) -> None:
    tenant_id, key = rt_tenant
    stream = await client(gateway, key).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream please."}],
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "length" and usage is not None and usage.completion_tokens == 10
    assert len(texts) >= 2  # really streamed, not one blob
    record = (await gateway.latest_requests(tenant_id, 1))[0]
    assert record["stream"] is True
    assert_timed(record, 10)


async def test_text_completion_both_ways(
    gateway: GatewayHandle, rt_tenant: tuple[str, str]
) -> None:
    _, key = rt_tenant
    c = client(gateway, key)
    reply = await c.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert reply.object == "text_completion" and reply.usage is not None
    assert reply.usage.completion_tokens == 8 and reply.choices[0].finish_reason == "length"
    pieces = [
        chunk.choices[0].text
        async for chunk in await c.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=8,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if chunk.choices
    ]
    assert len(pieces) >= 2


async def test_continuous_usage_stats(gateway: GatewayHandle, rt_tenant: tuple[str, str]) -> None:
    _, key = rt_tenant
    stream = await client(gateway, key).completions.create(
        model=MODEL,
        prompt="count",
        max_tokens=6,
        stream=True,
        extra_body={"ignore_eos": True, "stream_options": {"continuous_usage_stats": True}},
    )
    counts = [chunk.usage.completion_tokens async for chunk in stream if chunk.usage]
    assert counts == sorted(counts) and counts[-1] == 6 and len(counts) >= 2


async def test_rt_and_be_tenants_side_by_side(
    gateway: GatewayHandle,
    rt_tenant: tuple[str, str],
    be_tenant: tuple[str, str],
    engine_server: Any,
) -> None:
    (rt_id, rt_key), (be_id, be_key) = rt_tenant, be_tenant

    async def ask(key: str, n: int) -> int:
        reply = await client(gateway, key).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"request {n}"}],
            max_tokens=16,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None
        return reply.usage.completion_tokens

    done = await asyncio.gather(
        *(ask(be_key, i) for i in range(3)), *(ask(rt_key, i) for i in range(3))
    )
    assert done == [16] * 6
    be_records = await gateway.latest_requests(be_id, 3)
    rt_records = await gateway.latest_requests(rt_id, 3)
    for record in be_records + rt_records:
        assert_timed(record, 16)
    assert {r["tier"] for r in be_records} == {"be"}
    assert {r["tier"] for r in rt_records} == {"rt"}
    assert all(r["slo_met"] is True for r in be_records)  # finished well within the deadline
    # the tier and contract reached SGLang's scheduler for each of these requests
    traced = _scheduler_trace(Path(engine_server.trace_path))
    for record in be_records + rt_records:
        meta = traced[record["request_id"]]["meta"]
        assert meta["tier"] == record["tier"]
        assert meta["tenant_id"] == (be_id if record["tier"] == "be" else rt_id)
    assert traced[rt_records[0]["request_id"]]["meta"]["ttft_target_ms"] == 5000
    assert traced[be_records[0]["request_id"]]["meta"]["deadline_s"] == 3600


async def test_explicit_be_tier_from_an_rt_tenant(
    gateway: GatewayHandle, rt_tenant: tuple[str, str]
) -> None:
    tenant_id, key = rt_tenant
    await client(gateway, key).completions.create(
        model=MODEL, prompt="batch me", max_tokens=2, extra_body={"tier": "be"}
    )
    assert (await gateway.latest_requests(tenant_id, 1))[0]["tier"] == "be"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"},
            422,
            "max_tokens",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000},
            400,
            "max_tokens",
        ),
        ({"model": MODEL, "messages": "hello"}, 422, "messages"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 9},
            400,
            "temperature",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tier": "be"},
            None,
            None,
        ),
    ],
)
async def test_bad_requests_name_the_field_and_are_recorded(
    gateway: GatewayHandle,
    be_tenant: tuple[str, str],
    body: dict[str, Any],
    status: int | None,
    param: str | None,
) -> None:
    _, key = be_tenant
    if status is None:  # a valid request for comparison: BE tenant asking for BE is fine
        body = dict(body, max_tokens=1)
    async with gateway.session.post(
        f"{gateway.base_url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
    ) as resp:
        payload = await resp.json()
        if status is None:
            assert resp.status == 200, payload
            return
        assert resp.status == status, payload
        assert payload["error"]["param"] == param and payload["error"]["message"]
        assert "Traceback" not in json.dumps(payload)


async def test_be_tenant_cannot_ask_for_rt(
    gateway: GatewayHandle, be_tenant: tuple[str, str]
) -> None:
    _, key = be_tenant
    with pytest.raises(openai.PermissionDeniedError) as info:
        await client(gateway, key).completions.create(
            model=MODEL, prompt="x", max_tokens=1, extra_body={"tier": "rt"}
        )
    assert "tier" in str(info.value)


async def test_client_disconnect_aborts_the_engine_request(
    gateway: GatewayHandle, rt_tenant: tuple[str, str], engine_server: Any
) -> None:
    tenant_id, key = rt_tenant
    body = {
        "model": MODEL,
        "prompt": "a long story",
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
    }
    async with gateway.session.post(
        f"{gateway.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        assert resp.status == 200
        await resp.content.readline()  # the first token arrived; now hang up
        resp.connection.transport.abort()  # type: ignore[union-attr]
    # the engine drops the request long before 3000 tokens could have been generated

    async def engine_idle() -> bool:
        async with gateway.session.get(f"{engine_server.base_url}/v1/loads") as loads:
            return _num_running(await loads.json()) == 0

    await wait_until(engine_idle, timeout_s=10, what="the engine request aborted")
    record = (await gateway.latest_requests(tenant_id, 1))[0]
    assert record["status"] == "client_disconnected"
    assert 0 < record["completion_tokens"] < 3000


def _num_running(loads: Any) -> int:
    if isinstance(loads, dict) and "loads" in loads:
        loads = loads["loads"]
    items = loads if isinstance(loads, list) else [loads]
    return sum(
        int(item.get("num_running_reqs", 0)) + int(item.get("num_waiting_reqs", 0))
        for item in items
    )


def _scheduler_trace(path: Path) -> dict[str, dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {line["rid"]: line for line in lines if line.get("event") == "request"}
