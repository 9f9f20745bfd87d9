"""The OpenAI-compatible API as a client sees it: /v1/models, chat and text completions (JSON and
SSE streams), usage records, errors naming the field, tiers, disconnects, and the engine down.
The fast equivalents of tests/functional/test_gateway_openai.py (which stays: it runs the real
engine)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from tests.gateway.harness import MODEL, Gateway, sse_json
from tests.waiting import wait_until


def assert_timed(record: dict[str, Any], completion_tokens: int) -> None:
    """A usage record of a request that ran: tokens and latencies filled in."""
    assert record["status"] == "ok" and record["http_status"] == 200, record
    assert record["completion_tokens"] == completion_tokens
    assert record["prompt_tokens"] > 0
    assert record["ttft_ms"] is not None and record["ttft_ms"] > 0
    assert record["tpot_ms"] is not None and record["tpot_ms"] > 0
    assert record["e2e_ms"] >= record["ttft_ms"]


async def test_models_lists_the_served_model(gw: Gateway) -> None:
    _, key = await gw.new_tenant("models")
    reply = await gw.request("GET", "/v1/models", key=key)
    assert reply.status == 200, reply
    assert reply.body["object"] == "list"
    [model] = reply.body["data"]
    assert model["id"] == MODEL and model["object"] == "model"
    assert model["max_model_len"] > 0


async def test_chat_non_streaming_answers_and_records_usage(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("chat")
    reply = await gw.chat(key, "Say hello to tandem.", max_tokens=12)
    assert reply.status == 200, reply
    body = reply.body
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"] and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12

    [record] = await gw.records(tenant_id)
    assert record["endpoint"] == "chat" and record["tier"] == "rt" and record["stream"] is False
    assert_timed(record, 12)
    assert record["prompt_tokens"] == usage["prompt_tokens"]
    assert record["slo_met"] is True  # generous targets on purpose


async def test_chat_streaming_is_sse_ending_in_done_with_usage_last(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("chat-stream")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Stream please."}],
        "max_tokens": 10,
        "stream_options": {"include_usage": True},
    }
    reply, events = await gw.stream("/v1/chat/completions", key, body)
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    chunks = sse_json(events)  # the stream ends with data: [DONE]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0].get("role") == "assistant"
    text = "".join(d.get("content") or "" for d in deltas)
    assert len(text) > 0 and len(deltas) >= 2  # really streamed, not one blob
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    # include_usage: usage only on one extra, last chunk with no choices
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert all(c.get("usage") is None for c in chunks[:-1])

    [record] = await gw.records(tenant_id)
    assert record["stream"] is True
    assert_timed(record, 10)


async def test_streaming_without_include_usage_sends_no_usage(gw: Gateway) -> None:
    _, key = await gw.new_tenant("no-usage")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    reply, events = await gw.stream("/v1/chat/completions", key, body)
    assert reply.status == 200
    chunks = sse_json(events)
    assert all(c.get("usage") is None for c in chunks)
    assert all(c["choices"] for c in chunks)


async def test_text_completion_both_ways(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("completions")
    reply = await gw.completion(key, "Once upon a time", max_tokens=8)
    assert reply.status == 200, reply
    assert reply.body["object"] == "text_completion"
    assert reply.body["usage"]["completion_tokens"] == 8
    assert reply.body["choices"][0]["finish_reason"] == "length"
    assert isinstance(reply.body["choices"][0]["text"], str)

    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}
    reply, events = await gw.stream("/v1/completions", key, body)
    assert reply.status == 200
    chunks = sse_json(events)
    pieces = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert len(pieces) >= 2 and all(c["object"] == "text_completion" for c in chunks)
    records = await gw.records(tenant_id, 2)
    assert [(r["endpoint"], r["stream"]) for r in records] == [
        ("completions", True),
        ("completions", False),
    ]


async def test_continuous_usage_stats_count_up(gw: Gateway) -> None:
    _, key = await gw.new_tenant("continuous")
    body = {
        "model": MODEL,
        "prompt": "count",
        "max_tokens": 6,
        "stream_options": {"continuous_usage_stats": True},
    }
    reply, events = await gw.stream("/v1/completions", key, body)
    assert reply.status == 200
    counts = [c["usage"]["completion_tokens"] for c in sse_json(events) if c.get("usage")]
    assert counts == sorted(counts) and counts[-1] == 6 and len(counts) >= 2


async def test_the_official_client_works(gw: Gateway) -> None:
    _, key = await gw.new_tenant("sdk")
    client = openai.AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key=key, max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 5
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
        assert [u.completion_tokens for u in usage] == [5]
        with pytest.raises(openai.NotFoundError) as info:
            await client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
        assert info.value.code == "model_not_found"
    finally:
        await client.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_unknown_model_is_model_not_found(gw: Gateway, path: str) -> None:
    _, key = await gw.new_tenant("unknown-model")
    body: dict[str, Any] = {"model": "gpt-9", "max_tokens": 1}
    body.update(
        {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    )
    reply = await gw.request("POST", path, key=key, json_body=body)
    assert reply.status == 404, reply
    assert reply.error["code"] == "model_not_found" and reply.error["param"] == "model"
    assert "gpt-9" in reply.error["message"]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({**CHAT, "max_tokens": "many"}, 422, "max_tokens"),
        ({**CHAT, "max_tokens": 100_000}, 400, "max_tokens"),
        ({**CHAT, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": "hello"}, 422, "messages"),
        ({"model": MODEL}, 422, "messages"),
        ({"messages": CHAT["messages"]}, 422, "model"),
        ({**CHAT, "temperature": 9}, 400, "temperature"),
        ({**CHAT, "tier": "gold"}, 422, "tier"),
    ],
)
async def test_bad_bodies_are_refused_naming_the_field_and_recorded(
    gw: Gateway, body: dict[str, Any], status: int, param: str
) -> None:
    tenant_id, key = await gw.new_tenant("bad-bodies")
    reply = await gw.request("POST", "/v1/chat/completions", key=key, json_body=body)
    assert reply.status == status, reply
    assert reply.error["param"] == param and reply.error["message"]
    assert reply.error["type"] == "invalid_request_error"
    assert "Traceback" not in json.dumps(reply.body)
    [record] = await gw.records(tenant_id)
    assert record["http_status"] == reply.status and record["status"] != "ok"


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 422, "invalid_value"),
        (b"", 400, "invalid_json"),
    ],
)
async def test_a_body_that_is_no_json_object_is_refused(
    gw: Gateway, data: bytes, status: int, code: str
) -> None:
    _, key = await gw.new_tenant("not-json")
    headers = {"Content-Type": "application/json"}
    reply = await gw.request("POST", "/v1/chat/completions", key=key, data=data, headers=headers)
    assert reply.status == status, reply
    assert reply.error["code"] == code and reply.error["type"] == "invalid_request_error"
    assert reply.error["message"]


async def test_an_oversized_body_is_413(gw: Gateway) -> None:
    _, key = await gw.new_tenant("big")
    data = b'{"model": "tandem-tiny", "prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    reply = await gw.request(
        "POST",
        "/v1/completions",
        key=key,
        data=data,
        headers={"Content-Type": "application/json"},
    )
    assert reply.status == 413 and reply.error["code"] == "request_too_large"


async def test_a_prompt_beyond_the_context_is_refused(gw: Gateway) -> None:
    _, key = await gw.new_tenant("too-long")
    reply = await gw.completion(key, "word " * 5000, max_tokens=4)
    assert reply.status == 400, reply
    assert reply.error["code"] == "context_length_exceeded"


async def test_be_tenant_cannot_ask_for_rt_but_rt_may_ask_for_be(gw: Gateway) -> None:
    _, be_key = await gw.new_tenant("be-only", "be", deadline_s=3600)
    reply = await gw.completion(be_key, "x", max_tokens=1, tier="rt")
    assert reply.status == 403 and "tier" in reply.error["message"]
    reply = await gw.completion(be_key, "x", max_tokens=1, tier="be")
    assert reply.status == 200, reply

    rt_id, rt_key = await gw.new_tenant("rt-asks-be")
    reply = await gw.completion(rt_key, "batch me", max_tokens=2, tier="be")
    assert reply.status == 200, reply
    [record] = await gw.records(rt_id)
    assert record["tier"] == "be"


async def test_rt_and_be_tenants_side_by_side_are_recorded_by_tier(gw: Gateway) -> None:
    rt_id, rt_key = await gw.new_tenant("rt-side")
    be_id, be_key = await gw.new_tenant("be-side", "be", deadline_s=3600)
    replies = await asyncio.gather(
        *(gw.chat(be_key, f"request {i}", max_tokens=8) for i in range(3)),
        *(gw.chat(rt_key, f"request {i}", max_tokens=8) for i in range(3)),
    )
    assert [r.status for r in replies] == [200] * 6
    assert {r.body["usage"]["completion_tokens"] for r in replies} == {8}
    be_records = await gw.records(be_id, 3)
    rt_records = await gw.records(rt_id, 3)
    assert {r["tier"] for r in be_records} == {"be"}
    assert {r["tier"] for r in rt_records} == {"rt"}
    for record in be_records + rt_records:
        assert_timed(record, 8)
    assert all(r["slo_met"] is True for r in be_records)  # well within the deadline


async def test_client_disconnect_aborts_the_engine_request(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("disconnect")
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 3000, "stream": True}
    async with gw.session.post(
        f"{gw.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        assert resp.status == 200
        await resp.content.readline()  # the first token arrived; now hang up
        assert await gw.engine_running() >= 1
        resp.connection.transport.abort()  # type: ignore[union-attr]

    # the engine drops the request long before 3000 tokens could have been generated (the
    # session's simulator runs nothing else once this test's request is gone)
    async def engine_idle() -> bool:
        return await gw.engine_running() == 0

    await wait_until(engine_idle, what="the engine request aborted")
    [record] = await gw.records(tenant_id)
    assert record["status"] == "client_disconnected"
    assert 0 < record["completion_tokens"] < 3000


async def test_engine_down_is_503_with_retry_after_and_recorded(gw_engine_down: Gateway) -> None:
    gw = gw_engine_down
    tenant_id, key = await gw.new_tenant("rt-down")
    for stream in (False, True):
        reply = await gw.chat(key, max_tokens=4, stream=stream)
        assert reply.status == 503, reply
        assert int(reply.headers["Retry-After"]) > 0
        assert reply.error["code"] == "engine_unavailable"
    records = await gw.records(tenant_id, 2)
    assert [r["status"] for r in records] == ["engine_unavailable"] * 2
    assert all(r["http_status"] == 503 and r["slo_met"] is False for r in records)
