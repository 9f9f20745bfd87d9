"""The gateway's Prometheus series from finished requests and engine samples (pure: no server;
the endpoint itself is tested in tests/functional/test_metrics_endpoint.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client.parser import text_string_to_metric_families

from gateway.engine.sampler import EngineSample, EngineSampler, _sum_ranks
from gateway.metrics import GatewayMetrics
from gateway.store.types import UsageRecord

T0 = datetime(2026, 11, 21, tzinfo=UTC)


def record(status: str = "ok", slo_met: bool | None = True, **kw: object) -> UsageRecord:
    fields: dict[str, object] = dict(
        request_id="r",
        tenant_id="ten_a",
        tier="rt",
        model="m",
        endpoint="chat",
        prompt_tokens=10,
        completion_tokens=5,
        ttft_ms=120.0,
        tpot_ms=20.0,
        e2e_ms=300.0,
        status=status,
        http_status=200,
        slo_met=slo_met,
        created_at=T0,
        finished_at=T0,
    )
    fields.update(kw)
    return UsageRecord(**fields)  # type: ignore[arg-type]


def samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_finished_requests_feed_counts_histograms_and_windowed_attainment() -> None:
    m = GatewayMetrics()
    for met in (True, True, True, False):
        m.request_started("ten_a", "rt")
        m.request_finished(record(slo_met=met), started=True)
    m.request_finished(
        record(
            status="rate_limited", slo_met=None, ttft_ms=None, tpot_ms=None, completion_tokens=0
        ),
        started=False,
    )
    m.quota_rejected("ten_a", "requests_per_min")
    s = samples(m)
    t = {"tenant": "ten_a", "tier": "rt"}
    assert get(s, "tandem_requests_total", **t, status="ok") == 4
    assert get(s, "tandem_requests_total", **t, status="rate_limited") == 1
    assert get(s, "tandem_requests_in_flight", **t) == 0
    assert get(s, "tandem_ttft_seconds_count", **t) == 4
    assert get(s, "tandem_ttft_seconds_sum", **t) == 4 * 0.12
    assert get(s, "tandem_tpot_seconds_count", **t) == 4
    assert get(s, "tandem_slo_attainment_ratio", **t) == 0.75
    assert get(s, "tandem_tokens_total", **t, kind="prompt") == 40  # not the refused one
    assert get(s, "tandem_quota_rejections_total", tenant="ten_a", limit="requests_per_min") == 1


def get(
    s: dict[tuple[str, tuple[tuple[str, str], ...]], float], metric: str, **labels: str
) -> float:
    return s[(metric, tuple(sorted(labels.items())))]


def test_engine_gauges_come_from_the_latest_sample() -> None:
    m = GatewayMetrics()
    sampler = EngineSampler("http://127.0.0.1:1", None, 5.0, 60.0, lambda: 2)  # type: ignore[arg-type]
    sampler.history.append(
        EngineSample(
            time_s=1.0,
            up=True,
            running=3,
            waiting=7,
            kv_usage=0.4,
            kv_capacity_tokens=1000,
            batch_lines_pending=5,
            be_backlog=4,
        )
    )
    m.sampler = sampler
    s = samples(m)
    assert s[("tandem_engine_up", ())] == 1
    assert s[("tandem_engine_waiting_requests", ())] == 7
    assert s[("tandem_engine_kv_usage_ratio", ())] == 0.4
    assert s[("tandem_be_backlog_requests", ())] == 4  # the sample's, not a live reading
    sampler.history.append(
        EngineSample(
            time_s=2.0,
            up=False,
            running=0,
            waiting=0,
            kv_usage=None,
            kv_capacity_tokens=None,
            batch_lines_pending=5,
        )
    )
    s = samples(m)
    assert s[("tandem_engine_up", ())] == 0
    assert ("tandem_engine_kv_usage_ratio", ()) not in s  # no stale reading when it is down


def test_data_parallel_ranks_add_up() -> None:
    merged = _sum_ranks(
        [
            {
                "num_running_reqs": 2,
                "num_waiting_reqs": 1,
                "token_usage": 0.5,
                "max_total_num_tokens": 100,
            },
            {
                "num_running_reqs": 4,
                "num_waiting_reqs": 0,
                "token_usage": 0.25,
                "max_total_num_tokens": 300,
            },
        ]
    )
    assert merged == {
        "num_running_reqs": 6,
        "num_waiting_reqs": 1,
        "token_usage": (50 + 75) / 400,
        "max_total_num_tokens": 400,
    }
