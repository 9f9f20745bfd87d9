"""The engine sampler: polls the engines' `/v1/loads` and the batch tables for `GET /metrics`.

Every ``metrics.engine_poll_s`` it reads each engine's running and waiting requests and KV use
(summed over data-parallel ranks; the unlabelled gauges sum the pool's engines, and a pool of
several also gets each engine's, label `engine`) and the BE backlog (batch lines not finished,
batch progress, BE requests in flight), and keeps ``metrics.history_s`` of samples for the
dashboard. Its gauges are collected at scrape time by `gateway.metrics.GatewayMetrics`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import Table, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.models import BatchItemRow, BatchRow
from gateway.store.outage import outage_of

log = logging.getLogger(__name__)

ACTIVE_BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
"""Batches whose lines still count in the BE backlog."""
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
    """Batch-API lines not finished yet (of batches still running): waiting to be sent or in
    flight."""
    be_backlog: int = 0
    """BE work not finished, each piece once: batch lines waiting to be sent, plus the BE
    requests in flight in this gateway (interactive ones and the batch lines it runs), read
    together."""
    engines: tuple[ReplicaSample, ...] = ()
    """Each engine's own reading, in the pool's order (the fields above sum them)."""


@dataclass(frozen=True)
class ReplicaSample:
    """One engine's reading in a sample."""

    name: str
    """The engine's base URL."""
    up: bool
    running: int
    waiting: int
    kv_usage: float | None
    kv_capacity_tokens: int | None


@dataclass(frozen=True)
class SampledEngine:
    """An engine the sampler reads, or one data-parallel rank of one."""

    name: str
    """Its name in the samples (`EngineReplica.name`)."""
    url: str
    """The engine's base URL."""
    dp_rank: int | None = None
    """The rank of the engine's `/v1/loads` this one is; None: all its ranks summed."""


class EngineSampler:
    """Polls the engines' load and the batch backlog; keeps a history for the dashboard."""

    def __init__(
        self,
        engine_url: str | Sequence[str | SampledEngine],
        db: AsyncEngine,
        poll_s: float,
        history_s: float,
        be_in_flight: Callable[[], int],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """*headers* go with every poll of the engines (their API key)."""
        urls = [engine_url] if isinstance(engine_url, str) else list(engine_url)
        self._engines = [
            SampledEngine(e.rstrip("/"), e.rstrip("/")) if isinstance(e, str) else e for e in urls
        ]
        """The engines (the pool's, in order): a base URL is an engine read whole."""
        self._headers = dict(headers or {})
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
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=2.0), headers=self._headers
        )
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
        """Reads the engines and the batch tables now and appends the sample to the history."""
        loads = await asyncio.gather(*(self._engine_load(e) for e in self._engines))
        pending, waiting = await self._batch_backlog()
        # Read right after the tables: a line goes from waiting to in flight in between only in
        # the few milliseconds of this poll (it is then missed once, never counted twice).
        be_in_flight = self._be_in_flight()
        engines = tuple(
            ReplicaSample(
                name=engine.name,
                up=load is not None,
                running=int((load or {}).get("num_running_reqs", 0)),
                waiting=int((load or {}).get("num_waiting_reqs", 0)),
                kv_usage=_float((load or {}).get("token_usage")),
                kv_capacity_tokens=_int((load or {}).get("max_total_num_tokens")),
            )
            for engine, load in zip(self._engines, loads, strict=True)
        )
        # the pool as one engine: the engines that answered, counts and KV summed
        pool = _sum_ranks([load for load in loads if load is not None]) if any(loads) else None
        sample = EngineSample(
            time_s=time.time(),
            up=pool is not None,
            running=int((pool or {}).get("num_running_reqs", 0)),
            waiting=int((pool or {}).get("num_waiting_reqs", 0)),
            kv_usage=_float((pool or {}).get("token_usage")),
            kv_capacity_tokens=_int((pool or {}).get("max_total_num_tokens")),
            batch_lines_pending=pending,
            be_backlog=waiting + be_in_flight,
            engines=engines,
        )
        self.history.append(sample)
        return sample

    async def _engine_load(self, engine: SampledEngine) -> dict[str, Any] | None:
        assert self._session is not None
        try:
            async with self._session.get(f"{engine.url}/v1/loads") as resp:
                if resp.status != 200:
                    return None
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        loads = body.get("loads") if isinstance(body, dict) else None
        if isinstance(loads, list) and loads and isinstance(loads[0], dict):
            if engine.dp_rank is not None:  # one rank of the engine
                rank = engine.dp_rank
                return next((x for x in loads if x.get("dp_rank") == rank), None)
            return _sum_ranks(loads)
        return body if isinstance(body, dict) else None

    async def _batch_backlog(self) -> tuple[int, int]:
        """(lines not finished, lines waiting to be sent) of the batches still running."""
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
            if not outage_of(self._db).report(exc, "reading the batch backlog"):
                log.warning("reading the batch backlog failed: %s", exc)
            if not self.history:
                return 0, 0
            return self.history[-1].batch_lines_pending, self.batch_items.get("pending", 0)
        totals: dict[str, int] = collections.Counter()
        progress = {}
        for batch_id, counts in per_batch.items():
            totals.update(counts)
            done = sum(n for s, n in counts.items() if s in _DONE_ITEM_STATUSES)
            progress[batch_id] = done / max(sum(counts.values()), 1)
        self.batch_items = dict(totals)
        self.batch_progress = progress
        unfinished = sum(n for s, n in totals.items() if s not in _DONE_ITEM_STATUSES)
        return unfinished, totals.get("pending", 0)

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
        if last is not None and len(last.engines) > 1:
            yield from _per_engine(last.engines)
        # A running batch line is also a BE request in flight: counted as the latter only.
        yield gauge(
            "tandem_be_backlog_requests",
            "BE work not finished, each request once: batch lines waiting to be sent plus BE "
            "requests in flight in this gateway (interactive ones and batch lines).",
            last.be_backlog if last else 0,
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


def _per_engine(engines: Sequence[ReplicaSample]) -> Iterator[GaugeMetricFamily]:
    """A pool's gauges per engine (label `engine`); the unlabelled ones sum the pool."""
    up = GaugeMetricFamily(
        "tandem_engine_replica_up", "1 when the engine answered the last poll.", labels=["engine"]
    )
    running = GaugeMetricFamily(
        "tandem_engine_replica_running_requests",
        "Requests in the engine's batch.",
        labels=["engine"],
    )
    waiting = GaugeMetricFamily(
        "tandem_engine_replica_waiting_requests",
        "Requests in the engine's queue.",
        labels=["engine"],
    )
    kv = GaugeMetricFamily(
        "tandem_engine_replica_kv_usage_ratio",
        "Share of the engine's KV pool in use.",
        labels=["engine"],
    )
    for e in engines:
        up.add_metric([e.name], float(e.up))
        if e.up:
            running.add_metric([e.name], e.running)
            waiting.add_metric([e.name], e.waiting)
            if e.kv_usage is not None:
                kv.add_metric([e.name], e.kv_usage)
    yield from (up, running, waiting, kv)


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    """One unlabelled gauge, read at scrape time."""
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
