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
* Queue wait (`gateway.max_queue_wait_s`): a connection the gateway accepts after it waited
  longer than that in the listen queue (the kernel's `TCP_INFO`, gateway/overload.py) is answered
  the same canned way, with 503 `server_overloaded`: when the gateway has no CPU left to read a
  flood, answering the late ones without an aiohttp handler, a parse or a JSON body is what
  drains the listen queue faster than it fills (a shed through the app's middleware costs
  nearly what a served request does, and the queue grew past it). The app's middleware applies
  the same bound to each request of an open connection.
* A canned answer half-closes the connection and reads what the client had sent until it
  closes (at most `_LINGER_S`): closing with unread bytes would reset the connection, and the
  client could lose the answer to the reset.
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
from gateway.overload import UNCOUNTED_PATHS, socket_wait_s
from gateway.state import CONFIG, METRICS

log = logging.getLogger(__name__)

_BACKLOG = 4096
"""Connections the kernel queues before the gateway accepts them (aiohttp's default is 128:
a burst of new clients beyond it waits for SYN retries, a second and more; the kernel caps it
at net.core.somaxconn). At 1,200 streaming req/s past saturation 1,024 still overflowed 472
times in 8 s, 4,096 never."""
_LINGER_S = 2.0
"""Longest a connection answered with a canned 503 stays open for the client to close it first,
seconds."""
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


def _canned(status: str, message: str, code: str, retry_after_s: int) -> bytes:
    """A whole HTTP/1.1 error answer that closes its connection (OpenAI error body)."""
    body = json.dumps(error_body(message, "service_unavailable", code=code)).encode()
    return (
        f"HTTP/1.1 {status}\r\n".encode()
        + b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nRetry-After: {retry_after_s}\r\n".encode()
        + b"Connection: close\r\n\r\n"
        + body
    )


class ConnectionGate:
    """The listening socket's protocol factory: an aiohttp request handler per connection while
    fewer than `cap` are open and the connection did not wait too long to be accepted; a canned
    503 otherwise (module doc)."""

    def __init__(
        self,
        handler_factory: Callable[[], asyncio.Protocol],
        cap: int,
        retry_after_s: int,
        max_queue_wait_s: float,
    ) -> None:
        self._handler_factory = handler_factory
        self.cap = cap
        """Most connections open at once, connections."""
        self.max_queue_wait_s = max_queue_wait_s
        """Longest a connection may wait in the listen queue and still be served, seconds."""
        self.open = 0
        """Connections open now (accepted, not yet closed), connections."""
        self.refused = 0
        """Connections answered 503 and closed because `cap` were open, since start."""
        self.shed_late = 0
        """Connections answered 503 because they waited longer than `max_queue_wait_s` to be
        accepted, since start."""
        self._refusal = _canned(
            "503 Service Unavailable",
            f"the gateway has {cap} connections open (gateway.max_connections); retry in "
            f"{retry_after_s} s",
            "too_many_connections",
            retry_after_s,
        )
        self._late_answer = _canned(
            "503 Service Unavailable",
            "the gateway is overloaded: this connection waited longer than "
            f"gateway.max_queue_wait_s ({max_queue_wait_s:g} s) before the gateway could "
            f"accept it; retry in {retry_after_s} s",
            "server_overloaded",
            retry_after_s,
        )

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.cap:
            self.refused += 1
            return _Answered(self._refusal)
        self.open += 1  # counted now: a burst of accepts runs before any connection_made
        return _Counted(self)

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
        yield CounterMetricFamily(
            "tandem_gateway_connections_shed",
            "Client connections answered 503 server_overloaded at once because they waited "
            "longer than gateway.max_queue_wait_s in the listen queue.",
            value=self.shed_late,
        )


class _Counted(asyncio.Protocol):
    """One admitted connection, with the gate's count kept: its aiohttp request handler, made
    once the connection is known to be on time — or, for one that waited too long in the listen
    queue, once its first bytes show a health probe or the scrape (never shed) or a request that
    has just come; a request that waited too long is answered with the canned 503."""

    __slots__ = ("_gate", "_inner", "_late", "_timer")

    def __init__(self, gate: ConnectionGate) -> None:
        self._gate = gate
        self._inner: asyncio.Protocol | None = None
        self._late: asyncio.Transport | None = None
        """A late connection whose first bytes have not come yet."""
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        waited_s = socket_wait_s(transport)
        if waited_s is not None and waited_s > self._gate.max_queue_wait_s:
            self._late = cast(asyncio.Transport, transport)
            # one that sends nothing is not kept for the idle timeout either
            self._timer = asyncio.get_running_loop().call_later(_LINGER_S, transport.close)
            return
        self._serve(transport)

    def _serve(self, transport: asyncio.BaseTransport) -> None:
        self._inner = self._gate._handler_factory()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        late = self._late
        if late is not None:  # its first bytes: a probe goes on, a late request is shed
            self._late = None
            if self._timer is not None:
                self._timer.cancel()
            # measured again: a connection opened ahead of its request (a client's pool) was
            # late to be accepted, but its request may be new
            waited_s = socket_wait_s(late)
            if _is_probe(data) or waited_s is None or waited_s <= self._gate.max_queue_wait_s:
                self._serve(late)
            else:
                self._gate.shed_late += 1
                self._inner = _Answered(self._gate._late_answer)
                self._inner.connection_made(late)
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._inner is None:
            return False
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._gate.open -= 1
        if self._timer is not None:
            self._timer.cancel()
        if self._inner is not None:
            self._inner.connection_lost(exc)


def _is_probe(head: bytes) -> bool:
    """Whether *head*, the first bytes of a connection, is a request for a health probe or the
    scrape (`UNCOUNTED_PATHS`)."""
    method, _, rest = head.partition(b" ")
    if method not in (b"GET", b"HEAD"):
        return False
    target = rest.split(b" ", 1)[0].split(b"?", 1)[0]
    return target.decode("latin-1") in UNCOUNTED_PATHS


class _Answered(asyncio.Protocol):
    """A connection answered with a canned error: the answer, a half-close, and what the client
    sends is read and dropped until it closes (or `_LINGER_S`), so that the close is not a reset
    that could cost the client the answer."""

    __slots__ = ("_answer", "_timer", "_transport")

    def __init__(self, answer: bytes) -> None:
        self._answer = answer
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = self._transport = cast(asyncio.Transport, transport)
        stream.write(self._answer)
        if stream.can_write_eof():
            stream.write_eof()
            self._timer = asyncio.get_running_loop().call_later(_LINGER_S, stream.close)
        else:
            stream.close()

    def data_received(self, data: bytes) -> None:
        pass  # the request that was not served: dropped

    def eof_received(self) -> bool:
        return False  # the client closed too: close the connection

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


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
            server,
            connection_cap(config),
            config.gateway.overload_retry_after_s,
            config.gateway.max_queue_wait_s,
        )
        if METRICS in app:
            app[METRICS].registry.register(cast(Collector, self._gate))
        self._server = await asyncio.get_running_loop().create_server(
            self._gate, self._host, self._port, backlog=self._backlog, reuse_address=True
        )
