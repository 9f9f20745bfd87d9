"""What the gateway shows to whoever reaches its port (issue 16, "Exposure"): /metrics behind a
scrape token and without tenant names, downloads whose file name cannot break the header."""

from __future__ import annotations

import urllib.parse

from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import GatewayFactory
from tests.gateway.harness import ADMIN_TOKEN, Gateway
from tests.gateway.test_batches import chat_line, jsonl

SCRAPE_TOKEN = "scrape-token-for-tests"


def tenant_info(text: str) -> list[dict[str, str]]:
    """The label sets of `tandem_tenant_info` in a scrape."""
    return [
        dict(sample.labels)
        for family in text_string_to_metric_families(text)
        if family.name == "tandem_tenant_info"
        for sample in family.samples
    ]


async def test_metrics_list_tenant_ids_and_tiers_not_names(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("acme-secret-customer")
    assert (await gw.chat(key, max_tokens=2)).status == 200
    reply = await gw.request("GET", "/metrics")
    assert reply.status == 200
    assert "acme-secret-customer" not in reply.body
    assert {"tenant": tenant_id, "tier": "rt"} in tenant_info(reply.body)


async def test_metrics_name_tenants_when_the_operator_asks(make_gateway: GatewayFactory) -> None:
    async with make_gateway(TANDEM_METRICS__TENANT_NAMES="true") as gw:
        tenant_id, _ = await gw.new_tenant("acme")
        reply = await gw.request("GET", "/metrics")
        assert {"tenant": tenant_id, "name": "acme", "tier": "rt"} in tenant_info(reply.body)


async def test_metrics_need_the_scrape_token_once_one_is_set(
    make_gateway: GatewayFactory,
) -> None:
    async with make_gateway(TANDEM_METRICS__SCRAPE_TOKEN=SCRAPE_TOKEN) as gw:
        _, key = await gw.new_tenant("acme")
        for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": key}):
            reply = await gw.request("GET", "/metrics", headers=headers)
            assert reply.status == 401, reply
            assert reply.error["code"] == "invalid_metrics_token"
            assert reply.headers["WWW-Authenticate"] == "Bearer"
            assert "tandem_" not in str(reply.body)
        # a tenant's own key is no scrape token either
        assert (await gw.request("GET", "/metrics", key=key)).status == 401
        for token in (SCRAPE_TOKEN, ADMIN_TOKEN):
            reply = await gw.request(
                "GET", "/metrics", headers={"Authorization": f"Bearer {token}"}
            )
            assert reply.status == 200 and "tandem_requests_in_flight" in reply.body
        # the other operations endpoints stay open (probes carry no token)
        for path in ("/healthz", "/readyz"):
            assert (await gw.request("GET", path)).status == 200


def upload_body(filename: str, content: bytes) -> bytes:
    """A multipart upload whose file name travels percent-encoded (RFC 8187), as a browser sends
    one that is not plain ASCII."""
    encoded = urllib.parse.quote(filename, safe="")
    return (
        b'--BOUNDARY\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b"--BOUNDARY\r\nContent-Disposition: form-data; name=\"file\"; filename*=UTF-8''"
        + encoded.encode()
        + b"\r\nContent-Type: application/jsonl\r\n\r\n"
        + content
        + b"\r\n--BOUNDARY--\r\n"
    )


async def test_a_download_is_saved_under_its_uploaded_name(gw: Gateway) -> None:
    """Any name an upload may carry comes back whole in `filename*` (the old header replaced
    every non-ASCII character by "_") and safe in the plain `filename`."""
    _, key = await gw.new_tenant("files", "be")
    content = jsonl([chat_line("a", "hi")])
    for name, plain in [
        ("naïve résumé 日本.jsonl", "na_ve r_sum_ __.jsonl"),
        ('q"uo\\te; x=1, y.jsonl', "q_uo_te; x=1, y.jsonl"),
    ]:
        uploaded = await gw.request(
            "POST",
            "/v1/files",
            key=key,
            data=upload_body(name, content),
            headers={"Content-Type": "multipart/form-data; boundary=BOUNDARY"},
        )
        assert uploaded.status == 200 and uploaded.body["filename"] == name, uploaded
        async with gw.session.get(
            f"{gw.base_url}/v1/files/{uploaded.body['id']}/content",
            headers={"Authorization": f"Bearer {key}"},
        ) as resp:
            assert resp.status == 200 and await resp.read() == content
            disposition = resp.content_disposition
            assert disposition is not None and disposition.type == "attachment"
            assert disposition.filename == name  # what a client saves it as
            assert disposition.parameters["filename"] == plain
