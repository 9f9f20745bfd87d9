"""Gateway replicas over one PostgreSQL database (issue 18): exactly one runs the batches, and
when it dies another takes over and finishes them, every line exactly once.

* two gateways in this process: one leads (holds the advisory lock), the other does not; the
  leader stops, and the other leads within seconds; stopped mid-batch (gracefully, as SIGTERM
  does), the leader finishes its lines in flight first, and no line runs twice;
* two `tandem serve` processes attached to the session's engine through `engine.endpoints`
  (they launch none): the batch leader is SIGKILLed in the middle of a batch created through the
  other one, which takes over and completes it, every custom_id once.

Measured times (kill → new leader, kill → batch complete) are printed (``-s``).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.sockets import free_port
from gateway.batch.app import BATCH_LEADER
from gateway.batch.leader import LOCK_KEY
from tests.functional.engine_fixtures import EngineServer
from tests.functional.gateway_fixtures import start_gateway
from tests.functional.mid_batch import freeze_with_lines_running
from tests.functional.store_fixtures import PgServer
from tests.gateway.test_batches import chat_line, jsonl
from tests.waiting import wait_until, wait_until_sync

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
ADMIN_TOKEN = "leader-admin-token"
LINES = 30
TAKEOVER_TIMEOUT_S = 60.0
"""How long the other gateway may take to lead (the design: about a second): generous, so a
busy machine does not fail the test."""


async def fetch(url: str, query: str, *args: Any) -> list[asyncpg.Record]:
    """The rows of *query* on the database at *url*, on a connection of its own."""
    conn = await asyncpg.connect(url)
    try:
        return list(await conn.fetch(query, *args))
    finally:
        await conn.close()


async def lock_holders(url: str) -> int:
    """Sessions holding the batch runner's advisory lock, as PostgreSQL sees them."""
    rows = await fetch(
        url,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND ((classid::bigint << 32) | objid::bigint) = $1",
        LOCK_KEY,
    )
    return int(rows[0][0])


async def test_one_gateway_leads_and_another_takes_over_when_it_stops(
    engine_server: EngineServer, pg_server: PgServer
) -> None:
    url = await pg_server.new_database()
    started = [
        await start_gateway(url, engine_server.port, engine_server.model_path) for _ in range(2)
    ]
    try:
        leaders = [h.app[BATCH_LEADER] for _, h in started]
        assert all(leader is not None for leader in leaders)
        assert [leader.is_leader for leader in leaders if leader] == [True, False]
        assert await lock_holders(url) == 1
        first_server, first = started.pop(0)
        await first.session.close()
        await first_server.close()  # the leader stops: it gives the lock up
        other = leaders[1]
        assert other is not None
        await wait_until(lambda: other.is_leader, TAKEOVER_TIMEOUT_S, what="the other leads")
        assert await lock_holders(url) == 1
    finally:
        for server, handle in started:
            await handle.session.close()
            await server.close()


async def item_states(url: str, batch_id: str) -> list[tuple[str, int]]:
    """(status, attempts) of each line of the batch, as committed in SQL, in file order."""
    rows = await fetch(
        url,
        "SELECT status, attempts FROM batch_items WHERE batch_id = $1 ORDER BY line_no",
        batch_id,
    )
    return [(row["status"], int(row["attempts"])) for row in rows]


async def test_a_leader_stopped_gracefully_finishes_its_lines_and_none_runs_twice(
    engine_server: EngineServer, pg_server: PgServer
) -> None:
    """A rolling restart of gateway replicas: the leader, stopped as SIGTERM stops it, starts
    no line, lets the lines in flight finish, then gives the lock up; the other gateway leads
    and runs the rest. No line runs twice (every attempt count is 1)."""
    url = await pg_server.new_database()
    env = {"TANDEM_BATCH__MAX_INFLIGHT": "2", "TANDEM_BATCH__POLL_INTERVAL_S": "0.1"}
    started = [
        await start_gateway(url, engine_server.port, engine_server.model_path, **env)
        for _ in range(2)
    ]
    try:
        (first_server, first), (_, second) = started
        _, key = await first.new_tenant("rolling-be", "be")
        ids = [f"line-{i:02d}" for i in range(8)]
        lines = [chat_line(i, f"story {i}", max_tokens=24, ignore_eos=True) for i in ids]
        batch_id = await create_batch(first, key, jsonl(lines))

        async def lines_running() -> bool:
            return any(status == "running" for status, _ in await item_states(url, batch_id))

        await wait_until(lines_running, 120, what="lines running on the leader")
        started.pop(0)
        await first.session.close()
        await first_server.close()  # the drain: the lines in flight finish first
        stopped = await item_states(url, batch_id)
        assert all(status in ("succeeded", "pending") for status, _ in stopped), stopped
        assert any(status == "succeeded" for status, _ in stopped), stopped

        other = second.app[BATCH_LEADER]
        assert other is not None
        await wait_until(lambda: other.is_leader, TAKEOVER_TIMEOUT_S, what="the other leads")

        async def all_done() -> list[tuple[str, int]] | None:
            states = await item_states(url, batch_id)
            return states if all(status == "succeeded" for status, _ in states) else None

        done = await wait_until(all_done, 300, what="every line done on the other gateway")
        assert [attempts for _, attempts in done] == [1] * len(ids)  # none ran twice
    finally:
        for server, handle in started:
            await handle.session.close()
            await server.close()


async def create_batch(gw: Any, key: str, content: bytes) -> str:
    """Uploads *content* (JSONL) and creates a chat batch through *gw*; the batch id."""
    headers = {"Authorization": f"Bearer {key}"}
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", content, filename="in.jsonl", content_type="application/jsonl")
    async with gw.session.post(f"{gw.base_url}/v1/files", data=form, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        file_id = (await resp.json())["id"]
    body = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    async with gw.session.post(f"{gw.base_url}/v1/batches", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return str((await resp.json())["id"])


class GatewayProcess:
    """`python -m gateway serve` attached to an engine started elsewhere (`engine.endpoints`)."""

    def __init__(self, engine: EngineServer, db_url: str, log: Path) -> None:
        self.port = free_port()
        self.env = {
            **os.environ,
            "TANDEM_ADMIN_TOKEN": ADMIN_TOKEN,
            "TANDEM_DATABASE__URL": db_url,
            "TANDEM_ENGINE__ENDPOINTS": json.dumps([engine.base_url]),
            "TANDEM_MODEL__PATH": str(engine.model_path),
            "TANDEM_GATEWAY__PORT": str(self.port),
            "TANDEM_BATCH__MAX_INFLIGHT": "3",
            "TANDEM_BATCH__POLL_INTERVAL_S": "0.2",
        }
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        proc = self.proc

        def ready() -> bool:
            assert proc.poll() is None, self.log.read_text()[-3000:]
            try:
                return httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until_sync(ready, 120, what=lambda: f"gateway ready: {self.log.read_text()[-3000:]}")

    def leads(self) -> bool:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "tandem_batch_leader":
                    return sample.value == 1.0
        raise AssertionError("no tandem_batch_leader on /metrics")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def admin(self, path: str, body: dict[str, Any] | None = None) -> Any:
        reply = httpx.post(
            f"{self.url}/admin/v1{path}",
            json=body or {},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=30,
        )
        return reply.json()


@pytest.fixture
def two_processes(
    engine_server: EngineServer, pg_server: PgServer, tmp_path: Path
) -> Iterator[tuple[GatewayProcess, GatewayProcess, str]]:
    url = asyncio.run(pg_server.new_database())
    gateways = [GatewayProcess(engine_server, url, tmp_path / f"gateway-{i}.log") for i in range(2)]
    try:
        yield gateways[0], gateways[1], url
    finally:
        for gw in gateways:
            gw.stop()
        for gw in gateways:
            print(f"\n--- {gw.log.name} (tail) ---\n{gw.log.read_text()[-3000:]}")


def test_a_killed_batch_leader_hands_its_batch_over_every_line_once(
    two_processes: tuple[GatewayProcess, GatewayProcess, str],
) -> None:
    leader, other, url = two_processes
    leader.start()  # first: it migrates the database, and leads
    other.start()
    assert leader.leads() and not other.leads()
    tenant = other.admin("/tenants", {"name": "leader-be", "tier": "be"})
    key = other.admin(f"/tenants/{tenant['id']}/keys")["key"]
    lines = [
        {
            "custom_id": f"line-{i:02d}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tandem-tiny",
                "max_tokens": 48,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Tell story number {i}."}],
            },
        }
        for i in range(LINES)
    ]
    content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    # created through the gateway that does not lead: the leader's poll finds it in SQL
    api = openai.OpenAI(base_url=f"{other.url}/v1", api_key=key, max_retries=0)
    file_id = api.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch").id
    batch_id = api.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id

    async def line_counts() -> tuple[int, int]:
        """(lines succeeded, lines running) as committed in SQL."""
        rows = await fetch(
            url,
            "SELECT status, count(*) AS n FROM batch_items WHERE batch_id = $1 GROUP BY status",
            batch_id,
        )
        counts = {row["status"]: int(row["n"]) for row in rows}
        return counts.get("succeeded", 0), counts.get("running", 0)

    assert leader.proc is not None
    in_flight = freeze_with_lines_running(
        leader.proc, lambda: asyncio.run(line_counts()), min_done=4, total=LINES
    )
    killed_at = time.monotonic()
    leader.proc.send_signal(signal.SIGKILL)
    leader.proc.wait(timeout=30)

    wait_until_sync(other.leads, TAKEOVER_TIMEOUT_S, what="the other gateway leads")
    takeover_s = time.monotonic() - killed_at

    def finished() -> Any:
        batch = api.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "expired", "cancelled") else None

    batch = wait_until_sync(finished, 600, what="the batch finished on the other gateway")
    done_s = time.monotonic() - killed_at
    print(
        f"\nleader SIGKILL -> other leads after {takeover_s:.2f} s, batch done after {done_s:.1f} s"
    )
    assert batch.status == "completed"
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (LINES, 0)
    assert batch.output_file_id is not None and batch.error_file_id is None
    out = [json.loads(x) for x in api.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in out) == [line["custom_id"] for line in lines]
    assert all(line["response"]["body"]["usage"]["completion_tokens"] == 48 for line in out)

    async def rerun_lines() -> int:
        rows = await fetch(url, "SELECT count(*) FROM batch_items WHERE attempts > 1")
        return int(rows[0][0])

    # the lines the dead leader had in flight ran once more, and no other line did
    assert asyncio.run(rerun_lines()) == in_flight
