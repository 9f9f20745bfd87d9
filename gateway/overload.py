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

A bound on requests inside the process cannot see a flood that the gateway has no CPU left to
read: requests then wait in the kernel — new connections in the listen queue, requests on open
ones in their socket buffers — and each one the gateway finally gets to is served seconds late
while the in-flight count stays low (measured: the gateway given a quarter of a core, 400
streamed req/s offered, 2,700 connections in its listen queue, client p50 13 s and 1,950 of 3,200
requests timing out at 30 s, not one shed). So the same middleware reads how long the request's
bytes have waited on its socket (the kernel's `TCP_INFO` `last_data_recv`, one getsockopt): a
request older than `gateway.max_queue_wait_s` when its handling begins is shed with the same 503
— answering it would only make every request behind it later, and its client has likely given
up — and what is served counts its time from when it reached the host (`Arrival`): the SLO
admission, TTFT and the usage record see the wait too.

`OverloadGuard` is app state (`OVERLOAD`), installed by the app factory as its first middleware.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common.config import GatewayConfig
from gateway.errors import ApiError, Handler

DRAIN_MAX_BYTES = 64 * 1024
"""A shed request's unread body up to this size is drained to keep its connection alive; a
larger one (or one of unknown length) is not read and its connection closed, bytes."""
UNCOUNTED_PATHS = frozenset({"/healthz", "/health", "/readyz", "/metrics"})
"""Routes never counted nor shed: the health probes and the Prometheus scrape."""
_TCP_INFO = getattr(socket, "TCP_INFO", None)
"""Linux's `TCP_INFO` socket option (None elsewhere: the queue wait is then not measured)."""
_TCP_INFO_LEN = 64
"""Bytes of `struct tcp_info` read: up to and including `tcpi_last_ack_recv`."""
_LAST_DATA_RECV = struct.Struct("=I")
_LAST_DATA_RECV_OFFSET = 52
"""`tcpi_last_data_recv` (ms since the last data segment arrived): after 8 one-byte fields and
eleven 32-bit ones (linux/tcp.h, unchanged since 2.6)."""


def socket_wait_s(transport: asyncio.BaseTransport | None) -> float | None:
    """How long ago the latest bytes of the connection under *transport* reached the host,
    seconds (ms resolution): for a request whose handling begins now, how long it waited in the
    kernel's queues for the gateway to read it. None when that cannot be read (not TCP, not
    Linux, the connection gone)."""
    if transport is None or _TCP_INFO is None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN)
    except (OSError, ValueError):  # a Unix socket, a closed one
        return None
    if len(info) < _LAST_DATA_RECV_OFFSET + 4:
        return None
    last_data_recv_ms: int = _LAST_DATA_RECV.unpack_from(info, _LAST_DATA_RECV_OFFSET)[0]
    return last_data_recv_ms / 1000.0


@dataclass(frozen=True, slots=True)
class Arrival:
    """When a request reached the gateway's host (its bytes, not the gateway's reading of them)."""

    monotonic_s: float
    """On `time.monotonic`, seconds."""
    unix_s: float
    """Wall clock, seconds since the epoch."""
    queued_s: float
    """How long its bytes waited in the kernel before its handling began, seconds."""


ARRIVAL = web.RequestKey("arrival", Arrival)
"""Where the overload guard leaves a counted request's `Arrival`."""


def arrival_of(request: web.Request) -> Arrival:
    """The request's arrival (now, for one the guard did not see: a test's bare app)."""
    arrival = request.get(ARRIVAL)
    if arrival is None:
        arrival = request[ARRIVAL] = Arrival(time.monotonic(), time.time(), 0.0)
    return arrival


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
        self.max_queue_wait_s = config.max_queue_wait_s
        """Longest a request may have waited in the kernel before its handling begins, s."""
        self.retry_after_s = config.overload_retry_after_s
        """`Retry-After` of a shed request, seconds."""
        self.body_timeout_s = config.body_read_timeout_s
        """Longest a request's body may take to arrive, seconds."""
        self.in_flight = 0
        """Requests inside the gateway now (counted routes only), requests."""
        self.shed = 0
        """Requests answered 503 `server_overloaded` because the bound was reached, since
        start, requests."""
        self.shed_late = 0
        """Requests answered 503 `server_overloaded` because they had waited longer than
        `max_queue_wait_s` before the gateway read them, since start, requests."""
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
            return self._overloaded(
                request,
                f"{self.max_in_flight} requests are already in progress "
                "(gateway.max_requests_in_flight)",
            )
        queued_s = socket_wait_s(request.transport) or 0.0
        if queued_s > self.max_queue_wait_s:
            self.shed_late += 1
            return self._overloaded(
                request,
                f"this request waited {queued_s:.2f} s before the gateway could read it "
                f"(gateway.max_queue_wait_s {self.max_queue_wait_s:g})",
            )
        request[ARRIVAL] = Arrival(time.monotonic() - queued_s, time.time() - queued_s, queued_s)
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

    def _overloaded(self, request: web.Request, why: str) -> web.Response:
        error = ApiError(
            503,
            f"the gateway is overloaded: {why}; retry in {self.retry_after_s} s",
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
        shed = CounterMetricFamily(
            "tandem_gateway_requests_shed",
            "Requests answered 503 server_overloaded, by reason: in_flight "
            "(gateway.max_requests_in_flight reached), queue_wait (waited longer than "
            "gateway.max_queue_wait_s before the gateway could read it).",
            labels=["reason"],
        )
        shed.add_metric(["in_flight"], self.shed)
        shed.add_metric(["queue_wait"], self.shed_late)
        yield shed
        yield CounterMetricFamily(
            "tandem_gateway_body_timeouts",
            "Requests answered 408 because their body took longer than "
            "gateway.body_read_timeout_s to arrive.",
            value=self.body_timeouts,
        )


OVERLOAD = web.AppKey("overload_guard", OverloadGuard)
"""The app's overload guard."""
