"""Tool calling from the request's side: what `tools` / `tool_choice` / the messages' tool
fields are accepted or refused with (400 naming the field), what the engine is asked for, how a
conversation with calls is rendered, and the answer's OpenAI bodies — whole and streamed alike
(gateway/api/schemas.py, gateway/pipeline/prepare.py, gateway/api/render.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from backend.launch.tiny_model import ensure_tiny_model
from gateway.api.render import ResponseHead, StreamRenderer, completion_body, usage_body
from gateway.api.schemas import ChatCompletionRequest
from gateway.engine.client import EngineChunk, TokenLogprob
from gateway.errors import ApiError
from gateway.pipeline.prepare import build_engine_request, chat_prompt_text, parse_body
from gateway.tokenizer import ModelTokenizer
from gateway.tools import ToolPlan
from tests.tool_templates import with_chat_template
from tests.unit.pipeline_factories import make_principal

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "description": "Now."}},
]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def body(**fields: Any) -> bytes:
    return msgspec.json.encode({"model": "m", "messages": USER, "tools": TOOLS, **fields})


def parse(raw: bytes) -> ChatCompletionRequest:
    parsed = parse_body(raw, "chat", "m", declares_tools=True)
    assert isinstance(parsed, ChatCompletionRequest)
    return parsed


def tool(name: str, parameters: Any = None) -> dict[str, Any]:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": function}


def call(arguments: str) -> dict[str, Any]:
    return {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        ({"tools": [tool("a b")]}, "tools[0].function.name"),
        (
            {"tools": [tool("f", {"type": "string"})]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [tool("f", {"properties": {"x": {"type": "str"}}})]},
            "tools[0].function.parameters.properties.x.type",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {"messages": [*USER, {"role": "tool", "content": "22"}]},
            "messages[1].tool_call_id",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "tool_calls": [call("[1]")]}]},
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)  # fmt: skip
def test_tool_fields_that_cannot_be_honoured_are_a_400_naming_the_field(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as info:
        parse(body(**fields))
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def test_for_a_model_without_tool_template_tools_and_tool_messages_stay_refused() -> None:
    for raw, param in (
        (body(), "tools"),
        (
            msgspec.json.encode(
                {"model": "m", "messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}
            ),
            "messages[0].tool_call_id",
        ),
    ):
        with pytest.raises(ApiError) as info:
            parse_body(raw, "chat", "m", declares_tools=False)
        assert (info.value.code, info.value.param) == ("unsupported_parameter", param)
        assert "declares no tools" in info.value.message


def engine_params(fields: dict[str, Any], family: Any = "hermes") -> tuple[dict[str, Any], Any]:
    request = build_engine_request(
        parse(body(**fields)), [1], 8, make_principal(), "rt", tool_family=family
    )
    return request.payload["sampling_params"], request.tool_plan


def test_a_named_call_is_decoded_under_the_functions_schema() -> None:
    params, plan = engine_params(
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert json.loads(params["json_schema"]) == WEATHER_SCHEMA
    assert plan == ToolPlan("named", family="hermes", function_name="get_weather")


def test_required_calls_are_decoded_under_an_array_of_the_tools() -> None:
    params, plan = engine_params({"tool_choice": "required", "parallel_tool_calls": False})
    schema = json.loads(params["json_schema"])
    names = [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]] and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][1]["properties"]["parameters"]["type"] == "object"
    assert plan == ToolPlan("required", family="hermes", is_parallel=False)


def test_auto_keeps_special_tokens_and_needs_a_known_family() -> None:
    params, plan = engine_params({})
    assert plan == ToolPlan("auto", family="hermes") and "json_schema" not in params
    assert params["skip_special_tokens"] is False  # some families' markers are special tokens
    with pytest.raises(ApiError) as info:
        engine_params({}, family=None)
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "tool_choice")
    params, plan = engine_params({"tool_choice": "required"}, family=None)  # needs no family
    assert plan is not None and "json_schema" in params
    params, plan = engine_params({"tool_choice": "none"})  # rendered, read as plain content
    assert plan is None and "json_schema" not in params and "skip_special_tokens" not in params


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    cache = tmp_path_factory.mktemp("cache")
    return ModelTokenizer(with_chat_template(ensure_tiny_model(cache), cache / "tool-model"))


def test_a_conversation_with_calls_renders_them_as_the_template_says(
    tool_model: ModelTokenizer,
) -> None:
    made = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris <FR>"}'},
    }
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [made]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 degrees"},
    ]  # fmt: skip
    text = chat_prompt_text(parse(body(messages=messages)), tool_model)
    # tojson as Hugging Face's: JSON as is, no HTML escapes
    assert '{"name": "get_weather", "arguments": {"city": "Paris <FR>"}}' in text
    assert (
        '"required": ["city"]' in text and "<tool_response>\n22 degrees\n</tool_response>" in text
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_the_qwen_template_teaches_the_hermes_family(tool_model: ModelTokenizer) -> None:
    assert tool_model.tool_family == "hermes"


HERMES = ToolPlan("auto", family="hermes")
ANSWER = (
    'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def test_a_whole_answer_with_calls() -> None:
    head = ResponseHead("chat", "tdm-x", "m", tool_plan=HERMES)
    choice = completion_body(head, ANSWER, "stop", usage_body(1, 2))["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    plain = completion_body(head, "No call.", "stop", usage_body(1, 2))["choices"][0]
    assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]


def test_a_streamed_answer_gives_the_same_message_as_deltas() -> None:
    render = StreamRenderer(ResponseHead("chat", "tdm-x", "m", tool_plan=HERMES))
    pieces = [ANSWER[i : i + 7] for i in range(0, len(ANSWER), 7)]
    events = []
    for index, piece in enumerate(pieces):
        is_last = index == len(pieces) - 1
        events += render.events(
            EngineChunk(
                text_delta=piece,
                completion_tokens=index + 1,
                prompt_tokens=1,
                finish_reason="stop" if is_last else None,
            )
        )
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    reasons = [e["choices"][0]["finish_reason"] for e in events]
    assert reasons[-1] == "tool_calls" and not any(reasons[:-1])


def test_templates_render_in_hugging_faces_environment(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }}"
        "{% endgeneration %}{% else %}U:{{ m.content }}{% endif %}{% endfor %}"
        "{{ tools | tojson }}{{ strftime_now('%Y') | length }}"
    )
    tiny = ensure_tiny_model(tmp_path / "cache")
    model = ModelTokenizer(with_chat_template(tiny, tmp_path / "model", template))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text = model.render_chat(messages, add_generation_prompt=False, tools=[{"d": "<&>'é"}])
    assert text == 'U:hiA:yo[{"d": "<&>\'é"}]4'  # tojson: no HTML escapes, no \\u escapes


def test_streamed_log_probabilities_all_arrive_while_a_call_is_held() -> None:
    render = StreamRenderer(ResponseHead("chat", "tdm-x", "m", logprobs=True, tool_plan=HERMES))
    pieces = ["<tool_call>", '{"name": "f", ', '"arguments": {}}', "</tool_call>"]
    tokens = []
    for index, piece in enumerate(pieces):
        chunk = EngineChunk(
            text_delta=piece,
            completion_tokens=index + 1,
            prompt_tokens=1,
            finish_reason="stop" if index == len(pieces) - 1 else None,
            logprobs=[TokenLogprob(token=piece, logprob=-0.5)],
        )
        events = render.events(chunk)
        assert events  # the held text's tokens still get their event
        tokens += [t["token"] for e in events for t in e["choices"][0]["logprobs"]["content"]]
    assert tokens == pieces
