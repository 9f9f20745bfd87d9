"""Quotas as a tenant sees them: over a limit the gateway answers 429 with Retry-After and an
OpenAI error whose code names the limit; limits changed through the admin API apply at once.
(tests/functional/test_quotas.py also waits out Retry-After against the real engine; these tests
never wait for a bucket to refill.)"""

from __future__ import annotations

import asyncio
from typing import Any

from tests.gateway.harness import MODEL, Gateway, Reply
from tests.waiting import wait_until


def assert_rate_limited(reply: Reply, limit: str) -> int:
    """The 429 a client sees over *limit*; returns its Retry-After, seconds."""
    assert reply.status == 429, reply
    error = reply.error
    assert error["type"] == "rate_limit_error" and error["code"] == f"{limit}_exceeded"
    assert limit in error["message"]
    retry_after = int(reply.headers["Retry-After"])
    assert retry_after >= 1
    return retry_after


def assert_suspended(reply: Reply, limit: str) -> None:
    """The 403 a client sees when its tenant's *limit* is 0: refused for good, no Retry-After
    (a 429 would have the client retry a request no wait can admit)."""
    assert reply.status == 403, reply
    assert reply.error["type"] == "permission_error"
    assert reply.error["code"] == f"{limit}_is_zero"
    assert f"its {limit} limit is 0" in reply.error["message"]
    assert "Retry-After" not in reply.headers


async def test_a_limit_of_zero_refuses_every_request_for_good(gw: Gateway) -> None:
    for limit in ("requests_per_min", "max_concurrent", "monthly_tokens"):
        tenant_id, key = await gw.new_tenant(f"zero-{limit}", quota={limit: 0})
        assert_suspended(await gw.chat(key, max_tokens=1), limit)
        reply = await gw.admin("GET", f"/usage?tenant={tenant_id}")
        assert reply.status == 200, reply
    # raising it admits at once
    await gw.admin("PATCH", f"/tenants/{tenant_id}", {"quota": {"monthly_tokens": 10_000}})
    assert (await gw.chat(key, max_tokens=1)).status == 200


async def test_over_requests_per_min_is_429_with_retry_after_and_recorded(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("rpm", quota={"requests_per_min": 2})
    assert [(await gw.chat(key, max_tokens=1)).status for _ in range(2)] == [200, 200]
    reply = await gw.chat(key, max_tokens=1)
    retry_after = assert_rate_limited(reply, "requests_per_min")
    assert retry_after <= 30  # one request's worth of refill: 60 / 2 s
    records = await gw.records(tenant_id, 3)
    assert [r["status"] for r in records] == ["rate_limited", "ok", "ok"]
    refused = records[0]
    assert refused["http_status"] == 429
    assert refused["slo_met"] is None  # a refusal is not an SLO miss
    assert refused["completion_tokens"] == 0


async def test_a_streaming_request_over_the_limit_is_refused_before_the_stream(
    gw: Gateway,
) -> None:
    _, key = await gw.new_tenant("rpm-stream", quota={"requests_per_min": 1})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    reply, events = await gw.stream("/v1/chat/completions", key, body)
    assert reply.status == 200 and events[-1] == "[DONE]"
    reply, events = await gw.stream("/v1/chat/completions", key, body)
    assert_rate_limited(reply, "requests_per_min")
    assert events == []


async def test_over_tokens_per_min_is_429_naming_what_the_request_needs(gw: Gateway) -> None:
    _, key = await gw.new_tenant("tpm", quota={"tokens_per_min": 300})
    probe = await gw.chat(key, max_tokens=1)
    assert probe.status == 200, probe
    # each request reserves prompt + max_tokens when admitted; the engine generates all of them
    per_request = probe.body["usage"]["prompt_tokens"] + 100
    left = 300 - probe.body["usage"]["total_tokens"]
    statuses = []
    for _ in range(left // per_request + 1):
        reply = await gw.chat(key, max_tokens=100)
        statuses.append(reply.status)
    assert statuses == [200] * (left // per_request) + [429]
    retry_after = assert_rate_limited(reply, "tokens_per_min")
    assert "this request needs" in reply.error["message"]
    assert retry_after <= 60 * per_request / 300 + 1
    # a request larger than the whole limit can never pass: a 400 naming max_tokens
    reply = await gw.chat(key, max_tokens=400)
    assert reply.status == 400 and reply.error["code"] == "request_too_large_for_limit"
    assert "lower max_tokens" in reply.error["message"]


async def test_tokens_reserved_but_not_generated_are_given_back(gw: Gateway) -> None:
    _, key = await gw.new_tenant("tpm-refund", quota={"tokens_per_min": 200})
    # reserve prompt + 180, read one chunk, hang up: the engine stops and the rest comes back
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 180,
        "stream": True,
    }
    async with gw.session.post(
        f"{gw.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        assert resp.status == 200
        await resp.content.readline()
        resp.connection.transport.abort()  # type: ignore[union-attr]
    reply = await gw.chat(key, max_tokens=150)  # may come before the gateway saw the hang-up

    async def admitted() -> Reply | None:
        nonlocal reply
        if reply.status == 200:
            return reply
        assert_rate_limited(reply, "tokens_per_min")
        reply = await gw.chat(key, max_tokens=150)
        return None

    # without the refund only ~10 tokens would be left, refilling at 200 per minute
    await wait_until(admitted, timeout_s=10, what="the unused reservation given back")


async def test_over_max_concurrent_is_429_until_a_request_finishes(gw: Gateway) -> None:
    _, key = await gw.new_tenant("concurrent", quota={"max_concurrent": 1})
    body = {"model": MODEL, "prompt": "long", "max_tokens": 3000, "stream": True}
    async with gw.session.post(
        f"{gw.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        assert resp.status == 200
        await resp.content.readline()  # the long request holds the one slot
        assert_rate_limited(await gw.chat(key, max_tokens=1), "max_concurrent")
        resp.connection.transport.abort()  # type: ignore[union-attr]

    async def slot_free() -> bool:
        reply = await gw.chat(key, max_tokens=1)
        if reply.status == 429:
            assert reply.error["code"] == "max_concurrent_exceeded"
        return reply.status == 200

    await wait_until(slot_free, what="the slot released after the disconnect")


async def test_concurrent_requests_beyond_the_slots_are_refused(gw: Gateway) -> None:
    _, key = await gw.new_tenant("concurrent-burst", quota={"max_concurrent": 2})
    replies = await asyncio.gather(*(gw.chat(key, max_tokens=40) for _ in range(5)))
    statuses = sorted(r.status for r in replies)
    assert statuses.count(200) >= 2 and set(statuses) <= {200, 429}, statuses
    for reply in replies:
        if reply.status == 429:
            assert_rate_limited(reply, "max_concurrent")


async def test_monthly_budget_is_429_until_next_month(gw: Gateway) -> None:
    _, key = await gw.new_tenant("monthly", quota={"monthly_tokens": 30})
    reply = await gw.chat(key, max_tokens=30)
    assert reply.status == 200, reply
    reply = await gw.chat(key, max_tokens=30)
    retry_after = assert_rate_limited(reply, "monthly_tokens")
    assert retry_after <= 31 * 86_400
    assert "monthly_tokens is 30" in reply.error["message"]


async def test_limit_changes_through_the_admin_api_apply_at_once(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("patched", quota={"requests_per_min": 1})
    assert (await gw.chat(key, max_tokens=1)).status == 200
    assert_rate_limited(await gw.chat(key, max_tokens=1), "requests_per_min")
    reply = await gw.admin("PATCH", f"/tenants/{tenant_id}", {"quota": {"requests_per_min": 600}})
    assert reply.status == 200 and reply.body["quota"]["requests_per_min"] == 600
    for _ in range(3):  # the raise gave the extra burst at once
        reply = await gw.chat(key, max_tokens=1)
        assert reply.status == 200, reply
    await gw.admin("PATCH", f"/tenants/{tenant_id}", {"quota": {"max_concurrent": 0}})
    assert_suspended(await gw.chat(key, max_tokens=1), "max_concurrent")
    await gw.admin("PATCH", f"/tenants/{tenant_id}", {"quota": {"max_concurrent": None}})
    assert (await gw.chat(key, max_tokens=1)).status == 200


async def test_quota_of_one_tenant_does_not_touch_another(gw: Gateway) -> None:
    _, limited = await gw.new_tenant("limited", quota={"requests_per_min": 1})
    _, free = await gw.new_tenant("unlimited")
    assert (await gw.chat(limited, max_tokens=1)).status == 200
    assert (await gw.chat(limited, max_tokens=1)).status == 429
    assert [(await gw.chat(free, max_tokens=1)).status for _ in range(3)] == [200] * 3


async def test_patching_one_limit_keeps_the_others_and_null_removes_one(gw: Gateway) -> None:
    quota: dict[str, Any] = {"requests_per_min": 60, "tokens_per_min": 10_000, "max_concurrent": 4}
    reply = await gw.admin(
        "POST", "/tenants", {"name": "quota-patch", "tier": "be", "quota": quota}
    )
    assert reply.status == 201
    assert reply.body["quota"] == {**quota, "monthly_tokens": None}
    path = f"/tenants/{reply.body['id']}"
    reply = await gw.admin("PATCH", path, {"quota": {"monthly_tokens": 1_000_000}})
    assert reply.status == 200 and reply.body["quota"] == {**quota, "monthly_tokens": 1_000_000}
    reply = await gw.admin("PATCH", path, {"quota": {"tokens_per_min": None}})
    assert reply.status == 200 and reply.body["quota"]["tokens_per_min"] is None
    assert reply.body["quota"]["requests_per_min"] == 60
    patched = reply.body["quota"]
    bad = await gw.admin("PATCH", path, {"quota": {"max_concurrent": -1}})
    assert bad.status == 422 and bad.error["param"] == "quota.max_concurrent"
    bad = await gw.admin("PATCH", path, {"quota": {"burst": 5}})
    assert bad.status == 422 and bad.error["param"] == "quota" and "burst" in bad.error["message"]
    again = await gw.admin("GET", path)
    assert again.body["quota"] == patched  # the refused changes changed nothing
