"""The one renderer of OpenAI response bodies: chat.completion, chat.completion.chunk,
text_completion (whole and streamed) and usage — for the HTTP API and the batch output file alike.

Every body's `id` is the engine request id behind a prefix (`chatcmpl-tdm-…`, `cmpl-tdm-…`): the
same rid is the usage record's `request_id` and the engine's own `rid`, so a client's response
can be traced to both.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.api.schemas import Endpoint
from gateway.engine.client import EngineChunk, TokenLogprob
from gateway.tools import ContentDelta, ToolPlan, ToolStream, parse_output


def response_id(endpoint: Endpoint, rid: str) -> str:
    """The OpenAI `id` of the response to engine request *rid*."""
    return f"chatcmpl-{rid}" if endpoint == "chat" else f"cmpl-{rid}"


def usage_body(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
) -> dict[str, Any]:
    """OpenAI's `usage` object; `prompt_tokens_details.cached_tokens`: the prompt tokens the
    engine found in its prefix cache (a conversation's history, a shared system prompt)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason(engine_reason: str | None, *, has_tool_calls: bool = False) -> str | None:
    """OpenAI's finish_reason for the engine's: None while running (and for an abort, which the
    client learns about from the error that follows); "tool_calls" for an answer that ended
    with calls (one cut short by the output cap stays "length")."""
    if engine_reason in (None, "abort"):
        return None
    if engine_reason == "length":
        return "length"
    return "tool_calls" if has_tool_calls else "stop"


@dataclass(frozen=True)
class ResponseHead:
    """What every body of one response shares."""

    endpoint: Endpoint
    rid: str
    """The engine request id (also the usage record's request_id)."""
    model: str
    created_unix_s: int = field(default_factory=lambda: int(time.time()))
    logprobs: bool = False
    """The request asked for log probabilities: every choice carries them."""
    tool_plan: ToolPlan | None = None
    """How a chat answer is read for tool calls (None: it is plain content)."""

    def body(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": response_id(self.endpoint, self.rid),
            "object": obj,
            "created": self.created_unix_s,
            "model": self.model,
            "choices": choices,
        }


def chat_logprobs(tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's `logprobs`: each token with its log probability, its UTF-8 bytes and
    the most likely alternatives."""
    return {
        "content": [
            {
                **_chat_token(t.token, t.logprob),
                "top_logprobs": [_chat_token(a.token, a.logprob) for a in t.top],
            }
            for t in tokens
        ],
        "refusal": None,
    }


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def completion_logprobs(tokens: Sequence[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """A text completion choice's `logprobs` (OpenAI's legacy shape): the tokens, their log
    probabilities, the alternatives as token → log probability, and where each token starts
    in the completion's text (the first at *text_offset*)."""
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{a.token: a.logprob for a in t.top} for t in tokens],
        "text_offset": offsets,
    }


def completion_body(
    head: ResponseHead,
    text: str,
    engine_finish: str | None,
    usage: dict[str, int],
    logprobs: Sequence[TokenLogprob] = (),
) -> dict[str, Any]:
    """The whole (non-streamed) answer: a chat.completion or a text_completion; *logprobs*
    are the output tokens' (rendered when the request asked for them)."""
    reason = finish_reason(engine_finish)
    if head.endpoint == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if head.tool_plan is not None:
            parsed = parse_output(head.tool_plan, text)
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = [call.body() for call in parsed.tool_calls]
                reason = finish_reason(engine_finish, has_tool_calls=True)
        rendered = chat_logprobs(logprobs) if head.logprobs else None
        choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": rendered}
        return dict(head.body("chat.completion", [choice]), usage=usage)
    rendered = completion_logprobs(logprobs, 0) if head.logprobs else None
    choice = {"index": 0, "text": text, "logprobs": rendered, "finish_reason": reason}
    return dict(head.body("text_completion", [choice]), usage=usage)


@dataclass
class StreamRenderer:
    """The bodies of a streamed answer's server-sent events, one per engine chunk (`events`:
    none or several with tool calls)."""

    head: ResponseHead
    _role_sent: bool = False
    _text_offset: int = 0
    """Characters of the completion's tokens sent so far (`text_offset` of the next)."""
    _tools: ToolStream | None = None
    _tokens_sent: int = 0
    """Output tokens of the chunks seen so far (`events`' every_step)."""

    def __post_init__(self) -> None:
        if self.head.endpoint == "chat" and self.head.tool_plan is not None:
            self._tools = ToolStream(self.head.tool_plan)

    def events(self, chunk: EngineChunk, every_step: bool = False) -> list[dict[str, Any]]:
        """The events of *chunk*: one with its text, or — when the answer is read for tool
        calls — one per content piece or call piece it lets out (none while the text may be a
        call's start), the last chunk's with the finish reason.

        A chunk whose tokens make no text yet (the detokenizer holds back the bytes of a
        character not finished) has no event, unless *every_step* (the client asked for
        `continuous_usage_stats`): then it has one with empty text, so that the running usage
        it carries tells the client of every token as it is generated."""
        stepped = every_step and chunk.completion_tokens > self._tokens_sent
        self._tokens_sent = max(self._tokens_sent, chunk.completion_tokens)
        if self._tools is None:
            if chunk.text_delta or chunk.logprobs or chunk.finish_reason is not None or stepped:
                return [self.chunk(chunk)]
            return []
        pieces = self._tools.feed(chunk.text_delta)
        if chunk.finish_reason is not None:
            pieces += self._tools.finish()
        deltas: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, ContentDelta):
                deltas.append({"content": piece.text})
            else:
                deltas.append({"tool_calls": [piece.body()]})
        reason = finish_reason(chunk.finish_reason, has_tool_calls=self._tools.has_tool_calls)
        if not deltas and (reason is not None or (chunk.logprobs and self.head.logprobs)):
            deltas.append({})  # the finish reason (or log probabilities) still need an event
        events = []
        for index, delta in enumerate(deltas):
            if not self._role_sent:
                delta = {"role": "assistant", **delta}
                self._role_sent = True
            logprobs = None
            if self.head.logprobs:
                logprobs = chat_logprobs(chunk.logprobs if index == 0 else [])
            is_last = index == len(deltas) - 1
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": reason if is_last else None,
            }
            events.append(self.head.body("chat.completion.chunk", [choice]))
        return events

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
                logprobs = chat_logprobs(chunk.logprobs) if self.head.logprobs else None
                choices.append(
                    {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
                )
            return self.head.body("chat.completion.chunk", choices)
        if chunk is not None:
            reason = finish_reason(chunk.finish_reason)
            logprobs = None
            if self.head.logprobs:
                logprobs = completion_logprobs(chunk.logprobs, self._text_offset)
                self._text_offset += sum(len(t.token) for t in chunk.logprobs)
            choices.append(
                {
                    "index": 0,
                    "text": chunk.text_delta,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }
            )
        return self.head.body("text_completion", choices)
