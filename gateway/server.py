"""How the gateway's HTTP server treats connections, so that connections alone cannot make it
unreachable: every connection must bring a request soon, and only so many may be open.

* Idle timeout (`gateway.idle_timeout_s`): a connection is closed when no request head has fully
  arrived that long after it opened, or after the previous response of a keep-alive
  connection. aiohttp's keep-alive timer does both (it runs from the connection's opening, and a
  partial head does not reset it), so half-open connections and slowly trickled heads are closed
  after that long; aiohttp's own default keeps them an hour.
* Connection cap (`gateway.max_connections`): `GuardedSite` listens like `web.TCPSite` but counts
  the open connections; one beyond the cap is answered at once with a canned 503 (OpenAI error
  body, Retry-After) and closed, without creating a request handler for it, while the open ones
  go on. The cap is lowered to what the process's open-file limit leaves after the gateway's own
  sockets (engine, database), with a warning — past that limit `accept()` fails and the server
  stops accepting altogether.
* The body of a request is bounded in time by the app itself (`gateway.body_read_timeout_s`,
  gateway/overload.py), as is the number of requests inside it.

`tandem serve` (tandem/serve.py) passes `runner_options` to its `web.AppRunner` and listens with a
`GuardedSite`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Callable, Iterator
from typing import Any, cast

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.config import Config
from gateway.errors import error_body
from gateway.state import CONFIG, METRICS

log = logging.getLogger(__name__)

_BACKLOG = 4096
"""Connections the kernel queues before the gateway accepts them (aiohttp's default is 128:
a burst of new clients beyond it waits for SYN retries, a second and more; the kernel caps it
at net.core.somaxconn). At 1,200 streaming req/s past saturation 1,024 still overflowed 472
times in 8 s, 4,096 never."""
_RESERVED_FILES_EXTRA = 64
"""Open files kept for the gateway itself beyond its engine connections: database pool,
uploads, log files."""


def runner_options(app: web.Application) -> dict[str, Any]:
    """Keyword arguments of the `web.AppRunner` of the gateway *app* that bound how long
    connections live (module doc)."""
    return {"keepalive_timeout": app[CONFIG].gateway.idle_timeout_s}


def connection_cap(config: Config) -> int:
    """`gateway.max_connections`, lowered to what the open-file limit allows once the gateway's
    own sockets are reserved (its engine connections: up to one per request inside it and per
    batch line in flight). Raises the soft limit to the hard one first when that is needed."""
    wanted = config.gateway.max_connections
    reserved = (
        config.gateway.max_requests_in_flight + config.batch.max_inflight + _RESERVED_FILES_EXTRA
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted + reserved:
        target = (
            wanted + reserved if hard == resource.RLIM_INFINITY else min(hard, wanted + reserved)
        )
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
    if soft == resource.RLIM_INFINITY or soft >= wanted + reserved:
        return wanted
    reserved = min(reserved, soft // 2)  # half the files at least go to client connections
    allowed = max(1, soft - reserved)
    if allowed >= wanted:
        return wanted
    log.warning(
        "gateway.max_connections %d lowered to %d: the open-file limit is %d and %d files are "
        "kept for the gateway's own connections (raise `ulimit -n`)",
        wanted,
        allowed,
        soft,
        reserved,
    )
    return allowed


class ConnectionGate:
    """The listening socket's protocol factory: an aiohttp request handler per connection while
    fewer than `cap` are open, the canned 503 beyond."""

    def __init__(
        self, handler_factory: Callable[[], asyncio.Protocol], cap: int, retry_after_s: int
    ) -> None:
        self._handler_factory = handler_factory
        self.cap = cap
        """Most connections open at once, connections."""
        self.open = 0
        """Connections open now (accepted, not yet closed), connections."""
        self.refused = 0
        """Connections answered 503 and closed because `cap` were open, since start."""
        body = json.dumps(
            error_body(
                f"the gateway has {cap} connections open (gateway.max_connections); retry in "
                f"{retry_after_s} s",
                "service_unavailable",
                code="too_many_connections",
            )
        ).encode()
        self._refusal = (
            b"HTTP/1.1 503 Service Unavailable\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nRetry-After: {retry_after_s}\r\n".encode()
            + b"Connection: close\r\n\r\n"
            + body
        )

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.cap:
            self.refused += 1
            return _Refused(self._refusal)
        self.open += 1  # counted now: a burst of accepts runs before any connection_made
        return _Counted(self._handler_factory(), self)

    def collect(self) -> Iterator[Metric]:
        """The gate's series for /metrics (a Prometheus collector of the app's registry)."""
        yield GaugeMetricFamily(
            "tandem_gateway_connections_open",
            "Client connections open now (gateway.max_connections bounds them).",
            value=self.open,
        )
        yield CounterMetricFamily(
            "tandem_gateway_connections_refused",
            "Client connections answered 503 and closed at once because "
            "gateway.max_connections were open.",
            value=self.refused,
        )


class _Counted(asyncio.Protocol):
    """One admitted connection: its aiohttp request handler, with the gate's count kept."""

    __slots__ = ("_gate", "_inner")

    def __init__(self, inner: asyncio.Protocol, gate: ConnectionGate) -> None:
        self._inner = inner
        self._gate = gate

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._gate.open -= 1
        self._inner.connection_lost(exc)


class _Refused(asyncio.Protocol):
    """A connection beyond the cap: the canned 503, then closed; nothing it sends is read."""

    __slots__ = ("_answer",)

    def __init__(self, answer: bytes) -> None:
        self._answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)
        stream.write(self._answer)
        stream.close()


class GuardedSite(web.BaseSite):
    """`web.TCPSite` with the connection cap of the runner's app (module doc)."""

    __slots__ = ("_gate", "_host", "_port")

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        super().__init__(runner, backlog=_BACKLOG)
        self._host = host
        self._port = port
        self._gate: ConnectionGate | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        """The port it listens on (the one the OS picked when asked for port 0)."""
        listener = cast(asyncio.Server | None, self._server)
        if listener is None or not listener.sockets:
            return self._port
        return int(listener.sockets[0].getsockname()[1])

    @property
    def gate(self) -> ConnectionGate:
        """The connection count (after `start`)."""
        assert self._gate is not None, "the site has not started"
        return self._gate

    async def start(self) -> None:
        await super().start()
        runner = cast(web.AppRunner, self._runner)
        server = runner.server
        assert server is not None  # BaseSite.__init__ checked it
        app = runner.app
        config = app[CONFIG]
        self._gate = ConnectionGate(
            server, connection_cap(config), config.gateway.overload_retry_after_s
        )
        if METRICS in app:
            app[METRICS].registry.register(cast(Collector, self._gate))
        self._server = await asyncio.get_running_loop().create_server(
            self._gate, self._host, self._port, backlog=self._backlog, reuse_address=True
        )
