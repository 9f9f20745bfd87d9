"""The one renderer of OpenAI response bodies: chat.completion, chat.completion.chunk,
text_completion (whole and streamed) and usage — for the HTTP API and the batch output file alike.

Every body's `id` is the engine request id behind a prefix (`chatcmpl-tdm-…`, `cmpl-tdm-…`): the
same rid is the usage record's `request_id` and the engine's own `rid`, so a client's response
can be traced to both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.api.schemas import Endpoint
from gateway.engine.client import EngineChunk


def response_id(endpoint: Endpoint, rid: str) -> str:
    """The OpenAI `id` of the response to engine request *rid*."""
    return f"chatcmpl-{rid}" if endpoint == "chat" else f"cmpl-{rid}"


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's `usage` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(engine_reason: str | None) -> str | None:
    """OpenAI's finish_reason for the engine's: None while running (and for an abort, which the
    client learns about from the error that follows)."""
    if engine_reason in (None, "abort"):
        return None
    return "length" if engine_reason == "length" else "stop"


@dataclass(frozen=True)
class ResponseHead:
    """What every body of one response shares."""

    endpoint: Endpoint
    rid: str
    """The engine request id (also the usage record's request_id)."""
    model: str
    created_unix_s: int = field(default_factory=lambda: int(time.time()))

    def body(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": response_id(self.endpoint, self.rid),
            "object": obj,
            "created": self.created_unix_s,
            "model": self.model,
            "choices": choices,
        }


def completion_body(
    head: ResponseHead, text: str, engine_finish: str | None, usage: dict[str, int]
) -> dict[str, Any]:
    """The whole (non-streamed) answer: a chat.completion or a text_completion."""
    reason = finish_reason(engine_finish)
    if head.endpoint == "chat":
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
        return dict(head.body("chat.completion", [choice]), usage=usage)
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return dict(head.body("text_completion", [choice]), usage=usage)


@dataclass
class StreamRenderer:
    """The bodies of a streamed answer's server-sent events, one per engine chunk."""

    head: ResponseHead
    _role_sent: bool = False

    def chunk(self, chunk: EngineChunk | None) -> dict[str, Any]:
        """The event of *chunk*; None gives one with no choices (the last, usage-only event)."""
        choices: list[dict[str, Any]] = []
        if self.head.endpoint == "chat":
            if chunk is not None:
                delta: dict[str, Any] = {"content": chunk.text_delta}
                if not self._role_sent:  # OpenAI names the role once, in the first delta
                    delta["role"] = "assistant"
                    self._role_sent = True
                reason = finish_reason(chunk.finish_reason)
                choices.append(
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
                )
            return self.head.body("chat.completion.chunk", choices)
        if chunk is not None:
            reason = finish_reason(chunk.finish_reason)
            choices.append(
                {"index": 0, "text": chunk.text_delta, "logprobs": None, "finish_reason": reason}
            )
        return self.head.body("text_completion", choices)
