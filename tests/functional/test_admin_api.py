"""The admin REST API against the real store (SQLite and PostgreSQL), as an operator uses it."""

from __future__ import annotations

import pytest

from tests.functional.gateway_fixtures import GatewayHandle


async def test_admin_needs_the_admin_token(gateway_without_engine: GatewayHandle) -> None:
    gw = gateway_without_engine
    for headers in ({}, {"Authorization": "Bearer wrong-token"}):
        async with gw.session.get(f"{gw.base_url}/admin/v1/tenants", headers=headers) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["type"] == "authentication_error"


async def test_tenant_lifecycle(gateway_without_engine: GatewayHandle) -> None:
    gw = gateway_without_engine
    status, tenant = await gw.admin(
        "POST",
        "/tenants",
        {
            "name": "chat-app",
            "tier": "rt",
            "slo": {"ttft_ms": 300, "tpot_ms": 60},
            "quota": {"requests_per_min": 600, "max_concurrent": 8},
        },
    )
    assert status == 201
    assert tenant["id"].startswith("ten_") and tenant["slo"]["ttft_ms"] == 300
    assert tenant["quota"]["max_concurrent"] == 8

    status, body = await gw.admin("GET", "/tenants")
    assert status == 200 and [t["name"] for t in body["data"]] == ["chat-app"]

    status, patched = await gw.admin(
        "PATCH", f"/tenants/{tenant['id']}", {"slo": {"ttft_ms": 200, "tpot_ms": 40}}
    )
    assert status == 200 and patched["slo"]["ttft_ms"] == 200
    assert patched["quota"]["max_concurrent"] == 8  # untouched parts stay

    status, _ = await gw.admin("DELETE", f"/tenants/{tenant['id']}")
    assert status == 200
    status, body = await gw.admin("GET", f"/tenants/{tenant['id']}")
    assert status == 404 and body["error"]["code"] == "tenant_not_found"


@pytest.mark.parametrize(
    ("payload", "status", "param"),
    [
        ({"name": "x", "tier": "rt"}, 422, "slo"),
        ({"name": "x", "tier": "gold"}, 422, "tier"),
        ({"name": "", "tier": "be"}, 422, "name"),
        ({"name": "x", "tier": "be", "slo": {"deadline_s": -1}}, 422, "slo.deadline_s"),
        # The param is the JSON key the client sent, not the Python attribute (ttft_target_ms).
        ({"name": "x", "tier": "rt", "slo": {"ttft_ms": 0, "tpot_ms": 9}}, 422, "slo.ttft_ms"),
        # token_group was accepted and ignored until migration 0004 dropped it.
        (
            {"name": "x", "tier": "rt", "slo": {"ttft_ms": 1, "tpot_ms": 1, "token_group": 8}},
            422,
            "slo",
        ),
        (
            {"name": "x", "tier": "be", "quota": {"max_concurrent": "many"}},
            422,
            "quota.max_concurrent",
        ),
        ({"name": "x", "tier": "be", "colour": "red"}, 422, "colour"),
    ],
)
async def test_bad_tenants_are_refused_naming_the_field(
    gateway_without_engine: GatewayHandle, payload: dict[str, object], status: int, param: str
) -> None:
    code, body = await gateway_without_engine.admin("POST", "/tenants", payload)
    assert code == status and body["error"]["param"] == param


async def test_duplicate_name_is_a_conflict(gateway_without_engine: GatewayHandle) -> None:
    gw = gateway_without_engine
    assert (await gw.admin("POST", "/tenants", {"name": "dup", "tier": "be"}))[0] == 201
    status, body = await gw.admin("POST", "/tenants", {"name": "dup", "tier": "be"})
    assert status == 409 and body["error"]["param"] == "name"


async def test_keys_are_shown_once_and_revocation_is_immediate(
    gateway_without_engine: GatewayHandle,
) -> None:
    gw = gateway_without_engine
    tenant_id, key = await gw.new_tenant("batchco", "be")
    models_url = f"{gw.base_url}/v1/models"
    auth = {"Authorization": f"Bearer {key}"}
    async with gw.session.get(models_url, headers=auth) as resp:
        assert resp.status == 200
        assert (await resp.json())["data"][0]["id"] == "tandem-tiny"

    status, keys = await gw.admin("GET", f"/tenants/{tenant_id}/keys")
    assert status == 200 and len(keys["data"]) == 1
    listed = keys["data"][0]
    assert "key" not in listed and key.split("_")[1] == listed["prefix"]

    status, revoked = await gw.admin("DELETE", f"/keys/{listed['id']}")
    assert status == 200 and revoked["revoked_at"] is not None
    async with gw.session.get(models_url, headers=auth) as resp:
        assert resp.status == 401
        assert "revoked" in (await resp.json())["error"]["message"]


async def test_unknown_ids_are_404(gateway_without_engine: GatewayHandle) -> None:
    gw = gateway_without_engine
    assert (await gw.admin("GET", "/tenants/ten_nope"))[0] == 404
    assert (await gw.admin("POST", "/tenants/ten_nope/keys"))[0] == 404
    assert (await gw.admin("DELETE", "/keys/key_nope"))[0] == 404


async def test_public_api_auth_errors(gateway_without_engine: GatewayHandle) -> None:
    gw = gateway_without_engine
    body = {"model": "tandem-tiny", "messages": [{"role": "user", "content": "hi"}]}
    for headers in (
        {},
        {"Authorization": "Bearer tdm_0123456789ab_" + "x" * 43},
        {"Authorization": "Basic abc"},
    ):
        async with gw.session.post(
            f"{gw.base_url}/v1/chat/completions", json=body, headers=headers
        ) as resp:
            assert resp.status == 401
            error = (await resp.json())["error"]
            assert error["type"] == "authentication_error" and error["message"]


async def test_engine_down_is_503_with_retry_after_and_recorded(
    gateway_without_engine: GatewayHandle,
) -> None:
    gw = gateway_without_engine
    tenant_id, key = await gw.new_tenant("rt-down", "rt", ttft_ms=500, tpot_ms=100)
    body = {
        "model": "tandem-tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    }
    for stream in (False, True):
        async with gw.session.post(
            f"{gw.base_url}/v1/chat/completions",
            json=dict(body, stream=stream),
            headers={"Authorization": f"Bearer {key}"},
        ) as resp:
            assert resp.status == 503
            assert int(resp.headers["Retry-After"]) > 0
            assert (await resp.json())["error"]["code"] == "engine_unavailable"
    records = await gw.latest_requests(tenant_id)
    assert [r["status"] for r in records] == ["engine_unavailable"] * 2
    assert all(r["http_status"] == 503 and r["slo_met"] is False for r in records)


async def test_health_and_readiness(gateway_without_engine: GatewayHandle) -> None:
    gw = gateway_without_engine
    for path in ("/healthz", "/health"):
        async with gw.session.get(gw.base_url + path) as resp:
            assert resp.status == 200
    async with gw.session.get(gw.base_url + "/readyz") as resp:
        body = await resp.json()
        assert resp.status == 503 and body["checks"]["engine"] == "unavailable"
        assert body["checks"]["database"] == "ok"


async def test_oversized_body_is_413(gateway_without_engine: GatewayHandle) -> None:
    gw = gateway_without_engine
    _, key = await gw.new_tenant("big", "be")
    data = b'{"model": "tandem-tiny", "prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    async with gw.session.post(
        f"{gw.base_url}/v1/completions",
        data=data,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    ) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"
