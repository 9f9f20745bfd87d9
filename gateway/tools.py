"""Tool calling: which tool-call format a chat template teaches, what decoding a request's
`tool_choice` needs, and the tool calls read back out of the model's answer — whole or streamed.

Pure: plain data in, plain data out (no aiohttp, no engine); gateway/pipeline/prepare.py builds
the `ToolPlan` of a request and gateway/api/render.py turns the parsed output into OpenAI bodies.

How a request's tools are honoured (`ToolPlan.mode`):

=========  ================================================================================
auto       the model decides; its answer is parsed with its template's family's format
           (`ToolFamily`): text before the first call is the message's content, a call that
           does not parse leaves the whole answer as plain content (never an error)
named      `tool_choice: {"type": "function", ...}`: the engine decodes under the function's
           parameters schema, so the whole answer is that call's arguments
required   the engine decodes a JSON array of `{"name": ..., "parameters": ...}` objects, one
           of the tools each (`required_schema`)
=========  ================================================================================

`tool_choice: none` (or no tools) has no plan: the tools are still rendered into the prompt, the
answer is plain content.

Streaming (`ToolStream`) gives the same content and calls as parsing the whole answer
(`parse_output`): content is sent as it comes except the text that could be the start of a
call's marker (and whitespace before it); from a marker on, the answer is held until it ends and
then parsed whole, because one malformed call turns the whole answer back into content. A named
call's arguments stream as they are generated.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

ToolFamily = Literal["hermes", "llama3_json", "mistral"]
"""The tool-call formats tandem parses:

* hermes (Hermes 2 Pro, Qwen 2.5 / 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  once per call, after any text;
* llama3_json (Llama 3.1 / 3.2 / 3.3): the answer is `{"name": ..., "parameters": {...}}`
  (calls separated by `;`), optionally after `<|python_tag|>`;
* mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` after any text.
"""
TOOL_FAMILIES: tuple[ToolFamily, ...] = ("hermes", "llama3_json", "mistral")

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
MISTRAL_START = "[TOOL_CALLS]"
LLAMA_PYTHON_TAG = "<|python_tag|>"


def detect_family(template: str) -> ToolFamily | None:
    """The tool-call format a chat template teaches its model (from the markers it renders past
    tool calls with), or None when it is none tandem parses."""
    if HERMES_START in template:
        return "hermes"
    if MISTRAL_START in template:
        return "mistral"
    if LLAMA_PYTHON_TAG in template or (
        "<|start_header_id|>" in template and '"parameters"' in template
    ):
        return "llama3_json"
    return None


@dataclass(frozen=True)
class ToolPlan:
    """How one request's answer is read for tool calls."""

    mode: Literal["auto", "named", "required"]
    family: ToolFamily | None = None
    """The served model's call format: parsed in mode auto (which needs one); in every mode it
    shapes the call ids (`new_call_id`)."""
    function_name: str | None = None
    """The function of mode named."""
    is_parallel: bool = True
    """Whether the answer may hold several calls (`parallel_tool_calls`); without, only the
    first call is kept (auto) or the engine decodes exactly one (required)."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made."""

    id: str
    """Unique per call (`new_call_id`)."""
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's `function.arguments`)."""

    def body(self) -> dict[str, Any]:
        """OpenAI's `tool_calls[]` entry of a whole message."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedOutput:
    """A whole answer read for tool calls."""

    content: str | None
    """The text that is not a call (None: there is none)."""
    tool_calls: list[ToolCall] = field(default_factory=list)


MISTRAL_CALL_ID_CHARS = 9
"""Mistral's chat templates refuse a conversation whose call ids are not 9 letters or digits
(`raise_exception`), so a client that sends the calls back gets a 400 unless its ids are."""


def new_call_id(family: ToolFamily | None = None) -> str:
    """A fresh tool call id: `call_` and 24 hex digits, or 9 letters and digits for the
    mistral family (its templates accept no other)."""
    if family == "mistral":
        return uuid.uuid4().hex[:MISTRAL_CALL_ID_CHARS]
    return f"call_{uuid.uuid4().hex[:24]}"


def _with_ids(calls: list[ToolCall], family: ToolFamily | None) -> list[ToolCall]:
    return [replace(call, id=new_call_id(family)) for call in calls]


# ------------------------------------------------------------------------- forced decoding


def required_schema(tools: list[tuple[str, dict[str, Any]]], *, is_parallel: bool) -> str:
    """The JSON Schema (as text) the engine decodes `tool_choice: required` under: an array of
    one or more calls (exactly one without *is_parallel*), each `{"name": <a tool's name>,
    "parameters": <its schema>}`. *tools*: (name, parameters schema) of each tool."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in tools
    ]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not is_parallel:
        array["maxItems"] = 1
    return json.dumps(array, ensure_ascii=False)


# ------------------------------------------------------------------------- whole answers


def parse_output(plan: ToolPlan, text: str) -> ParsedOutput:
    """The content and tool calls of a whole answer *text* under *plan*."""
    if plan.mode == "named":
        assert plan.function_name is not None
        call = ToolCall(new_call_id(plan.family), plan.function_name, text)
        return ParsedOutput(None, [call])
    if plan.mode == "required":
        calls = _parse_call_list(text, ("parameters", "arguments"))
    else:
        assert plan.family is not None
        before, calls = _PARSERS[plan.family](text)
        if calls is not None:
            if not plan.is_parallel:
                calls = calls[:1]
            return ParsedOutput(before.rstrip() or None, _with_ids(calls, plan.family))
    if calls is None:
        return ParsedOutput(text)
    return ParsedOutput(None, _with_ids(calls, plan.family))


def _call_from(obj: object, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded `{"name": ..., "arguments"|"parameters": {...}}` (None when it is
    not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments: object = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    # the id is given once the whole answer parsed (`_with_ids`)
    return ToolCall("", obj["name"], json.dumps(arguments, ensure_ascii=False))


def _parse_call_list(text: str, argument_keys: tuple[str, ...]) -> list[ToolCall] | None:
    """Calls from a JSON array (or one object) of calls; None unless every element is one."""
    try:
        decoded = json.loads(text)
    except ValueError:
        return None
    items = decoded if isinstance(decoded, list) else [decoded]
    calls = [_call_from(item, argument_keys) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


_HERMES_CALL = re.compile(
    re.escape(HERMES_START) + r"(.*?)(?:" + re.escape(HERMES_END) + r"|\Z)", re.DOTALL
)


def _parse_hermes(text: str) -> tuple[str, list[ToolCall] | None]:
    start = text.find(HERMES_START)
    if start < 0:
        return text, None
    calls: list[ToolCall] = []
    for match in _HERMES_CALL.finditer(text, start):
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            return text, None
        call = _call_from(obj, ("arguments", "parameters"))
        if call is None:
            return text, None
        calls.append(call)
    return text[:start], calls


def _parse_mistral(text: str) -> tuple[str, list[ToolCall] | None]:
    start = text.find(MISTRAL_START)
    if start < 0:
        return text, None
    calls = _parse_call_list(text[start + len(MISTRAL_START) :], ("arguments", "parameters"))
    return text[:start], calls


_JSON = json.JSONDecoder()


def _parse_llama3_json(text: str) -> tuple[str, list[ToolCall] | None]:
    body = text.lstrip()
    if body.startswith(LLAMA_PYTHON_TAG):
        body = body[len(LLAMA_PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return text, None
    calls: list[ToolCall] = []
    position = 0
    while position < len(body):
        try:
            obj, position = _JSON.raw_decode(body, position)
        except ValueError:
            return text, None
        call = _call_from(obj, ("parameters", "arguments"))
        if call is None:
            return text, None
        calls.append(call)
        # calls are separated by ";" (Llama 3.2's prompt asks for it) or whitespace
        rest = body[position:].lstrip()
        rest = rest[1:].lstrip() if rest.startswith(";") else rest
        position = len(body) - len(rest)
    return "", calls


_PARSERS = {"hermes": _parse_hermes, "mistral": _parse_mistral, "llama3_json": _parse_llama3_json}


# ------------------------------------------------------------------------- streamed answers


@dataclass(frozen=True)
class ContentDelta:
    """Text of the message's content."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the call at *index*: its first piece names it (id, name), the rest carry
    arguments text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def body(self) -> dict[str, Any]:
        """OpenAI's `delta.tool_calls[]` entry."""
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


StreamDelta = ContentDelta | ToolCallDelta


class ToolStream:
    """Reads an answer for tool calls as it streams: `feed` each text delta, then `finish`;
    together they give the content and calls `parse_output` gives for the whole text."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._held = ""
        """Text not yet sent: a possible marker start (auto), or everything after a marker."""
        self._in_call = False
        """Auto: a marker was seen, the rest is held until the end. Required: always."""
        self._started_named = False
        self._sent_any_content = False
        self.has_tool_calls = False
        """Whether any call was sent (the finish reason is then "tool_calls")."""

    def feed(self, text: str) -> list[StreamDelta]:
        """The deltas that *text*, the next piece of the answer, lets out."""
        if not text:
            return []
        if self.plan.mode == "named":
            return self._named(text)
        self._held += text
        if self.plan.mode == "required" or self._in_call:
            return []
        return self._scan()

    def finish(self) -> list[StreamDelta]:
        """The deltas the end of the answer lets out (the held text, parsed)."""
        if self.plan.mode == "named":
            return [] if self._started_named else self._named("")
        held, self._held = self._held, ""
        if not held:
            return []
        if self.plan.mode == "required":
            parsed = parse_output(self.plan, held)
        elif self._in_call:
            assert self.plan.family is not None
            before, calls = _PARSERS[self.plan.family](held)
            if calls is not None and not self.plan.is_parallel:
                calls = calls[:1]
            parsed = (
                ParsedOutput(before, _with_ids(calls, self.plan.family))
                if calls is not None
                else ParsedOutput(held)
            )
        else:
            parsed = ParsedOutput(held)
        if not parsed.tool_calls:
            return self._content(parsed.content or "")
        # what came before the marker was sent already, but for whitespace held before it
        out: list[StreamDelta] = []
        for index, call in enumerate(parsed.tool_calls):
            out.append(ToolCallDelta(index, "", id=call.id, name=call.name))
            out.append(ToolCallDelta(index, call.arguments))
        self.has_tool_calls = True
        return out

    def _named(self, text: str) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        if not self._started_named:
            assert self.plan.function_name is not None
            self._started_named = self.has_tool_calls = True
            call_id = new_call_id(self.plan.family)
            out.append(ToolCallDelta(0, "", id=call_id, name=self.plan.function_name))
        if text:
            out.append(ToolCallDelta(0, text))
        return out

    def _content(self, text: str) -> list[StreamDelta]:
        if not text:
            return []
        self._sent_any_content = True
        return [ContentDelta(text)]

    def _scan(self) -> list[StreamDelta]:
        """Auto mode before any marker: send what cannot be part of one."""
        assert self.plan.family is not None
        held = self._held
        if self.plan.family == "llama3_json":
            # a call is the whole answer: it can only start the answer
            body = held.lstrip()
            if self._sent_any_content:
                self._held = ""
                return self._content(held)
            if not body:
                return []
            if body.startswith("{") or body.startswith(LLAMA_PYTHON_TAG):
                self._in_call = True
                return []
            if LLAMA_PYTHON_TAG.startswith(body):
                return []
            self._held = ""
            return self._content(held)
        marker = HERMES_START if self.plan.family == "hermes" else MISTRAL_START
        found = held.find(marker)
        if found >= 0:
            self._in_call = True
            sendable, self._held = _split_trailing_space(held[:found])
            self._held += held[found:]
            return self._content(sendable)
        keep = _marker_prefix_len(held, marker)
        sendable, pending = _split_trailing_space(held[: len(held) - keep])
        self._held = pending + held[len(held) - keep :]
        return self._content(sendable)


def _marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest end of *text* that is a proper start of *marker*."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _split_trailing_space(text: str) -> tuple[str, str]:
    """*text* as (all but its trailing whitespace, the trailing whitespace)."""
    stripped = text.rstrip()
    return stripped, text[len(stripped) :]
