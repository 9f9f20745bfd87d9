"""Authentication and the admin API as an operator uses them: tenants, keys (shown once, revoked
at once), validation naming the field, 404s, and the usage records of `/admin/v1/requests`.
(tests/functional/test_admin_api.py runs the same API on SQLite and PostgreSQL.)"""

from __future__ import annotations

import pytest

from tests.gateway.harness import MODEL, Gateway


@pytest.mark.parametrize("auth", [None, "Bearer wrong-token", "Basic dGVzdDp0ZXN0"])
async def test_admin_api_needs_the_admin_token(gw: Gateway, auth: str | None) -> None:
    headers = {} if auth is None else {"Authorization": auth}
    for method, path in [("GET", "/tenants"), ("POST", "/tenants"), ("GET", "/requests")]:
        reply = await gw.request(method, "/admin/v1" + path, headers=headers, json_body={})
        assert reply.status == 401, (method, path, reply)
        assert reply.error["type"] == "authentication_error" and reply.error["message"]


async def test_a_tenant_key_is_not_an_admin_token(gw: Gateway) -> None:
    _, key = await gw.new_tenant("not-admin")
    reply = await gw.request("GET", "/admin/v1/tenants", key=key)
    assert reply.status in (401, 403), reply


@pytest.mark.parametrize(
    "auth",
    [
        None,
        "Bearer tdm_0123456789ab_" + "x" * 43,  # well-formed, unknown
        "Bearer not-a-key",
        "Basic abc",
        "Bearer ",
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models", "/v1/files"])
async def test_public_api_refuses_missing_and_unknown_keys(
    gw: Gateway, auth: str | None, path: str
) -> None:
    headers = {} if auth is None else {"Authorization": auth}
    method = "POST" if path == "/v1/chat/completions" else "GET"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    reply = await gw.request(method, path, headers=headers, json_body=body)
    assert reply.status == 401, reply
    assert reply.error["type"] == "authentication_error" and reply.error["message"]


async def test_tenant_lifecycle(gw: Gateway) -> None:
    reply = await gw.admin(
        "POST",
        "/tenants",
        {
            "name": "chat-app",
            "tier": "rt",
            "slo": {"ttft_ms": 300, "tpot_ms": 60},
            "quota": {"requests_per_min": 600, "max_concurrent": 8},
        },
    )
    assert reply.status == 201, reply
    tenant = reply.body
    assert tenant["id"].startswith("ten_") and tenant["name"] == "chat-app"
    assert tenant["tier"] == "rt" and tenant["slo"]["ttft_ms"] == 300
    assert tenant["quota"]["max_concurrent"] == 8

    listed = await gw.admin("GET", "/tenants")
    assert listed.status == 200 and [t["name"] for t in listed.body["data"]] == ["chat-app"]
    got = await gw.admin("GET", f"/tenants/{tenant['id']}")
    assert got.status == 200 and got.body == tenant

    patched = await gw.admin(
        "PATCH", f"/tenants/{tenant['id']}", {"slo": {"ttft_ms": 200, "tpot_ms": 40}}
    )
    assert patched.status == 200 and patched.body["slo"]["ttft_ms"] == 200
    assert patched.body["quota"]["max_concurrent"] == 8  # untouched parts stay

    assert (await gw.admin("DELETE", f"/tenants/{tenant['id']}")).status == 200
    gone = await gw.admin("GET", f"/tenants/{tenant['id']}")
    assert gone.status == 404 and gone.error["code"] == "tenant_not_found"


async def test_a_deleted_tenants_keys_stop_working(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("short-lived")
    assert (await gw.request("GET", "/v1/models", key=key)).status == 200
    assert (await gw.admin("DELETE", f"/tenants/{tenant_id}")).status == 200
    assert (await gw.request("GET", "/v1/models", key=key)).status == 401


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"name": "x", "tier": "rt"}, "slo"),
        ({"name": "x", "tier": "gold"}, "tier"),
        ({"name": "", "tier": "be"}, "name"),
        ({"tier": "be"}, "name"),
        ({"name": "x", "tier": "be", "slo": {"deadline_s": -1}}, "slo.deadline_s"),
        ({"name": "x", "tier": "be", "quota": {"max_concurrent": "many"}}, "quota.max_concurrent"),
        ({"name": "x", "tier": "be", "colour": "red"}, "colour"),
        ({"name": "x", "tier": "be", "slo": {"weight": 0}}, "slo.weight"),
        ({"name": "x", "tier": "be", "slo": {"weight": -2.5}}, "slo.weight"),
        ({"name": "x", "tier": "be", "slo": {"weight": "heavy"}}, "slo.weight"),
        (
            {
                "name": "x",
                "tier": "rt",
                "slo": {"ttft_ms": 1, "tpot_ms": 1, "on_unattainable": "x"},
            },
            "slo.on_unattainable",
        ),
        (
            {"name": "x", "tier": "be", "slo": {"on_unattainable": "downgrade"}},
            "slo.on_unattainable",
        ),
    ],
)
async def test_bad_tenants_are_refused_naming_the_field(
    gw: Gateway, payload: dict[str, object], param: str
) -> None:
    reply = await gw.admin("POST", "/tenants", payload)
    assert reply.status == 422, reply
    assert reply.error["param"] == param and reply.error["message"]
    assert (await gw.admin("GET", "/tenants")).body["data"] == []  # nothing was created


async def test_the_contract_sets_what_an_unattainable_request_gets_and_the_tenant_weight(
    gw: Gateway,
) -> None:
    slo = {"ttft_ms": 300, "tpot_ms": 60}
    created = await gw.admin("POST", "/tenants", {"name": "c", "tier": "rt", "slo": slo})
    assert created.status == 201, created
    assert created.body["slo"]["on_unattainable"] == "reject"  # the defaults
    assert created.body["slo"]["weight"] == 1.0
    tenant_id = created.body["id"]
    contract = {**slo, "on_unattainable": "downgrade", "weight": 2.5}
    patched = await gw.admin("PATCH", f"/tenants/{tenant_id}", {"slo": contract})
    assert patched.status == 200, patched
    got = await gw.admin("GET", f"/tenants/{tenant_id}")
    assert got.body["slo"]["on_unattainable"] == "downgrade" and got.body["slo"]["weight"] == 2.5
    # a be tenant with allow_rt has RT requests: it may choose too
    be_slo = {**slo, "allow_rt": True, "on_unattainable": "accept", "weight": 0.5}
    be = await gw.admin("POST", "/tenants", {"name": "b", "tier": "be", "slo": be_slo})
    assert be.status == 201 and be.body["slo"]["on_unattainable"] == "accept", be
    # moving the rt tenant to be (no allow_rt) while it asks for a downgrade is refused
    moved = await gw.admin("PATCH", f"/tenants/{tenant_id}", {"tier": "be"})
    assert moved.status == 422 and moved.error["param"] == "slo.on_unattainable", moved
    assert "allow_rt" in moved.error["message"]


async def test_duplicate_name_is_a_conflict(gw: Gateway) -> None:
    assert (await gw.admin("POST", "/tenants", {"name": "dup", "tier": "be"})).status == 201
    reply = await gw.admin("POST", "/tenants", {"name": "dup", "tier": "be"})
    assert reply.status == 409 and reply.error["param"] == "name"


async def test_keys_are_shown_once_and_revocation_is_immediate(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("batchco", "be")
    assert (await gw.request("GET", "/v1/models", key=key)).status == 200
    assert (await gw.chat(key, max_tokens=2)).status == 200  # the key is in the auth cache now

    keys = await gw.admin("GET", f"/tenants/{tenant_id}/keys")
    assert keys.status == 200 and len(keys.body["data"]) == 1
    listed = keys.body["data"][0]
    assert "key" not in listed and key.split("_")[1] == listed["prefix"]
    assert listed["revoked_at"] is None

    revoked = await gw.admin("DELETE", f"/keys/{listed['id']}")
    assert revoked.status == 200 and revoked.body["revoked_at"] is not None
    for reply in (await gw.request("GET", "/v1/models", key=key), await gw.chat(key)):
        assert reply.status == 401, reply
        assert "revoked" in reply.error["message"]


async def test_a_second_key_works_beside_the_first(gw: Gateway) -> None:
    tenant_id, first = await gw.new_tenant("two-keys")
    second = await gw.admin("POST", f"/tenants/{tenant_id}/keys")
    assert second.status == 201 and second.body["key"] != first
    for key in (first, second.body["key"]):
        assert (await gw.request("GET", "/v1/models", key=key)).status == 200
    keys = await gw.admin("GET", f"/tenants/{tenant_id}/keys")
    assert len(keys.body["data"]) == 2


async def test_unknown_ids_are_404(gw: Gateway) -> None:
    for method, path, code in [
        ("GET", "/tenants/ten_nope", "tenant_not_found"),
        ("PATCH", "/tenants/ten_nope", "tenant_not_found"),
        ("DELETE", "/tenants/ten_nope", "tenant_not_found"),
        ("POST", "/tenants/ten_nope/keys", "tenant_not_found"),
        ("DELETE", "/keys/key_nope", "key_not_found"),
    ]:
        reply = await gw.admin(method, path, {} if method == "PATCH" else None)
        assert reply.status == 404, (method, path, reply)
        assert reply.error["code"] == code


async def test_requests_lists_usage_records_newest_first(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("usage")
    other_id, other_key = await gw.new_tenant("usage-other")
    assert (await gw.chat(key, max_tokens=3)).status == 200
    assert (await gw.completion(key, max_tokens=5)).status == 200
    assert (await gw.chat(other_key, max_tokens=2)).status == 200
    records = await gw.records(tenant_id, 2)
    assert [r["endpoint"] for r in records] == ["completions", "chat"]
    assert [r["completion_tokens"] for r in records] == [5, 3]
    assert {r["tenant_id"] for r in records} == {tenant_id}
    assert all(r["request_id"] for r in records)
    assert len({r["request_id"] for r in records}) == 2
    assert (await gw.records(other_id))[0]["completion_tokens"] == 2
    everyone = await gw.admin("GET", "/requests?limit=10")
    assert everyone.status == 200 and len(everyone.body["data"]) == 3
    one = await gw.admin("GET", f"/requests?tenant={tenant_id}&limit=1")
    assert [r["endpoint"] for r in one.body["data"]] == ["completions"]


@pytest.mark.parametrize("limit", ["0", "-1", "many", "100000"])
async def test_requests_refuses_a_bad_limit(gw: Gateway, limit: str) -> None:
    reply = await gw.admin("GET", f"/requests?limit={limit}")
    assert reply.status == 400 and reply.error["param"] == "limit"
