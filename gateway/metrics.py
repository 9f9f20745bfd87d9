"""Prometheus metrics (`GET /metrics`) and the sampled engine history the dashboard draws.

Request series are updated from each finished request's usage record (`request_finished`), so
they agree with the usage reports: counts and tokens by tenant and tier, end-to-end latency, TTFT
and TPOT histograms, SLO verdicts and a windowed SLO attainment, requests in flight, quota
refusals by limit. `EngineSampler` (gateway.engine.sampler) polls the engine's `/v1/loads`
(running and waiting requests, KV use) and the batch tables (BE backlog, batch progress) every
``metrics.engine_poll_s`` and keeps ``metrics.history_s`` of samples for the dashboard. Each app
has its own registry, so two gateways in one process (tests) never share series. Tenants are
labelled by id; ``tandem_tenant_info`` gives each id its tier, and its name only where the
operator asks for names (``metrics.tenant_names``). With ``metrics.scrape_token`` set, a scrape
must present that token (or the admin token) as a bearer token.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterator
from typing import cast

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from sqlalchemy import Table, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.engine.sampler import EngineSampler
from gateway.errors import ApiError
from gateway.slo import SloWindow
from gateway.store.models import TenantRow
from gateway.store.types import UsageRecord

SLO_WINDOW_S = 300.0
"""Window of the `tandem_slo_attainment_ratio` gauge, seconds."""
_LATENCY_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
_TPOT_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
)
_FORECAST_ERROR_BUCKETS_S = (
    -2.0,
    -1.0,
    -0.5,
    -0.2,
    -0.1,
    -0.05,
    -0.02,
    0.0,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
)
"""First token minus its forecast, seconds: symmetric around 0 (a forecast is a mean), finer
near it, where a well-calibrated engine model lands."""


class GatewayMetrics:
    """Every series of this gateway, in its own registry.

    *scrape_tokens*: the bearer tokens a scrape may present (the scrape token and the admin
    token); empty: scrapes need none."""

    def __init__(self, scrape_tokens: tuple[str, ...] = ()) -> None:
        self.scrape_tokens = scrape_tokens
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        tt = ["tenant", "tier"]
        self.requests = Counter(
            "tandem_requests", "Requests finished, by outcome.", [*tt, "status"], registry=r
        )
        self.tokens = Counter(
            "tandem_tokens", "Tokens processed (prompt, completion).", [*tt, "kind"], registry=r
        )
        self.latency = Histogram(
            "tandem_request_duration_seconds",
            "Arrival to last byte of requests that ran.",
            tt,
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ttft = Histogram(
            "tandem_ttft_seconds",
            "Time to first token.",
            tt,
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "tandem_tpot_seconds",
            "Time per output token after the first.",
            tt,
            buckets=_TPOT_BUCKETS_S,
            registry=r,
        )
        self.slo = Counter(
            "tandem_slo_requests",
            "Requests judged against their tenant's SLO.",
            [*tt, "result"],
            registry=r,
        )
        self.in_flight = Gauge(
            "tandem_requests_in_flight",
            "Requests admitted and not finished (the gateway's queue).",
            tt,
            registry=r,
        )
        self.slo_ttft_feedback = Gauge(
            "tandem_slo_ttft_feedback_seconds",
            "How much later than the engine model forecast admitted RT requests got their first "
            "token lately, by engine: the SLO admission adds it to its TTFT forecasts on that "
            "engine (0: as forecast).",
            ["engine"],
            registry=r,
        )
        self.slo_ttft_forecast_error = Histogram(
            "tandem_slo_ttft_forecast_error_seconds",
            "How much later than the engine model forecast each admitted RT request got its "
            "first token (negative: sooner), by engine — the forecast from its admission, "
            "before the correction first tokens taught (tandem_slo_ttft_feedback_seconds): how "
            "right the SLO admission's forecast is on each engine.",
            ["engine"],
            buckets=_FORECAST_ERROR_BUCKETS_S,
            registry=r,
        )
        self.slo_slot_wait_scale = Gauge(
            "tandem_slo_slot_wait_scale",
            "The scale the SLO admission applies to a request slot's forecast wait on each "
            "engine, learned from admitted RT requests whose wait's decode steps the engine "
            "ran faster than forecast (1: as forecast; at least 0.5).",
            ["engine"],
            registry=r,
        )
        self.quota_rejections = Counter(
            "tandem_quota_rejections",
            "Requests refused with 429, by the limit they hit.",
            ["tenant", "limit"],
            registry=r,
        )
        self.slo_rechecks = Counter(
            "tandem_slo_rechecks",
            "RT requests the SLO admission judged again on the engine's next reports (every "
            "request slot held by RT requests when they arrived) before its verdict, by that "
            "verdict (admitted, downgraded, shed; refused: by a later check).",
            ["tenant", "outcome"],
            registry=r,
        )
        self.slo_admissions = Counter(
            "tandem_slo_admissions",
            "RT requests judged by the SLO admission, by outcome (admitted, unchecked: no engine "
            "state; accepted, downgraded, shed: forecast to miss) and the target forecast to miss.",
            ["tenant", "outcome", "target"],
            registry=r,
        )
        # every RT request counts one verdict on the admission's path: its labelled child is
        # looked up once (`labels` validates and locks each time); no tenant's series is removed
        self._slo_admission_children: dict[tuple[str, str, str], Counter] = {}
        self.slo_admitted = Counter(
            "tandem_slo_admitted_results",
            "RT requests the SLO admission let run as RT, by its outcome (admitted, unchecked, "
            "accepted) and whether they met the SLO.",
            ["tenant", "admission", "result"],
            registry=r,
        )
        self._slo_window = SloWindow[tuple[str, str]](SLO_WINDOW_S)  # bounded even unscraped
        self.sampler: EngineSampler | None = None
        self.before_scrape: list[Callable[[], Awaitable[None]]] = []
        """Refreshes run before each scrape (the tenant list of `tandem_tenant_info`)."""
        self.extra: list[Callable[[], Iterator[GaugeMetricFamily]]] = []
        """More gauges read at scrape time (tenant info, usage recorder, quota sync)."""
        r.register(cast(Collector, _Dynamic(self)))

    def request_started(self, tenant_id: str, tier: str) -> None:
        self.in_flight.labels(tenant_id, tier).inc()

    def request_finished(self, record: UsageRecord, *, started: bool) -> None:
        """Counts one finished request (*started*: it was admitted and counted in flight)."""
        labels = (record.tenant_id, record.tier)
        if started:
            self.in_flight.labels(*labels).dec()
        self.requests.labels(*labels, record.status).inc()
        self.tokens.labels(*labels, "prompt").inc(record.prompt_tokens if started else 0)
        self.tokens.labels(*labels, "completion").inc(record.completion_tokens)
        if started and record.e2e_ms is not None:
            self.latency.labels(*labels).observe(record.e2e_ms / 1000.0)
        if record.ttft_ms is not None:
            self.ttft.labels(*labels).observe(record.ttft_ms / 1000.0)
        if record.tpot_ms is not None:
            self.tpot.labels(*labels).observe(record.tpot_ms / 1000.0)
        if record.slo_met is not None:
            self.slo.labels(*labels, "met" if record.slo_met else "missed").inc()
            self._slo_window.add(labels, record.slo_met)
            if record.admission in ("admitted", "unchecked", "accepted"):
                result = "met" if record.slo_met else "missed"
                self.slo_admitted.labels(record.tenant_id, record.admission, result).inc()

    def slo_rechecked(self, tenant_id: str, outcome: str) -> None:
        """Counts one RT request that waited at the gateway for the engine's reports before the
        SLO admission's verdict (*outcome*: that verdict, or "refused" by a later check)."""
        self.slo_rechecks.labels(tenant_id, outcome).inc()

    def slo_admission(self, tenant_id: str, outcome: str, target: str) -> None:
        """Counts one SLO admission verdict (*target*: "ttft", "tpot", or "" when none missed)."""
        key = (tenant_id, outcome, target)
        child = self._slo_admission_children.get(key)
        if child is None:
            child = self._slo_admission_children[key] = self.slo_admissions.labels(*key)
        child.inc()

    def quota_rejected(self, tenant_id: str, limit: str) -> None:
        self.quota_rejections.labels(tenant_id, limit).inc()

    def slo_attainment(self) -> dict[tuple[str, str], float]:
        """Share of requests meeting their SLO over the last `SLO_WINDOW_S`, per tenant and tier."""
        return self._slo_window.attainment()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Dynamic:
    """Gauges computed at scrape time."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        slo = GaugeMetricFamily(
            "tandem_slo_attainment_ratio",
            f"Share of requests meeting their SLO over the last {SLO_WINDOW_S:.0f} s.",
            labels=["tenant", "tier"],
        )
        for (tenant, tier), ratio in sorted(self._metrics.slo_attainment().items()):
            slo.add_metric([tenant, tier], ratio)
        yield slo
        sampler = self._metrics.sampler
        if sampler is not None:
            yield from sampler.collect()
        for extra in self._metrics.extra:
            yield from extra()


def tenant_info_collector(
    tenants: Callable[[], list[tuple[str, str, str]]], *, with_names: bool
) -> Callable[[], Iterator[GaugeMetricFamily]]:
    """`tandem_tenant_info{tenant,tier} 1` from a cached (id, name, tier) list; with the label
    `name` too when *with_names* (the operator's choice: a scrape then lists the customers)."""

    def collect() -> Iterator[GaugeMetricFamily]:
        if with_names:
            info = GaugeMetricFamily(
                "tandem_tenant_info",
                "A tenant's name and tier (value 1).",
                labels=["tenant", "name", "tier"],
            )
            for tenant_id, name, tier in tenants():
                info.add_metric([tenant_id, name, tier], 1)
        else:
            info = GaugeMetricFamily(
                "tandem_tenant_info", "A tenant's tier (value 1).", labels=["tenant", "tier"]
            )
            for tenant_id, _, tier in tenants():
                info.add_metric([tenant_id, tier], 1)
        yield info

    return collect


async def read_tenants(db: AsyncEngine) -> list[tuple[str, str, str]]:
    """(id, name, tier) of live tenants, for `tandem_tenant_info`."""
    t = cast(Table, TenantRow.__table__)
    async with db.connect() as conn:
        rows = await conn.execute(
            select(t.c.id, t.c.name, t.c.tier).where(t.c.deleted_at.is_(None)).order_by(t.c.id)
        )
        return [(str(a), str(b), str(c)) for a, b, c in rows.all()]


routes = web.RouteTableDef()
METRICS_KEY = web.AppKey("metrics", GatewayMetrics)


@routes.get("/metrics")
async def metrics_endpoint(request: web.Request) -> web.Response:
    """Prometheus text format; with a scrape token configured, only for its bearer (or the
    admin token's)."""
    registry = request.app[METRICS_KEY]
    check_scrape_auth(request, registry.scrape_tokens)
    for refresh in registry.before_scrape:
        await refresh()
    body = registry.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def check_scrape_auth(request: web.Request, tokens: tuple[str, ...]) -> None:
    """401 unless *tokens* is empty or the request's bearer token is one of them (each compared
    in constant time, all of them every time)."""
    if not tokens:
        return
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    presented = value.strip().encode() if scheme.lower() == "bearer" else b""
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(presented, token.encode())
    if not presented or not matched:
        raise ApiError(
            401,
            "/metrics needs the scrape token (metrics.scrape_token) or the admin token: send "
            "'Authorization: Bearer <token>'",
            code="invalid_metrics_token",
            headers={"WWW-Authenticate": "Bearer"},
        )
