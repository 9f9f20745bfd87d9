"""The tool-calling parts of a chat request body, as msgspec Structs, and the checks msgspec's
types cannot express (400 `invalid_value` naming the field). They are honoured only for a model
whose chat template declares tools (gateway/api/schemas.py refuses them otherwise); how the
answer is read for calls is gateway/tools.py."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import msgspec

from gateway.errors import ApiError

FUNCTION_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What OpenAI allows as a function's name."""


class FunctionCall(msgspec.Struct, kw_only=True):
    """The function an assistant message's tool call called."""

    name: str
    arguments: str
    """The arguments as JSON text of an object (OpenAI's form); the template is given them
    decoded (`arguments | tojson` in the templates)."""


class MessageToolCall(msgspec.Struct, kw_only=True):
    """An entry of an assistant message's `tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tool's function: what the model may call."""

    name: str
    """1 to 64 letters, digits, `_` or `-` (OpenAI's rule), unique among the tools."""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON Schema of an object: the arguments (none: no arguments)."""
    strict: bool | None = None
    """Accepted either way: a forced call (`tool_choice` named or required) is decoded under
    the schema's grammar, what `strict: true` promises; a call the model makes on its own
    (`auto`) is not constrained."""

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' JSON Schema (an empty object's when the tool has none)."""
        if self.parameters is None:
            return {"type": "object", "properties": {}}
        return self.parameters


class Tool(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this one."""

    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tools(
    tools: list[Tool] | None, choice: ToolChoice | None, *, has_response_format: bool
) -> None:
    """400 naming the field of *tools* or the tool_choice *choice* that cannot be honoured as
    sent: a bad or repeated function name, parameters that are no object schema, a tool_choice
    without tools or naming none of them, a tool_choice that forces a call together with a
    response_format (*has_response_format*: one other than text)."""
    names: set[str] = set()
    for index, tool in enumerate(tools or []):
        function, param = tool.function, f"tools[{index}].function"
        if not FUNCTION_NAME_PATTERN.match(function.name):
            raise _bad(
                f"{param}.name",
                f"{param}.name must be 1 to 64 letters, digits, _ or -, got {function.name!r}",
            )
        if function.name in names:
            raise _bad(f"{param}.name", f"{param}.name {function.name!r} names two tools")
        names.add(function.name)
        check_parameters_schema(f"{param}.parameters", function.parameters)
    if choice is not None and choice != "none" and not tools:
        raise _bad("tool_choice", "tool_choice needs tools: there is no tool to choose")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise _bad(
            "tool_choice.function.name",
            f"tool_choice.function.name {choice.function.name!r} is none of the tools"
            f" ({', '.join(sorted(names))})",
        )
    forced = isinstance(choice, NamedToolChoice) or choice == "required"
    if forced and has_response_format:
        raise _bad(
            "response_format",
            "response_format cannot go with a tool_choice that forces a call: the answer is the"
            " call's arguments, decoded under the tool's schema",
        )


JSON_SCHEMA_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})


def check_parameters_schema(param: str, schema: dict[str, Any] | None) -> None:
    """400 naming *param* unless *schema* is None or a JSON Schema of an object (the arguments
    of a call are an object): its `type`, when given, must be "object", and its `properties`,
    when given, an object of schemas. The engine compiles the whole schema into a grammar when a
    call is forced and refuses what it cannot (400)."""
    if schema is None:
        return
    kind = schema.get("type", "object")
    if kind != "object":
        raise _bad(
            param,
            f'{param} must be the JSON Schema of an object (type "object"): a call\'s'
            f" arguments are a JSON object, got type {kind!r}",
        )
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(
        isinstance(p, (dict, bool)) for p in properties.values()
    ):
        raise _bad(f"{param}.properties", f"{param}.properties must map names to JSON Schemas")
    for name, prop in properties.items():
        prop_type = prop.get("type") if isinstance(prop, dict) else None
        types = prop_type if isinstance(prop_type, list) else [prop_type]
        if prop_type is not None and not all(t in JSON_SCHEMA_TYPES for t in types):
            raise _bad(
                f"{param}.properties.{name}.type",
                f"{param}.properties.{name}.type must be one of"
                f" {', '.join(sorted(JSON_SCHEMA_TYPES))}, got {prop_type!r}",
            )


def check_message_tool_fields(
    index: int, role: str, tool_calls: list[MessageToolCall] | None, tool_call_id: str | None
) -> None:
    """400 naming the tool field of `messages[index]` (of *role*) that does not fit: calls on a
    message that is not the assistant's, a tool message without its call's id, a call's
    arguments that are not the JSON text of an object."""
    param = f"messages[{index}]"
    if tool_calls and role != "assistant":
        raise _bad(f"{param}.tool_calls", f"{param}.tool_calls belong to assistant messages")
    if role == "tool" and not tool_call_id:
        raise _bad(
            f"{param}.tool_call_id",
            f"{param}.tool_call_id is required: a tool message answers a call by its id",
        )
    for call_index, call in enumerate(tool_calls or []):
        arguments_param = f"{param}.tool_calls[{call_index}].function.arguments"
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise _bad(arguments_param, f"{arguments_param} must be the JSON text of an object")


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")
