"""The gateway's own protection against floods: a bound on the requests inside it, and a bound on
how long a request's body may take to arrive.

Under a flood the gateway's event loop is what saturates first (parsing, authentication, the
admission checks, JSON): every accepted request then waits for CPU behind all the others, and
without a bound that wait grows with the flood — seconds, then the clients' own timeouts. The
per-tier queues (gateway/pipeline/tier_queue.py) cannot help there: they are checked after
authentication and tokenization, the very work that is late. So the first middleware counts the
requests inside the process and answers the one beyond `gateway.max_requests_in_flight` at once,
before anything else runs — no authentication, no database, not even reading the body — with 503,
`Retry-After` and the OpenAI error code `server_overloaded`. What was accepted runs on in bounded
time; what was not is told so in well under a millisecond.

Health probes and `/metrics` are neither counted nor shed: an orchestrator must keep seeing a
saturated gateway alive, and an operator must keep seeing why it sheds.

The same middleware bounds a request's body: one whose body has not fully arrived
`gateway.body_read_timeout_s` after its handling began is answered 408 `request_timeout` and its
connection closed, so a client trickling a body cannot hold a place in the bound for ever (the
wait for a request's head is bounded where connections are accepted: gateway/server.py).

`OverloadGuard` is app state (`OVERLOAD`), installed by the app factory as its first middleware.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common.config import GatewayConfig
from gateway.errors import ApiError, Handler

DRAIN_MAX_BYTES = 64 * 1024
"""A shed request's unread body up to this size is drained to keep its connection alive; a
larger one (or one of unknown length) is not read and its connection closed, bytes."""
UNCOUNTED_PATHS = frozenset({"/healthz", "/health", "/readyz", "/metrics"})
"""Routes never counted nor shed: the health probes and the Prometheus scrape."""


class BodyReadTimeout(ApiError, TimeoutError):
    """A request's body did not arrive within `gateway.body_read_timeout_s`.

    Set on the request's payload stream, so the handler's next read raises it: as an ApiError
    the error middleware answers it (408); as a TimeoutError aiohttp's drain of the unread body
    after the response ends quietly, without logging it as an unhandled error."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408,
            f"the request body did not arrive within {timeout_s:g} s (gateway.body_read_timeout_s)",
            code="request_timeout",
            headers={"Connection": "close"},
        )


class OverloadGuard:
    """Counts the requests inside the gateway and sheds the ones beyond the bound (module doc)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.max_in_flight = config.max_requests_in_flight
        """Most requests inside the gateway at once, requests."""
        self.retry_after_s = config.overload_retry_after_s
        """`Retry-After` of a shed request, seconds."""
        self.body_timeout_s = config.body_read_timeout_s
        """Longest a request's body may take to arrive, seconds."""
        self.in_flight = 0
        """Requests inside the gateway now (counted routes only), requests."""
        self.shed = 0
        """Requests answered 503 `server_overloaded` since start, requests."""
        self.body_timeouts = 0
        """Requests answered 408 because their body came too slowly, since start, requests."""

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The app's first middleware: shed beyond the bound, else count the request while it
        runs and bound its body's arrival."""
        if request.path in UNCOUNTED_PATHS:
            return await handler(request)
        if self.in_flight >= self.max_in_flight:
            self.shed += 1
            return self._overloaded(request)
        self.in_flight += 1
        timer = None
        if request.body_exists and not request.content.is_eof():
            timer = asyncio.get_running_loop().call_later(
                self.body_timeout_s, self._expire_body, request
            )
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
            if timer is not None:
                timer.cancel()

    def _overloaded(self, request: web.Request) -> web.Response:
        error = ApiError(
            503,
            f"the gateway is overloaded: {self.max_in_flight} requests are already in progress "
            f"(gateway.max_requests_in_flight); retry in {self.retry_after_s} s",
            code="server_overloaded",
            headers={"Retry-After": str(self.retry_after_s)},
        )
        response = error.to_response()
        # The body was never read. A small one is drained by aiohttp after the answer and the
        # connection kept: closing it would have the client open a new one for its retry, and
        # under a flood of shed requests those reconnections overflow the listen backlog — the
        # kernel then drops SYNs, which clients retry after 1, 3, 7 s, so every new client,
        # accepted or not, waits seconds (measured: 60,000 listen drops in 8 s at 1,200
        # non-streaming req/s, p50 6.5 s). A large or unsized body is not worth reading.
        length = request.content_length
        if length is None or length > DRAIN_MAX_BYTES:
            response.force_close()
        return response

    def _expire_body(self, request: web.Request) -> None:
        if not request.content.is_eof():  # still arriving: fail the handler's read of it
            self.body_timeouts += 1
            request.content.set_exception(BodyReadTimeout(self.body_timeout_s))

    def collect(self) -> Iterator[Metric]:
        """The guard's series for /metrics (a Prometheus collector of the app's registry)."""
        yield GaugeMetricFamily(
            "tandem_gateway_requests_in_progress",
            "Requests inside the gateway now (every route but health probes and /metrics); "
            "beyond gateway.max_requests_in_flight they are shed with 503.",
            value=self.in_flight,
        )
        yield CounterMetricFamily(
            "tandem_gateway_requests_shed",
            "Requests answered 503 server_overloaded (gateway.max_requests_in_flight reached).",
            value=self.shed,
        )
        yield CounterMetricFamily(
            "tandem_gateway_body_timeouts",
            "Requests answered 408 because their body took longer than "
            "gateway.body_read_timeout_s to arrive.",
            value=self.body_timeouts,
        )


OVERLOAD = web.AppKey("overload_guard", OverloadGuard)
"""The app's overload guard."""
