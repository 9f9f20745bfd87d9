"""Connections cannot make the gateway unreachable: served as `tandem serve` serves it
(gateway/server.py's runner options and site), a connection that brings no request is closed
after `gateway.idle_timeout_s`, past `gateway.max_connections` open ones a new connection is
answered 503 and closed at once while the open ones are still served, and a request that
waited longer than `gateway.max_queue_wait_s` for a gateway behind its clients is answered 503
at once (health probes excepted) instead of being served seconds late."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from aiohttp import web

from common.config import load_config
from gateway.app import create_app
from gateway.server import GuardedSite, runner_options
from tests.gateway.harness import ADMIN_TOKEN, FAST_BACKGROUND, MODEL, Gateway, metric
from tests.waiting import wait_until

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@asynccontextmanager
async def served_like_tandem_serve(
    tmp_path: Path, model_dir: Path, engine_port: int, template_db: Path, **env: str
) -> AsyncIterator[Gateway]:
    """The gateway app behind the runner and site `tandem serve` uses (tandem/serve.py), on a
    port the OS picks, in front of the simulator; *env* are ``TANDEM_*`` overrides."""
    db_path = tmp_path / "tandem.db"
    shutil.copyfile(template_db, db_path)
    environ = {
        "TANDEM_DATABASE__URL": f"sqlite:///{db_path}",
        "TANDEM_ENGINE__KIND": "sim",
        "TANDEM_ENGINE__LAUNCH": "false",
        "TANDEM_ENGINE__PORT": str(engine_port),
        **FAST_BACKGROUND,
        **env,
    }
    app = create_app(load_config(environ=environ), ADMIN_TOKEN, model_dir)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, **runner_options(app))
    await runner.setup()
    try:
        site = GuardedSite(runner, "127.0.0.1", 0)
        await site.start()
        async with aiohttp.ClientSession() as session:
            yield Gateway(
                base_url=f"http://127.0.0.1:{site.port}",
                engine_url=f"http://127.0.0.1:{engine_port}",
                session=session,
                database_url=environ["TANDEM_DATABASE__URL"],
            )
    finally:
        await runner.cleanup()


async def open_idle(gw: Gateway, count: int) -> list[Connection]:
    """*count* connections that send nothing."""
    port = int(gw.base_url.rsplit(":", 1)[1])
    return [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]


async def closed_by_server(conn: Connection, timeout_s: float) -> bytes | None:
    """What the server sent before closing *conn* (None: still open after *timeout_s*)."""
    try:
        return await asyncio.wait_for(conn[0].read(), timeout_s)
    except TimeoutError:
        return None


def close_all(conns: list[Connection]) -> None:
    for _, writer in conns:
        writer.transport.abort()


def _chat_request(key: str) -> bytes:
    """A whole chat request (2 tokens), as raw HTTP/1.1 bytes."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


async def chat_over(conn: Connection, key: str) -> bytes:
    """One chat request written on the raw connection *conn*; the answer's status line."""
    conn[1].write(_chat_request(key))
    return await asyncio.wait_for(conn[0].readline(), 30)


async def test_idle_connections_are_closed_after_the_idle_timeout_and_clients_are_served(
    tmp_path: Path, tiny_model_dir: Path, sim_port: int, template_db: Path
) -> None:
    async with served_like_tandem_serve(
        tmp_path, tiny_model_dir, sim_port, template_db, TANDEM_GATEWAY__IDLE_TIMEOUT_S="0.5"
    ) as gw:
        _, key = await gw.new_tenant("t")
        idle = await open_idle(gw, 200)
        # a connection that sends half a request head is no better than a silent one
        port = int(gw.base_url.rsplit(":", 1)[1])
        trickle = await asyncio.open_connection("127.0.0.1", port)
        trickle[1].write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")
        try:
            assert (await gw.chat(key, max_tokens=2)).status == 200  # a real client meanwhile
            for conn in [*idle, trickle]:  # each one closed by the gateway, none answered
                assert await closed_by_server(conn, timeout_s=30) == b""
            assert (await gw.chat(key, max_tokens=2)).status == 200
        finally:
            close_all([*idle, trickle])


async def test_past_the_connection_cap_new_connections_are_refused_and_open_ones_served(
    tmp_path: Path, tiny_model_dir: Path, sim_port: int, template_db: Path
) -> None:
    async with served_like_tandem_serve(
        tmp_path, tiny_model_dir, sim_port, template_db, TANDEM_GATEWAY__MAX_CONNECTIONS="20"
    ) as gw:
        _, key = await gw.new_tenant("t")  # (the client's pooled connection is one of the 20)
        await gw.session.close()  # frees it: the raw connections below are all there is
        idle = await open_idle(gw, 20)
        try:
            extra = (await open_idle(gw, 1))[0]
            answer = await closed_by_server(extra, timeout_s=30)  # answered and closed at once
            assert answer is not None and answer.startswith(b"HTTP/1.1 503 "), answer
            assert b"Retry-After: 1\r\n" in answer
            error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
            assert error["code"] == "too_many_connections"
            assert "20 connections open" in error["message"]
            # the open ones are served
            assert (await chat_over(idle[0], key)).startswith(b"HTTP/1.1 200 ")
            assert (await chat_over(idle[1], key)).startswith(b"HTTP/1.1 200 ")
            close_all(idle[10:])
        finally:
            close_all(idle[:10])

        async with aiohttp.ClientSession() as session:  # room again
            gw.session = session

            async def served() -> bool:
                try:
                    return (await gw.chat(key, max_tokens=2)).status == 200
                except aiohttp.ClientError:
                    return False

            await wait_until(served, what="a new connection served once others closed")
            samples = await gw.metrics()
            refused = metric(samples, "tandem_gateway_connections_refused_total")
            assert refused is not None and refused >= 1


def _read_answer(sock: socket.socket) -> bytes:
    """One whole HTTP answer with a Content-Length body (blocking; a thread's)."""
    sock.settimeout(30)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _hold_the_loop_while(send: threading.Thread, hold_s: float) -> None:
    """The gateway (in this loop) falls behind: nothing of it runs while *send* writes its
    requests from another thread and for *hold_s* after, as when its core is taken."""
    send.start()
    send.join()
    time.sleep(hold_s)


async def test_requests_that_waited_too_long_to_be_read_are_shed_and_probes_still_answered(
    tmp_path: Path, tiny_model_dir: Path, sim_port: int, template_db: Path
) -> None:
    async with served_like_tandem_serve(
        tmp_path, tiny_model_dir, sim_port, template_db, TANDEM_GATEWAY__MAX_QUEUE_WAIT_S="0.3"
    ) as gw:
        _, key = await gw.new_tenant("t")
        port = int(gw.base_url.rsplit(":", 1)[1])
        # a keep-alive connection served once, whose next request will find the gateway behind
        kept = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port))
        kept.sendall(_chat_request(key))
        assert (await asyncio.to_thread(_read_answer, kept)).startswith(b"HTTP/1.1 200 ")
        sent: dict[str, socket.socket] = {}

        def send() -> None:
            for name, request in (
                ("new", _chat_request(key)),
                ("probe", b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n"),
                ("scrape", b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n"),
            ):
                sent[name] = socket.create_connection(("127.0.0.1", port))  # in the listen queue
                sent[name].sendall(request)
            kept.sendall(_chat_request(key))
            sent["kept"] = kept

        _hold_the_loop_while(threading.Thread(target=send), hold_s=1.0)
        try:
            answers = {
                name: await asyncio.to_thread(_read_answer, sock) for name, sock in sent.items()
            }
        finally:
            for sock in sent.values():
                sock.close()
        for name in ("new", "kept"):  # a new connection and a keep-alive one: shed, not served
            answer = answers[name]
            assert answer.startswith(b"HTTP/1.1 503 "), (name, answer)
            assert b"Retry-After: 1\r\n" in answer, (name, answer)
            error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
            assert error["code"] == "server_overloaded", (name, error)
            assert "gateway.max_queue_wait_s" in error["message"], (name, error)
        assert answers["probe"].startswith(b"HTTP/1.1 200 "), answers["probe"]
        assert answers["scrape"].startswith(b"HTTP/1.1 200 "), answers["scrape"][:200]

        # on time again: served
        assert (await gw.chat(key, max_tokens=2)).status == 200
        samples = await gw.metrics()
        assert metric(samples, "tandem_gateway_connections_shed_total") == 1
        assert metric(samples, "tandem_gateway_requests_shed_total", reason="queue_wait") == 1
        assert metric(samples, "tandem_gateway_requests_shed_total", reason="in_flight") == 0


async def test_a_request_served_after_waiting_to_be_read_counts_the_wait_in_its_latency(
    tmp_path: Path, tiny_model_dir: Path, sim_port: int, template_db: Path
) -> None:
    """Under the bound, the late request is served, and its TTFT (the usage record's, the SLO
    admission's clock) starts when it reached the host, not when the gateway got to it."""
    async with served_like_tandem_serve(
        tmp_path, tiny_model_dir, sim_port, template_db, TANDEM_GATEWAY__MAX_QUEUE_WAIT_S="30"
    ) as gw:
        tenant_id, key = await gw.new_tenant("t")
        port = int(gw.base_url.rsplit(":", 1)[1])
        sent: list[socket.socket] = []

        def send() -> None:
            sent.append(socket.create_connection(("127.0.0.1", port)))
            sent[0].sendall(_chat_request(key))

        _hold_the_loop_while(threading.Thread(target=send), hold_s=0.6)
        try:
            answer = await asyncio.to_thread(_read_answer, sent[0])
        finally:
            sent[0].close()
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        [record] = await gw.records(tenant_id)
        assert record["ttft_ms"] >= 550 and record["e2e_ms"] >= 550, record
