"""A real PostgreSQL restart under load (not a cut TCP relay, as in test_database_outage.py): the
server terminates every backend ("terminating connection due to administrator command"), is
down for a moment, and comes back with new backends. Requests during it are answered 200 or
503 `database_unavailable`, never another 5xx; afterwards every request is served again on
fresh pooled connections, and a batch running across the restart completes with every line
exactly once.

The server is a private cluster the test makes (initdb as the `postgres` user, on a free port,
its socket in its own folder), so restarting it touches no other test's database.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.harness import running_gateway
from tests.gateway.test_batches import chat_line, create_batch, jsonl, read_lines, upload
from tests.waiting import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

_PG_BIN_CANDIDATES = ("/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin")


class PrivatePostgres:
    """A PostgreSQL cluster of this test's own (see the module docstring)."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder = folder
        self.port = port
        self._bin = next((Path(b) for b in _PG_BIN_CANDIDATES if Path(b, "pg_ctl").exists()), None)
        if self._bin is None:
            self._bin = Path(shutil.which("pg_ctl") or "pg_ctl").parent

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _as_postgres(self, *argv: str) -> None:
        command = ["runuser", "-u", "postgres", "--", str(self._bin / argv[0]), *argv[1:]]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.stdout}")

    def _pg_ctl(self, action: str, *extra: str) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1"
        data = str(self.folder / "data")
        self._as_postgres("pg_ctl", action, "-D", data, "-w", "-t", "60", "-o", options, *extra)

    def init_and_start(self) -> None:
        data = str(self.folder / "data")
        self._as_postgres("initdb", "-D", data, "-A", "trust", "-U", "postgres")
        self._pg_ctl("start", "-l", str(self.folder / "server.log"))

    def restart(self) -> None:
        """`pg_ctl restart -m fast`: every backend is terminated, then the server starts again."""
        self._pg_ctl("restart", "-m", "fast", "-l", str(self.folder / "server.log"))

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._pg_ctl("stop", "-m", "immediate")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    folder = Path(tempfile.mkdtemp(prefix="tandem-pg-"))
    shutil.chown(folder, "postgres", "postgres")
    os.chmod(folder, 0o700)
    server = PrivatePostgres(folder, _free_port())
    try:
        server.init_and_start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


async def test_a_postgres_restart_mid_load_loses_nothing(
    tmp_path: Path, tiny_model_dir: Path, sim_port: int, private_postgres: PrivatePostgres
) -> None:
    async with running_gateway(
        tmp_path,
        tiny_model_dir,
        sim_port,
        TANDEM_DATABASE__URL=private_postgres.url,
        TANDEM_GATEWAY__AUTH_CACHE_TTL_S="0.05",  # requests need the database at once
        TANDEM_BATCH__MAX_INFLIGHT="8",
    ) as gw:
        _, rt_key = await gw.new_tenant("rt")
        _, be_key = await gw.new_tenant("batch", "be")
        custom_ids = [f"line-{i}" for i in range(40)]
        lines = [chat_line(cid, f"question {cid}", max_tokens=200) for cid in custom_ids]
        file = await upload(gw, be_key, jsonl(lines))
        batch = await create_batch(gw, be_key, file.body["id"])
        assert batch.status == 200, batch

        async def some_done() -> bool:
            reply = await gw.request("GET", f"/v1/batches/{batch.body['id']}", key=be_key)
            return reply.body["request_counts"]["completed"] >= 4

        await wait_until(some_done, timeout_s=60, what="batch lines done before the restart")

        statuses: Counter[int] = Counter()
        codes: Counter[str] = Counter()
        restarting = True

        async def chat_meanwhile() -> None:
            while restarting:
                reply = await gw.chat(rt_key, max_tokens=2)
                statuses[reply.status] += 1
                if reply.status != 200:
                    codes[str(reply.error.get("code"))] += 1
                await asyncio.sleep(0.02)

        chatter = asyncio.create_task(chat_meanwhile())
        try:
            await asyncio.to_thread(private_postgres.restart)
        finally:
            restarting = False
            await chatter
        assert set(statuses) <= {200, 503}, (statuses, codes)
        assert set(codes) <= {"database_unavailable"}, codes

        async def served() -> bool:
            return (await gw.chat(rt_key, max_tokens=2)).status == 200

        await wait_until(served, timeout_s=30, what="requests served again after the restart")
        after = [await gw.chat(rt_key, max_tokens=2) for _ in range(10)]
        assert [r.status for r in after] == [200] * 10  # no stale pooled connection fails one

        async def completed() -> dict[str, object] | None:
            reply = await gw.request("GET", f"/v1/batches/{batch.body['id']}", key=be_key)
            return reply.body if reply.body["status"] == "completed" else None

        done = await wait_until(completed, timeout_s=120, what="the batch completed")
        output = await read_lines(gw, be_key, done["output_file_id"])  # type: ignore[arg-type]
        assert sorted(line["custom_id"] for line in output) == sorted(custom_ids)
        assert done["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
