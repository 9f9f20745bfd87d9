"""What the gateway relies on in the engine's HTTP API (the real patched engine on CPU)."""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import pytest

from tests.functional.engine_fixtures import (
    EngineServer,
    get_json,
    post_json,
    stream_events,
)

pytestmark = pytest.mark.slow


def test_stream_chunks_are_cumulative(engine_server: EngineServer) -> None:
    body: dict[str, Any] = {
        "text": "Once upon a time",
        "rid": f"test-cumulative-{uuid.uuid4().hex}",
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
    }
    chunks = list(stream_events(engine_server.base_url, "/generate", body))
    ids = [c["output_ids"] for c in chunks]
    # Every chunk repeats everything so far: output_ids (and text) grow, never restart.
    assert [len(x) for x in ids] == sorted(len(x) for x in ids)
    assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(ids))
    assert len(ids[-1]) == 6
    # Text too, up to an incomplete UTF-8 sequence at the end of a chunk (shown as U+FFFD).
    final_text = chunks[-1]["text"]
    assert all(final_text.startswith(c["text"].rstrip("\ufffd")) for c in chunks)
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"] == {"type": "length", "length": 6}
    assert final["completion_tokens"] == 6 and final["prompt_tokens"] > 0
    # The same greedy request without streaming ends in the same tokens.
    status, whole = post_json(
        engine_server.base_url, "/generate", {**body, "rid": body["rid"] + "x"}
    )
    assert status == 200 and whole["output_ids"] == ids[-1]


def test_loads_report_capacity(engine_server: EngineServer) -> None:
    status, body = get_json(engine_server.base_url, "/v1/loads")
    assert status == 200
    (load,) = body["loads"]
    assert load["max_total_num_tokens"] == engine_server.config.max_total_tokens
    assert load["max_running_requests"] == engine_server.config.max_running_requests
    for key in ("num_running_reqs", "num_waiting_reqs", "token_usage"):
        assert key in load


def test_chat_completion_uses_the_tiny_models_template(engine_server: EngineServer) -> None:
    status, body = post_json(
        engine_server.base_url,
        "/v1/chat/completions",
        {
            "model": engine_server.model_name,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 5,
        },
    )
    assert status == 200, body
    assert body["model"] == engine_server.model_name
    # "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n" is more than 5 tokens.
    assert body["usage"]["prompt_tokens"] > 5
    assert body["usage"]["completion_tokens"] <= 5
    assert isinstance(body["choices"][0]["message"]["content"], str)
