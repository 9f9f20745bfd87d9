"""Request bodies of the OpenAI-compatible API, as msgspec Structs.

Decoding a body validates every known field's type in one pass (a wrong type is a 422 naming the
field). Range checks that msgspec cannot express live in `check_sampling`.

Nothing a body asks for is ignored (issue 17): `check_parameters` refuses, before the types are
checked, every field the gateway does not honour — a known OpenAI parameter tandem does not
implement (`REFUSED`) as much as a name it does not know — with 400 `unsupported_parameter`
naming the field; OpenAI itself answers an unknown parameter with a 400. A refused parameter sent
with the value that asks for nothing (`store: false`, `tools: []`, `best_of: 1`) is accepted:
it asks for what every answer does. The few fields accepted although they change nothing
(`NO_OP`) are those whose OpenAI meaning is a hint to the provider, not a promise about the
answer. docs/API.md has the table of all three.

Every value the gateway forwards is range-checked here or in gateway/pipeline/prepare.py before
the engine sees it: SGLang checks some values itself (and answers 400), but others it takes on
trust, and one of those kills its scheduler for every tenant — `top_k` ≥ 2³¹ overflows the int32
tensor it is copied into, a prompt token id beyond the vocabulary indexes past the embedding
table (issue 16). The ranges follow SGLang's own (`SamplingParams.verify`) and the width of the
tensor each value lands in, and OpenAI's where those are narrower.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from gateway.api.tool_schemas import (
    MessageToolCall,
    Tool,
    ToolChoice,
    check_message_tool_fields,
    check_tools,
)
from gateway.errors import ApiError, validation_error


class Refused(msgspec.Struct, frozen=True):
    """A known parameter tandem does not honour."""

    reason: str
    """Why, for the error message (completes "<param> is not supported: ...")."""
    off: tuple[object, ...] = ()
    """The values that ask for nothing beyond what every answer does (accepted; null always is)."""


_NO_TOOLS = "tandem does not render tools into the prompt nor parse tool calls out of the answer"
_LEGACY_FUNCTIONS = (
    "the legacy `functions` / `function_call` API is not supported; send the same functions as"
    " `tools` (and `tool_choice`)"
)
TOOL_PARAMETERS = frozenset(
    {
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "tool_calls",
        "tool_call_id",
    }
)
"""The parameters (and message fields) of tool calling; their refusal also says whether the
served model's chat template declares tools (`tool_refusal`)."""
TOOL_FIELDS = frozenset(
    {"tools", "tool_choice", "parallel_tool_calls", "tool_calls", "tool_call_id"}
)
"""The tool-calling fields tandem honours — for a model whose chat template declares tools only
(for any other they are refused, `tool_refusal`)."""


def tool_refusal(declares_tools: bool) -> str:
    """Why tool calling is refused: for a model whose chat template declares no tools, any of
    it; for one that does, the legacy `functions` API only."""
    if declares_tools:
        return _LEGACY_FUNCTIONS
    return (
        f"{_NO_TOOLS}, and the served model's chat template declares no tools (it never renders"
        " a `tools` variable), so the model was never shown how to call one"
    )


REFUSED_COMMON: dict[str, Refused] = {
    "logit_bias": Refused("tandem does not pass logit biases to the engine", off=({},)),
}
"""Known parameters of both endpoints that are refused."""
REFUSED_CHAT: dict[str, Refused] = {
    **REFUSED_COMMON,
    "tools": Refused(_NO_TOOLS, off=([],)),
    "tool_choice": Refused(_NO_TOOLS, off=("none",)),
    "parallel_tool_calls": Refused(_NO_TOOLS),
    "functions": Refused(_NO_TOOLS, off=([],)),
    "function_call": Refused(_NO_TOOLS, off=("none",)),
    "audio": Refused("the served model reads and writes text only"),
    "modalities": Refused("the served model reads and writes text only", off=(["text"],)),
    "prediction": Refused("tandem does not use predicted outputs"),
    "web_search_options": Refused("tandem does not search the web"),
    "reasoning_effort": Refused("the served model is not a reasoning model"),
    "verbosity": Refused("the served model has no verbosity setting"),
    "store": Refused("tandem does not store completions for later retrieval", off=(False,)),
    "metadata": Refused(
        "metadata is kept with stored completions, and tandem stores none", off=({},)
    ),
    "service_tier": Refused(
        "tandem's processing tier is the tenant's contract (the `tier` field), not OpenAI's"
        " service tiers",
        off=("auto", "default"),
    ),
}
"""Known /v1/chat/completions parameters that are refused (unless sent with an `off` value)."""
REFUSED_COMPLETIONS: dict[str, Refused] = {
    **REFUSED_COMMON,
    "best_of": Refused("tandem generates one sequence per request (best_of must be 1)", off=(1,)),
    "suffix": Refused("the served model does not fill in the middle", off=("",)),
}
"""Known /v1/completions parameters that are refused (unless sent with an `off` value)."""
REFUSED_MESSAGE_FIELDS: dict[str, Refused] = {
    "tool_calls": Refused(_NO_TOOLS, off=([],)),
    "tool_call_id": Refused(_NO_TOOLS),
    "function_call": Refused(_NO_TOOLS),
    "audio": Refused("the served model reads and writes text only"),
    "refusal": Refused("the chat template has no place for an assistant's refusal"),
}
"""Fields of a chat message that are refused (`messages[i].<field>`)."""
REFUSED_STREAM_OPTIONS: dict[str, Refused] = {
    "include_obfuscation": Refused(
        "tandem does not pad stream events with obfuscation characters", off=(False,)
    ),
}
"""Fields of `stream_options` that are refused."""
NO_OP: dict[str, str] = {
    "user": "an end user's id for the provider's abuse monitoring; it changes no answer",
    "safety_identifier": "OpenAI's newer name of `user`; it changes no answer",
    "prompt_cache_key": "a hint for the provider's prompt cache; tandem's engine reuses"
    " common prefixes by itself, and the key changes no answer",
}
"""Parameters accepted although they change nothing, and why that is honest."""


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    """Send a last chunk with the usage of the whole request."""
    continuous_usage_stats: bool = False
    """Attach the running usage to every chunk (vLLM/SGLang extension)."""


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    """The calls an assistant message made (its content may then be null)."""
    tool_call_id: str | None = None
    """The call a `tool` message answers (required there)."""


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and text completions (OpenAI + vLLM/SGLang extensions)."""

    model: str
    max_tokens: int | None = None
    """Output cap, tokens: [1, the context left after the prompt] (default: the gateway's)."""
    temperature: float | None = None
    """[0, 2]; 0 is greedy."""
    top_p: float | None = None
    """(0, 1]."""
    n: int = 1
    """Choices per request: only 1 (anything else is refused as unsupported)."""
    stop: str | list[str] | None = None
    """At most 4 non-empty strings."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    """[-2**63, 2**63 - 1] (the engine's int64); only with temperature 0 (`SEED_NEEDS_GREEDY`)."""
    presence_penalty: float | None = None
    """[-2, 2]."""
    frequency_penalty: float | None = None
    """[-2, 2]."""
    user: str | None = None
    """Accepted, no effect (`NO_OP`)."""
    safety_identifier: str | None = None
    """Accepted, no effect (`NO_OP`)."""
    prompt_cache_key: str | None = None
    """Accepted, no effect (`NO_OP`)."""
    # engine extensions that benchmark clients send
    top_k: int | None = None
    """-1 (all tokens) or [1, 2**31 - 1] (the engine's int32)."""
    min_p: float | None = None
    """[0, 1]."""
    repetition_penalty: float | None = None
    """(0, 2]; 1 is none."""
    min_tokens: int | None = None
    """Output tokens before a stop may end it: [0, the output cap]."""
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    # tandem: ask for a tier within what the tenant's contract allows
    tier: Literal["rt", "be"] | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """`response_format.json_schema`: the schema the answer must follow."""

    name: str
    """The schema's name (1 to 64 letters, digits, `_` or `-`, as OpenAI)."""
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    """A JSON Schema object; none: any JSON object."""
    strict: bool | None = None
    """Accepted either way: the engine's grammar-constrained decoding always follows the
    schema exactly (what OpenAI's `strict: true` promises)."""
    description: str | None = None
    """Accepted, no effect: OpenAI shows it to the model; the schema constrains the decoding."""


class ResponseFormat(msgspec.Struct, kw_only=True):
    """`response_format`: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    """Required with type json_schema (and only there)."""

    def engine_schema(self) -> str | None:
        """The JSON Schema the engine's grammar-constrained decoding is given (SGLang's
        `sampling_params.json_schema`), or None for plain text."""
        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        return msgspec.json.encode(schema or {"type": "object"}).decode()


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    """OpenAI's newer name of max_tokens (it wins when both are sent); same range."""
    response_format: ResponseFormat | None = None
    """`{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {...}}`: the answer
    is JSON, decoded under the schema's grammar (the engine's xgrammar backend)."""
    logprobs: bool = False
    """Return each output token's log probability (`choices[].logprobs.content`)."""
    top_logprobs: int | None = None
    """[0, 20] most likely alternatives per output token; needs `logprobs: true`."""
    tools: list[Tool] | None = None
    """Functions the model may call (only for a model whose chat template declares tools);
    rendered into the prompt by the template."""
    tool_choice: ToolChoice | None = None
    """`none`, `auto` (the default with tools), `required` or a named function; see
    gateway/tools.py for how each is honoured."""
    parallel_tool_calls: bool | None = None
    """Whether the answer may hold several calls (default true)."""

    @property
    def top_logprobs_num(self) -> int | None:
        """Alternatives per output token to ask the engine for; None: no log probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """`tool_choice`, or its default: `auto` with tools, `none` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[str | int | list[int]]
    """Text, a one-element list of text, token ids, or a one-element list of token ids (a list
    mixing them is refused); token ids must be in [0, the model's vocab_size)."""
    echo: bool = False
    """Only false: echoing the prompt is refused as unsupported."""
    logprobs: int | None = None
    """[0, 5]: return each output token's log probability and this many most likely
    alternatives (`choices[].logprobs`: tokens, token_logprobs, top_logprobs, text_offset)."""

    @property
    def top_logprobs_num(self) -> int | None:
        """Alternatives per output token to ask the engine for; None: no log probabilities."""
        return self.logprobs


Endpoint = Literal["chat", "completions"]
"""Which OpenAI API a request speaks: /v1/chat/completions or /v1/completions."""
OpenAIRequest = ChatCompletionRequest | CompletionRequest
"""A request body of either endpoint."""


def decode_body(raw: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    """Decodes and type-checks a JSON body; malformed JSON (bytes that are not UTF-8, nesting
    deeper than the decoder's recursion limit included) → 400, wrong types → 422."""
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    decode_json(raw)
    return _decode_typed(raw, kind)


def decode_request(
    raw: bytes, endpoint: Endpoint, *, declares_tools: bool = False
) -> OpenAIRequest:
    """`decode_body` for a generation request of *endpoint*, with what it does not honour
    refused first (`check_parameters`: 400 `unsupported_parameter`)."""
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    check_parameters(decode_json(raw), endpoint, declares_tools=declares_tools)
    body = _decode_typed(raw, ChatCompletionRequest if endpoint == "chat" else CompletionRequest)
    assert isinstance(body, (ChatCompletionRequest, CompletionRequest))
    return body


def _decode_typed(raw: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None


def decode_json(raw: bytes) -> object:
    """*raw* as untyped JSON; 400 `invalid_json` saying what is wrong with it. msgspec raises
    UnicodeDecodeError on bytes that are not UTF-8 and RecursionError on nesting deeper than
    Python's recursion limit (e.g. 100,000 `[`): both are the client's malformed JSON, not the
    server's error."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except UnicodeDecodeError as exc:
        raise ApiError(
            400,
            f"request body is not valid JSON: it is not UTF-8 text ({exc.reason} in a string)",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise ApiError(
            400,
            "request body is not valid JSON for this API: it is nested too deeply",
            code="invalid_json",
        ) from None


def check_parameters(raw: object, endpoint: Endpoint, *, declares_tools: bool = False) -> None:
    """400 `unsupported_parameter` naming the first field of the request body *raw* (untyped
    JSON) that the gateway does not honour: a refused parameter (`REFUSED_CHAT`,
    `REFUSED_COMPLETIONS`, a chat message's or `stream_options`' refused fields) sent with a
    value that asks for something, or a name the endpoint does not know. A body that is not an
    object is left to the typed decoding (a 422). *declares_tools*: whether the served model's
    chat template declares tools (`ModelTokenizer.declares_tools`), for the tool refusals'
    reason."""
    if not isinstance(raw, dict):
        return
    kind = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    refused = REFUSED_CHAT if endpoint == "chat" else REFUSED_COMPLETIONS
    _check_fields(raw, kind.__struct_fields__, refused, "", declares_tools)
    options = raw.get("stream_options")
    if isinstance(options, dict):
        _check_fields(
            options,
            StreamOptions.__struct_fields__,
            REFUSED_STREAM_OPTIONS,
            "stream_options.",
            declares_tools,
        )
    messages = raw.get("messages") if endpoint == "chat" else None
    if isinstance(messages, list):
        for index, message in enumerate(messages):
            if isinstance(message, dict):
                _check_fields(
                    message,
                    ChatMessage.__struct_fields__,
                    REFUSED_MESSAGE_FIELDS,
                    f"messages[{index}].",
                    declares_tools,
                )
                parts = message.get("content")
                for part_index, part in enumerate(parts if isinstance(parts, list) else []):
                    if isinstance(part, dict):
                        _check_fields(
                            part,
                            ContentPart.__struct_fields__,
                            {},
                            f"messages[{index}].content[{part_index}].",
                            declares_tools,
                        )


def _check_fields(
    raw: dict[str, object],
    known: tuple[str, ...],
    refused: dict[str, Refused],
    prefix: str,
    declares_tools: bool,
) -> None:
    for name, value in raw.items():
        rule = refused.get(name)
        # tool fields are known, but honoured only for a model whose template declares tools
        if name in known and not (rule is not None and name in TOOL_FIELDS and not declares_tools):
            continue
        param = prefix + name
        if rule is None:
            raise unsupported(
                param,
                f"{param} is not a parameter tandem knows, so it cannot honour it; remove it"
                " (docs/API.md lists the parameters)",
            )
        if not _is_off(value, rule.off):
            reason = tool_refusal(declares_tools) if name in TOOL_PARAMETERS else rule.reason
            raise unsupported(param, f"{param} is not supported: {reason}")


def _is_off(value: object, off: tuple[object, ...]) -> bool:
    """Whether *value* is null or one of *off* (of the same JSON type: `0` is not `false`)."""
    return value is None or any(type(value) is type(o) and value == o for o in off)


def unsupported(param: str, message: str) -> ApiError:
    """The 400 of a parameter the gateway does not honour."""
    return ApiError(400, message, param=param, code="unsupported_parameter")


SEED_NEEDS_GREEDY = (
    "seed is supported only with temperature 0: SGLang applies a per-request seed only with"
    " deterministic inference, which needs a GPU attention backend (fa3, flashinfer, triton),"
    " and this engine samples on CPU with torch_native attention, where the same seed would"
    " not give the same answer; with temperature 0 (greedy) the answer depends on no seed"
)
"""Why a seed is refused with sampling (it is accepted with greedy decoding)."""


def check_text(param: str, value: str | None) -> None:
    """400 naming *param* when *value* holds a NUL character: no PostgreSQL text column can store
    one (the insert fails), and no name, id or file name needs one."""
    if value is not None and "\x00" in value:
        raise _bad(param, f"{param} must not contain a NUL character (\\u0000)")


INT32_MAX = 2**31 - 1
"""The largest 32-bit signed integer: the engine copies top_k (and lengths) into int32 tensors,
where a larger value wraps around and crashes the scheduler."""
INT64_MIN = -(2**63)
"""The smallest 64-bit signed integer (the engine's seed tensor is int64)."""
INT64_MAX = 2**63 - 1
"""The largest 64-bit signed integer (the engine's seed tensor is int64)."""
MAX_STOP_SEQUENCES = 4
"""Stop strings per request at most (OpenAI's limit)."""
MAX_TOP_LOGPROBS_CHAT = 20
"""`top_logprobs` of a chat completion at most (OpenAI's limit)."""
MAX_LOGPROBS_COMPLETIONS = 5
"""`logprobs` of a text completion at most (OpenAI's limit)."""


def check_sampling(req: SamplingFields) -> None:
    """Range checks msgspec's types cannot express; raises 400 naming the field and its range.

    Checks the body alone; what depends on the model or the prompt (token ids against the
    vocabulary, the output cap against the context, min_tokens against the cap) is checked
    where the prompt is prepared (gateway/pipeline/prepare.py)."""
    check_float_range("temperature", req.temperature, 0.0, 2.0)
    check_float_range("top_p", req.top_p, 0.0, 1.0, low_open=True)
    check_float_range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    check_float_range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    check_float_range("min_p", req.min_p, 0.0, 1.0)
    check_float_range("repetition_penalty", req.repetition_penalty, 0.0, 2.0, low_open=True)
    if req.top_k is not None and req.top_k != -1 and not 1 <= req.top_k <= INT32_MAX:
        raise _bad(
            "top_k",
            f"top_k must be -1 (all tokens) or in [1, {INT32_MAX}], got {req.top_k}",
        )
    check_int_range("max_tokens", req.max_tokens, 1, INT32_MAX)
    if isinstance(req, ChatCompletionRequest):
        check_int_range("max_completion_tokens", req.max_completion_tokens, 1, INT32_MAX)
        check_int_range("top_logprobs", req.top_logprobs, 0, MAX_TOP_LOGPROBS_CHAT)
        if req.top_logprobs is not None and not req.logprobs:
            raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
        check_response_format(req.response_format)
        format_type = req.response_format.type if req.response_format is not None else "text"
        check_tools(req.tools, req.tool_choice, has_response_format=format_type != "text")
        for index, message in enumerate(req.messages):
            check_message_tool_fields(index, message.role, message.tool_calls, message.tool_call_id)
    elif isinstance(req, CompletionRequest):
        check_int_range("logprobs", req.logprobs, 0, MAX_LOGPROBS_COMPLETIONS)
    check_int_range("min_tokens", req.min_tokens, 0, INT32_MAX)
    check_int_range("seed", req.seed, INT64_MIN, INT64_MAX)
    if req.seed is not None and req.temperature != 0:
        raise unsupported("seed", SEED_NEEDS_GREEDY)
    if req.n != 1:
        raise unsupported("n", "only n=1 is supported; send several requests for several choices")
    if isinstance(req, CompletionRequest) and req.echo:
        raise unsupported("echo", "echo is not supported: tandem does not return the prompt")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise _bad("stop", f"stop must be at most {MAX_STOP_SEQUENCES} non-empty strings")


SCHEMA_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What OpenAI allows as `response_format.json_schema.name`."""


def check_response_format(response_format: ResponseFormat | None) -> None:
    """400 naming the field of a `response_format` that does not fit its type."""
    if response_format is None:
        return
    spec = response_format.json_schema
    if response_format.type != "json_schema":
        if spec is not None:
            raise _bad(
                "response_format.json_schema",
                "response_format.json_schema goes with type json_schema, not"
                f" {response_format.type}",
            )
        return
    if spec is None:
        raise _bad(
            "response_format.json_schema", "response_format type json_schema needs json_schema"
        )
    if not SCHEMA_NAME_PATTERN.match(spec.name):
        raise _bad(
            "response_format.json_schema.name",
            "response_format.json_schema.name must be 1 to 64 letters, digits, _ or -",
        )


def check_int_range(param: str, value: int | None, low: int, high: int) -> None:
    """400 naming *param* unless *value* is None or in [low, high]."""
    if value is not None and not low <= value <= high:
        raise _bad(param, f"{param} must be in [{low}, {high}], got {value}")


def check_float_range(
    param: str, value: float | None, low: float, high: float, *, low_open: bool = False
) -> None:
    """400 naming *param* unless *value* is None or a finite number in [low, high] ((low, high]
    with *low_open*). NaN fails every comparison, so it is refused explicitly."""
    if value is None:
        return
    above_low = value > low if low_open else value >= low
    if not math.isfinite(value) or not above_low or value > high:
        bracket = "(" if low_open else "["
        raise _bad(
            param, f"{param} must be a finite number in {bracket}{low}, {high}], got {value}"
        )


def check_token_ids(param: str, ids: Sequence[int], vocab_size: int) -> None:
    """400 naming the first id of *ids* (`param[i]`) outside [0, vocab_size): the engine looks
    each up in the model's embedding table, whose rows are the vocabulary."""
    for index, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise _bad(
                f"{param}[{index}]",
                f"{param}[{index}] is {token_id}, not a token of the model: token ids must be in"
                f" [0, {vocab_size - 1}] (the vocabulary has {vocab_size} tokens)",
            )


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")
