"""The drain of a stopping gateway (gateway/shutdown.py) on hand-made requests: it waits for the
requests inside and returns as soon as the last one ends; it ends the rest when its time is up
or at once on `end_now` (a second signal); a request arriving while it drains is refused with a
503 that closes its connection; the health probes are answered as before. It waits for the
batch lines in flight the same way (tests/gateway/test_shutdown_drain.py runs the real runner)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from gateway.errors import ApiError, Handler
from gateway.shutdown import Drain
from tests.waiting import wait_until


async def slow_handler(request: web.Request) -> web.StreamResponse:
    await asyncio.Event().wait()  # never set: runs until it is ended
    return web.Response(text="late")


async def ok_handler(request: web.Request) -> web.StreamResponse:
    return web.Response(text="ok")


def handler_until(release: asyncio.Event) -> Handler:
    """A handler that answers 200 once *release* is set."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(text="done")

    return handler


async def inside(drain: Drain, count: int) -> None:
    await wait_until(lambda: drain.inside >= count, 10, what=f"{count} requests inside")


async def test_a_request_ended_by_the_drain_gets_a_503_and_the_drain_counts_it() -> None:
    drain = Drain()
    request = asyncio.create_task(
        drain.middleware(make_mocked_request("POST", "/v1/x"), slow_handler)
    )
    await inside(drain, 1)
    assert await drain.drain(0.0) == 1
    with pytest.raises(ApiError) as refused:
        await request
    assert refused.value.status == 503 and refused.value.code == "gateway_shutting_down"
    assert refused.value.headers["Connection"] == "close"
    assert "ended the request" in refused.value.message
    assert drain.inside == 0


async def test_the_drain_returns_when_the_last_request_ends() -> None:
    drain = Drain()
    release = asyncio.Event()

    request = asyncio.create_task(
        drain.middleware(make_mocked_request("POST", "/v1/x"), handler_until(release))
    )
    await inside(drain, 1)
    draining = asyncio.create_task(drain.drain(3600.0))
    await wait_until(lambda: drain.is_draining, 10, what="the drain begun")
    assert not draining.done()
    release.set()
    assert await draining == 0  # nothing ended: it finished
    assert (await request).status == 200


async def test_end_now_ends_what_is_inside_at_once() -> None:
    drain = Drain()
    request = asyncio.create_task(
        drain.middleware(make_mocked_request("POST", "/v1/x"), slow_handler)
    )
    await inside(drain, 1)
    draining = asyncio.create_task(drain.drain(3600.0))
    await wait_until(lambda: drain.is_draining, 10, what="the drain begun")
    drain.end_now()
    assert await draining == 1
    with pytest.raises(ApiError):
        await request


async def test_while_draining_new_requests_are_refused_and_probes_answered() -> None:
    drain = Drain()
    assert await drain.drain(0.0) == 0
    with pytest.raises(ApiError) as refused:
        await drain.middleware(make_mocked_request("POST", "/v1/chat/completions"), ok_handler)
    assert refused.value.status == 503 and refused.value.code == "gateway_shutting_down"
    assert refused.value.headers["Retry-After"] == "1"
    for probe in ("/readyz", "/healthz", "/metrics"):
        assert (await drain.middleware(make_mocked_request("GET", probe), ok_handler)).status == 200


async def test_a_client_that_goes_away_is_not_taken_for_the_drain() -> None:
    drain = Drain()
    request = asyncio.create_task(
        drain.middleware(make_mocked_request("POST", "/v1/x"), slow_handler)
    )
    await inside(drain, 1)
    request.cancel()  # what aiohttp does when the client disconnects
    with pytest.raises(asyncio.CancelledError):
        await request
    assert drain.inside == 0


class Lines:
    """Batch lines in flight, as the drain sees a runner's: done when released."""

    def __init__(self, count: int) -> None:
        self.in_flight = count
        self.released = asyncio.Event()

    async def lines_done(self) -> None:
        await self.released.wait()
        self.in_flight = 0


async def test_the_drain_waits_for_the_batch_lines_in_flight_after_the_requests() -> None:
    drain = Drain()
    lines = Lines(3)
    release = asyncio.Event()

    request = asyncio.create_task(
        drain.middleware(make_mocked_request("POST", "/v1/x"), handler_until(release))
    )
    await inside(drain, 1)
    draining = asyncio.create_task(drain.drain(3600.0, lines))
    await wait_until(lambda: drain.is_draining, 10, what="the drain begun")
    release.set()
    assert (await request).status == 200
    assert drain.inside == 0 and not draining.done()  # the request is out, the lines still run
    lines.released.set()
    assert await draining == 0


async def test_lines_still_running_when_the_time_is_up_are_left_to_their_runner() -> None:
    drain = Drain()
    lines = Lines(2)
    assert await drain.drain(0.0, lines) == 0  # no request ended; the lines stay in flight
    assert lines.in_flight == 2


async def test_end_now_ends_the_wait_for_batch_lines() -> None:
    drain = Drain()
    draining = asyncio.create_task(drain.drain(3600.0, Lines(1)))
    await wait_until(lambda: drain.is_draining, 10, what="the drain begun")
    drain.end_now()
    assert await draining == 0
