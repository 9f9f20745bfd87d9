"""The live bench reports how many RT requests the gateway's SLO admission judged again as
request slots freed (`tandem_slo_rechecks_total`, read from the served gateway's /metrics)."""

from __future__ import annotations

from bench.live import rechecks_of
from bench.live_report import rechecks_line
from gateway.metrics import GatewayMetrics


def test_the_rechecks_are_read_from_the_gateways_metrics_by_verdict() -> None:
    metrics = GatewayMetrics()
    metrics.slo_rechecked("ten_a", "admitted")
    metrics.slo_rechecked("ten_b", "admitted")
    metrics.slo_rechecked("ten_b", "shed")
    counts = rechecks_of(metrics.render().decode())
    assert counts == {"admitted": 2.0, "shed": 1.0}
    line = rechecks_line("tandem", {"gateway_slo_rechecks": counts})
    assert "judged 3 RT requests again" in line and "admitted 2, shed 1" in line
    assert rechecks_of(GatewayMetrics().render().decode()) == {}
    assert "not read (connection refused)" in rechecks_line(
        "tandem", {"gateway_slo_rechecks": "connection refused"}
    )
