"""Request bodies of the OpenAI-compatible API, as msgspec Structs.

Decoding a body validates every known field's type in one pass (a wrong type is a 422 naming the
field); unknown fields are ignored, as OpenAI-compatible servers do, because client libraries add
fields of their own. Range checks that msgspec cannot express live in `check_sampling`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.errors import ApiError, validation_error


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


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and text completions (OpenAI + vLLM/SGLang extensions)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # engine extensions that benchmark clients send
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    # tandem: ask for a tier within what the tenant's contract allows
    tier: Literal["rt", "be"] | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[str | int]
    """Text, a one-element list of text, or token ids (a list mixing both is refused)."""
    echo: bool = False


Endpoint = Literal["chat", "completions"]
"""Which OpenAI API a request speaks: /v1/chat/completions or /v1/completions."""
OpenAIRequest = ChatCompletionRequest | CompletionRequest
"""A request body of either endpoint."""


def decode_body(raw: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    """Decodes and type-checks a JSON body; malformed JSON → 400, wrong types → 422."""
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None


def check_sampling(req: SamplingFields) -> None:
    """Range checks msgspec's types cannot express; raises 400 naming the field."""
    _check_range("temperature", req.temperature, 0.0, 2.0)
    _check_range("top_p", req.top_p, 0.0, 1.0, low_open=True)
    _check_range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    _check_range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    _check_range("min_p", req.min_p, 0.0, 1.0)
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise _bad("repetition_penalty", "repetition_penalty must be positive")
    if req.top_k is not None and req.top_k < -1:
        raise _bad("top_k", "top_k must be -1 (all) or a positive count")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise _bad("max_tokens", "max_tokens must be at least 1")
    if req.min_tokens is not None and req.min_tokens < 0:
        raise _bad("min_tokens", "min_tokens must not be negative")
    if req.n != 1:
        raise _bad("n", "only n=1 is supported; send several requests for several choices")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise _bad("stop", "stop must be at most 4 non-empty strings")


def _check_range(
    name: str, value: float | None, low: float, high: float, *, low_open: bool = False
) -> None:
    if value is None:
        return
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise _bad(name, f"{name} must be in {bracket}{low}, {high}], got {value}")


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")
