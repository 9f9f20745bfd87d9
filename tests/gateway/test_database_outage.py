"""A PostgreSQL outage as clients and the operator see it: while the database is cut off,
requests that need it are answered 503 `database_unavailable` with Retry-After (not 500), the log
says so once instead of once per failure, and when it is back a batch whose lines were in flight
completes with every line exactly once (lines whose outcome could not be written run again,
instead of staying `running` until a restart)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.functional.store_fixtures import PG_HOST, PG_PORT, PgServer
from tests.gateway.harness import Gateway, running_gateway
from tests.gateway.test_batches import chat_line, create_batch, jsonl, read_lines, upload
from tests.waiting import wait_until

pytestmark = pytest.mark.postgres


class TcpProxy:
    """A TCP relay in front of PostgreSQL that the test cuts (every connection dropped, new ones
    refused) and restores, on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._relay, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(PG_HOST, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


@contextlib.asynccontextmanager
async def proxy_to_postgres() -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(PG_PORT)
    await proxy.start()
    try:
        yield proxy
    finally:
        with contextlib.suppress(Exception):
            await proxy.cut()


async def test_an_outage_is_a_503_logged_once_and_the_batch_completes_after_it(
    tmp_path: Path,
    tiny_model_dir: Path,
    sim_port: int,
    pg_server: PgServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    database = (await pg_server.new_database()).rpartition("/")[2]
    async with (
        proxy_to_postgres() as proxy,
        running_gateway(
            tmp_path,
            tiny_model_dir,
            sim_port,
            TANDEM_DATABASE__URL=f"postgresql://postgres@127.0.0.1:{proxy.port}/{database}",
            TANDEM_GATEWAY__AUTH_CACHE_TTL_S="0.05",  # requests need the database at once
            TANDEM_BATCH__MAX_INFLIGHT="8",
        ) as gw,
    ):
        _, rt_key = await gw.new_tenant("rt")
        _, be_key = await gw.new_tenant("batch", "be")
        custom_ids = [f"line-{i}" for i in range(40)]
        lines = [chat_line(cid, f"question {cid}", max_tokens=400) for cid in custom_ids]
        file = await upload(gw, be_key, jsonl(lines))
        batch = await create_batch(gw, be_key, file.body["id"])
        assert batch.status == 200, batch

        async def some_done_and_some_running() -> bool:
            reply = await gw.request("GET", f"/v1/batches/{batch.body['id']}", key=be_key)
            return reply.body["request_counts"]["completed"] >= 4 and await gw.engine_running() > 0

        await wait_until(some_done_and_some_running, timeout_s=60, what="lines in flight")
        caplog.clear()
        caplog.set_level(logging.INFO)
        await proxy.cut()

        # lines on the engine finish during the outage; their results cannot be written
        await wait_until(lambda: _engine_idle(gw), timeout_s=60, what="the engine idle")
        refused = await gw.chat(rt_key, max_tokens=2)
        assert refused.status == 503, refused
        assert refused.error["code"] == "database_unavailable"
        assert int(refused.headers["Retry-After"]) >= 1
        for _ in range(20):
            assert (await gw.chat(rt_key, max_tokens=2)).status == 503
        outage_lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert not [r for r in outage_lines if r.exc_info], [r.getMessage() for r in outage_lines]
        assert len(outage_lines) <= 2, [r.getMessage() for r in outage_lines]

        await proxy.start()  # the database is back

        async def served() -> bool:
            return (await gw.chat(rt_key, max_tokens=2)).status == 200

        await wait_until(served, timeout_s=30, what="requests served again")

        async def completed() -> dict[str, object] | None:
            reply = await gw.request("GET", f"/v1/batches/{batch.body['id']}", key=be_key)
            return reply.body if reply.body["status"] == "completed" else None

        done = await wait_until(completed, timeout_s=120, what="the batch completed")
        output = await read_lines(gw, be_key, done["output_file_id"])  # type: ignore[arg-type]
        assert sorted(line["custom_id"] for line in output) == sorted(custom_ids)
        assert all(line["response"]["status_code"] == 200 for line in output)
        assert done["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
        messages = [r.getMessage() for r in caplog.records]
        assert any("database available again" in m for m in messages), messages


async def _engine_idle(gw: Gateway) -> bool:
    return await gw.engine_running() == 0
