"""What the gateway shows to whoever reaches its port (issue 16, "Exposure"): /metrics behind a
scrape token and without tenant names, downloads whose file name cannot break the header."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import GatewayFactory
from tests.gateway.harness import ADMIN_TOKEN, Gateway

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
