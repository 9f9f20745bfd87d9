"""The Files and Batch API end to end over HTTP: upload → batch → output file with every custom_id
exactly once; validation naming each bad line; refusals naming the field; tenant isolation;
cancel; file listing, content and delete. The fast equivalents of tests/functional/test_batches.py
(which stays: it checks what reaches the real engine's scheduler)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tests.gateway.harness import MODEL, Gateway, Reply
from tests.waiting import wait_until

DONE = ("completed", "failed", "expired", "cancelled")


def chat_line(custom_id: str, text: str, max_tokens: int = 6, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            **body,
        },
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def upload(
    gw: Gateway, key: str, content: bytes, purpose: str = "batch", filename: str = "input.jsonl"
) -> Reply:
    form = aiohttp.FormData()
    form.add_field("purpose", purpose)
    form.add_field("file", content, filename=filename, content_type="application/jsonl")
    return await gw.request("POST", "/v1/files", key=key, data=form)


async def create_batch(gw: Gateway, key: str, file_id: str, **fields: Any) -> Reply:
    body = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        **fields,
    }
    return await gw.request("POST", "/v1/batches", key=key, json_body=body)


async def wait_for(
    gw: Gateway,
    key: str,
    batch_id: str,
    statuses: tuple[str, ...] = DONE,
    timeout_s: float = 30.0,
) -> dict[str, Any]:
    last: dict[str, Any] = {}

    async def reached() -> dict[str, Any] | None:
        reply = await gw.request("GET", f"/v1/batches/{batch_id}", key=key)
        assert reply.status == 200, reply
        last.update(reply.body)
        return reply.body if reply.body["status"] in statuses else None

    return await wait_until(
        reached, timeout_s=timeout_s, what=lambda: f"batch {'/'.join(statuses)} (now: {last})"
    )


async def read_lines(gw: Gateway, key: str, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    async with gw.session.get(
        f"{gw.base_url}/v1/files/{file_id}/content", headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        assert resp.status == 200
        text = await resp.text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def test_a_batch_runs_to_completion_with_every_custom_id_once(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("batch", "be")
    prompts = {f"req-{i}": f"Question {i}: name a colour." for i in range(8)}
    file = await upload(gw, key, jsonl([chat_line(cid, text) for cid, text in prompts.items()]))
    assert file.status == 200, file
    assert file.body["purpose"] == "batch" and file.body["bytes"] > 0
    assert file.body["filename"] == "input.jsonl" and file.body["object"] == "file"

    created = await create_batch(gw, key, file.body["id"], metadata={"job": "colours"})
    assert created.status == 200, created
    batch = created.body
    assert batch["object"] == "batch" and batch["status"] == "validating"
    assert batch["metadata"] == {"job": "colours"}
    assert batch["endpoint"] == "/v1/chat/completions"
    assert batch["input_file_id"] == file.body["id"]

    done = await wait_for(gw, key, batch["id"])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
    assert done["in_progress_at"] and done["completed_at"] and done["output_file_id"]
    assert done["error_file_id"] is None
    out = await read_lines(gw, key, done["output_file_id"])
    assert sorted(line["custom_id"] for line in out) == sorted(prompts)  # each exactly once
    for line in out:
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["usage"]["completion_tokens"] == 6
        assert isinstance(body["choices"][0]["message"]["content"], str)
    listed = await gw.request("GET", "/v1/batches", key=key)
    assert listed.status == 200 and done["id"] in [b["id"] for b in listed.body["data"]]
    # every line ran on the engine as BE, and is in the usage records
    records = await gw.records(tenant_id, 8)
    assert {r["tier"] for r in records} == {"be"}
    assert {r["request_id"] for r in records} == {line["response"]["request_id"] for line in out}


async def test_a_completions_batch(gw: Gateway) -> None:
    _, key = await gw.new_tenant("completions-batch", "be")
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"count to {i}", "max_tokens": 3},
        }
        for i in range(3)
    ]
    file = await upload(gw, key, jsonl(lines))
    batch = await create_batch(gw, key, file.body["id"], endpoint="/v1/completions")
    assert batch.status == 200, batch
    done = await wait_for(gw, key, batch.body["id"])
    assert done["status"] == "completed", done
    out = await read_lines(gw, key, done["output_file_id"])
    assert sorted(line["custom_id"] for line in out) == ["c0", "c1", "c2"]
    assert {line["response"]["body"]["object"] for line in out} == {"text_completion"}


async def test_lines_the_model_cannot_take_go_to_the_error_file(gw: Gateway) -> None:
    _, key = await gw.new_tenant("batch-errors", "be")
    lines = [
        chat_line("ok-1", "hello"),
        chat_line("too-long", "word " * 5000),  # beyond the tiny model's context
        chat_line("ok-2", "hi there"),
    ]
    file = await upload(gw, key, jsonl(lines))
    batch = await create_batch(gw, key, file.body["id"])
    done = await wait_for(gw, key, batch.body["id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    out = await read_lines(gw, key, done["output_file_id"])
    errors = await read_lines(gw, key, done["error_file_id"])
    assert sorted(line["custom_id"] for line in out) == ["ok-1", "ok-2"]
    assert [line["custom_id"] for line in errors] == ["too-long"]
    error = errors[0]["response"]
    assert error["status_code"] == 400
    assert error["body"]["error"]["code"] == "context_length_exceeded"


async def test_a_token_id_beyond_the_vocabulary_goes_to_the_error_file(gw: Gateway) -> None:
    _, key = await gw.new_tenant("batch-vocab", "be")
    lines = [
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": prompt, "max_tokens": 2},
        }
        for custom_id, prompt in [("ok", [1, 2]), ("beyond", [[3, 1_000_000]]), ("text", "hi")]
    ]
    file = await upload(gw, key, jsonl(lines))
    batch = await create_batch(gw, key, file.body["id"], endpoint="/v1/completions")
    done = await wait_for(gw, key, batch.body["id"])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    out = await read_lines(gw, key, done["output_file_id"])
    errors = await read_lines(gw, key, done["error_file_id"])
    assert sorted(line["custom_id"] for line in out) == ["ok", "text"]
    assert [line["custom_id"] for line in errors] == ["beyond"]
    error = errors[0]["response"]
    assert error["status_code"] == 400
    assert error["body"]["error"]["param"] == "prompt[0][1]"


async def test_an_engine_crashing_sampling_value_fails_validation_naming_line_and_field(
    gw: Gateway,
) -> None:
    _, key = await gw.new_tenant("batch-top-k", "be")
    lines = [chat_line("ok", "hi"), chat_line("huge-top-k", "hi", top_k=2**31)]
    file = await upload(gw, key, jsonl(lines))
    batch = await create_batch(gw, key, file.body["id"])
    done = await wait_for(gw, key, batch.body["id"])
    assert done["status"] == "failed", done
    [error] = done["errors"]["data"]
    assert error["line"] == 2 and error["param"] == "body.top_k"
    assert "2147483647" in error["message"]


async def test_an_invalid_file_fails_validation_naming_each_bad_line(gw: Gateway) -> None:
    _, key = await gw.new_tenant("batch-invalid", "be")
    content = (
        b"\n".join(
            [
                json.dumps(chat_line("a", "hi")).encode(),
                b"{not json",
                json.dumps(chat_line("a", "again")).encode(),  # duplicate custom_id
                json.dumps({**chat_line("c", "x"), "url": "/v1/embeddings"}).encode(),
                json.dumps(chat_line("d", "x", temperature=9)).encode(),
                json.dumps(chat_line("e", "x", stream=True)).encode(),
            ]
        )
        + b"\n"
    )
    file = await upload(gw, key, content)
    batch = await create_batch(gw, key, file.body["id"])
    done = await wait_for(gw, key, batch.body["id"])
    assert done["status"] == "failed" and done["failed_at"]
    by_line = {e["line"]: e for e in done["errors"]["data"]}
    assert set(by_line) == {2, 3, 4, 5, 6}
    assert by_line[2]["code"] == "invalid_json"
    assert by_line[3]["code"] == "duplicate_custom_id" and "line 1" in by_line[3]["message"]
    assert by_line[4]["code"] == "mismatched_url"
    assert by_line[5]["param"] == "body.temperature"
    assert by_line[6]["param"] == "body.stream"
    assert done["output_file_id"] is None


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"endpoint": "/v1/embeddings"}, 400, "endpoint"),
        ({"completion_window": "48h"}, 400, "completion_window"),
        ({"completion_window": "soon"}, 400, "completion_window"),
        ({"input_file_id": "file-nope"}, 404, "file_id"),
        ({"input_file_id": 7}, 422, "input_file_id"),
    ],
)
async def test_create_batch_refuses_bad_requests_naming_the_field(
    gw: Gateway, change: dict[str, Any], status: int, param: str
) -> None:
    _, key = await gw.new_tenant("batch-refused", "be")
    file = await upload(gw, key, jsonl([chat_line("a", "hi")]))
    reply = await create_batch(gw, key, file.body["id"], **change)
    assert reply.status == status, reply
    assert reply.error["param"] == param and reply.error["message"]
    assert (await gw.request("GET", "/v1/batches", key=key)).body["data"] == []


async def test_tenants_see_only_their_own_files_and_batches(gw: Gateway) -> None:
    _, mine = await gw.new_tenant("owner", "be")
    _, theirs = await gw.new_tenant("stranger", "be")
    file_id = (await upload(gw, mine, jsonl([chat_line("a", "hi")]))).body["id"]
    batch_id = (await create_batch(gw, mine, file_id)).body["id"]
    for method, path in [
        ("GET", f"/v1/files/{file_id}"),
        ("GET", f"/v1/files/{file_id}/content"),
        ("DELETE", f"/v1/files/{file_id}"),
        ("GET", f"/v1/batches/{batch_id}"),
        ("POST", f"/v1/batches/{batch_id}/cancel"),
    ]:
        reply = await gw.request(method, path, key=theirs)
        assert reply.status == 404, (method, path, reply)
    reply = await create_batch(gw, theirs, file_id)
    assert reply.status == 404
    assert (await gw.request("GET", "/v1/files", key=theirs)).body["data"] == []
    assert (await gw.request("GET", "/v1/batches", key=theirs)).body["data"] == []
    done = await wait_for(gw, mine, batch_id)
    assert done["status"] == "completed"
    output = await gw.request("GET", f"/v1/files/{done['output_file_id']}/content", key=theirs)
    assert output.status == 404
    assert (await gw.request("GET", f"/v1/files/{file_id}", key=mine)).status == 200


async def test_cancel_stops_the_batch_and_keeps_what_finished(gw: Gateway) -> None:
    _, key = await gw.new_tenant("cancel", "be")
    lines = [chat_line(f"c-{i}", f"story {i}", max_tokens=400) for i in range(40)]
    file = await upload(gw, key, jsonl(lines))
    batch = (await create_batch(gw, key, file.body["id"])).body
    await wait_for(gw, key, batch["id"], ("in_progress", *DONE))
    cancelling = await gw.request("POST", f"/v1/batches/{batch['id']}/cancel", key=key)
    assert cancelling.status == 200 and cancelling.body["status"] in ("cancelling", "cancelled")
    done = await wait_for(gw, key, batch["id"])
    assert done["status"] == "cancelled" and done["cancelled_at"]
    out = await read_lines(gw, key, done["output_file_id"])
    errors = await read_lines(gw, key, done["error_file_id"])
    ids = [line["custom_id"] for line in out + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each exactly once
    assert errors and all(e["error"]["code"] == "batch_cancelled" for e in errors)
    again = await gw.request("POST", f"/v1/batches/{batch['id']}/cancel", key=key)
    assert again.status == 409 and again.error["code"] == "batch_not_cancellable"


async def test_the_admin_cancels_any_tenants_batch(gw: Gateway) -> None:
    _, key = await gw.new_tenant("flooder", "be")
    _, other_key = await gw.new_tenant("bystander", "be")
    lines = [chat_line(f"a-{i}", f"story {i}", max_tokens=400) for i in range(40)]
    batch = (await create_batch(gw, key, (await upload(gw, key, jsonl(lines))).body["id"])).body
    await wait_for(gw, key, batch["id"], ("in_progress", *DONE))
    path = f"/admin/v1/batches/{batch['id']}/cancel"
    assert (await gw.request("POST", path)).status == 401
    for tenant_key in (other_key, key):  # a tenant's key is not the admin token, not even its own
        refused = await gw.request("POST", path, key=tenant_key)
        assert refused.status == 401 and refused.error["code"] == "invalid_admin_token"
    cancelling = await gw.request("POST", path, admin=True)
    assert cancelling.status == 200, cancelling
    assert cancelling.body["id"] == batch["id"]
    assert cancelling.body["status"] in ("cancelling", "cancelled")
    done = await wait_for(gw, key, batch["id"])
    assert done["status"] == "cancelled" and done["cancelled_at"]
    out = await read_lines(gw, key, done["output_file_id"])
    errors = await read_lines(gw, key, done["error_file_id"])
    ids = [line["custom_id"] for line in out + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each exactly once
    assert errors and all(e["error"]["code"] == "batch_cancelled" for e in errors)
    again = await gw.request("POST", path, admin=True)
    assert again.status == 409 and again.error["code"] == "batch_not_cancellable"


async def test_the_admin_cancel_of_an_unknown_batch_is_a_404(gw: Gateway) -> None:
    reply = await gw.request("POST", "/admin/v1/batches/batch_nope/cancel", admin=True)
    assert reply.status == 404
    assert reply.body == {
        "error": {
            "message": "No such Batch object: batch_nope",
            "type": "not_found_error",
            "param": "batch_id",
            "code": "batch_not_found",
        }
    }


async def test_file_listing_content_and_delete(gw: Gateway) -> None:
    _, key = await gw.new_tenant("files", "be")
    content = jsonl([chat_line("z", "hi")])
    file_id = (await upload(gw, key, content)).body["id"]
    async with gw.session.get(
        f"{gw.base_url}/v1/files/{file_id}/content", headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        assert resp.status == 200 and await resp.read() == content
    listed = await gw.request("GET", "/v1/files?purpose=batch", key=key)
    assert listed.status == 200 and [f["id"] for f in listed.body["data"]] == [file_id]
    deleted = await gw.request("DELETE", f"/v1/files/{file_id}", key=key)
    assert deleted.status == 200 and deleted.body == {
        "id": file_id,
        "object": "file",
        "deleted": True,
    }
    gone = await gw.request("GET", f"/v1/files/{file_id}", key=key)
    assert gone.status == 404


async def test_upload_refusals_name_the_problem(gw: Gateway) -> None:
    _, key = await gw.new_tenant("uploader", "be")
    reply = await upload(gw, key, b"{}\n", purpose="fine-tune")
    assert reply.status == 400 and reply.error["param"] == "purpose"
    reply = await upload(gw, key, b"")
    assert reply.status == 400 and reply.error["code"] == "empty_file"
    reply = await gw.request("POST", "/v1/files", key=key, json_body={"purpose": "batch"})
    assert reply.status == 400 and "multipart" in reply.error["message"]
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", b"{}\n", filename="x.jsonl")
    assert (await gw.request("POST", "/v1/files", data=form)).status == 401
