"""Running one generation on the engine: the stream of chunks, timing, the client's disconnect,
and the usage record written when it ends (whatever way it ends)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from aiohttp import web

from gateway.api.prepare import EngineRequest
from gateway.auth import Principal
from gateway.engine.client import EngineChunk, EngineRequestError, EngineUnavailable
from gateway.errors import ApiError
from gateway.quotas.limiter import QuotaExceeded, Ticket
from gateway.slo import RequestTimer, slo_met
from gateway.state import CONFIG, ENGINE, METRICS, QUOTAS, USAGE, spawn
from gateway.store.types import UsageRecord


@dataclass
class Outcome:
    """How a request ended, for its usage record."""

    status: str = "ok"
    """ok | invalid_request | rate_limited | engine_error | engine_unavailable | aborted |
    client_disconnected."""
    http_status: int = 200
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float | None = None
    finish_reason: str | None = None


@dataclass
class Generation:
    """One request's life on the engine. Iterate `chunks()`; call `close()` exactly once."""

    app: web.Application
    principal: Principal
    endpoint: str
    model: str
    stream: bool
    timer: RequestTimer = field(default_factory=RequestTimer)
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    request: EngineRequest | None = None
    outcome: Outcome = field(default_factory=Outcome)
    ticket: Ticket | None = None
    """The request's hold on its tenant's quota (None until admitted)."""
    _finished: bool = False

    async def chunks(self) -> AsyncIterator[EngineChunk]:
        """The engine's chunks; engine failures become ApiErrors (503 / 400)."""
        assert self.request is not None
        self.outcome.prompt_tokens = len(self.request.input_ids)
        self._admit(self.request)
        config = self.app[CONFIG]
        try:
            async for chunk in self.app[ENGINE].generate(self.request.payload):
                self.timer.on_tokens(chunk.completion_tokens)
                self.outcome.completion_tokens = chunk.completion_tokens
                self.outcome.prompt_tokens = chunk.prompt_tokens or self.outcome.prompt_tokens
                if chunk.queue_time_s is not None:
                    self.outcome.queue_ms = chunk.queue_time_s * 1000.0
                if chunk.finish_reason is not None:
                    self.outcome.finish_reason = chunk.finish_reason
                    self._finished = True
                yield chunk
        except EngineUnavailable as exc:
            self._fail("engine_unavailable", 503, str(exc))
            raise ApiError(
                503,
                "the inference engine is unavailable; retry later",
                code="engine_unavailable",
                headers={"Retry-After": str(config.gateway.engine_retry_after_s)},
            ) from None
        except EngineRequestError as exc:
            self._fail("engine_error", 400, str(exc))
            raise ApiError(
                400, f"engine rejected the request: {exc}", code="engine_error"
            ) from None
        if not self._finished:
            self._fail("engine_error", 502, "engine stream ended without a finish reason")
            raise ApiError(
                503,
                "the engine ended the stream early; retry later",
                code="engine_error",
                headers={"Retry-After": "1"},
            )
        if self.outcome.finish_reason == "abort":
            self._fail("aborted", 503, "the engine aborted the request")

    def reject(self, exc: ApiError) -> None:
        """Marks the request as refused before it reached the engine."""
        self._fail("invalid_request", exc.status, exc.message)

    def close(self, *, cancelled: bool = False) -> None:
        """Records usage; if the request is still running (client gone), aborts it upstream."""
        if cancelled and not self._finished and self.outcome.status == "ok":
            self._fail("client_disconnected", 499, "client disconnected")
        if self.request is not None and not self._finished and self.ticket is not None:
            spawn(self.app, self.app[ENGINE].abort(self.request.rid))
        self.timer.finish()
        if self.ticket is not None:
            o = self.outcome
            ran = o.completion_tokens > 0 or o.status == "ok"
            self.app[QUOTAS].release(
                self.ticket, o.prompt_tokens + o.completion_tokens if ran else 0
            )
        self._record()

    def _admit(self, request: EngineRequest) -> None:
        """Checks the tenant's quota (in memory); over it: 429 with Retry-After, not sent."""
        tenant = self.principal.tenant
        try:
            # Batch-API lines (endpoint "batch/…") count toward the monthly budget only
            self.ticket = self.app[QUOTAS].admit(
                tenant,
                len(request.input_ids),
                request.max_tokens,
                interactive=not self.endpoint.startswith("batch/"),
            )
        except QuotaExceeded as exc:
            self._fail("rate_limited", 429, exc.message)
            self.app[METRICS].quota_rejected(tenant.id, exc.limit)
            raise ApiError(
                429,
                exc.message,
                code=f"{exc.limit}_exceeded",
                headers={"Retry-After": str(int(exc.retry_after_s))},
            ) from None
        self.app[METRICS].request_started(tenant.id, request.meta.tier)

    def _fail(self, status: str, http_status: int, error: str) -> None:
        if self.outcome.status == "ok":
            self.outcome.status = status
            self.outcome.http_status = http_status
            self.outcome.error = error

    def _record(self) -> None:
        tenant = self.principal.tenant
        meta = self.request.meta if self.request is not None else None
        tier = meta.tier if meta is not None else tenant.tier
        ok = self.outcome.status == "ok"
        record = UsageRecord(
            request_id=self.request.rid if self.request else f"rejected-{id(self):x}",
            tenant_id=tenant.id,
            key_id=self.principal.key_id,
            tier=tier,
            model=self.model,
            endpoint=self.endpoint,
            stream=self.stream,
            prompt_tokens=self.outcome.prompt_tokens,
            completion_tokens=self.outcome.completion_tokens,
            queue_ms=self.outcome.queue_ms,
            ttft_ms=self.timer.ttft_ms,
            tbt_max_ms=self.timer.tbt_max_ms,
            tpot_ms=self.timer.tpot_ms,
            e2e_ms=self.timer.e2e_ms,
            status=self.outcome.status,
            http_status=self.outcome.http_status,
            error=self.outcome.error,
            slo_met=None
            if self.request is None or self.ticket is None
            else slo_met(
                tier=tier,
                ttft_target_ms=meta.ttft_target_ms if meta else None,
                tpot_target_ms=meta.tpot_target_ms if meta else None,
                deadline_s=meta.deadline_s if meta else None,
                ok=ok,
                ttft_ms=self.timer.ttft_ms,
                tpot_ms=self.timer.tpot_ms,
                e2e_ms=self.timer.e2e_ms,
            ),
            created_at=self.created_at,
            finished_at=datetime.now(UTC),
        )
        length_key = meta.length_key if meta is not None and ok else None
        self.app[METRICS].request_finished(record, started=self.ticket is not None)
        self.app[USAGE].record(record, length_key=length_key, key_id=self.principal.key_id)


def is_cancellation(exc: BaseException) -> bool:
    """The client went away (handler cancelled, or a write hit a closed connection)."""
    return isinstance(exc, (asyncio.CancelledError, ConnectionResetError))
