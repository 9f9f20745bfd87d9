"""From an OpenAI request to an engine request: parsing, prompts, output caps, tiers, scheduler
metadata."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from common.wire import PRIORITY_BE, PRIORITY_RT, meta_from_custom_params
from gateway.api.schemas import ChatCompletionRequest, CompletionRequest, check_sampling
from gateway.auth import Principal
from gateway.errors import ApiError
from gateway.pipeline.prepare import (
    build_engine_request,
    output_cap,
    parse_body,
    prepare_prompt,
    resolve_tier,
)
from gateway.store.types import Quota, Slo, Tenant

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def make_tenant(tier: str = "rt", **slo: object) -> Tenant:
    return Tenant(
        id="ten_a",
        name="a",
        tier=tier,
        slo=Slo(**slo),
        quota=Quota(),  # type: ignore[arg-type]
        created_at=NOW,
        updated_at=NOW,
    )


def chat(**fields: object) -> ChatCompletionRequest:
    return msgspec.convert({"model": "m", "messages": [], **fields}, ChatCompletionRequest)


def test_output_cap_defaults_to_the_room_left_up_to_the_configured_default() -> None:
    assert output_cap(chat(), None, 100, 4096, 1024) == 1024
    assert output_cap(chat(), None, 4000, 4096, 1024) == 96
    assert output_cap(chat(), 50, 100, 4096, 1024) == 50


def test_max_tokens_over_the_context_is_a_400_naming_it() -> None:
    with pytest.raises(ApiError) as info:
        output_cap(chat(), 4000, 100, 4096, 1024)
    assert info.value.status == 400 and info.value.param == "max_tokens"
    assert "4096" in info.value.message


def test_prompt_over_the_context_is_a_400() -> None:
    with pytest.raises(ApiError) as info:
        output_cap(chat(), None, 5000, 4096, 1024)
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"


def test_tiers_follow_the_contract() -> None:
    rt = make_tenant("rt", ttft_target_ms=200, tpot_target_ms=50)
    be = make_tenant("be", deadline_s=3600)
    be_upgradable = make_tenant("be", ttft_target_ms=500, tpot_target_ms=100, allow_rt=True)
    assert resolve_tier(rt, None) == "rt"
    assert resolve_tier(rt, "be") == "be"  # asking for a looser tier is always fine
    assert resolve_tier(be, None) == "be"
    assert resolve_tier(be_upgradable, "rt") == "rt"
    with pytest.raises(ApiError) as info:
        resolve_tier(be, "rt")
    assert info.value.status == 403 and info.value.param == "tier"


def test_engine_payload_carries_metadata_priority_and_sampling() -> None:
    tenant = make_tenant("rt", ttft_target_ms=200, tpot_target_ms=50)
    principal = Principal(tenant=tenant, key_id="key_1", key_prefix="p")
    req = build_engine_request(
        chat(temperature=0.0, seed=7, ignore_eos=True, stop="x"),
        [1, 2, 3],
        16,
        principal,
        "rt",
        arrival_unix_s=1000.0,
    )
    payload = req.payload
    assert payload["input_ids"] == [1, 2, 3] and payload["rid"] == req.rid
    assert payload["priority"] == PRIORITY_RT
    params = payload["sampling_params"]
    assert params["max_new_tokens"] == 16 and params["temperature"] == 0.0
    assert params["sampling_seed"] == 7 and params["ignore_eos"] is True
    meta = meta_from_custom_params(params["custom_params"])
    assert meta is not None and meta.tier == "rt" and meta.ttft_target_ms == 200
    assert meta.ttft_due_unix_s == pytest.approx(1000.2)
    assert meta.length_key == tenant.id


def test_be_request_has_no_rt_targets_and_low_priority() -> None:
    principal = Principal(
        tenant=make_tenant("rt", ttft_target_ms=200, tpot_target_ms=50), key_id="k", key_prefix="p"
    )
    req = build_engine_request(chat(), [1], 8, principal, "be")
    assert req.meta.ttft_target_ms is None and req.meta.tpot_target_ms is None
    assert req.payload["priority"] == PRIORITY_BE


def test_rids_are_unique() -> None:
    principal = Principal(
        tenant=make_tenant("rt", ttft_target_ms=1, tpot_target_ms=1), key_id="k", key_prefix="p"
    )
    rids = {build_engine_request(chat(), [1], 1, principal, "rt").rid for _ in range(100)}
    assert len(rids) == 100


def test_parse_refuses_another_model_and_out_of_range_sampling_naming_the_field() -> None:
    raw = b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}'
    with pytest.raises(ApiError) as info:
        parse_body(raw, "chat", "m")
    assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(ApiError) as info:
        parse_body(b'{"model": "m", "prompt": "x", "temperature": 9}', "completions", "m")
    assert info.value.status == 400 and info.value.param == "temperature"
    body = parse_body(b'{"model": "m", "prompt": "x"}', "completions", "m")
    assert isinstance(body, CompletionRequest)


def test_echo_is_refused_for_api_requests_and_batch_lines_alike() -> None:
    body = msgspec.convert({"model": "m", "prompt": [1, 2], "echo": True}, CompletionRequest)
    with pytest.raises(ApiError) as info:
        check_sampling(body)  # what parse_body and a batch line's validation both run
    assert info.value.param == "echo" and info.value.code == "unsupported_parameter"


def test_a_token_id_prompt_gets_the_default_cap_within_the_context() -> None:
    class Tokenizer:
        context_len = 10
        vocab_size = 100

    body = msgspec.convert({"model": "m", "prompt": [1, 2, 3, 4]}, CompletionRequest)
    prompt = prepare_prompt(body, Tokenizer(), 16)  # type: ignore[arg-type]
    assert prompt.input_ids == [1, 2, 3, 4] and prompt.max_tokens == 6


class TinyTokenizer:
    """The tokenizer facts preparing a token-id prompt needs."""

    context_len = 64
    vocab_size = 100
    tool_family = None


def completion(**fields: object) -> CompletionRequest:
    return msgspec.convert({"model": "m", **fields}, CompletionRequest)


@pytest.mark.parametrize(
    ("prompt", "param"),
    [([1, 100], "prompt[1]"), ([[7, 8, 2**40]], "prompt[0][2]"), ([-1], "prompt[0]")],
)
def test_a_token_id_outside_the_vocabulary_is_a_400_naming_it(prompt: object, param: str) -> None:
    with pytest.raises(ApiError) as info:
        prepare_prompt(completion(prompt=prompt), TinyTokenizer(), 16)  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == param
    assert "[0, 99]" in info.value.message


@pytest.mark.parametrize("prompt", [[0, 99], [[0, 99]]])
def test_token_ids_within_the_vocabulary_are_the_prompt(prompt: object) -> None:
    prepared = prepare_prompt(completion(prompt=prompt), TinyTokenizer(), 16)  # type: ignore[arg-type]
    assert prepared.input_ids == [0, 99]


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([[1], [2]], "only one prompt"), ([1, "a"], "not a mix"), ([[]], "empty"), ([], "empty")],
)
def test_prompt_shapes_the_engine_cannot_take_are_refused(prompt: object, message: str) -> None:
    with pytest.raises(ApiError) as info:
        prepare_prompt(completion(prompt=prompt), TinyTokenizer(), 16)  # type: ignore[arg-type]
    assert info.value.param == "prompt" and message in info.value.message


def test_max_completion_tokens_wins_and_is_named_when_it_cannot_fit() -> None:
    tokenizer: Any = _ChatTokenizer()  # the chat template is not what this is about
    body = chat(messages=USER, max_tokens=5, max_completion_tokens=70)
    with pytest.raises(ApiError) as info:
        prepare_prompt(body, tokenizer, 16)
    assert info.value.param == "max_completion_tokens" and "[1, 62]" in info.value.message
    body = chat(messages=USER, max_tokens=5, max_completion_tokens=3)
    assert prepare_prompt(body, tokenizer, 16).max_tokens == 3


def test_min_tokens_beyond_the_output_cap_is_a_400_naming_it() -> None:
    with pytest.raises(ApiError) as info:
        prepare_prompt(completion(prompt=[1], max_tokens=4, min_tokens=5), TinyTokenizer(), 16)  # type: ignore[arg-type]
    assert info.value.param == "min_tokens" and "[0, 4]" in info.value.message
    ok = prepare_prompt(completion(prompt=[1], max_tokens=4, min_tokens=4), TinyTokenizer(), 16)  # type: ignore[arg-type]
    assert ok.max_tokens == 4


USER = [{"role": "user", "content": "x"}]


class _ChatTokenizer(TinyTokenizer):
    def render_chat(
        self, messages: object, *, add_generation_prompt: bool, tools: object = None
    ) -> str:
        return "x"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [1, 2]


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat", {"tool_choice": "auto"}, "tool_choice"),
        ("chat", {"logit_bias": {"5": 1}}, "logit_bias"),
        ("chat", {"store": True}, "store"),
        ("chat", {"some_client_field": 1}, "some_client_field"),
        ("chat", {"seed": 7}, "seed"),
        ("chat", {"seed": 7, "temperature": 0.7}, "seed"),
        ("chat", {"n": 2}, "n"),
        (
            "chat",
            {"stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
        ),
        (
            "chat",
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}]},
            "messages[0].tool_calls",
        ),
        (
            "chat",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x", "cache_control": {}}],
                    }
                ]
            },
            "messages[0].content[0].cache_control",
        ),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("completions", {"top_logprobs": 2}, "top_logprobs"),
        ("completions", {"suffix": "end"}, "suffix"),
        ("completions", {"echo": True}, "echo"),
        ("completions", {"messages": []}, "messages"),
    ],
)
def test_what_the_gateway_does_not_honour_is_refused_naming_the_field(
    endpoint: str, fields: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = {"model": "m"}
    base.update(
        {"messages": [{"role": "user", "content": "x"}]} if endpoint == "chat" else {"prompt": "x"}
    )
    raw = msgspec.json.encode({**base, **fields})
    with pytest.raises(ApiError) as info:
        parse_body(raw, endpoint, "m")  # type: ignore[arg-type]
    assert (info.value.status, info.value.code, info.value.param) == (
        400,
        "unsupported_parameter",
        param,
    ), info.value.message


@pytest.mark.parametrize(
    ("endpoint", "fields"),
    [
        ("chat", {"logprobs": False, "tools": [], "tool_choice": "none", "store": False}),
        ("chat", {"response_format": {"type": "text"}, "top_logprobs": None, "user": "u-1"}),
        ("chat", {"safety_identifier": "s", "prompt_cache_key": "k", "service_tier": "auto"}),
        ("chat", {"seed": 7, "temperature": 0, "stream_options": {"include_obfuscation": False}}),
        ("completions", {"best_of": 1, "suffix": None, "echo": False, "logprobs": None}),
    ],
)
def test_parameters_sent_with_the_value_that_asks_for_nothing_are_accepted(
    endpoint: str, fields: dict[str, Any]
) -> None:
    base: dict[str, Any] = {"model": "m"}
    base.update(
        {"messages": [{"role": "user", "content": "x"}]} if endpoint == "chat" else {"prompt": "x"}
    )
    parse_body(msgspec.json.encode({**base, **fields}), endpoint, "m")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("completions", {"logprobs": 6}, "logprobs"),
        ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
            "response_format.json_schema.name",
        ),
        (
            "chat",
            {"response_format": {"type": "json_object", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
    ],
)
def test_logprobs_and_response_format_out_of_their_range_are_refused_naming_the_field(
    endpoint: str, fields: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = {"model": "m"}
    base.update(
        {"messages": [{"role": "user", "content": "x"}]} if endpoint == "chat" else {"prompt": "x"}
    )
    with pytest.raises(ApiError) as info:
        parse_body(msgspec.json.encode({**base, **fields}), endpoint, "m")  # type: ignore[arg-type]
    assert (info.value.status, info.value.code, info.value.param) == (400, "invalid_value", param)


def test_logprobs_and_a_schema_reach_the_engine_as_sglang_fields() -> None:
    principal = Principal(
        tenant=make_tenant("rt", ttft_target_ms=1, tpot_target_ms=1), key_id="k", key_prefix="p"
    )
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    raw = msgspec.json.encode(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": True,
            "top_logprobs": 3,
            "stop": ["x", "y"],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": schema},
            },
        }
    )
    request = build_engine_request(parse_body(raw, "chat", "m"), [1], 4, principal, "rt")
    payload = request.payload
    assert (payload["return_logprob"], payload["top_logprobs_num"]) == (True, 3)
    assert payload["return_text_in_logprobs"] is True and payload["logprob_start_len"] == -1
    assert request.asks_logprobs
    params = payload["sampling_params"]
    assert params["stop"] == ["x", "y"] and msgspec.json.decode(params["json_schema"]) == schema
    raw = msgspec.json.encode(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_object"},
        }
    )
    plain = build_engine_request(parse_body(raw, "chat", "m"), [1], 4, principal, "rt")
    assert "return_logprob" not in plain.payload and not plain.asks_logprobs
    assert msgspec.json.decode(plain.payload["sampling_params"]["json_schema"]) == {
        "type": "object"
    }
    raw = msgspec.json.encode({"model": "m", "prompt": "x", "logprobs": 0})
    completion = build_engine_request(parse_body(raw, "completions", "m"), [1], 4, principal, "rt")
    assert completion.payload["top_logprobs_num"] == 0 and completion.asks_logprobs


def test_the_refusal_of_tools_says_whether_the_models_template_declares_them() -> None:
    raw = msgspec.json.encode(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        }
    )
    with pytest.raises(ApiError) as info:
        parse_body(raw, "chat", "m", declares_tools=False)
    assert info.value.code == "unsupported_parameter" and info.value.param == "tools"
    assert "declares no tools" in info.value.message
    assert parse_body(raw, "chat", "m", declares_tools=True)  # honoured for a tool template
    legacy = msgspec.json.encode(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}
    )
    with pytest.raises(ApiError) as info:
        parse_body(legacy, "chat", "m", declares_tools=True)
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "functions")
    assert "send the same functions as `tools`" in info.value.message
