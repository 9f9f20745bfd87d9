"""Reading tool calls out of a model's answer (gateway/tools.py): each template family's format,
parallel calls, text before the calls, malformed calls left as content, and the streamed reading
giving the same content and calls as the whole answer's, however the text is split."""

from __future__ import annotations

import json

import pytest

from gateway.tools import (
    ContentDelta,
    ParsedOutput,
    ToolCallDelta,
    ToolPlan,
    ToolStream,
    detect_family,
    parse_output,
    required_schema,
)
from tests.tool_templates import QWEN25_TEMPLATE

HERMES = ToolPlan("auto", family="hermes")
LLAMA = ToolPlan("auto", family="llama3_json")
MISTRAL = ToolPlan("auto", family="mistral")
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def calls_of(parsed: ParsedOutput) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_the_family_is_read_from_the_template() -> None:
    assert detect_family(QWEN25_TEMPLATE) == "hermes"
    assert detect_family("{{ '[TOOL_CALLS] ' + (tool_calls | tojson) }}") == "mistral"
    llama = '<|start_header_id|>ipython<|end_header_id|>{{ \'{"name": "\' }}"parameters"'
    assert detect_family(llama) == "llama3_json"
    assert detect_family("{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}") is None


def test_hermes_calls_with_text_before_them() -> None:
    text = f"Let me look.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" + (
        '{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    parsed = parse_output(HERMES, text)
    assert parsed.content == "Let me look."
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_hermes_call_alone_has_no_content_and_an_unclosed_last_call_counts() -> None:
    parsed = parse_output(HERMES, f"<tool_call>\n{WEATHER}")
    assert parsed.content is None and calls_of(parsed) == [("get_weather", {"city": "Paris"})]


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    plan = ToolPlan("auto", family="hermes", is_parallel=False)
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>"
    assert len(parse_output(plan, text).tool_calls) == 1


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        f"<tool_call>{WEATHER}</tool_call><tool_call>{{</tool_call>",  # one bad call of two
    ],
)
def test_a_malformed_call_leaves_the_whole_answer_as_content(text: str) -> None:
    assert parse_output(HERMES, text) == ParsedOutput(text)


def test_llama3_json_calls_with_and_without_python_tag() -> None:
    plain = parse_output(LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert plain.content is None and calls_of(plain) == [("get_weather", {"city": "Paris"})]
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert calls_of(parse_output(LLAMA, two)) == [("a", {}), ("b", {"x": 1})]


def test_llama3_json_text_or_other_json_is_content() -> None:
    for text in ("The weather is fine.", '{"answer": 42}', '{"name": "a", "parameters": {}} x'):
        assert parse_output(LLAMA, text) == ParsedOutput(text)


def test_mistral_calls_after_text() -> None:
    calls = '[{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": {}}]'
    text = f"Sure. [TOOL_CALLS] {calls}"
    parsed = parse_output(MISTRAL, text)
    assert parsed.content == "Sure." and calls_of(parsed) == [("a", {"q": "x"}), ("b", {})]
    assert parse_output(MISTRAL, "[TOOL_CALLS] [{]") == ParsedOutput("[TOOL_CALLS] [{]")
    # Mistral's templates refuse (raise_exception) call ids that are not 9 letters or digits
    assert all(len(c.id) == 9 and c.id.isalnum() for c in parsed.tool_calls)
    named = parse_output(ToolPlan("named", family="mistral", function_name="f"), "{}")
    assert len(named.tool_calls[0].id) == 9


def test_a_named_call_is_the_whole_answer() -> None:
    parsed = parse_output(ToolPlan("named", function_name="f"), '{"x": 1}')
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("f", '{"x": 1}')]


def test_required_calls_are_a_json_array_under_the_schema() -> None:
    plan = ToolPlan("required")
    parsed = parse_output(
        plan, '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    )
    assert calls_of(parsed) == [("a", {"x": 1}), ("b", {})]
    assert parse_output(plan, '[{"name": "a", "param') == ParsedOutput('[{"name": "a", "param')
    schema = json.loads(required_schema([("a", {"type": "object"})], is_parallel=False))
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["a"]}


def stream(plan: ToolPlan, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], bool]:
    """The content and (name, arguments) calls a stream of *pieces* sends, and whether it says it
    sent calls; checks the delta protocol on the way (a call's first delta names it)."""
    reader = ToolStream(plan)
    deltas = [d for piece in pieces for d in reader.feed(piece)] + reader.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if isinstance(delta, ToolCallDelta):
            if delta.index not in calls:
                assert delta.id and delta.name
                calls[delta.index] = [delta.name, ""]
            else:
                assert delta.id is None
            calls[delta.index][1] += delta.arguments
    return content or None, [(n, a) for n, a in calls.values()], reader.has_tool_calls


ANSWERS = [
    (
        HERMES,
        f"Let me look.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{WEATHER}</tool_call>",
    ),
    (HERMES, f"  <tool_call>{WEATHER}</tool_call>"),
    (HERMES, "Plain answer with a < sign and <tool_ but no call.\n"),
    (HERMES, "<tool_call>{broken</tool_call>"),
    (ToolPlan("auto", family="hermes", is_parallel=False), f"<tool_call>{WEATHER}</tool_call>" * 2),
    (
        LLAMA,
        '<|python_tag|>{"name": "a", "parameters": {"x": "}"}}; {"name": "b", "parameters": {}}',
    ),
    (LLAMA, "  <|pyth not a tag"),
    (LLAMA, "Hello {there}"),
    (MISTRAL, 'Hi [TOOL_CALLS] [{"name": "a", "arguments": {"q": "[TOOL"}}]'),
    (MISTRAL, "[TOOL_CALLS oops"),
    (ToolPlan("named", function_name="f"), '{"x": [1, 2]}'),
    (ToolPlan("required"), '[{"name": "a", "parameters": {}}]'),
    (ToolPlan("required"), '[{"name": "a", "par'),
]


@pytest.mark.parametrize(("plan", "text"), ANSWERS)
def test_streaming_split_anywhere_gives_the_whole_answers_content_and_calls(
    plan: ToolPlan, text: str
) -> None:
    whole = parse_output(plan, text)
    expected = (whole.content, [(c.name, c.arguments) for c in whole.tool_calls])
    for split in range(len(text) + 1):
        for pieces in ([text[:split], text[split:]], [text[:split], *text[split:]]):
            content, calls, has_calls = stream(plan, pieces)
            assert (content, calls) == expected, (split, pieces)
            assert has_calls == bool(calls)


def test_content_streams_before_the_answer_ends() -> None:
    reader = ToolStream(HERMES)
    assert reader.feed("Hello there ") == [ContentDelta("Hello there")]
    assert reader.feed("<tool") == []  # may be a marker's start: held
    assert reader.feed("box>") == [ContentDelta(" <toolbox>")]


def test_a_named_calls_arguments_stream_as_they_come() -> None:
    reader = ToolStream(ToolPlan("named", function_name="f"))
    first = reader.feed('{"x"')
    assert isinstance(first[0], ToolCallDelta) and first[0].name == "f"
    assert first[1] == ToolCallDelta(0, '{"x"')
    assert reader.feed(": 1}") == [ToolCallDelta(0, ": 1}")]
    assert reader.finish() == []
