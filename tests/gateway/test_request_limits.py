"""Every value the gateway forwards is checked against the model and the engine's types before the
engine sees it (issue 16: `top_k` ≥ 2³¹ overflows the engine's int32 tensor, a prompt token id
at or beyond the vocabulary indexes past the embedding table — either kills the engine, and every
tenant gets 503). A bad value is a 400 whose `param` names the field and whose message says the
allowed range; the values at the edges of each range still run. The simulator accepts all of
these, so only the gateway's refusal is visible here (tests/functional/test_request_limits.py
sends the crashing ones to the real engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.harness import MODEL, Gateway

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


@pytest.fixture
def vocab_size(tiny_model_dir: Path) -> int:
    """The served model's vocabulary, tokens (its config.json, as the engine reads it)."""
    return int(json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"])


@pytest.mark.parametrize(
    ("fields", "param", "allowed"),
    [
        ({"top_k": 2**31}, "top_k", "2147483647"),
        ({"top_k": 2**63}, "top_k", "2147483647"),
        ({"top_k": 0}, "top_k", "-1"),
        ({"top_k": -2}, "top_k", "-1"),
        ({"max_tokens": 2**31}, "max_tokens", ""),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "1"),
        ({"max_completion_tokens": 2**40}, "max_completion_tokens", ""),
        ({"min_tokens": 2**31}, "min_tokens", "2147483647"),
        ({"min_tokens": -1}, "min_tokens", "0"),
        ({"min_tokens": 3}, "min_tokens", "2"),  # more than the output cap (max_tokens 2)
        ({"seed": 2**63}, "seed", str(INT64_MAX)),
        ({"seed": -(2**63) - 1}, "seed", str(INT64_MIN)),
        ({"n": 2**31}, "n", "1"),
        ({"temperature": 1e308}, "temperature", "2"),
        ({"temperature": -0.5}, "temperature", "0"),
        ({"top_p": 0}, "top_p", "(0"),
        ({"top_p": 1.5}, "top_p", "1"),
        ({"min_p": -0.1}, "min_p", "0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "-2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "(0"),
        ({"repetition_penalty": 2.5}, "repetition_penalty", "2"),
    ],
)
async def test_out_of_range_sampling_is_a_400_naming_the_field_and_its_range(
    gw: Gateway, fields: dict[str, Any], param: str, allowed: str
) -> None:
    tenant_id, key = await gw.new_tenant("limits")
    reply = await gw.request("POST", "/v1/chat/completions", key=key, json_body={**CHAT, **fields})
    assert reply.status == 400, reply
    assert reply.error["param"] == param, reply
    assert reply.error["type"] == "invalid_request_error"
    assert allowed in reply.error["message"], reply
    [record] = await gw.records(tenant_id)
    assert record["http_status"] == 400 and record["status"] != "ok"


async def test_the_same_limits_hold_for_text_completions(gw: Gateway) -> None:
    _, key = await gw.new_tenant("limits-text")
    reply = await gw.completion(key, "hi", max_tokens=2, top_k=2**31)
    assert reply.status == 400 and reply.error["param"] == "top_k", reply


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        ([1, 2, 1_000_000], "prompt[2]"),
        ([[5, 1_000_000]], "prompt[0][1]"),
        ([2**64], "prompt[0]"),
        ([-1], "prompt[0]"),
    ],
)
async def test_a_token_id_outside_the_vocabulary_is_a_400_naming_it(
    gw: Gateway, vocab_size: int, prompt: list[Any], param: str
) -> None:
    _, key = await gw.new_tenant("vocab")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    reply = await gw.request("POST", "/v1/completions", key=key, json_body=body)
    assert reply.status == 400, reply
    assert reply.error["param"] == param, reply
    assert f"[0, {vocab_size - 1}]" in reply.error["message"], reply


async def test_the_first_id_beyond_the_vocabulary_is_refused_the_last_one_in_runs(
    gw: Gateway, vocab_size: int
) -> None:
    _, key = await gw.new_tenant("vocab-edge")
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    beyond = await gw.request(
        "POST", "/v1/completions", key=key, json_body={**body, "prompt": [vocab_size]}
    )
    assert beyond.status == 400 and beyond.error["param"] == "prompt[0]", beyond
    for prompt in ([0, vocab_size - 1], [[0, vocab_size - 1]]):
        reply = await gw.request(
            "POST", "/v1/completions", key=key, json_body={**body, "prompt": prompt}
        )
        assert reply.status == 200, reply
        assert reply.body["usage"]["prompt_tokens"] == 2


async def test_values_at_the_edges_of_every_range_still_run(gw: Gateway) -> None:
    _, key = await gw.new_tenant("edges")
    edges: list[dict[str, Any]] = [
        {"top_k": INT32_MAX, "seed": INT64_MAX, "temperature": 0, "top_p": 1, "min_p": 1},
        {"top_k": INT32_MAX, "temperature": 2, "top_p": 1, "min_p": 1},
        {"top_k": -1, "seed": INT64_MIN, "temperature": 0, "top_p": 1e-6, "min_p": 0},
        {"top_k": 1, "presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 2},
        {"presence_penalty": 2, "frequency_penalty": -2, "repetition_penalty": 1e-6},
        {"min_tokens": 2, "max_completion_tokens": 2},
        {"min_tokens": 0, "n": 1},
    ]
    for fields in edges:
        reply = await gw.request(
            "POST", "/v1/chat/completions", key=key, json_body={**CHAT, **fields}
        )
        assert reply.status == 200, (fields, reply)
