"""Quotas through the admin API (SQLite and PostgreSQL; the engine is down, so admitted requests
end in 503 while refused ones are 429): partial changes, removal, validation, immediate effect."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tandem.cli import main as tandem
from tests.functional.gateway_fixtures import ADMIN_TOKEN, GatewayHandle


async def post_chat(gw: GatewayHandle, key: str) -> tuple[int, dict[str, str], Any]:
    body = {
        "model": "tandem-tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    }
    async with gw.session.post(
        f"{gw.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def test_patching_one_limit_keeps_the_others_and_null_removes_one(
    gateway_without_engine: GatewayHandle,
) -> None:
    gw = gateway_without_engine
    status, tenant = await gw.admin(
        "POST",
        "/tenants",
        {
            "name": "quota-patch",
            "tier": "be",
            "quota": {"requests_per_min": 60, "tokens_per_min": 10_000, "max_concurrent": 4},
        },
    )
    assert status == 201
    assert tenant["quota"] == {
        "requests_per_min": 60,
        "tokens_per_min": 10_000,
        "max_concurrent": 4,
        "monthly_tokens": None,
    }
    path = f"/tenants/{tenant['id']}"
    status, patched = await gw.admin("PATCH", path, {"quota": {"monthly_tokens": 1_000_000}})
    assert status == 200 and patched["quota"] == {
        "requests_per_min": 60,
        "tokens_per_min": 10_000,
        "max_concurrent": 4,
        "monthly_tokens": 1_000_000,
    }
    status, patched = await gw.admin("PATCH", path, {"quota": {"tokens_per_min": None}})
    assert status == 200 and patched["quota"]["tokens_per_min"] is None
    assert patched["quota"]["requests_per_min"] == 60
    status, body = await gw.admin("PATCH", path, {"quota": {"max_concurrent": -1}})
    assert status == 422 and body["error"]["param"] == "quota.max_concurrent"
    status, body = await gw.admin("PATCH", path, {"quota": {"burst": 5}})
    assert status == 422 and body["error"]["param"] == "quota"
    assert "burst" in body["error"]["message"]
    status, again = await gw.admin("GET", path)
    assert again["quota"] == patched["quota"]  # the refused changes changed nothing


async def test_quota_applies_at_once_and_a_raise_lets_the_tenant_back_in(
    gateway_without_engine: GatewayHandle,
) -> None:
    gw = gateway_without_engine
    tenant_id, key = await gw.new_tenant("quota-live", "be")
    assert (await post_chat(gw, key))[0] == 503  # admitted (the engine is down)
    status, _ = await gw.admin("PATCH", f"/tenants/{tenant_id}", {"quota": {"requests_per_min": 2}})
    assert status == 200
    statuses = [(await post_chat(gw, key))[0] for _ in range(3)]
    assert statuses == [503, 503, 429]
    status, headers, body = await post_chat(gw, key)
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "requests_per_min_exceeded"
    await gw.admin("PATCH", f"/tenants/{tenant_id}", {"quota": {"requests_per_min": 100}})
    assert (await post_chat(gw, key))[0] == 503  # the raise gave the extra burst at once
    records = await gw.latest_requests(tenant_id, 20)
    assert sum(r["status"] == "rate_limited" for r in records) == 2
    assert all(r["slo_met"] is None for r in records if r["status"] == "rate_limited")


async def test_cli_creates_a_tenant_with_a_quota(
    gateway_without_engine: GatewayHandle,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    gw = gateway_without_engine
    monkeypatch.setenv("TANDEM_URL", gw.base_url)  # the CLI talks to the gateway's admin API
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", ADMIN_TOKEN)
    code = await asyncio.to_thread(
        tandem,
        [
            "admin",
            "tenant",
            "create",
            "cli-quota",
            "--tier",
            "be",
            "--requests-per-min",
            "5",
            "--monthly-tokens",
            "1000",
        ],
    )
    assert code == 0
    created = json.loads(capsys.readouterr().out)
    assert created["quota"] == {
        "requests_per_min": 5,
        "tokens_per_min": None,
        "max_concurrent": None,
        "monthly_tokens": 1000,
    }
    status, tenant = await gw.admin("GET", f"/tenants/{created['id']}")
    assert status == 200 and tenant["quota"] == created["quota"]
    code = await asyncio.to_thread(
        tandem, ["admin", "tenant", "create", "cli-bad", "--tier", "be", "--max-concurrent", "-1"]
    )
    assert code == 2
    assert "--max-concurrent must be in [0, 2147483647], got -1" in capsys.readouterr().err
