"""Connections cannot make the gateway unreachable: served as `tandem serve` serves it
(gateway/server.py's runner options and site), a connection that brings no request is closed
after `gateway.idle_timeout_s`, and past `gateway.max_connections` open ones a new connection is
answered 503 and closed at once while the open ones are still served."""

from __future__ import annotations

import asyncio
import json
import shutil
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


async def chat_over(conn: Connection, key: str) -> bytes:
    """One chat request written on the raw connection *conn*; the answer's status line."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ).encode()
    conn[1].write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
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
