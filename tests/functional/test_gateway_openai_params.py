"""The request parameters tandem honours, end to end through the official `openai` client → the
gateway → the real patched SGLang engine on CPU (random weights: the text is noise, but what a
parameter promises about it still holds) — and a 400 `unsupported_parameter` for what it does
not honour (issue 17)."""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema
import openai
import pytest

from tests.functional.gateway_fixtures import GatewayHandle

pytestmark = pytest.mark.slow
MODEL = "tandem-tiny"
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about the weather."}]


@pytest.fixture(scope="module")
async def api(gateway: GatewayHandle) -> openai.AsyncOpenAI:
    _, key = await gateway.new_tenant("params", "rt", ttft_ms=60_000, tpot_ms=10_000)
    return openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0)


async def test_stop_ends_the_answer_before_the_stop_string(api: openai.AsyncOpenAI) -> None:
    # greedy decoding gives the same text twice: a word from the middle of the first answer
    # must end the second one before it
    free = await api.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    stopped = await api.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stop=[stop, "@@"],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop", (text, stop, choice)
    assert stop not in choice.text and text.startswith(choice.text), (text, stop, choice.text)


async def test_the_same_seed_with_greedy_decoding_gives_the_same_text(
    api: openai.AsyncOpenAI,
) -> None:
    answers = [
        (
            await api.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, seed=11
            )
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert answers[0] == answers[1] and answers[0]


async def test_a_seed_with_sampling_is_refused_saying_why(api: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0.8, seed=11
        )
    error = info.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == ("unsupported_parameter", "seed")
    assert "deterministic inference" in error["message"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"logit_bias": {"42": 3}},
        {"extra_body": {"include_stop_str_in_output": True}},
    ],
)
async def test_what_is_not_honoured_is_a_400_unsupported_parameter(
    api: openai.AsyncOpenAI, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kwargs)
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "unsupported_parameter"
    named = next(iter(kwargs.get("extra_body", kwargs)))
    assert error["param"] == named


WHOLE_TEXT = {"ignore_eos": True, "skip_special_tokens": False}
"""Sampling that keeps every generated token in the text. By default the text skips special
tokens while the logprobs list every token, as OpenAI's do (its `<|endoftext|>`): the dummy
weights sample any token, a `<|pad|>` among them (a CI run), and only a text that keeps them
must equal its tokens joined."""


def _check_chat_logprobs(content: list[Any], count: int, top: int) -> None:
    assert len(content) == count
    for entry in content:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == top
        assert all(alt.logprob <= 0 for alt in entry.top_logprobs)
        logprobs = [alt.logprob for alt in entry.top_logprobs]
        assert logprobs == sorted(logprobs, reverse=True)  # most likely first


async def test_chat_logprobs_whole_and_streamed(api: openai.AsyncOpenAI) -> None:
    reply = await api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=3,
        extra_body=WHOLE_TEXT,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    _check_chat_logprobs(choice.logprobs.content, 6, 3)
    assert "".join(e.token for e in choice.logprobs.content) == choice.message.content

    stream = await api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=2,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    streamed, chunks_with_logprobs = [], 0
    async for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                chunks_with_logprobs += 1
                streamed.extend(c.logprobs.content)
    _check_chat_logprobs(streamed, 6, 2)
    assert chunks_with_logprobs >= 2  # per chunk, not one blob at the end


async def test_completion_logprobs_whole_and_streamed(api: openai.AsyncOpenAI) -> None:
    reply = await api.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, logprobs=2,
        extra_body=WHOLE_TEXT,
    )  # fmt: skip
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == 5
    assert logprobs.token_logprobs is not None and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.top_logprobs is not None
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    assert "".join(logprobs.tokens) == reply.choices[0].text
    for i in range(1, 5):
        assert logprobs.text_offset[i] == logprobs.text_offset[i - 1] + len(logprobs.tokens[i - 1])

    tokens: list[str] = []
    offsets: list[int] = []
    async for chunk in await api.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, logprobs=1, stream=True,
        extra_body={"ignore_eos": True},
    ):  # fmt: skip
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.tokens:
                tokens.extend(c.logprobs.tokens)
                offsets.extend(c.logprobs.text_offset or [])
    assert len(tokens) == 5 and offsets[0] == 0
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(5)]


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "sunny": {"type": "boolean"},
        "sky": {"enum": ["blue", "grey", "black"]},
    },
    "required": ["sunny", "sky"],
    "additionalProperties": False,
}


async def test_a_json_schema_answer_validates_against_the_schema(
    api: openai.AsyncOpenAI,
) -> None:
    for _ in range(2):  # sampled: two different draws of noise, both held to the schema
        reply = await api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=40, temperature=1.0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True},
            },
        )  # fmt: skip
        text = reply.choices[0].message.content
        assert text is not None and reply.choices[0].finish_reason == "stop", reply
        jsonschema.validate(json.loads(text), SCHEMA)


async def test_a_json_object_answer_is_a_json_object_when_it_ends(
    api: openai.AsyncOpenAI,
) -> None:
    stream = await api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
        response_format={"type": "json_object"}, stream=True,
    )  # fmt: skip
    text, finish = "", None
    async for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text.startswith("{"), text
    if finish == "stop":  # random weights may fill the whole cap with a long string
        assert isinstance(json.loads(text), dict)


async def test_a_schema_the_engine_cannot_compile_is_a_400(api: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await api.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}},
            },
        )
    error = info.value.body  # the engine's reason, not a 503 "retry later"
    assert isinstance(error, dict) and "grammar" in error["message"], error


async def test_a_batch_line_gets_its_logprobs_and_an_unsupported_one_the_error_file(
    gateway: GatewayHandle,
) -> None:
    from tests.functional.test_batches import chat_line, jsonl, read_lines, upload, wait_for

    _, key = await gateway.new_tenant("params-batch", "be")
    batch_api = openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0)
    lines = [
        chat_line("with-logprobs", "hello", max_tokens=4, logprobs=True, top_logprobs=2),
        chat_line("with-tools", "hello", tools=[{"type": "function", "function": {"name": "f"}}]),
    ]
    batch = await batch_api.batches.create(
        input_file_id=await upload(batch_api, jsonl(lines)),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    done = await wait_for(batch_api, batch.id)
    assert done.status == "completed", done
    [out] = await read_lines(batch_api, done.output_file_id)
    content = out["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    [error] = await read_lines(batch_api, done.error_file_id)
    assert error["custom_id"] == "with-tools"
    assert error["response"]["body"]["error"]["code"] == "unsupported_parameter"
