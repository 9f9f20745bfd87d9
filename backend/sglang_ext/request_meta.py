"""Scheduler-side request metadata: the gateway's :class:`~common.wire.RequestMeta`, resolved.

The gateway sends relative targets (``ttft_ms`` after arrival, ``deadline_s`` after arrival) and
the wall-clock arrival time; the scheduler wants absolute instants it can compare with "now" at
every iteration. :func:`sched_meta_from_custom_params` does that conversion once, when SGLang
creates the ``Req`` (see ``backend.sglang_ext.plugin``), and the result rides on the request as
``req.tandem`` for its whole life, retractions included (it is the same ``Req`` object).

This module imports neither torch nor sglang, so it is unit-testable in isolation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec

from common.wire import RequestMeta, Tier, meta_from_custom_params


class SchedReqMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What the scheduler knows about one request beyond its tokens (times: ``time.time()``).

    The first block repeats the wire fields as sent (so a trace shows exactly what arrived); the
    second holds what the scheduler derives from them.
    """

    tier: Tier
    """Service tier: "rt" (TTFT/TPOT targets) or "be" (best effort)."""
    tenant_id: str
    """The tenant the request is billed to."""
    length_key: str
    """Key of the output-length history that predicts this request's output length."""
    arrival_unix_s: float
    """When the gateway accepted the request (wall clock, same host), seconds since the epoch."""
    ttft_ms: float | None
    """RT: time-to-first-token target after arrival, ms; None for BE."""
    tpot_ms: float | None
    """RT: time-per-output-token target after the first token, ms; None for BE."""
    deadline_s: float | None
    """BE: completion deadline after arrival, seconds; None: pure best effort (or RT)."""
    max_tokens: int | None
    """The client's output-length cap, tokens (a prior for the length predictor); None: unset."""

    received_unix_s: float
    """When the scheduler process created the request, seconds since the epoch."""
    ttft_deadline_unix_s: float | None
    """RT: absolute time by which the first token is due; None for BE."""
    tpot_target_s: float | None
    """RT: target time per output token after the first, seconds; None for BE."""
    be_deadline_unix_s: float | None
    """BE: absolute completion deadline; None for RT and for pure best effort."""
    sglang_priority: int
    """The stock SGLang priority that mirrors the tier (see ``common.wire``)."""

    @property
    def is_rt(self) -> bool:
        """True for a real-time (latency-critical) request."""
        return self.tier == "rt"


REQ_ATTR = "tandem"
"""Attribute of SGLang's ``Req`` that holds its :class:`SchedReqMeta` (or None)."""


def get_meta(req: Any) -> SchedReqMeta | None:
    """The metadata the plugin attached to *req*, or None (no metadata, or not hooked)."""
    meta = getattr(req, REQ_ATTR, None)
    return meta if isinstance(meta, SchedReqMeta) else None


def sched_meta(meta: RequestMeta, *, received_unix_s: float) -> SchedReqMeta:
    """Resolves *meta*'s relative targets into absolute times."""
    return SchedReqMeta(
        tier=meta.tier,
        tenant_id=meta.tenant_id,
        length_key=meta.length_key,
        arrival_unix_s=meta.arrival_unix_s,
        ttft_ms=meta.ttft_target_ms,
        tpot_ms=meta.tpot_target_ms,
        deadline_s=meta.deadline_s,
        max_tokens=meta.max_tokens,
        received_unix_s=received_unix_s,
        ttft_deadline_unix_s=meta.ttft_due_unix_s,
        tpot_target_s=None if meta.tpot_target_ms is None else meta.tpot_target_ms / 1000.0,
        be_deadline_unix_s=meta.deadline_due_unix_s,
        sglang_priority=meta.sglang_priority,
    )


def sched_meta_from_custom_params(
    custom_params: Mapping[str, Any] | None, *, received_unix_s: float | None = None
) -> SchedReqMeta | None:
    """The metadata carried in a request's ``custom_params``; None when it carries none.

    Raises ``msgspec.ValidationError`` (or ``TypeError`` for a non-dict) when it is malformed;
    the caller in the scheduler turns that into a warning, never a crash.
    """
    if custom_params is None:
        return None
    if not isinstance(custom_params, Mapping):
        raise TypeError(f"custom_params must be a dict, got {type(custom_params).__name__}")
    meta = meta_from_custom_params(dict(custom_params))
    if meta is None:
        return None
    now = time.time() if received_unix_s is None else received_unix_s
    return sched_meta(meta, received_unix_s=now)


def sched_meta_to_dict(meta: SchedReqMeta) -> dict[str, Any]:
    """All fields as a plain JSON-ready dict (the debug trace writes this)."""
    return msgspec.structs.asdict(meta)
