"""Tool calling end to end: the official `openai` client → a gateway serving the tiny model with
a Qwen 2.5 (Hermes) tool template → the real patched SGLang engine on CPU.

The engine's weights are random, so the model never chooses a call by itself (`tool_choice:
auto` is covered on parser input in tests/unit/test_tools.py); a forced call is decoded under
the tool's schema, so its arguments hold whatever the weights. The gateway renders the prompt
and sends token ids, so the session's engine serves the copy's prompts as they are."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import pytest_asyncio

from tests.functional.gateway_fixtures import GatewayHandle, start_gateway
from tests.functional.test_batches import jsonl, read_lines, upload, wait_for
from tests.tool_templates import with_chat_template

pytestmark = pytest.mark.slow
MODEL = "tandem-tiny"
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "tomorrow": {"type": "boolean"},
    },
    "required": ["unit", "tomorrow"],
    "additionalProperties": False,
}  # bounded: random weights cannot fill the output cap with an endless string
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def tool(name: str, **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


def assistant_call(name: str, arguments: str) -> dict[str, Any]:
    """An assistant message that called *name* (as `call_1`)."""
    function = {"name": name, "arguments": arguments}
    call = {"id": "call_1", "type": "function", "function": function}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


TOOLS: list[Any] = [
    tool("get_weather", description="The weather.", parameters=PARAMETERS),
    tool("get_time", parameters=NO_ARGUMENTS),
]
GET_WEATHER: Any = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather like?"}]


@pytest_asyncio.fixture(scope="module")
async def tool_gateway(
    engine_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GatewayHandle]:
    """A gateway whose model directory is the engine's tiny model with a Qwen 2.5 template."""
    workdir = tmp_path_factory.mktemp("tool-gateway")
    model_dir = with_chat_template(Path(engine_server.model_path), workdir / "model")
    server, handle = await start_gateway(
        f"sqlite:///{workdir / 'tandem.db'}", engine_server.port, model_dir
    )
    yield handle
    await handle.session.close()
    await server.close()


@pytest.fixture(scope="module")
async def api(tool_gateway: GatewayHandle) -> openai.AsyncOpenAI:
    _, key = await tool_gateway.new_tenant("tools", "rt", ttft_ms=60_000, tpot_ms=10_000)
    return openai.AsyncOpenAI(base_url=f"{tool_gateway.base_url}/v1", api_key=key, max_retries=0)


async def streamed_calls(
    stream: openai.AsyncStream[Any],
) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """The content, the calls (index → id, name, arguments) and the finish reason of a stream."""
    content, calls, finish = "", {}, None
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += (delta.function and delta.function.name) or ""
                call["arguments"] += (delta.function and delta.function.arguments) or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


async def test_a_named_tool_choice_returns_a_call_following_the_schema_whole_and_streamed(
    api: openai.AsyncOpenAI,
) -> None:
    reply = await api.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=GET_WEATHER,
        max_tokens=40, temperature=0,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", reply
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)

    stream = await api.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=GET_WEATHER,
        max_tokens=40, temperature=0, stream=True,
    )  # fmt: skip
    content, calls, finish = await streamed_calls(stream)
    assert finish == "tool_calls" and not content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", call.function.arguments)  # greedy: the same call as the whole answer
    ]
    assert calls[0]["id"].startswith("call_")


async def test_required_tool_choice_returns_calls_of_the_tools(api: openai.AsyncOpenAI) -> None:
    reply = await api.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", reply
    [call] = choice.message.tool_calls or []
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])


async def test_a_conversation_with_a_call_and_its_result_renders_and_completes(
    api: openai.AsyncOpenAI,
) -> None:
    messages: list[Any] = [
        *MESSAGES,
        assistant_call("get_weather", '{"unit": "celsius", "tomorrow": false}'),
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"},
    ]  # fmt: skip
    reply = await api.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=6, temperature=0
    )
    choice = reply.choices[0]
    # tool_choice auto: random weights make no call, so the answer is content
    assert choice.finish_reason in ("stop", "length") and choice.message.content is not None
    assert reply.usage is not None and reply.usage.prompt_tokens > 100  # the tools were rendered


async def test_an_unknown_tool_choice_is_a_400_naming_it(api: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=2,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )  # fmt: skip
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "tool_choice.function.name"


async def test_a_batch_line_with_a_named_tool_choice_gets_the_same_answer(
    tool_gateway: GatewayHandle, api: openai.AsyncOpenAI
) -> None:
    body = {
        "model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": GET_WEATHER,
        "max_tokens": 40, "temperature": 0,
    }  # fmt: skip
    live = await api.chat.completions.create(**body)
    _, key = await tool_gateway.new_tenant("tools-batch", "be")
    batch_api = openai.AsyncOpenAI(
        base_url=f"{tool_gateway.base_url}/v1", api_key=key, max_retries=0
    )
    line = {"custom_id": "call", "method": "POST", "url": "/v1/chat/completions", "body": body}
    batch = await batch_api.batches.create(
        input_file_id=await upload(batch_api, jsonl([line])),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    done = await wait_for(batch_api, batch.id)
    assert done.status == "completed", done
    [out] = await read_lines(batch_api, done.output_file_id)
    choice = out["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    live_call = (live.choices[0].message.tool_calls or [])[0]
    assert call["function"] == {
        "name": "get_weather",
        "arguments": live_call.function.arguments,  # greedy: the same as the live request's
    }


def test_the_prompt_is_the_one_transformers_renders(tmp_path: Path, engine_server: Any) -> None:
    from transformers import AutoTokenizer

    from gateway.pipeline.prepare import chat_prompt_text, parse_body
    from gateway.tokenizer import ModelTokenizer

    model_dir = with_chat_template(Path(engine_server.model_path), tmp_path / "model")
    arguments = '{"city": "Paris <FR> & co", "unit": "°C"}'
    messages: list[Any] = [
        {"role": "system", "content": "Be brief & <exact>."},
        {"role": "user", "content": "Weather in Paris?"},
        assistant_call("get_weather", arguments),
        {"role": "tool", "tool_call_id": "call_1", "content": "22"},
        {"role": "tool", "tool_call_id": "call_2", "content": "It's <b>sunny</b>"},
    ]  # fmt: skip
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["°C", "°F"]}},
        "required": ["city"],
    }
    tools = [
        tool("get_weather", description="Weather & <more>'s", parameters=parameters),
        tool("get_time", strict=True),
    ]
    raw = json.dumps({"model": MODEL, "messages": messages, "tools": tools}).encode()
    ours = chat_prompt_text(
        parse_body(raw, "chat", MODEL, declares_tools=True),  # type: ignore[arg-type]
        ModelTokenizer(model_dir),
    )
    hf_messages = json.loads(json.dumps(messages))  # transformers takes the arguments decoded
    hf_messages[2]["tool_calls"][0]["function"]["arguments"] = json.loads(arguments)
    theirs = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        hf_messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
