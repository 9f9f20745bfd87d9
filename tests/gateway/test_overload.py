"""The gateway's own protection, as a client sees it: past `gateway.max_requests_in_flight`
requests inside it, a request is answered at once with 503 `server_overloaded` and Retry-After —
before authentication or its body — while the health probes and /metrics still answer and the
requests already inside go on; a body that arrives too slowly is answered 408 and loses its
place."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from urllib.parse import urlsplit

from tests.gateway.conftest import GatewayFactory
from tests.gateway.harness import MODEL, Gateway, Reply, metric
from tests.gateway.test_tier_queues import held
from tests.waiting import wait_until

CHAT_PATH = "/v1/chat/completions"


def assert_overloaded(reply: Reply, bound: int) -> None:
    assert reply.status == 503, reply
    error = reply.error
    assert error["type"] == "service_unavailable" and error["code"] == "server_overloaded"
    assert f"{bound} requests are already in progress" in error["message"]
    assert int(reply.headers["Retry-After"]) >= 1


@asynccontextmanager
async def trickling(gw: Gateway, key: str) -> AsyncIterator[asyncio.StreamReader]:
    """A chat request whose body never finishes arriving (half of it sent): inside the gateway,
    its handler waiting for the rest, until the block ends (then the connection is dropped)."""
    url = urlsplit(gw.base_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = (
        f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body[: len(body) // 2])
    await writer.drain()
    try:
        yield reader
    finally:
        writer.transport.abort()


async def in_progress(gw: Gateway) -> float:
    return metric(await gw.metrics(), "tandem_gateway_requests_in_progress") or 0.0


async def test_a_request_past_the_bound_is_shed_at_once_and_the_ones_inside_go_on(
    make_gateway: GatewayFactory,
) -> None:
    async with make_gateway(TANDEM_GATEWAY__MAX_REQUESTS_IN_FLIGHT="3") as gw:
        _, key = await gw.new_tenant("t")
        async with AsyncExitStack() as inside:
            stream = await inside.enter_async_context(held(gw, key))  # a stream on the engine
            for _ in range(2):  # and two requests whose bodies are still arriving
                await inside.enter_async_context(trickling(gw, key))
            await wait_until(lambda: in_progress(gw), what="3 requests inside the gateway")
            assert await in_progress(gw) == 3

            assert_overloaded(await gw.chat(key), 3)
            # shed before authentication: a bad key is not even looked at
            assert_overloaded(await gw.chat("tdm_not_a_key"), 3)
            # the probes and the scrape are neither counted nor shed
            for path in ("/healthz", "/health", "/readyz"):
                assert (await gw.request("GET", path)).status == 200, path
            samples = await gw.metrics()
            assert metric(samples, "tandem_gateway_requests_shed_total", reason="in_flight") == 2
            # the stream inside goes on
            line = b"\n"
            while line == b"\n":  # events are separated by blank lines
                line = await stream.content.readline()
            assert line.startswith(b"data: {"), line

        async def served() -> Reply | None:  # the places are free again once those ended
            reply = await gw.chat(key, max_tokens=2)
            return reply if reply.status == 200 else None

        await wait_until(served, what="a request served after the others left")


async def test_a_flood_is_answered_in_full_every_request_served_or_shed(
    make_gateway: GatewayFactory,
) -> None:
    """300 requests at once against a bound of 8: each one gets an answer — served, or shed with
    503 — none waits unanswered or fails otherwise, and the gauge never passes the bound."""
    async with make_gateway(TANDEM_GATEWAY__MAX_REQUESTS_IN_FLIGHT="8") as gw:
        _, key = await gw.new_tenant("t")
        replies = await asyncio.gather(*(gw.chat(key, max_tokens=4) for _ in range(300)))
        statuses = [r.status for r in replies]
        assert set(statuses) <= {200, 503}, statuses
        assert 200 in statuses and 503 in statuses
        for reply in replies:
            if reply.status == 503:
                assert_overloaded(reply, 8)
        samples = await gw.metrics()
        assert metric(
            samples, "tandem_gateway_requests_shed_total", reason="in_flight"
        ) == statuses.count(503)
        assert metric(samples, "tandem_gateway_requests_in_progress") == 0


async def test_a_body_that_arrives_too_slowly_is_answered_408_and_frees_its_place(
    make_gateway: GatewayFactory,
) -> None:
    async with make_gateway(
        TANDEM_GATEWAY__BODY_READ_TIMEOUT_S="0.3", TANDEM_GATEWAY__MAX_REQUESTS_IN_FLIGHT="1"
    ) as gw:
        _, key = await gw.new_tenant("t")
        async with trickling(gw, key) as reader:
            answer = await asyncio.wait_for(reader.read(), timeout=30)  # to the close
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert (await gw.chat(key, max_tokens=2)).status == 200  # its place is free
        samples = await gw.metrics()
        assert metric(samples, "tandem_gateway_body_timeouts_total") == 1


async def _raw_exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[bytes, bytes]:
    """Sends *request* on an open connection and reads one answer: its head and its body."""
    writer.write(request)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await asyncio.wait_for(reader.readexactly(length), timeout=30)


async def test_a_shed_request_keeps_its_connection_unless_its_body_is_large(
    make_gateway: GatewayFactory,
) -> None:
    """Shed with 503, a small request's keep-alive connection stays open for the client's retry
    (a flood of shed clients reconnecting would overflow the listen backlog, and dropped SYNs
    cost every new client seconds); a large body is not read, its connection closed."""
    async with make_gateway(TANDEM_GATEWAY__MAX_REQUESTS_IN_FLIGHT="1") as gw:
        _, key = await gw.new_tenant("t")
        url = urlsplit(gw.base_url)

        def chat_request(body: bytes) -> bytes:
            head = (
                f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {url.netloc}\r\n"
                f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            return head.encode() + body

        small = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        large = json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "word " * 20_000}]}
        )
        async with held(gw, key):  # the one place is taken
            await wait_until(lambda: in_progress(gw), what="a request inside the gateway")
            reader, writer = await asyncio.open_connection(url.hostname, url.port)
            try:
                head, body = await _raw_exchange(reader, writer, chat_request(small.encode()))
                assert head.startswith(b"HTTP/1.1 503"), head
                assert b"connection: close" not in head.lower(), head
                assert json.loads(body)["error"]["code"] == "server_overloaded"
                # the same connection serves the next request
                probe = f"GET /healthz HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n".encode()
                head, _ = await _raw_exchange(reader, writer, probe)
                assert head.startswith(b"HTTP/1.1 200"), head

                head, _ = await _raw_exchange(reader, writer, chat_request(large.encode()))
                assert head.startswith(b"HTTP/1.1 503"), head
                assert b"connection: close" in head.lower(), head
                assert await asyncio.wait_for(reader.read(), timeout=30) == b""  # closed
            finally:
                writer.close()
