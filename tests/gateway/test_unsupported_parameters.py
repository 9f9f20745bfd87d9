"""What the gateway does not honour is refused, never ignored (issue 17): a 400
`unsupported_parameter` naming the field, for a live request (streamed or not) and a batch line
alike — the line goes to the error file with the same error while the rest of the batch runs."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.harness import Gateway
from tests.gateway.test_batches import chat_line, create_batch, jsonl, read_lines, upload, wait_for

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": TOOLS}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logit_bias": {"12": 5}}, "logit_bias"),
        ({"seed": 1}, "seed"),
        ({"n": 3}, "n"),
        ({"a_field_nobody_knows": True}, "a_field_nobody_knows"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ],
)
async def test_a_chat_parameter_tandem_does_not_honour_is_a_400_naming_it(
    gw: Gateway, fields: dict[str, Any], param: str
) -> None:
    _, key = await gw.new_tenant("refusals")
    for stream in (False, True):
        reply = await gw.chat(key, max_tokens=2, stream=stream, **fields)
        assert reply.status == 400, reply
        assert reply.error["code"] == "unsupported_parameter", reply
        assert reply.error["param"] == param
        assert param in reply.error["message"]


async def test_tools_are_refused_saying_why(gw: Gateway) -> None:
    _, key = await gw.new_tenant("no-tools")
    reply = await gw.chat(key, tools=TOOLS)
    assert reply.status == 400
    assert "chat template declares no tools" in reply.error["message"]


async def test_a_completions_parameter_tandem_does_not_honour_is_a_400_naming_it(
    gw: Gateway,
) -> None:
    _, key = await gw.new_tenant("refusals-completions")
    for fields, param in (({"best_of": 2}, "best_of"), ({"suffix": "}"}, "suffix")):
        reply = await gw.completion(key, max_tokens=2, **fields)
        assert reply.status == 400, reply
        assert (reply.error["code"], reply.error["param"]) == ("unsupported_parameter", param)


async def test_parameters_that_ask_for_nothing_run(gw: Gateway) -> None:
    _, key = await gw.new_tenant("no-op-values")
    reply = await gw.chat(
        key,
        max_tokens=2,
        tools=[],
        tool_choice="none",
        store=False,
        user="end-user-1",
        seed=3,
        temperature=0,
    )
    assert reply.status == 200, reply
    reply = await gw.completion(key, max_tokens=2, best_of=1, echo=False)
    assert reply.status == 200, reply


async def test_a_batch_line_with_an_unsupported_parameter_goes_to_the_error_file(
    gw: Gateway,
) -> None:
    _, key = await gw.new_tenant("batch-refusals", "be")
    lines = [
        chat_line("ok-1", "hello"),
        chat_line("with-tools", "hello", tools=TOOLS),
        chat_line("unknown", "hello", frobnicate=1),
        chat_line("ok-2", "hi there"),
    ]
    file = await upload(gw, key, jsonl(lines))
    batch = await create_batch(gw, key, file.body["id"])
    assert batch.status == 200, batch
    done = await wait_for(gw, key, batch.body["id"])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    out = await read_lines(gw, key, done["output_file_id"])
    assert sorted(line["custom_id"] for line in out) == ["ok-1", "ok-2"]
    errors = {
        line["custom_id"]: line["response"]
        for line in await read_lines(gw, key, done["error_file_id"])
    }
    assert set(errors) == {"with-tools", "unknown"}
    for custom_id, param in (("with-tools", "tools"), ("unknown", "frobnicate")):
        assert errors[custom_id]["status_code"] == 400
        error = errors[custom_id]["body"]["error"]
        assert (error["code"], error["param"]) == ("unsupported_parameter", param)


@pytest.mark.parametrize(
    ("fields", "what"),
    [
        ({"logprobs": True}, "log probabilities"),
        ({"stop": ["x"]}, "stop strings"),
        ({"response_format": {"type": "json_object"}}, "grammar-constrained output"),
    ],
)
async def test_the_simulator_refuses_what_its_fake_text_cannot_honour(
    gw: Gateway, fields: dict[str, Any], what: str
) -> None:
    # the gateway honours these on a real engine (tests/functional/test_gateway_openai_params.py);
    # the simulator's fake words cannot, so it says so rather than answering as if it had
    _, key = await gw.new_tenant("sim-limits")
    reply = await gw.chat(key, max_tokens=2, **fields)
    assert reply.status == 400, reply
    assert what in reply.error["message"], reply.error
