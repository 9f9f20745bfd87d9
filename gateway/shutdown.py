"""Stopping the gateway without cutting its clients off mid-answer: the drain.

On SIGINT or SIGTERM `tandem serve` stops listening at once, and the requests already inside
the gateway (a stream, a non-streamed generation, an upload) may finish for up to
`gateway.shutdown_timeout_s`. Meanwhile a new request on a connection that is still open is
refused with 503 `gateway_shutting_down` and `Connection: close`, and `/readyz` answers 503, so a
load balancer sends its clients elsewhere. When that time is up, or at a second signal, each
request still inside ends now, and its client is told so:

* a stream whose headers are out ends in-band, with an error event (code
  `gateway_shutting_down`) and `[DONE]`, as every other failure mid-stream does;
* any other request gets the 503 with `Retry-After`.

Its engine request is aborted, which frees its KV at once. Its usage record says
`gateway_shutdown`: an error in the usage reports (its client got one), billed for the tokens
that ran, and not judged against the SLO (a deploy says nothing about the latency it got).
Batch lines get the same time: from the drain's start the batch runner starts no line (nor a
retry), and the drain also waits for the lines in flight to finish and write their results, so
the engine work they have done is kept. A line still running when the time is up is stopped
with the runner and runs again after the restart (its usage record says `interrupted`).

Before this, aiohttp waited a fixed 60 s and then closed the connections under the streams.
Their clients read a broken response, and the usage records said the clients had gone away.

How a request is ended: the drain cancels its handler's task, and marks the task as cut. A
handler that can say more than a 503 catches that cancellation (`Drain.was_cut`) and answers
itself; the middleware answers the rest. `Drain` is app state (`DRAIN`), its middleware
installed by the app factory, and `Drain.drain` runs in the app's `on_shutdown`, which aiohttp
awaits after closing the listening sockets and before it waits for the handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from aiohttp import web

from gateway.errors import ApiError, Handler
from gateway.pipeline.outcome import gateway_shut_down

log = logging.getLogger(__name__)

CUT_GRACE_S = 5.0
"""How long the handlers ended by the drain may take to tell their clients (an error event, a
503) before aiohttp closes their connections, seconds."""
PROBE_PATHS = frozenset({"/healthz", "/health", "/readyz", "/metrics"})
"""Routes a draining gateway still answers as before (/readyz says it is shutting down)."""


class LineDrain(Protocol):
    """The gateway's own work the drain also lets finish: the batch runner's lines in flight
    (gateway/batch/runner.py), told to start no more before the drain waits for them."""

    @property
    def in_flight(self) -> int:
        """Lines running now."""
        ...

    async def lines_done(self) -> None:
        """Returns once no line is in flight."""
        ...


def refusal(*, ended: bool) -> ApiError:
    """The 503 of a request the drain refused or *ended*; its connection is closed after it."""
    error = gateway_shut_down(ended=ended).api_error()
    error.headers["Connection"] = "close"
    return error


class Drain:
    """The requests inside the gateway, and the drain that ends them when it stops."""

    def __init__(self) -> None:
        self._inside: set[asyncio.Task[Any]] = set()
        self._cut: set[asyncio.Task[Any]] = set()
        self._emptied: asyncio.Event | None = None
        self._end_now: asyncio.Event | None = None
        self.is_draining = False
        """Whether the gateway is stopping (set when the drain begins, never cleared)."""

    @property
    def inside(self) -> int:
        """Requests inside the gateway now (the probes' excepted)."""
        return len(self._inside)

    def was_cut(self) -> bool:
        """Whether the current task is a request the drain ended (its handler then answers the
        cancellation it is getting, rather than letting it through)."""
        task = asyncio.current_task()
        return task is not None and task in self._cut

    def end_now(self) -> None:
        """Ends the drain's wait at once (a second signal): what is inside is ended now."""
        if self._end_now is not None:
            self._end_now.set()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Tracks each request while it is inside; refuses new ones while the gateway drains;
        answers a request the drain ended whose handler did not (503)."""
        if request.path in PROBE_PATHS:
            return await handler(request)
        if self.is_draining:
            raise refusal(ended=False)
        task = asyncio.current_task()
        assert task is not None
        self._inside.add(task)
        try:
            return await handler(request)
        except asyncio.CancelledError:
            if task not in self._cut:
                raise  # the client went away
            task.uncancel()
            raise refusal(ended=True) from None
        finally:
            self._inside.discard(task)
            if not self._inside and self._emptied is not None:
                self._emptied.set()

    async def drain(self, timeout_s: float, lines: LineDrain | None = None) -> int:
        """Stops taking requests, waits up to *timeout_s* (or until `end_now`) for those inside
        to finish, and for the batch *lines* in flight (which start no more: the caller told
        them), then ends the requests still inside and gives them `CUT_GRACE_S` to tell their
        clients (lines still running are stopped by their runner's close). Returns how many
        requests it ended."""
        self.is_draining = True
        self._emptied, self._end_now = asyncio.Event(), asyncio.Event()
        line_count = 0 if lines is None else lines.in_flight
        if self._inside or line_count:
            log.info(
                "shutting down: %d requests%s in flight, waiting up to %g s for them to finish "
                "(a second signal ends them now)",
                len(self._inside),
                f" and {line_count} batch lines" if line_count else "",
                timeout_s,
            )
            waits = [
                asyncio.ensure_future(self._all_done(lines)),
                asyncio.ensure_future(self._end_now.wait()),
            ]
            try:
                await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        if lines is not None and lines.in_flight:
            log.warning(
                "shutting down: %d batch lines still running are stopped; they run again after "
                "the restart",
                lines.in_flight,
            )
        left = [task for task in self._inside if not task.done()]
        if not left:
            return 0
        log.warning("shutting down: ending the %d requests still in flight", len(left))
        for task in left:
            self._cut.add(task)
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CUT_GRACE_S):
                await asyncio.gather(*left, return_exceptions=True)
        return len(left)

    async def _all_done(self, lines: LineDrain | None) -> None:
        """Returns once no request is inside and no batch line in flight (none start: the drain
        refuses requests, the runner starts no line)."""
        if self._inside:
            assert self._emptied is not None
            await self._emptied.wait()
        if lines is not None:
            await lines.lines_done()
