"""Request metadata travels from an HTTP client to SGLang's scheduler process, and bad metadata
or an abort never hurts the engine (the real patched engine on CPU)."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import msgspec
import pytest

from common.wire import RequestMeta, meta_to_custom_params
from tests.functional.engine_fixtures import (
    EngineServer,
    get_json,
    post_json,
    stream_events,
)

pytestmark = pytest.mark.slow

NOW = time.time()
METAS = {
    "rt": RequestMeta(
        tier="rt",
        tenant_id="acme",
        length_key="acme/chat",
        arrival_unix_s=NOW,
        ttft_target_ms=250.0,
        tpot_target_ms=40.0,
        max_tokens=6,
    ),
    "be_deadline": RequestMeta(
        tier="be", tenant_id="bulk", length_key="bulk/docs", arrival_unix_s=NOW, deadline_s=3600.0
    ),
    "be": RequestMeta(tier="be", tenant_id="bulk", length_key="bulk/misc", arrival_unix_s=NOW),
    "rt_minimal": RequestMeta(tier="rt", tenant_id="t2", length_key="t2", arrival_unix_s=NOW),
}


def _rid(label: str) -> str:
    return f"test-{label}-{uuid.uuid4().hex}"


def _generate(engine: EngineServer, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """Runs /generate; returns the final response (the last chunk when streaming)."""
    if not stream:
        status, result = post_json(engine.base_url, "/generate", body)
        assert status == 200, result
        return dict(result)
    chunks = list(stream_events(engine.base_url, "/generate", body))
    assert chunks, "the stream sent no chunk"
    return chunks[-1]


@pytest.mark.parametrize(
    ("label", "prompt_kind", "stream"),
    [
        ("rt", "text", False),
        ("be_deadline", "text", True),
        ("be", "input_ids", False),
        ("rt_minimal", "input_ids", True),
    ],
)
def test_metadata_reaches_the_scheduler_intact(
    engine_server: EngineServer, label: str, prompt_kind: str, stream: bool
) -> None:
    meta = METAS[label]
    rid = _rid(label)
    prompt: dict[str, Any] = (
        {"text": "The deadline of this request is soon."}
        if prompt_kind == "text"
        else {"input_ids": [11, 12, 13, 14, 15]}
    )
    body = {
        **prompt,
        "rid": rid,
        "priority": meta.sglang_priority,
        "sampling_params": {
            "max_new_tokens": 4,
            "temperature": 0.0,
            "ignore_eos": True,
            "custom_params": meta_to_custom_params(meta),
        },
    }
    sent_at = time.time()
    final = _generate(engine_server, body, stream)
    assert final["meta_info"]["id"] == rid
    assert final["meta_info"]["completion_tokens"] == 4

    record = engine_server.trace_for(rid)
    # Parsed in a process other than this test and the engine's HTTP process: the scheduler.
    assert record["process"] == "scheduler"
    assert record["pid"] not in (os.getpid(), engine_server.pid)
    assert record["priority"] == meta.sglang_priority
    assert record["error"] is None
    arrived = record["meta"]
    for field in msgspec.structs.fields(RequestMeta):
        assert arrived[field.name] == getattr(meta, field.name), field.name
    assert arrived["ttft_due_unix_s"] == meta.ttft_due_unix_s
    assert arrived["deadline_due_unix_s"] == meta.deadline_due_unix_s
    assert arrived["tpot_target_s"] == (
        None if meta.tpot_target_ms is None else meta.tpot_target_ms / 1000
    )
    assert arrived["sglang_priority"] == meta.sglang_priority
    assert sent_at <= arrived["received_unix_s"] <= time.time()


@pytest.mark.parametrize(
    ("label", "custom_params", "is_malformed"),
    [
        ("absent", None, False),
        ("foreign", {"other_gateway": {"x": 1}}, False),
        ("bad_tier", {"tandem": {"tier": "gold", "tenant_id": "t", "length_key": "t"}}, True),
        ("bad_shape", {"tandem": "rt"}, True),
        (
            "unknown_field",
            {"tandem": {**meta_to_custom_params(METAS["be"])["tandem"], "x": 1}},
            True,
        ),
    ],
)
def test_missing_or_malformed_metadata_is_ignored(
    engine_server: EngineServer,
    label: str,
    custom_params: dict[str, Any] | None,
    is_malformed: bool,
) -> None:
    rid = _rid(label)
    sampling: dict[str, Any] = {"max_new_tokens": 3, "ignore_eos": True}
    if custom_params is not None:
        sampling["custom_params"] = custom_params
    status, result = post_json(
        engine_server.base_url,
        "/generate",
        {"text": "hello", "rid": rid, "sampling_params": sampling},
    )
    assert status == 200, result
    assert result["meta_info"]["completion_tokens"] == 3

    record = engine_server.trace_for(rid)
    assert record["meta"] is None
    assert (record["error"] is not None) == is_malformed
    assert get_json(engine_server.base_url, "/health")[0] == 200


def test_abort_request_ends_a_long_stream(engine_server: EngineServer) -> None:
    rid = _rid("abort")
    body = {
        "text": "Write a very long story.",
        "rid": rid,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
    }
    chunks = []
    for chunk in stream_events(engine_server.base_url, "/generate", body):
        chunks.append(chunk)
        if len(chunks) == 3:  # the request is decoding now: abort it from another connection
            status, _ = post_json(engine_server.base_url, "/abort_request", {"rid": rid})
            assert status == 200
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "abort"
    assert final["completion_tokens"] < 3000
    assert get_json(engine_server.base_url, "/health")[0] == 200
