"""With the engine down, a batch waits instead of failing its lines; limits on uploads. Runs the
Files and Batch API on SQLite and PostgreSQL (no engine needed)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.sockets import free_port
from tests.functional.gateway_fixtures import GatewayHandle, start_gateway
from tests.waiting import wait_until


def line(i: int) -> dict[str, Any]:
    return {
        "custom_id": f"l{i}",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "tandem-tiny", "prompt": f"count to {i}", "max_tokens": 4},
    }


async def upload(gw: GatewayHandle, key: str, content: bytes) -> tuple[int, Any]:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", content, filename="in.jsonl", content_type="application/jsonl")
    async with gw.session.post(
        f"{gw.base_url}/v1/files", data=form, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        return resp.status, await resp.json()


async def call(
    gw: GatewayHandle, key: str, method: str, path: str, body: Any = None
) -> tuple[int, Any]:
    async with gw.session.request(
        method, f"{gw.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        return resp.status, await resp.json()


async def test_engine_down_delays_lines_without_failing_them(
    gateway_without_engine: GatewayHandle,
) -> None:
    gw = gateway_without_engine
    tenant_id, key = await gw.new_tenant("waiting-be", "be")
    content = b"".join(json.dumps(line(i)).encode() + b"\n" for i in range(5))
    status, file = await upload(gw, key, content)
    assert status == 200, file
    status, batch = await call(
        gw,
        key,
        "POST",
        "/v1/batches",
        {"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
    )
    assert status == 200, batch
    batch_id = batch["id"]

    async def batch_in(status: str) -> dict[str, Any] | None:
        _, batch = await call(gw, key, "GET", f"/v1/batches/{batch_id}")
        return batch if batch["status"] == status else None

    await wait_until(lambda: batch_in("in_progress"), timeout_s=10, what="the batch started")

    async def every_line_tried() -> bool:  # each attempt leaves a usage record
        records = await gw.latest_requests(tenant_id, 50)
        tried = [r for r in records if r["status"] == "engine_unavailable"]
        assert all(r["endpoint"] == "batch/completions" for r in tried), tried
        return len(tried) >= 5

    await wait_until(every_line_tried, timeout_s=20, what="every line tried on the closed port")
    status, batch = await call(gw, key, "GET", f"/v1/batches/{batch_id}")
    assert batch["status"] == "in_progress"  # tried and failed, yet nothing failed the batch
    assert batch["request_counts"] == {"total": 5, "completed": 0, "failed": 0}
    status, batch = await call(gw, key, "POST", f"/v1/batches/{batch_id}/cancel")
    assert status == 200 and batch["status"] in ("cancelling", "cancelled")
    batch = await wait_until(lambda: batch_in("cancelled"), timeout_s=10, what="cancelled")
    assert batch["output_file_id"] is None
    async with gw.session.get(
        f"{gw.base_url}/v1/files/{batch['error_file_id']}/content",
        headers={"Authorization": f"Bearer {key}"},
    ) as resp:
        errors = [json.loads(x) for x in (await resp.text()).splitlines()]
    assert sorted(e["custom_id"] for e in errors) == [f"l{i}" for i in range(5)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


@pytest.fixture
async def limited_gateway(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[GatewayHandle]:
    """A gateway (engine down) taking files of at most 1000 bytes and 3 lines."""
    server, handle = await start_gateway(
        f"sqlite:///{tmp_path / 'limits.db'}",
        free_port(),
        tiny_model_dir,
        TANDEM_BATCH__MAX_FILE_BYTES="1000",
        TANDEM_BATCH__MAX_LINES="3",
    )
    yield handle
    await handle.session.close()
    await server.close()


async def test_upload_limits_and_purpose_are_enforced_with_clear_errors(
    limited_gateway: GatewayHandle,
) -> None:
    gw = limited_gateway
    _, key = await gw.new_tenant("uploader", "be")
    status, body = await upload(gw, key, b"x" * 5000)
    assert status == 413 and body["error"]["code"] == "file_too_large"
    assert "1000 bytes" in body["error"]["message"]
    status, body = await upload(gw, key, b"{}\n" * 4)
    assert status == 400 and body["error"]["code"] == "too_many_lines"
    assert "4 lines" in body["error"]["message"] and "at most 3" in body["error"]["message"]
    status, body = await upload(gw, key, b"{}\n" * 3)
    assert status == 200 and body["bytes"] == 9
    status, body = await upload(gw, key, b"")
    assert status == 400 and body["error"]["code"] == "empty_file"
    status, body = await upload(gw, key, b"\xff\xfe\n")
    assert status == 400 and body["error"]["code"] == "invalid_file"
    form = aiohttp.FormData()
    form.add_field("purpose", "fine-tune")
    form.add_field("file", b"{}\n", filename="x.jsonl")
    async with gw.session.post(
        f"{gw.base_url}/v1/files", data=form, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        body = await resp.json()
        assert resp.status == 400 and body["error"]["param"] == "purpose"
    async with gw.session.post(f"{gw.base_url}/v1/files", data=form) as resp:
        assert resp.status == 401
