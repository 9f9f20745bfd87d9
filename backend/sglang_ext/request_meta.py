"""The wire metadata on SGLang's requests: ``req.tandem`` holds the gateway's
:class:`~common.wire.RequestMeta` exactly as it arrived (no sglang import).

The plugin parses ``req.sampling_params.custom_params`` once, when SGLang creates the ``Req``
(``backend.sglang_ext.plugin``), and the meta rides on the request for its whole life,
retractions included (it is the same ``Req`` object). Nothing is derived here: the mirror turns
the meta's wall-clock instants into due instants on the scheduler's clock when it first sees the
request (``backend.sglang_ext.mirror``), and the debug trace writes the meta with its derived
figures (:func:`trace_fields`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from common.wire import RequestMeta, meta_from_custom_params

REQ_ATTR = "tandem"
"""Attribute of SGLang's ``Req`` that holds its :class:`~common.wire.RequestMeta` (or None)."""


def get_meta(req: Any) -> RequestMeta | None:
    """The metadata the plugin attached to *req*, or None (no metadata, or not hooked)."""
    meta = getattr(req, REQ_ATTR, None)
    return meta if isinstance(meta, RequestMeta) else None


def meta_of(custom_params: object) -> RequestMeta | None:
    """The metadata carried in a request's ``custom_params``; None when it carries none.

    Raises ``msgspec.ValidationError`` (or ``TypeError`` for a non-dict) when it is malformed;
    the caller in the scheduler turns that into a warning, never a crash.
    """
    if custom_params is None:
        return None
    if not isinstance(custom_params, Mapping):
        raise TypeError(f"custom_params must be a dict, got {type(custom_params).__name__}")
    return meta_from_custom_params(dict(custom_params))


def tpot_target_s(meta: RequestMeta) -> float | None:
    """The TPOT target in seconds (``ReqState.tpot_target_s``); None without one."""
    return None if meta.tpot_target_ms is None else meta.tpot_target_ms / 1000.0


def trace_fields(meta: RequestMeta, *, received_unix_s: float) -> dict[str, Any]:
    """What the debug trace writes for a request: every wire field as it arrived, then what the
    engine derives from them (due instants on the wall clock, the TPOT target in seconds, the
    tier's SGLang priority) and when the scheduler received it (``time.time()``)."""
    return {
        **msgspec.structs.asdict(meta),
        "ttft_due_unix_s": meta.ttft_due_unix_s,
        "deadline_due_unix_s": meta.deadline_due_unix_s,
        "tpot_target_s": tpot_target_s(meta),
        "sglang_priority": meta.sglang_priority,
        "received_unix_s": received_unix_s,
    }
