"""The live bench's tenants on a real gateway (`bench.live_client.TenantKeys`): a workload's
named tenants (W6) each become a tenant of the gateway with their tier, SLO and fair-share
weight, so the engine's fair share sees them apart; requests without a tenant (W1) share one
tenant per SLO class."""

from __future__ import annotations

from typing import Any

from bench.live_client import TenantKeys
from bench.workloads.base import RequestSpec
from tests.gateway.harness import ADMIN_TOKEN, Gateway


def spec(tier: str, tenant: str = "", weight: float = 1.0, ttft_s: float = 1.5) -> RequestSpec:
    rt = tier == "rt"
    return RequestSpec(
        rid=f"{tenant or tier}-x",
        tier=tier,  # type: ignore[arg-type]
        arrival_s=0.0,
        prompt_len=8,
        output_len=4,
        max_new_tokens=4,
        ttft_target_s=ttft_s if rt else None,
        tpot_target_s=0.25 if rt else None,
        length_key=tenant or tier,
        tenant_id=tenant,
        tenant_weight=weight,
    )


async def test_named_tenants_become_gateway_tenants_with_their_weights(gw: Gateway) -> None:
    keys = TenantKeys(gw.base_url, ADMIN_TOKEN, gw.session)
    steady, burst = spec("rt", "rt-steady", 1.0), spec("rt", "rt-burst", 3.0)
    be_a, be_b = spec("be", "be-a", 2.0), spec("be", "be-b", 1.0)
    made = {s.tenant_id: await keys.key_for(s) for s in (steady, burst, be_a, be_b)}
    assert len(set(made.values())) == 4  # a key, and a tenant, each
    assert await keys.key_for(spec("rt", "rt-burst", 3.0)) == made["rt-burst"]  # reused
    # W1's anonymous requests: one tenant per RT class and one for BE, apart from the named ones
    anonymous = [await keys.key_for(s) for s in (spec("rt"), spec("rt", ttft_s=3.0), spec("be"))]
    assert len(set(anonymous) | set(made.values())) == 7
    listed = (await gw.admin("GET", "/tenants")).body["data"]
    by_name: dict[str, Any] = {t["name"].rsplit("-", 1)[0]: t for t in listed}
    for name, tier, weight in (
        ("rt-steady", "rt", 1.0),
        ("rt-burst", "rt", 3.0),
        ("be-a", "be", 2.0),
        ("be-b", "be", 1.0),
    ):
        tenant = by_name[name]
        assert (tenant["tier"], tenant["slo"]["weight"]) == (tier, weight), tenant
        if tier == "rt":
            assert (tenant["slo"]["ttft_ms"], tenant["slo"]["tpot_ms"]) == (1500.0, 250.0)
    # each key serves as its tenant
    reply = await gw.completion(made["be-a"], "hello", max_tokens=2)
    assert reply.status == 200, reply
