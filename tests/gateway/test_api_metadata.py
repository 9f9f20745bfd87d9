"""What the API tells a client about its requests beside the answer: the model object
(`GET /v1/models/{id}`) and `model_not_found`, the request id on every response, the tenant's
rate-limit headers, and the 400 of a request no limit could ever admit — as the official
`openai` client sees them (it retries 429s and 5xx, never a 400 or 404)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.gateway.harness import MODEL, Gateway
from tests.gateway.test_batches import chat_line, create_batch, jsonl, read_lines, upload, wait_for


def client_of(gw: Gateway, key: str, max_retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key=key, max_retries=max_retries)


# ---------------------------------------------------------------------------------- models


async def test_models_retrieve_answers_the_listed_model(gw: Gateway) -> None:
    _, key = await gw.new_tenant("retrieve")
    listed = await gw.request("GET", "/v1/models", key=key)
    client = client_of(gw, key)
    try:
        model = await client.models.retrieve(MODEL)
        assert model.id == MODEL and model.object == "model"
        assert model.model_dump() == listed.body["data"][0]
        with pytest.raises(openai.NotFoundError) as info:
            await client.models.retrieve("gpt-9")
        assert info.value.status_code == 404
        assert info.value.code == "model_not_found"
        assert "gpt-9" in info.value.message
    finally:
        await client.close()


async def test_models_retrieve_needs_a_key(gw: Gateway) -> None:
    reply = await gw.request("GET", f"/v1/models/{MODEL}")
    assert reply.status == 401, reply


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_a_generation_naming_an_unknown_model_is_a_404(gw: Gateway, endpoint: str) -> None:
    _, key = await gw.new_tenant("unknown-model-404")
    client = client_of(gw, key, max_retries=2)
    try:
        with pytest.raises(openai.NotFoundError) as info:
            if endpoint == "chat":
                await client.chat.completions.create(
                    model="gpt-9", messages=[{"role": "user", "content": "x"}], max_tokens=1
                )
            else:
                await client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
        assert info.value.code == "model_not_found"
        body: Any = info.value.body
        assert body["param"] == "model" and "gpt-9" in body["message"]
    finally:
        await client.close()


async def test_a_batch_line_naming_an_unknown_model_goes_to_the_error_file(gw: Gateway) -> None:
    _, key = await gw.new_tenant("batch-unknown-model", "be")
    other = chat_line("other", "hi")
    other["body"]["model"] = "gpt-9"
    file = await upload(gw, key, jsonl([chat_line("ok", "hi"), other]))
    batch = await create_batch(gw, key, file.body["id"])
    done = await wait_for(gw, key, batch.body["id"])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    out = await read_lines(gw, key, done["output_file_id"])
    assert [line["custom_id"] for line in out] == ["ok"]
    [error] = await read_lines(gw, key, done["error_file_id"])
    assert error["custom_id"] == "other"
    assert error["response"]["status_code"] == 404
    assert error["response"]["body"]["error"]["code"] == "model_not_found"
    assert error["response"]["body"]["error"]["param"] == "model"


# ---------------------------------------------------------------------------------- request id


async def test_every_response_carries_its_own_request_id(gw: Gateway) -> None:
    _, key = await gw.new_tenant("request-ids")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    replies = [
        await gw.chat(key, max_tokens=2),
        (await gw.stream("/v1/chat/completions", key, chat))[0],
        await gw.chat(key, max_tokens="two"),  # 422
        await gw.chat(key, temperature=9),  # 400
        await gw.request("POST", "/v1/chat/completions", key=key, json_body={**chat, "model": "x"}),
        await gw.request("GET", "/v1/models"),  # 401
        await gw.request("GET", "/v1/models", key=key),
        await gw.request("GET", f"/v1/models/{MODEL}", key=key),
        await gw.request("GET", "/v1/nothing-here", key=key),  # 404 route
        await gw.request("DELETE", "/v1/models", key=key),  # 405
        await gw.request("GET", "/v1/files", key=key),
        await gw.request("GET", "/v1/batches/batch_nope", key=key),  # 404
    ]
    ids = [reply.headers.get("x-request-id") for reply in replies]
    assert all(ids), list(zip([r.status for r in replies], ids, strict=True))
    assert len(set(ids)) == len(ids)


async def test_a_generations_request_id_is_its_usage_records_and_names_its_body(
    gw: Gateway,
) -> None:
    tenant_id, key = await gw.new_tenant("request-id-usage", quota={"requests_per_min": 2})
    whole = await gw.chat(key, max_tokens=3)
    assert whole.status == 200, whole
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    streamed, events = await gw.stream("/v1/chat/completions", key, chat)
    refused = await gw.chat(key, max_tokens=3)  # over requests_per_min
    assert refused.status == 429, refused
    records = await gw.records(tenant_id, 3)
    by_id = {r["request_id"]: r for r in records}
    whole_id = whole.headers["x-request-id"]
    assert by_id[whole_id]["status"] == "ok" and not by_id[whole_id]["stream"]
    assert whole.body["id"] == f"chatcmpl-{whole_id}"
    stream_id = streamed.headers["x-request-id"]
    assert by_id[stream_id]["status"] == "ok" and by_id[stream_id]["stream"]
    chunk_ids = {json.loads(e)["id"] for e in events if e != "[DONE]"}
    assert chunk_ids == {f"chatcmpl-{stream_id}"}
    assert by_id[refused.headers["x-request-id"]]["status"] == "rate_limited"


async def test_a_client_sent_request_id_is_not_taken_as_the_gateways(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("client-request-id")
    mine = "tdm-0123456789abcdef0123456789abcdef"
    reply = await gw.request(
        "POST",
        "/v1/completions",
        key=key,
        json_body={"model": MODEL, "prompt": "x", "max_tokens": 2},
        headers={"X-Request-Id": mine},
    )
    assert reply.status == 200, reply
    assert reply.headers["x-request-id"] != mine
    [record] = await gw.records(tenant_id, 1)
    assert record["request_id"] == reply.headers["x-request-id"]


# ---------------------------------------------------------------------------------- rate limits

RATE_LIMIT_HEADERS = [
    f"x-ratelimit-{what}-{limit}"
    for limit in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
]


def duration_s(text: str) -> float:
    """Seconds of a reset header ("1s", "6m0s", "250ms", "1m30.5s": OpenAI's spelling)."""
    seconds, rest = 0.0, text
    if rest.endswith("ms"):
        return float(rest[:-2]) / 1000.0
    if "m" in rest:
        minutes, rest = rest.split("m", 1)
        seconds += 60.0 * float(minutes)
    assert rest.endswith("s"), text
    return seconds + float(rest[:-1])


async def test_a_success_carries_the_tenants_rate_limits(gw: Gateway) -> None:
    _, key = await gw.new_tenant(
        "rate-headers", quota={"requests_per_min": 3, "tokens_per_min": 600}
    )
    first = await gw.chat(key, max_tokens=200)
    assert first.status == 200, first
    headers = first.headers
    assert headers["x-ratelimit-limit-requests"] == "3"
    # refilling one request takes 20 s at 3/min: after one, two are left
    assert headers["x-ratelimit-remaining-requests"] == "2"
    assert 0 < duration_s(headers["x-ratelimit-reset-requests"]) <= 20
    assert headers["x-ratelimit-limit-tokens"] == "600"
    # the request held prompt + max_tokens (refilled at 10 tokens/s): well under the limit left
    remaining = int(headers["x-ratelimit-remaining-tokens"])
    assert 600 - first.body["usage"]["prompt_tokens"] - 200 <= remaining < 600
    assert 0 < duration_s(headers["x-ratelimit-reset-tokens"]) <= 60
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    streamed, _ = await gw.stream("/v1/chat/completions", key, body)
    assert streamed.status == 200
    assert streamed.headers["x-ratelimit-limit-requests"] == "3"
    assert streamed.headers["x-ratelimit-remaining-requests"] == "1"
    assert set(RATE_LIMIT_HEADERS) <= {h.lower() for h in streamed.headers}


async def test_rate_limit_headers_are_only_those_of_the_tenants_limits(gw: Gateway) -> None:
    _, unlimited = await gw.new_tenant("no-limits")
    reply = await gw.completion(unlimited, max_tokens=2)
    assert reply.status == 200, reply
    assert not [h for h in reply.headers if h.lower().startswith("x-ratelimit-")]
    _, requests_only = await gw.new_tenant("requests-only", quota={"requests_per_min": 100})
    reply = await gw.completion(requests_only, max_tokens=2)
    assert reply.status == 200, reply
    present = {h.lower() for h in reply.headers if h.lower().startswith("x-ratelimit-")}
    assert present == {h for h in RATE_LIMIT_HEADERS if h.endswith("-requests")}


# ---------------------------------------------------------------------------------- never fits


async def test_a_request_over_the_whole_tokens_per_min_is_a_400_the_client_does_not_retry(
    gw: Gateway,
) -> None:
    tenant_id, key = await gw.new_tenant("too-large", quota={"tokens_per_min": 300})
    client = client_of(gw, key, max_retries=2)  # it would retry a 429 (after Retry-After)
    try:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=400
            )
        assert info.value.code == "request_too_large_for_limit"
        body: Any = info.value.body
        assert body["param"] == "max_tokens"
        message = body["message"]
        assert "tokens_per_min" in message and "300" in message and "400" in message
        # no max_tokens: the gateway's default cap (gateway.default_max_tokens) counts
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=MODEL, prompt="x")
        assert info.value.code == "request_too_large_for_limit"
        assert "default" in info.value.message
        fits = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=50
        )
        assert fits.usage is not None and fits.usage.completion_tokens == 50
    finally:
        await client.close()
    records = await gw.records(tenant_id, 3)
    assert [(r["status"], r["http_status"]) for r in records] == [
        ("ok", 200),
        ("invalid_request", 400),
        ("invalid_request", 400),
    ]


async def test_a_batch_line_over_the_whole_tokens_per_min_still_runs(gw: Gateway) -> None:
    # batch lines are held to the monthly budget only (gateway/quotas): no per-minute limit can
    # refuse one, so none is refused for being larger than it
    _, key = await gw.new_tenant("too-large-batch", "be", quota={"tokens_per_min": 100})
    file = await upload(gw, key, jsonl([chat_line("big", "hi", max_tokens=150)]))
    batch = await create_batch(gw, key, file.body["id"])
    done = await wait_for(gw, key, batch.body["id"])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
