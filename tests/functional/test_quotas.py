"""Quotas end to end: the gateway in front of the real engine refuses a tenant over its limits
with 429, Retry-After and an OpenAI error naming the limit, and serves it again afterwards."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.functional.gateway_fixtures import GatewayHandle
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
MODEL = "tandem-tiny"


async def tenant_with_quota(gw: GatewayHandle, name: str, **quota: int) -> tuple[str, str]:
    status, tenant = await gw.admin(
        "POST",
        "/tenants",
        {"name": name, "tier": "rt", "slo": {"ttft_ms": 5000, "tpot_ms": 1000}, "quota": quota},
    )
    assert status == 201, tenant
    status, key = await gw.admin("POST", f"/tenants/{tenant['id']}/keys")
    assert status == 201, key
    return tenant["id"], key["key"]


async def chat(
    gw: GatewayHandle, key: str, max_tokens: int = 1, **extra: Any
) -> tuple[int, dict[str, str], Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }
    async with gw.session.post(
        f"{gw.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        payload = await resp.json() if resp.content_type == "application/json" else None
        return resp.status, dict(resp.headers), payload


def streamed_chat(gw: GatewayHandle, key: str, max_tokens: int) -> Any:
    """A streamed chat of *max_tokens* tokens (ignore_eos), as an open response: leaving its
    `async with` block hangs up."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    return gw.session.post(
        f"{gw.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )


async def in_flight(gw: GatewayHandle, tenant_id: str) -> float:
    """The tenant's requests in flight, as /metrics says (all tiers)."""
    async with gw.session.get(f"{gw.base_url}/metrics") as resp:
        text = await resp.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem_requests_in_flight" and sample.labels.get("tenant") == tenant_id
    )


def assert_rate_limited(status: int, headers: dict[str, str], body: Any, limit: str) -> int:
    """The 429 a client sees; returns its Retry-After."""
    assert status == 429, body
    error = body["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == f"{limit}_exceeded"
    assert limit in error["message"]
    retry_after = int(headers["Retry-After"])
    assert retry_after >= 1
    return retry_after


async def test_over_requests_per_min_is_429_then_served_after_retry_after(
    gateway: GatewayHandle,
) -> None:
    tenant_id, key = await tenant_with_quota(gateway, "rpm-tenant", requests_per_min=12)
    started = time.monotonic()
    served = 0
    while True:
        status, headers, body = await chat(gateway, key)
        if status != 200:
            break
        served += 1
        assert served <= 20, "the limit never applied"
    elapsed = time.monotonic() - started
    retry_after = assert_rate_limited(status, headers, body, "requests_per_min")
    # the bucket holds 12 and refills 12 per minute: no more than that got through
    assert 12 <= served <= 12 + int(elapsed * 12 / 60) + 1
    assert retry_after <= 5  # one request's worth of refill: 60 / 12 s
    await asyncio.sleep(retry_after)  # the behaviour under test: a client honouring Retry-After
    status, _, body = await chat(gateway, key)
    assert status == 200, body
    records = await gateway.latest_requests(tenant_id, 50)
    limited = [r for r in records if r["status"] == "rate_limited"]
    assert len(limited) == 1 and limited[0]["http_status"] == 429
    assert limited[0]["slo_met"] is None  # a refusal is not an SLO miss


async def test_over_tokens_per_min_is_429_then_served_after_retry_after(
    gateway: GatewayHandle,
) -> None:
    _, key = await tenant_with_quota(gateway, "tpm-tenant", tokens_per_min=600)
    status, _, body = await chat(gateway, key, max_tokens=1)
    assert status == 200, body
    per_request = body["usage"]["prompt_tokens"] + 40  # what a max_tokens=40 request reserves
    probe = body["usage"]["total_tokens"]
    # a burst: each request is charged prompt + max_tokens when admitted, so the bucket of 600
    # (less what the probe used, unless it has refilled already) admits 600 // per_request of
    # them at once, give or take one, and refuses the rest
    results = await asyncio.gather(*(chat(gateway, key, max_tokens=40) for _ in range(16)))
    admitted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    fewest, most = (600 - probe) // per_request, 600 // per_request + 1
    assert fewest <= len(admitted) <= most, len(admitted)
    retry_after = assert_rate_limited(*refused[0], "tokens_per_min")
    assert "this request needs" in refused[0][2]["error"]["message"]
    assert retry_after <= 60 * per_request / 600 + 1
    await asyncio.sleep(retry_after)  # the behaviour under test: a client honouring Retry-After
    status, _, body = await chat(gateway, key, max_tokens=40)
    assert status == 200, body
    # a request larger than the whole limit can never pass: said so, naming max_tokens
    status, _, body = await chat(gateway, key, max_tokens=700)
    assert status == 400 and "lower max_tokens" in body["error"]["message"]
    assert body["error"]["code"] == "request_too_large_for_limit"


async def test_tokens_are_corrected_when_a_request_ends_early(gateway: GatewayHandle) -> None:
    _, key = await tenant_with_quota(gateway, "tpm-correction", tokens_per_min=850)
    # max_tokens 600 is reserved, but the stop string ("w": every word of the tiny model) ends the
    # answer early; the tokens not generated go back to the bucket when the request ends
    status, _, body = await chat(gateway, key, max_tokens=600, ignore_eos=False, stop=["w"])
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "stop"
    used = body["usage"]["total_tokens"]
    assert used < 200
    status, _, body = await chat(gateway, key, max_tokens=600)
    # admitted only because the ~600 - used tokens came back (the refill alone, 700 per minute,
    # gives ~12 per second: the first answer would have to take ~40 s)
    assert status == 200, body


async def test_tokens_reserved_but_not_generated_are_given_back(gateway: GatewayHandle) -> None:
    _, key = await tenant_with_quota(gateway, "tpm-refund", tokens_per_min=1000)
    # reserve prompt + 900, read one chunk, hang up: the engine stops and the rest comes back
    async with streamed_chat(gateway, key, max_tokens=900) as resp:
        assert resp.status == 200
        await resp.content.readline()

    async def admitted() -> bool:  # once the gateway saw the hang-up and released the rest
        status, _, reply = await chat(gateway, key, max_tokens=800)
        if status != 200:
            assert status == 429 and reply["error"]["code"] == "tokens_per_min_exceeded", reply
        return status == 200

    # without the refund only ~100 tokens would be left
    await wait_until(admitted, timeout_s=5, what="the unused reservation given back")


async def test_over_max_concurrent_is_429_until_the_request_in_flight_ends(
    gateway: GatewayHandle,
) -> None:
    tenant_id, key = await tenant_with_quota(gateway, "conc-tenant", max_concurrent=1)
    # a stream long enough (seconds on the CPU engine) that it still holds the slot when the
    # probe arrives, on an idle machine too; it ends when its client hangs up (the slot must
    # come back then: waiting for its 1,500 tokens took 20–35 s of the suite)
    async with streamed_chat(gateway, key, max_tokens=1500) as long:
        assert long.status == 200
        await long.content.readline()  # admitted and streaming: it holds the slot
        assert await in_flight(gateway, tenant_id) >= 1
        status, headers, reply = await chat(gateway, key)
        assert_rate_limited(status, headers, reply, "max_concurrent")
        assert not long.content.at_eof(), "the long request ended before the limit was seen"

    async def slot_back() -> bool:  # once the gateway saw the hang-up and ended the request
        return await in_flight(gateway, tenant_id) == 0

    await wait_until(slot_back, timeout_s=10, what="the hung-up request's slot given back")
    status, _, reply = await chat(gateway, key)
    assert status == 200, reply


async def test_limit_changes_through_the_admin_api_apply_without_restart(
    gateway: GatewayHandle,
) -> None:
    tenant_id, key = await tenant_with_quota(gateway, "patched-tenant", requests_per_min=1)
    assert (await chat(gateway, key))[0] == 200
    status, headers, body = await chat(gateway, key)
    assert_rate_limited(status, headers, body, "requests_per_min")
    status, patched = await gateway.admin(
        "PATCH", f"/tenants/{tenant_id}", {"quota": {"requests_per_min": 600}}
    )
    assert status == 200 and patched["quota"]["requests_per_min"] == 600
    for _ in range(5):
        status, _, body = await chat(gateway, key)
        assert status == 200, body
    await gateway.admin("PATCH", f"/tenants/{tenant_id}", {"quota": {"max_concurrent": 0}})
    status, headers, body = await chat(gateway, key)  # suspended: refused for good, no retry
    assert status == 403 and body["error"]["code"] == "max_concurrent_is_zero", body
    assert "Retry-After" not in headers


async def test_a_revoked_key_is_refused_immediately(gateway: GatewayHandle) -> None:
    tenant_id, key = await tenant_with_quota(gateway, "revoked-tenant", requests_per_min=100)
    assert (await chat(gateway, key))[0] == 200
    _, keys = await gateway.admin("GET", f"/tenants/{tenant_id}/keys")
    status, _ = await gateway.admin("DELETE", f"/keys/{keys['data'][0]['id']}")
    assert status == 200
    status, _, body = await chat(gateway, key)
    assert status == 401 and "revoked" in body["error"]["message"]


async def test_monthly_budget_is_429_until_next_month(gateway: GatewayHandle) -> None:
    _, key = await tenant_with_quota(gateway, "monthly-tenant", monthly_tokens=30)
    status, _, body = await chat(gateway, key, max_tokens=30)
    assert status == 200, body
    status, headers, body = await chat(gateway, key, max_tokens=30)
    retry_after = assert_rate_limited(status, headers, body, "monthly_tokens")
    assert retry_after <= 31 * 86_400
    assert "monthly_tokens is 30 and 30 have been used" in body["error"]["message"]
