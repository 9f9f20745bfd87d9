"""HTTP client for the engine's native API (SGLang `/generate`, streaming; the simulator serves
the same surface).

The gateway always streams from the engine, even for a non-streaming client, so that it sees the
first token and the gaps between tokens (TTFT, TBT) on its own clock.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aiohttp
import msgspec

log = logging.getLogger(__name__)


class EngineUnavailable(Exception):
    """The engine could not be reached, refused the request for capacity reasons, or went away
    while it had the request (`is_lost`)."""

    def __init__(self, message: str, *, is_lost: bool = False) -> None:
        super().__init__(message)
        self.is_lost = is_lost
        """The request was sent and the engine went away before answering (the connection broke,
        it timed out, or it answered a server error other than 429/503): the engine may have run
        it, and may have died of it. False: the engine never took it (connection refused, or a
        429/503 for capacity)."""


class EngineRequestError(Exception):
    """The engine rejected the request (its message is safe to show the client)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class TopLogprob(msgspec.Struct, frozen=True):
    """One of the most likely tokens at an output position."""

    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    """An output token with its log probability and the most likely alternatives (SGLang's
    `output_token_logprobs` / `output_top_logprobs` entries, asked with `return_logprob`)."""

    token: str
    """Its text (the engine's detokenization of the token alone)."""
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    """The `top_logprobs_num` most likely tokens at its position, most likely first."""


class EngineChunk(msgspec.Struct, kw_only=True):
    """One streamed update of a generation, normalised to deltas."""

    text_delta: str
    """Text generated since the previous chunk."""
    completion_tokens: int
    """Output tokens so far (cumulative)."""
    prompt_tokens: int
    """Prompt tokens (as counted by the engine)."""
    cached_tokens: int = 0
    """Prompt tokens served from the engine's prefix cache."""
    finish_reason: str | None = None
    """None while running; "stop", "length" or "abort" on the last chunk."""
    matched_stop: str | int | None = None
    """The stop string or token that ended the generation, if any."""
    abort_message: str | None = None
    """Why the engine aborted the request (finish reason "abort"), in its words."""
    abort_status: int | None = None
    """The HTTP status the engine gives its abort: 400 when the request itself cannot run (a
    grammar that does not compile, a prompt beyond the KV pool), also for an operator's
    abort."""
    queue_time_s: float | None = None
    """Time the request waited in the engine's queue, seconds (engine metrics on)."""
    num_retractions: int = 0
    """How often the engine evicted and re-queued this request."""
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    """The output tokens since the previous chunk, with their log probabilities (the request
    asked for them: `return_logprob`; empty otherwise)."""


class _GenerateOut(msgspec.Struct):
    text: str = ""
    meta_info: dict[str, Any] = msgspec.field(default_factory=dict)
    error: dict[str, Any] | None = None


class EngineClient:
    """Talks to one engine at `base_url` over a shared aiohttp session."""

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        timeout_s: float,
        *,
        dp_rank: int | None = None,
    ) -> None:
        """*dp_rank*: the engine's data-parallel rank every request of this client runs on
        (SGLang's `routed_dp_rank`); None: wherever the engine puts it."""
        self.base_url = base_url.rstrip("/")
        self.dp_rank = dp_rank
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5.0)
        self._decoder = msgspec.json.Decoder(_GenerateOut)

    async def generate(
        self, payload: dict[str, Any], *, stream: bool = True
    ) -> AsyncGenerator[EngineChunk, None]:
        """Streams the generation for one `/generate` payload (which must carry a unique rid).
        With *stream* off the engine answers once, at the end, and this yields one chunk with
        everything: for work nobody watches token by token (batch lines), since SGLang streams
        the cumulative text on every token — O(n²) bytes to encode, send and decode per request,
        CPU that an engine sharing the host's cores takes from everyone's iterations.

        Raises EngineUnavailable when the engine cannot be reached or goes away with the request
        (`is_lost`: whatever broke the exchange once the request was sent, a response cut short
        included), and EngineRequestError when it rejects the request; nothing else. Closing the
        iterator early closes the upstream connection; callers also call `abort` so the engine
        frees the request's KV at once.
        """
        body = dict(payload, stream=stream)
        if self.dp_rank is not None:
            body["routed_dp_rank"] = self.dp_rank
        try:
            async with self._session.post(
                f"{self.base_url}/generate", json=body, timeout=self._timeout
            ) as resp:
                if resp.status >= 500 or resp.status == 429:
                    raise EngineUnavailable(
                        f"engine answered {resp.status}", is_lost=resp.status not in (429, 503)
                    )
                if resp.status >= 400:
                    raise EngineRequestError(await _error_message(resp), resp.status)
                if not stream:
                    out = self._decoder.decode(await resp.read())
                    if out.error is not None:
                        raise EngineRequestError(str(out.error.get("message", "engine error")))
                    yield _to_chunk(out, 0, 0)
                    return
                emitted = emitted_logprobs = 0
                async for data in _sse_data(resp.content):
                    if data == b"[DONE]":
                        await _drain(resp)
                        return
                    out = self._decoder.decode(data)
                    if out.error is not None:
                        raise EngineRequestError(str(out.error.get("message", "engine error")))
                    chunk = _to_chunk(out, emitted, emitted_logprobs)
                    emitted += len(chunk.text_delta)
                    emitted_logprobs += len(chunk.logprobs)
                    yield chunk
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            # The connection was never made: the engine did not see the request.
            raise EngineUnavailable(f"engine unreachable: {exc.__class__.__name__}") from None
        except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError) as exc:
            # Sent, then the engine went away: the connection broke (a dead engine's stream ends
            # mid-body, ClientPayloadError), timed out, or its last line was cut short.
            raise EngineUnavailable(
                f"engine lost: {exc.__class__.__name__}", is_lost=True
            ) from None

    async def abort(self, rid: str) -> None:
        """Asks the engine to drop request *rid* (best effort; never raises)."""
        try:
            async with self._session.post(
                f"{self.base_url}/abort_request",
                json={"rid": rid},
                timeout=aiohttp.ClientTimeout(total=5.0),
            ) as resp:
                await resp.read()
        except aiohttp.ClientConnectorError as exc:  # the engine is down: it holds nothing
            log.debug("abort of %s not sent: %s", rid, exc)
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("abort of %s failed: %s", rid, exc)

    async def is_healthy(self, timeout_s: float = 5.0) -> bool:
        """True when the engine answers its health probe (``GET /health``: SGLang's runs a
        one-token generation, about a second) with 200 within *timeout_s*."""
        try:
            async with self._session.get(
                f"{self.base_url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False


def _to_chunk(out: _GenerateOut, emitted: int, emitted_logprobs: int = 0) -> EngineChunk:
    """The chunk for one SSE update; *emitted* is how many characters were already sent,
    *emitted_logprobs* how many output tokens' log probabilities."""
    meta = out.meta_info
    finish = meta.get("finish_reason")
    # SGLang streams the cumulative text. Until a generation ends, a trailing U+FFFD is half of a
    # multi-byte character whose next token completes it: hold it back, or the client would get
    # a replacement character and then the real one.
    text = out.text if finish is not None else out.text.rstrip("\ufffd")
    delta = text[emitted:]
    return EngineChunk(
        text_delta=delta,
        completion_tokens=int(meta.get("completion_tokens", 0)),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0) or 0),
        finish_reason=finish.get("type") if isinstance(finish, dict) else None,
        matched_stop=finish.get("matched") if isinstance(finish, dict) else None,
        abort_message=finish.get("message") if isinstance(finish, dict) else None,
        abort_status=finish.get("status_code") if isinstance(finish, dict) else None,
        queue_time_s=meta.get("queue_time"),
        num_retractions=int(meta.get("num_retractions", 0) or 0),
        logprobs=_new_logprobs(meta, emitted_logprobs),
    )


def _new_logprobs(meta: dict[str, Any], emitted: int) -> list[TokenLogprob]:
    """The output tokens' log probabilities after the first *emitted* (SGLang streams them
    cumulatively): entries `[logprob, token_id, text]`, and per position a list of such
    entries for the most likely tokens."""
    tokens = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    new: list[TokenLogprob] = []
    for index in range(emitted, len(tokens)):
        logprob, _token_id, text = tokens[index][:3]
        top = tops[index] if index < len(tops) and tops[index] else []
        new.append(
            TokenLogprob(
                token=text or "",
                logprob=float(logprob),
                top=tuple(TopLogprob(token=t or "", logprob=float(lp)) for lp, _, t in top),
            )
        )
    return new


async def _sse_data(stream: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The payloads of `data:` lines of a server-sent-event stream."""
    async for line in stream:
        line = line.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip()


async def _error_message(resp: aiohttp.ClientResponse) -> str:
    try:
        body = await resp.json(content_type=None)
    except (ValueError, aiohttp.ContentTypeError):
        return f"engine rejected the request ({resp.status})"
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))
    if isinstance(err, str):
        return err
    return str(body.get("message", body)) if isinstance(body, dict) else str(body)


async def _drain(resp: aiohttp.ClientResponse) -> None:
    """Reads what is left of a finished stream's body (its chunked terminator), so that the
    connection goes back to the pool: left unread, aiohttp closes it, and every other streamed
    request paid for a new connection to the engine (about 8 % of the gateway's time at
    200 req/s). The answer is complete by then: a failure here is nobody's business."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError):
        await resp.content.read()
