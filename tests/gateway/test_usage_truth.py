"""Usage says what really happened (issue 17): batch work a gateway restart cut off is neither an
error nor billed twice (its line runs again and is billed once); a client stopping its stream is
a cancel, not an SLO miss; batch usage is counted when each line ran, not when the batch was
submitted. Checked where an operator reads them: the usage report, the records and the
dashboard's data."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.store.db import create_engine, session_factory
from gateway.store.repo import Store
from gateway.store.types import UsageRecord
from tests.gateway.harness import MODEL, Gateway, running_gateway, serve, sim_app
from tests.gateway.test_batches import chat_line, create_batch, jsonl, read_lines, upload, wait_for
from tests.waiting import wait_until

HANG_MAX_TOKENS = 11
"""A line asking for this many tokens hangs on the engine the first time (the gateway is
stopped meanwhile); the other lines ask for 6."""


@dataclass
class HangingOnce:
    """The simulator, except that the first request asking HANG_MAX_TOKENS never answers."""

    hung: int = 0
    _never: asyncio.Event = field(default_factory=asyncio.Event)

    @web.middleware
    async def middleware(self, request: web.Request, handler: web.Handler) -> web.StreamResponse:
        if request.path == "/generate":
            body = json.loads(await request.read())  # cached: the simulator reads it again
            if body["sampling_params"]["max_new_tokens"] == HANG_MAX_TOKENS and not self.hung:
                self.hung += 1
                await self._never.wait()  # cancelled when the gateway drops the connection
        return await handler(request)


async def report(gw: Gateway, tenant_id: str) -> dict[str, Any]:
    """The tenant's one row of today's usage report."""
    reply = await gw.admin("GET", f"/usage?tenant={tenant_id}&group_by=day")
    assert reply.status == 200, reply
    [row] = reply.body["data"]
    return dict(row)


async def test_batch_work_cut_by_a_restart_is_neither_an_error_nor_billed_twice(
    tmp_path: Path, tiny_model_dir: Path, template_db: Path
) -> None:
    engine = HangingOnce()
    app = sim_app()
    app.middlewares.append(engine.middleware)
    lines = [chat_line(f"line-{i}", f"question {i}") for i in range(4)]
    lines[1] = chat_line("cut", "a long story", max_tokens=HANG_MAX_TOKENS)
    async with serve(app) as engine_server:
        port = engine_server.port
        assert port is not None
        # the hung line outlives the stop's drain, which then cuts it
        async with running_gateway(
            tmp_path,
            tiny_model_dir,
            port,
            template_db=template_db,
            TANDEM_GATEWAY__SHUTDOWN_TIMEOUT_S="0.2",
        ) as gw:
            tenant_id, key = await gw.new_tenant("restarted", "be")
            file_id = (await upload(gw, key, jsonl(lines))).body["id"]
            batch_id = (await create_batch(gw, key, file_id)).body["id"]
            await wait_until(lambda: engine.hung == 1, timeout_s=30, what="the line on the engine")
            # the other three lines done first, so that the restart cuts only the hung one (on
            # a busy machine a line still running when the gateway stopped was cut too)
            await gw.records(tenant_id, 3, timeout_s=60)
        async with running_gateway(tmp_path, tiny_model_dir, port) as gw:
            done = await wait_for(gw, key, batch_id)
            assert done["status"] == "completed", done
            out = await read_lines(gw, key, done["output_file_id"])
            billed = [line["response"]["body"]["usage"] for line in out]
            prompt = sum(u["prompt_tokens"] for u in billed)
            completion = sum(u["completion_tokens"] for u in billed)
            records = await gw.records(tenant_id, 5)  # 4 lines, and the cut attempt
            cut = [r for r in records if r["status"] != "ok"]
            assert [(r["status"], r["slo_met"]) for r in cut] == [("interrupted", None)], records
            row = await report(gw, tenant_id)
            assert (row["requests"], row["errors"]) == (4, 0), row
            assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt, completion)
            data = await gw.admin("GET", "/dashboard/data?hours=1")
            usage = [u for u in data.body["usage"] if u["tenant_id"] == tenant_id]
            assert sum(u["prompt_tokens"] for u in usage) == prompt
            assert sum(u["errors"] for u in usage) == 0
            be = [t for t in data.body["tiers"] if t["tier"] == "be"]
            assert sum(t["prompt_tokens"] for t in be) == prompt


async def test_a_client_stopping_its_stream_is_a_cancel_not_an_slo_miss(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("stopper")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 500,
        "stream": True,
    }
    async with gw.session.post(
        f"{gw.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        assert resp.status == 200
        await resp.content.readline()
        resp.connection.transport.abort()  # type: ignore[union-attr]  # the client's stop button
    assert (await gw.chat(key, max_tokens=3)).status == 200
    records = await gw.records(tenant_id, 2)
    by_status = {r["status"]: r for r in records}
    assert set(by_status) == {"ok", "client_disconnected"}, records
    assert by_status["client_disconnected"]["slo_met"] is None
    assert by_status["ok"]["slo_met"] is True
    row = await report(gw, tenant_id)
    assert (row["requests"], row["errors"], row["cancelled"]) == (2, 0, 1), row
    assert (row["slo_judged"], row["slo_attainment"]) == (1, 1.0), row
    assert row["completion_tokens"] >= 3 + 1  # what the stopped stream got is still used


async def test_batch_usage_counts_when_each_line_finished_not_when_it_was_sent(
    gw: Gateway,
) -> None:
    # Lines of one batch, all sent to the engine at once 40 minutes ago (the runner sends up to
    # batch.max_inflight lines together; they wait in the engine's queue behind RT work) and
    # finished one by one since: each counts in the minute it finished, not all in the first.
    tenant_id, _ = await gw.new_tenant("batch-spread", "be")
    now = datetime.now(UTC)
    sent = now - timedelta(minutes=40)
    finishes = [now - timedelta(minutes=m) for m in (30, 20, 10)]
    records = [
        UsageRecord(
            request_id=f"tdm-line{i}",
            tenant_id=tenant_id,
            tier="be",
            model=MODEL,
            endpoint="batch/chat",
            prompt_tokens=10,
            completion_tokens=100 + i,
            status="ok",
            http_status=200,
            created_at=sent,
            finished_at=finished,
        )
        for i, finished in enumerate(finishes)
    ]
    engine = create_engine(gw.database_url)
    try:
        await Store(session_factory(engine)).insert_usage(records)
    finally:
        await engine.dispose()
    data = (await gw.admin("GET", "/dashboard/data?hours=1")).body
    bucket_s = data["bucket_s"]
    usage = {u["t"]: u["completion_tokens"] for u in data["usage"] if u["tenant_id"] == tenant_id}
    want = {int(f.timestamp()) // bucket_s * bucket_s: 100 + i for i, f in enumerate(finishes)}
    assert usage == want
    tiers = {t["t"]: t["completion_tokens"] for t in data["tiers"] if t["tier"] == "be"}
    assert tiers == want
