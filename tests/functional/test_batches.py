"""The Files and Batch API end to end: the official `openai` client → gateway → batch runner →
the real patched SGLang engine on CPU; output and error files, statuses, cancel, expiry,
deadlines, and tenant isolation."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from typing import Any

import openai
import pytest
from sqlalchemy import update

from gateway.batch.app import BATCH_STORE
from gateway.state import DB_ENGINE
from gateway.store.db import session_factory
from gateway.store.models import BatchRow
from tests.functional.engine_fixtures import EngineServer
from tests.functional.gateway_fixtures import GatewayHandle
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
MODEL = "tandem-tiny"
DONE = ("completed", "failed", "expired", "cancelled")


def client(gw: GatewayHandle, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key=key, max_retries=0)


def chat_line(custom_id: str, text: str, max_tokens: int = 6, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            **body,
        },
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def upload(api: openai.AsyncOpenAI, content: bytes) -> str:
    created = await api.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
    return created.id


async def wait_for(
    api: openai.AsyncOpenAI,
    batch_id: str,
    statuses: tuple[str, ...] = DONE,
    timeout_s: float = 180.0,
) -> Any:
    last: list[Any] = [None]

    async def reached() -> Any:
        last[0] = await api.batches.retrieve(batch_id)
        return last[0] if last[0].status in statuses else None

    return await wait_until(
        reached, timeout_s, what=lambda: f"batch {'/'.join(statuses)} (now: {last[0]})"
    )


async def read_lines(api: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await api.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
async def be_tenant(gateway: GatewayHandle) -> tuple[str, str]:
    return await gateway.new_tenant("batch-tenant", "be")


@pytest.fixture(scope="module")
async def other_tenant(gateway: GatewayHandle) -> tuple[str, str]:
    return await gateway.new_tenant("batch-other", "be")


async def test_openai_client_runs_a_batch_to_completion(
    gateway: GatewayHandle, be_tenant: tuple[str, str], engine_server: EngineServer
) -> None:
    api = client(gateway, be_tenant[1])
    prompts = {f"req-{i}": f"Question {i}: name a colour." for i in range(8)}
    file_id = await upload(api, jsonl([chat_line(cid, text) for cid, text in prompts.items()]))
    info = await api.files.retrieve(file_id)
    assert info.purpose == "batch" and info.bytes > 0 and info.filename == "input.jsonl"

    batch = await api.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "colours"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "colours"}
    done = await wait_for(api, batch.id)

    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (
        done.request_counts.total,
        done.request_counts.completed,
        done.request_counts.failed,
    ) == (8, 8, 0)
    assert done.in_progress_at and done.completed_at and done.output_file_id
    assert done.error_file_id is None
    out = await read_lines(api, done.output_file_id)
    assert sorted(line["custom_id"] for line in out) == sorted(prompts)
    for line in out:
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["id"] == f"chatcmpl-{response['request_id']}"
        assert body["usage"]["completion_tokens"] == 6
        assert isinstance(body["choices"][0]["message"]["content"], str)
        # every line ran on the engine as BE
        trace = engine_server.trace_for(response["request_id"])
        assert trace["meta"]["tier"] == "be"
    listed = await api.batches.list()
    assert done.id in [b.id for b in listed.data]


async def test_lines_the_model_cannot_take_go_to_the_error_file(
    gateway: GatewayHandle, be_tenant: tuple[str, str]
) -> None:
    api = client(gateway, be_tenant[1])
    too_long = "word " * 5000  # beyond the tiny model's context
    lines = [
        chat_line("ok-1", "hello"),
        chat_line("too-long", too_long),
        chat_line("ok-2", "hi there"),
    ]
    file_id = await upload(api, jsonl(lines))
    batch = await api.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await wait_for(api, batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    out = await read_lines(api, done.output_file_id)
    errors = await read_lines(api, done.error_file_id)
    assert sorted(line["custom_id"] for line in out) == ["ok-1", "ok-2"]
    assert [line["custom_id"] for line in errors] == ["too-long"]
    error = errors[0]["response"]
    assert error["status_code"] == 400
    assert error["body"]["error"]["code"] == "context_length_exceeded"


async def test_an_invalid_file_fails_validation_naming_each_bad_line(
    gateway: GatewayHandle, be_tenant: tuple[str, str]
) -> None:
    api = client(gateway, be_tenant[1])
    good = chat_line("a", "hi")
    content = (
        b"\n".join(
            [
                json.dumps(good).encode(),
                b"{not json",
                json.dumps(chat_line("a", "again")).encode(),  # duplicate custom_id
                json.dumps({**chat_line("c", "x"), "url": "/v1/embeddings"}).encode(),
                json.dumps(chat_line("d", "x", temperature=9)).encode(),
                json.dumps(chat_line("e", "x", stream=True)).encode(),
            ]
        )
        + b"\n"
    )
    file_id = await upload(api, content)
    batch = await api.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await wait_for(api, batch.id)
    assert done.status == "failed" and done.failed_at
    assert done.errors is not None and done.errors.data is not None
    by_line = {e.line: e for e in done.errors.data}
    assert set(by_line) == {2, 3, 4, 5, 6}
    assert by_line[2].code == "invalid_json"
    assert by_line[3].code == "duplicate_custom_id" and "line 1" in (by_line[3].message or "")
    assert by_line[4].code == "mismatched_url"
    assert by_line[5].param == "body.temperature"
    assert by_line[6].param == "body.stream"
    assert done.output_file_id is None


async def test_create_batch_refuses_bad_requests_naming_the_field(
    gateway: GatewayHandle, be_tenant: tuple[str, str]
) -> None:
    api = client(gateway, be_tenant[1])
    file_id = await upload(api, jsonl([chat_line("a", "hi")]))
    cases = [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "48h"}, "completion_window"),
        ({"completion_window": "soon"}, "completion_window"),
        ({"input_file_id": "file-nope"}, "file_id"),
    ]
    for change, param in cases:
        args = {
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **change,
        }
        with pytest.raises(openai.APIStatusError) as err:
            await api.batches.create(**args)  # type: ignore[arg-type]
        assert err.value.status_code in (400, 404)
        assert isinstance(err.value.body, dict) and err.value.body.get("param") == param


async def test_tenants_see_only_their_own_files_and_batches(
    gateway: GatewayHandle, be_tenant: tuple[str, str], other_tenant: tuple[str, str]
) -> None:
    mine, theirs = client(gateway, be_tenant[1]), client(gateway, other_tenant[1])
    file_id = await upload(mine, jsonl([chat_line("a", "hi")]))
    batch = await mine.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for call in (
        theirs.files.retrieve(file_id),
        theirs.files.content(file_id),
        theirs.files.delete(file_id),
        theirs.batches.retrieve(batch.id),
        theirs.batches.cancel(batch.id),
        theirs.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            await call
    assert file_id not in [f.id for f in (await theirs.files.list()).data]
    assert batch.id not in [b.id for b in (await theirs.batches.list()).data]
    done = await wait_for(mine, batch.id)
    assert done.status == "completed"
    with pytest.raises(openai.NotFoundError):
        await theirs.files.content(done.output_file_id or "")
    # the owner still has everything
    assert (await mine.files.retrieve(file_id)).id == file_id


async def test_cancel_stops_the_batch_and_keeps_what_finished(
    gateway: GatewayHandle, be_tenant: tuple[str, str]
) -> None:
    api = client(gateway, be_tenant[1])
    lines = [chat_line(f"c-{i}", f"story {i}", max_tokens=64) for i in range(40)]
    batch = await api.batches.create(
        input_file_id=await upload(api, jsonl(lines)),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    await wait_for(api, batch.id, ("in_progress", *DONE))
    cancelling = await api.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await wait_for(api, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    out = await read_lines(api, done.output_file_id)
    errors = await read_lines(api, done.error_file_id)
    ids = [line["custom_id"] for line in out + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each exactly once
    assert errors and all(e["error"]["code"] == "batch_cancelled" for e in errors)
    with pytest.raises(openai.APIStatusError) as err:
        await api.batches.cancel(batch.id)
    assert err.value.status_code == 409


async def test_a_batch_past_its_window_expires(
    gateway: GatewayHandle, be_tenant: tuple[str, str]
) -> None:
    api = client(gateway, be_tenant[1])
    lines = [chat_line(f"x-{i}", f"essay {i}", max_tokens=64) for i in range(30)]
    batch = await api.batches.create(
        input_file_id=await upload(api, jsonl(lines)),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    await wait_for(api, batch.id, ("in_progress", *DONE))
    # Fast-forward: the 24 h window ends now.
    sessions = session_factory(gateway.app[DB_ENGINE])
    async with sessions.begin() as session:
        await session.execute(
            update(BatchRow).where(BatchRow.id == batch.id).values(expires_at=BatchRow.created_at)
        )
    done = await wait_for(api, batch.id)
    assert done.status == "expired" and done.expired_at
    out = await read_lines(api, done.output_file_id)
    errors = await read_lines(api, done.error_file_id)
    assert sorted(line["custom_id"] for line in out + errors) == sorted(
        line["custom_id"] for line in lines
    )
    assert errors and all(e["error"]["code"] == "batch_expired" for e in errors)


async def test_a_short_window_is_a_deadline_passed_to_the_engine(
    gateway: GatewayHandle, be_tenant: tuple[str, str], engine_server: EngineServer
) -> None:
    api = client(gateway, be_tenant[1])
    file_id = await upload(api, jsonl([chat_line(f"d-{i}", "hi") for i in range(3)]))
    batch = await api.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="30m"
    )
    created = batch.created_at
    done = await wait_for(api, batch.id)
    assert done.status == "completed"
    assert done.expires_at == created + 1800
    for line in await read_lines(api, done.output_file_id):
        meta = engine_server.trace_for(line["response"]["request_id"])["meta"]
        assert meta["tier"] == "be"
        assert abs(meta["deadline_due_unix_s"] - (created + 1800)) < 5


async def test_file_listing_content_and_delete(
    gateway: GatewayHandle, be_tenant: tuple[str, str]
) -> None:
    api = client(gateway, be_tenant[1])
    content = jsonl([chat_line("z", "hi")])
    file_id = await upload(api, content)
    assert (await api.files.content(file_id)).content == content
    assert file_id in [f.id for f in (await api.files.list(purpose="batch")).data]
    deleted = await api.files.delete(file_id)
    assert deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        await api.files.retrieve(file_id)
    assert gateway.app[BATCH_STORE] is not None


async def test_cli_creates_watches_and_downloads(
    gateway: GatewayHandle, be_tenant: tuple[str, str], tmp_path: Any
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat_line(f"cli-{i}", "hello") for i in range(4)]))
    env = {**os.environ, "TANDEM_API_KEY": be_tenant[1]}

    def tandem(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway", "batch", *args, "--url", gateway.base_url],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    created = await asyncio.to_thread(tandem, "create", str(source), "--watch")
    assert created.returncode == 0, created.stderr
    batch = json.loads(created.stdout)
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 4
    assert "4/4 lines" in created.stderr and "done" in created.stderr  # the progress bar
    out = tmp_path / "out.jsonl"
    got = await asyncio.to_thread(tandem, "results", batch["id"], "--output", str(out))
    assert got.returncode == 0, got.stderr
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == [
        f"cli-{i}" for i in range(4)
    ]
    missing = await asyncio.to_thread(tandem, "get", "batch_nope")
    assert missing.returncode == 1
    assert missing.stderr.startswith("tandem: error: 404")
