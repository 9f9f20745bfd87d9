"""Prometheus metrics (`GET /metrics`) and the sampled engine history the dashboard draws.

Request series are updated from each finished request's usage record (`request_finished`), so
they agree with the usage reports: counts and tokens by tenant and tier, end-to-end latency, TTFT
and TPOT histograms, SLO verdicts and a windowed SLO attainment, requests in flight, quota
refusals by limit. `EngineSampler` polls the engine's `/v1/loads` (running and waiting requests,
KV use) and the batch tables (BE backlog, batch progress) every ``metrics.engine_poll_s`` and
keeps ``metrics.history_s`` of samples for the dashboard. Each app has its own registry, so two
gateways in one process (tests) never share series. Tenants are labelled by id; the name and
tier are on ``tandem_tenant_info``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from sqlalchemy import Table, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.models import BatchItemRow, BatchRow, TenantRow
from gateway.store.types import UsageRecord

log = logging.getLogger(__name__)

SLO_WINDOW_S = 300.0
"""Window of the `tandem_slo_attainment_ratio` gauge, seconds."""
ACTIVE_BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
"""Batches whose lines still count in the BE backlog."""
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
_DONE_ITEM_STATUSES = ("completed", "failed", "cancelled", "expired", "succeeded", "done")


@dataclass(frozen=True)
class EngineSample:
    """One reading of the engine's load and the BE backlog."""

    time_s: float
    """Wall-clock time of the reading (Unix seconds)."""
    up: bool
    """Whether the engine answered."""
    running: int
    """Requests in the engine's running batch."""
    waiting: int
    """Requests waiting in the engine's queue."""
    kv_usage: float | None
    """Share of the KV pool in use, 0-1 (None: unknown)."""
    kv_capacity_tokens: int | None
    """Size of the KV pool, tokens."""
    batch_lines_pending: int
    """Batch-API lines not finished yet (of batches still running)."""


class GatewayMetrics:
    """Every series of this gateway, in its own registry."""

    def __init__(self) -> None:
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
        self.quota_rejections = Counter(
            "tandem_quota_rejections",
            "Requests refused with 429, by the limit they hit.",
            ["tenant", "limit"],
            registry=r,
        )
        self._slo_window: dict[tuple[str, str], collections.deque[tuple[float, bool]]] = {}
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
            window = self._slo_window.setdefault(labels, collections.deque())
            window.append((time.monotonic(), record.slo_met))

    def quota_rejected(self, tenant_id: str, limit: str) -> None:
        self.quota_rejections.labels(tenant_id, limit).inc()

    def slo_attainment(self) -> dict[tuple[str, str], float]:
        """Share of requests meeting their SLO over the last `SLO_WINDOW_S`, per tenant and tier."""
        cutoff = time.monotonic() - SLO_WINDOW_S
        out = {}
        for labels, window in list(self._slo_window.items()):
            while window and window[0][0] < cutoff:
                window.popleft()
            if window:
                out[labels] = sum(met for _, met in window) / len(window)
            else:
                del self._slo_window[labels]
        return out

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


class EngineSampler:
    """Polls the engine's load and the batch backlog; keeps a history for the dashboard."""

    def __init__(
        self,
        engine_url: str,
        db: AsyncEngine,
        poll_s: float,
        history_s: float,
        be_in_flight: Callable[[], int],
    ) -> None:
        self._url = engine_url.rstrip("/") + "/v1/loads"
        self._db = db
        self._poll_s = poll_s
        self.history: collections.deque[EngineSample] = collections.deque(
            maxlen=max(1, int(history_s / poll_s))
        )
        self._be_in_flight = be_in_flight
        self.batches: dict[str, int] = {}
        """Batches by status."""
        self.batch_items: dict[str, int] = {}
        """Lines of active batches by status."""
        self.batch_progress: dict[str, float] = {}
        """Active batch id → share of its lines finished, 0-1."""
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        await self.sample()
        self._task = asyncio.create_task(self._run(), name="engine-sampler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                await self.sample()
            except Exception:  # a sampling bug must not stop the gateway; log and keep going
                log.exception("sampling the engine load failed")

    async def sample(self) -> EngineSample:
        """Reads the engine and the batch tables now and appends the sample to the history."""
        load = await self._engine_load()
        pending = await self._batch_backlog()
        sample = EngineSample(
            time_s=time.time(),
            up=load is not None,
            running=int((load or {}).get("num_running_reqs", 0)),
            waiting=int((load or {}).get("num_waiting_reqs", 0)),
            kv_usage=_float((load or {}).get("token_usage")),
            kv_capacity_tokens=_int((load or {}).get("max_total_num_tokens")),
            batch_lines_pending=pending,
        )
        self.history.append(sample)
        return sample

    async def _engine_load(self) -> dict[str, Any] | None:
        assert self._session is not None
        try:
            async with self._session.get(self._url) as resp:
                if resp.status != 200:
                    return None
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        loads = body.get("loads") if isinstance(body, dict) else None
        if isinstance(loads, list) and loads and isinstance(loads[0], dict):
            return _sum_ranks(loads)
        return body if isinstance(body, dict) else None

    async def _batch_backlog(self) -> int:
        batches = cast(Table, BatchRow.__table__)
        items = cast(Table, BatchItemRow.__table__)
        try:
            async with self._db.connect() as conn:
                by_status = await conn.execute(
                    select(batches.c.status, func.count()).group_by(batches.c.status)
                )
                self.batches = {s: int(n) for s, n in by_status.all()}
                rows = await conn.execute(
                    select(items.c.batch_id, items.c.status, func.count())
                    .join(batches, batches.c.id == items.c.batch_id)
                    .where(batches.c.status.in_(ACTIVE_BATCH_STATUSES))
                    .group_by(items.c.batch_id, items.c.status)
                )
                per_batch: dict[str, dict[str, int]] = {}
                for batch_id, status, n in rows.all():
                    per_batch.setdefault(batch_id, {})[status] = int(n)
        except Exception as exc:  # database down or not migrated: keep the last figures
            log.warning("reading the batch backlog failed: %s", exc)
            return self.history[-1].batch_lines_pending if self.history else 0
        totals: dict[str, int] = collections.Counter()
        progress = {}
        for batch_id, counts in per_batch.items():
            totals.update(counts)
            done = sum(n for s, n in counts.items() if s in _DONE_ITEM_STATUSES)
            progress[batch_id] = done / max(sum(counts.values()), 1)
        self.batch_items = dict(totals)
        self.batch_progress = progress
        return sum(n for s, n in totals.items() if s not in _DONE_ITEM_STATUSES)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        last = self.history[-1] if self.history else None
        yield gauge(
            "tandem_engine_up",
            "1 when the engine answered the last poll.",
            int(last.up) if last else 0,
        )
        if last is not None and last.up:
            yield gauge(
                "tandem_engine_running_requests", "Requests in the engine's batch.", last.running
            )
            yield gauge(
                "tandem_engine_waiting_requests", "Requests in the engine's queue.", last.waiting
            )
            if last.kv_usage is not None:
                yield gauge(
                    "tandem_engine_kv_usage_ratio", "Share of the KV pool in use.", last.kv_usage
                )
            if last.kv_capacity_tokens is not None:
                yield gauge(
                    "tandem_engine_kv_capacity_tokens",
                    "Size of the KV pool, tokens.",
                    last.kv_capacity_tokens,
                )
        pending = last.batch_lines_pending if last else 0
        yield gauge(
            "tandem_be_backlog_requests",
            "BE work not finished: batch lines pending plus BE requests in flight.",
            pending + self._be_in_flight(),
        )
        batches = GaugeMetricFamily("tandem_batches", "Batches by status.", labels=["status"])
        for status, n in sorted(self.batches.items()):
            batches.add_metric([status], n)
        yield batches
        items = GaugeMetricFamily(
            "tandem_batch_lines", "Lines of running batches by status.", labels=["status"]
        )
        for status, n in sorted(self.batch_items.items()):
            items.add_metric([status], n)
        yield items
        progress = GaugeMetricFamily(
            "tandem_batch_progress_ratio",
            "Share of a running batch's lines finished.",
            labels=["batch"],
        )
        for batch_id, ratio in sorted(self.batch_progress.items()):
            progress.add_metric([batch_id], ratio)
        yield progress


def tenant_info_collector(
    tenants: Callable[[], list[tuple[str, str, str]]],
) -> Callable[[], Iterator[GaugeMetricFamily]]:
    """`tandem_tenant_info{tenant,name,tier} 1` from a cached (id, name, tier) list."""

    def collect() -> Iterator[GaugeMetricFamily]:
        info = GaugeMetricFamily(
            "tandem_tenant_info",
            "A tenant's name and tier (value 1).",
            labels=["tenant", "name", "tier"],
        )
        for tenant_id, name, tier in tenants():
            info.add_metric([tenant_id, name, tier], 1)
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
    """Prometheus text format (no auth, like the other operations endpoints)."""
    registry = request.app[METRICS_KEY]
    for refresh in registry.before_scrape:
        await refresh()
    body = registry.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _sum_ranks(loads: list[dict[str, Any]]) -> dict[str, Any]:
    """One load for all data-parallel ranks: counts and capacity add up, KV use is weighted."""
    if len(loads) == 1:
        return loads[0]
    capacity = sum(_int(x.get("max_total_num_tokens")) or 0 for x in loads)
    used = sum(
        (_float(x.get("token_usage")) or 0.0) * (_int(x.get("max_total_num_tokens")) or 0)
        for x in loads
    )
    return {
        "num_running_reqs": sum(int(x.get("num_running_reqs", 0)) for x in loads),
        "num_waiting_reqs": sum(int(x.get("num_waiting_reqs", 0)) for x in loads),
        "token_usage": used / capacity if capacity else None,
        "max_total_num_tokens": capacity or None,
    }


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) else None
