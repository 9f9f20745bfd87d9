"""The server keeps the contract /openapi.json states (issue 16): every method a path does not
list is refused with 405 and an `Allow` header naming the ones it does, and bodies the schema
allows are never answered with a 5xx."""

from __future__ import annotations

import time
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import GatewayFactory
from tests.gateway.harness import MODEL, Gateway
from tests.gateway.schema_data import instances, validator
from tests.gateway.test_batches import chat_line, jsonl
from tests.gateway.test_exposure import upload_body

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def concrete(path: str) -> str:
    """*path* with each `{param}` replaced by a made-up id."""
    return "/".join("x_1" if part.startswith("{") else part for part in path.split("/"))


async def test_every_other_method_gets_405_with_allow(gw: Gateway) -> None:
    doc: dict[str, Any] = (await gw.request("GET", "/openapi.json")).body
    checked = 0
    for path, operations in doc["paths"].items():
        documented = {method.upper() for method in operations}
        allowed = documented | ({"HEAD"} if "GET" in documented else set())
        for method in sorted(set(METHODS) - documented):
            reply = await gw.request(method, concrete(path), admin=True)
            assert reply.status == 405, (method, path, reply)
            assert reply.error["code"] == "method_not_allowed"
            allow = reply.headers.get("Allow")
            assert allow is not None, f"{method} {path}: 405 without Allow"
            assert {m.strip() for m in allow.split(",")} == allowed, (method, path, allow)
            checked += 1
    assert checked >= len(doc["paths"])


# What the server refuses beyond the types, one case per constraint: (method, path, body or
# query, the param the refusal names). The document must refuse each too.
_MESSAGES = [{"role": "user", "content": "hi"}]
BodyCase = tuple[str, str, dict[str, Any], str]


def cases(
    method: str, path: str, base: dict[str, Any], refused: list[tuple[dict[str, Any], str]]
) -> list[BodyCase]:
    """(method, path, body, param) for each (fields, param) of *refused*, over *base*."""
    return [(method, path, {**base, **fields}, param) for fields, param in refused]


BODY_CASES: list[BodyCase] = [
    *cases(
        "POST",
        "/v1/chat/completions",
        {"messages": _MESSAGES},
        [
            ({"temperature": 2.5}, "temperature"),
            ({"top_p": 0}, "top_p"),
            ({"n": 2}, "n"),
            ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
            ({"stop": [""]}, "stop"),
            ({"top_k": 0}, "top_k"),
            ({"top_k": 2**31}, "top_k"),
            ({"seed": 2**63, "temperature": 0}, "seed"),
            ({"seed": 7}, "seed"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
            ({"some_client_field": 1}, "some_client_field"),
            ({"top_logprobs": 2}, "top_logprobs"),
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
            (
                {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
                "response_format.json_schema.name",
            ),
            (
                {"stream_options": {"include_obfuscation": True}},
                "stream_options.include_obfuscation",
            ),
            (
                {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]},
                "messages[0].tool_calls",
            ),
            ({"presence_penalty": -3}, "presence_penalty"),
            ({"min_p": 1.5}, "min_p"),
            ({"repetition_penalty": 0}, "repetition_penalty"),
            ({"max_tokens": 0}, "max_tokens"),
            ({"max_completion_tokens": 0}, "max_completion_tokens"),
            ({"min_tokens": -1}, "min_tokens"),
            ({"model": "gpt-4o"}, "model"),
            ({"messages": []}, "messages"),
            (
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                "messages[0].content",
            ),
        ],
    ),
    *cases(
        "POST",
        "/v1/completions",
        {},
        [
            ({"prompt": ""}, "prompt"),
            ({"prompt": []}, "prompt"),
            ({"prompt": ["a", "b"]}, "prompt"),
            ({"prompt": ["a", 1]}, "prompt"),
            ({"prompt": [[1], [2]]}, "prompt"),
            ({"prompt": [1_000_000]}, "prompt[0]"),
            ({"prompt": "hi", "echo": True}, "echo"),
            ({"prompt": "hi", "best_of": 2}, "best_of"),
            ({"prompt": "hi", "logprobs": 6}, "logprobs"),
        ],
    ),
    *cases(
        "POST",
        "/v1/batches",
        {"input_file_id": "file-x"},
        [
            ({"endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
            ({"endpoint": "/v1/completions", "completion_window": "48h"}, "completion_window"),
            ({"endpoint": "/v1/completions", "completion_window": "30s"}, "completion_window"),
            ({"endpoint": "/v1/completions", "completion_window": "soon"}, "completion_window"),
            (
                {
                    "endpoint": "/v1/completions",
                    "completion_window": "24h",
                    "metadata": {str(i): "v" for i in range(17)},
                },
                "metadata",
            ),
            (
                {
                    "endpoint": "/v1/completions",
                    "completion_window": "24h",
                    "metadata": {"k": "v" * 513},
                },
                "metadata",
            ),
        ],
    ),
    *cases(
        "POST",
        "/admin/v1/tenants",
        {},
        [
            ({"name": "", "tier": "be"}, "name"),
            ({"name": "   ", "tier": "be"}, "name"),
            ({"name": "x" * 101, "tier": "be"}, "name"),
            ({"name": "t", "tier": "rt"}, "slo"),
            ({"name": "t", "tier": "rt", "slo": {"ttft_ms": 100}}, "slo"),
            ({"name": "t", "tier": "be", "slo": {"deadline_s": 0}}, "slo.deadline_s"),
            ({"name": "t", "tier": "be", "slo": {"weight": 0}}, "slo.weight"),
            ({"name": "t", "tier": "be", "slo": {"allow_rt": True}}, "slo.allow_rt"),
            (
                {"name": "t", "tier": "be", "slo": {"on_unattainable": "accept"}},
                "slo.on_unattainable",
            ),
            ({"name": "t", "tier": "be", "quota": {"max_concurrent": -1}}, "quota.max_concurrent"),
        ],
    ),
    ("PATCH", "/admin/v1/tenants/{tenant_id}", {"name": "  "}, "name"),
    (
        "PATCH",
        "/admin/v1/tenants/{tenant_id}",
        {"slo": {"ttft_ms": 100, "tpot_ms": 10, "weight": -1}},
        "slo.weight",
    ),
]
QUERY_CASES: list[tuple[str, str, str, Any]] = [
    # (path, parameter, value the server refuses, the same as the schema sees it)
    ("/v1/batches", "limit", "0", 0),
    ("/v1/batches", "limit", "101", 101),
    ("/v1/files", "limit", "0", 0),
    ("/admin/v1/requests", "limit", "1001", 1001),
    ("/admin/v1/usage", "group_by", "week", "week"),
    ("/admin/v1/usage", "format", "xml", "xml"),
    ("/admin/v1/usage", "start", "yesterday", "yesterday"),
    ("/admin/v1/dashboard/data", "hours", "0", 0),
    ("/admin/v1/dashboard/data", "hours", "73", 73),
]


def body_schema(doc: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    """The JSON request body's schema of an operation (none: anything goes)."""
    body = doc["paths"][path][method.lower()].get("requestBody")
    return dict(body["content"]["application/json"]["schema"]) if body else {}


async def test_the_document_refuses_what_the_server_refuses(gw: Gateway) -> None:
    """The schema used to allow every one of these (right types, wrong values); the server
    refuses each with a 4xx naming the field, and now the schema refuses each too."""
    doc: dict[str, Any] = (await gw.request("GET", "/openapi.json")).body
    tenant_id, key = await gw.new_tenant("contract")
    looser = []
    for method, path, body, param in BODY_CASES:
        if path.startswith("/v1/") and path != "/v1/batches":
            body = {"model": MODEL, **body}
        url = path.replace("{tenant_id}", tenant_id)
        reply = await gw.request(
            method,
            url,
            key=None if path.startswith("/admin") else key,
            admin=path.startswith("/admin"),
            json_body=body,
        )
        assert reply.status in (400, 404, 422), (method, path, body, reply)
        assert reply.error["param"] == param, (body, reply)
        if validator(body_schema(doc, method, path), doc).is_valid(body):
            looser.append((method, path, body))
    for path, name, text, value in QUERY_CASES:
        reply = await gw.request(
            "GET", f"{path}?{name}={text}", key=key, admin=path.startswith("/admin")
        )
        assert reply.status == 400, (path, name, reply)
        parameters = doc["paths"][path]["get"].get("parameters", [])
        schema: dict[str, Any] = next((p["schema"] for p in parameters if p["name"] == name), {})
        if validator(schema, doc).is_valid(value):
            looser.append(("GET", path, {name: value}))
    assert not looser, f"the document allows what the server refuses: {looser}"


EXAMPLES_PER_OPERATION = 30
GENERATED = [
    ("POST", "/admin/v1/tenants"),
    ("PATCH", "/admin/v1/tenants/{tenant_id}"),
    ("POST", "/admin/v1/tenants/{tenant_id}/keys"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/batches"),
]


def draw(strategy: st.SearchStrategy[Any], count: int) -> list[Any]:
    """*count* values of *strategy*, the same ones every run (hypothesis, derandomized)."""
    drawn: list[Any] = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(strategy)
    def collect(value: Any) -> None:
        drawn.append(value)

    collect()
    return drawn


async def test_bodies_the_document_allows_never_get_a_5xx(make_gateway: GatewayFactory) -> None:
    """Generated from the document's request schemas (fixed seed, bounded): whatever the server
    answers, it is never a 5xx, and never a 422 (a type the document allows)."""
    async with make_gateway(TANDEM_GATEWAY__DEFAULT_MAX_TOKENS="4") as gw:
        doc: dict[str, Any] = (await gw.request("GET", "/openapi.json")).body
        # a tokens/min quota refuses (400 request_too_large_for_limit, after every check) the
        # bodies asking for thousands of tokens, which would only keep the simulator busy
        _, key = await gw.new_tenant("generated", "be", quota={"tokens_per_min": 600})
        patched_id, _ = await gw.new_tenant("patched")  # the PATCHes and new keys go to it
        upload = await gw.request(
            "POST",
            "/v1/files",
            key=key,
            data=upload_body("input.jsonl", jsonl([chat_line("a", "hi")])),
            headers={"Content-Type": "multipart/form-data; boundary=BOUNDARY"},
        )
        assert upload.status == 200, upload
        seen: dict[int, int] = {}
        for method, path in GENERATED:
            started = time.monotonic()
            schema = body_schema(doc, method, path)
            for body in draw(instances(schema, doc), EXAMPLES_PER_OPERATION):
                if path == "/v1/batches":  # a real file: the batch gets created and runs
                    body["input_file_id"] = upload.body["id"]
                url = path.replace("{tenant_id}", patched_id)
                admin = path.startswith("/admin")
                reply = await gw.request(
                    method, url, key=None if admin else key, admin=admin, json_body=body
                )
                seen[reply.status] = seen.get(reply.status, 0) + 1
                assert reply.status < 500, (method, path, body, reply)
                if method != "PATCH":  # a PATCH is checked against the tenant's current state
                    assert reply.status != 422, (method, path, body, reply)
            print(f"{method} {path}: {time.monotonic() - started:.1f} s")
        print(f"statuses of generated requests: {dict(sorted(seen.items()))}")
