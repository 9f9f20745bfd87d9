"""How a request that did not complete ended: one typed `Failure`, decided once, that the HTTP
handlers turn into the client's error response, the batch runner into a retry or an error-file
line, and the record stage into the usage record — so the three always agree (the status the
record logs is the status the client got).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.errors import ApiError

FailureKind = Literal[
    "invalid_request",
    "rate_limited",
    "slo_unattainable",
    "engine_unavailable",
    "engine_error",
    "aborted",
    "client_disconnected",
    "interrupted",
    "gateway_shutdown",
    "internal_error",
]
"""The usage record's `status` of a request that failed (a completed one is "ok"); reports count
"rate_limited" as quota 429s, "slo_unattainable" as requests the SLO admission shed (also 429s),
"client_disconnected" as cancels (the client stopped it: its own outcome, neither an error nor
judged against the SLO), leave "interrupted" out (batch work a gateway shutdown cut off: the line
runs again, and that run is the one billed), and count anything else as an error —
"gateway_shutdown" too (a client's request a stopping gateway ended: gateway/shutdown.py; not
judged against the SLO)."""

UNJUDGED: frozenset[FailureKind] = frozenset(
    {"client_disconnected", "interrupted", "gateway_shutdown"}
)
"""Outcomes that say nothing about the latency the request got: no SLO verdict (`slo_met` is
None). The reports count neither a cancel nor an interrupted batch line as an error; a request
a stopping gateway ended is one (its client got the 503), but a deploy is no SLO miss."""


@dataclass(frozen=True, kw_only=True)
class Failure:
    """Why a request ended without a full answer, and what its client is told."""

    kind: FailureKind
    http_status: int
    """The HTTP status of the error the client gets (in-band once a stream's headers are out);
    the usage record logs this very number."""
    message: str
    """The error message the client sees."""
    code: str | None = None
    """OpenAI's error `code` (`engine_unavailable`, `requests_per_min_exceeded`, …)."""
    param: str | None = None
    """The request field at fault, if one is."""
    retryable: bool = False
    """Whether the same request may succeed later unchanged (the batch runner requeues it)."""
    retry_after_s: int | None = None
    """When a retry may succeed, whole seconds (`Retry-After`); None: no advice."""
    detail: str | None = None
    """What the usage record's `error` says when it differs from *message* (the engine's own
    words, which the client is not shown)."""
    is_engine_lost: bool = False
    """The engine went away after the request was sent (an `engine_unavailable` whose
    connection broke or timed out): the request may be what brought the engine down, so the
    batch runner counts the attempt, unlike one that never reached the engine."""

    @property
    def record_error(self) -> str:
        """The usage record's `error`."""
        return self.detail if self.detail is not None else self.message

    def api_error(self) -> ApiError:
        """The client's error response (status, OpenAI error body, `Retry-After`)."""
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}
        return ApiError(
            self.http_status, self.message, param=self.param, code=self.code, headers=headers
        )


@dataclass(frozen=True, kw_only=True)
class Refused(Failure):
    """A request the admission stage turned away before it reached an engine."""


def invalid_request(exc: ApiError) -> Failure:
    """A request the parse or prepare stage refused (malformed body, prompt too long, …)."""
    return Failure(
        kind="invalid_request",
        http_status=exc.status,
        message=exc.message,
        code=exc.code,
        param=exc.param,
    )


def engine_unavailable(detail: str, retry_after_s: int, *, is_engine_lost: bool = False) -> Failure:
    """The engine could not be reached, or refused the request for capacity; *is_engine_lost*:
    it went away after the request was sent."""
    return Failure(
        kind="engine_unavailable",
        http_status=503,
        message="the inference engine is unavailable; retry later",
        code="engine_unavailable",
        retryable=True,
        retry_after_s=retry_after_s,
        detail=detail,
        is_engine_lost=is_engine_lost,
    )


def attempts_exhausted(attempts: int) -> Failure:
    """A batch line that used up its *attempts* and whose last one was lost with the engine (or
    the gateway) before an answer: it may be what crashes them, so it is not sent again."""
    return Failure(
        kind="engine_error",
        http_status=500,
        message=(
            f"no answer after {attempts} attempts, the last of which the engine (or the gateway) "
            "did not survive; the request is not sent again, as it may be what crashes the engine"
        ),
        code="batch_attempts_exhausted",
    )


def engine_rejected(detail: str) -> Failure:
    """The engine refused the request itself: sending it again would not help."""
    return Failure(
        kind="engine_error",
        http_status=400,
        message=f"engine rejected the request: {detail}",
        code="engine_error",
        detail=detail,
    )


def stream_ended_early() -> Failure:
    """The engine's stream closed before a finish reason: the generation is incomplete."""
    return Failure(
        kind="engine_error",
        http_status=503,
        message="the engine ended the stream early; retry later",
        code="engine_error",
        retryable=True,
        retry_after_s=1,
        detail="engine stream ended without a finish reason",
    )


def engine_aborted() -> Failure:
    """The engine dropped the request (finish reason "abort": evicted, or an operator's abort)."""
    return Failure(
        kind="aborted",
        http_status=503,
        message="the engine aborted the request; retry later",
        code="engine_aborted",
        retryable=True,
        retry_after_s=1,
        detail="the engine aborted the request",
    )


def client_disconnected() -> Failure:
    """The client went away before the answer was complete — it pressed stop, or cancelled its
    batch (499, nginx's convention): a cancel, billed for what ran, never an SLO miss."""
    return Failure(kind="client_disconnected", http_status=499, message="client disconnected")


def interrupted() -> Failure:
    """A batch line the gateway's shutdown cut off: it stays pending and runs again after the
    restart, so this attempt is neither an error nor billed (the re-run is). 503: the gateway
    was going away (no client is told: a batch line has none)."""
    return Failure(
        kind="interrupted",
        http_status=503,
        message="interrupted by a gateway shutdown; the line runs again after the restart",
        code="interrupted",
        retryable=True,
    )


SHUTTING_DOWN_CODE = "gateway_shutting_down"
"""The OpenAI error `code` of a request a stopping gateway refused or ended."""


def gateway_shut_down(*, ended: bool) -> Failure:
    """A client's request the gateway's shutdown refused (*ended* False: it came while the
    gateway drained) or ended (its drain time ran out, or a second signal came): 503, to retry
    on another gateway process or after the restart (gateway/shutdown.py)."""
    message = (
        "the gateway is shutting down and ended the request before it finished; retry"
        if ended
        else "the gateway is shutting down; retry"
    )
    return Failure(
        kind="gateway_shutdown",
        http_status=503,
        message=message,
        code=SHUTTING_DOWN_CODE,
        retryable=True,
        retry_after_s=1,
    )


def batch_expired() -> Failure:
    """A batch line cut off because its batch's completion window ran out (a deadline miss)."""
    return Failure(
        kind="aborted",
        http_status=408,
        message="the batch expired before the line finished",
        code="batch_expired",
    )


def internal_error() -> Failure:
    """The gateway itself failed while running the request (a bug, or the database)."""
    return Failure(
        kind="internal_error",
        http_status=500,
        message="internal error while running the request",
        code="internal_error",
        retryable=True,
    )
