"""Plain data returned by :class:`gateway.store.repo.Store` (msgspec Structs, never ORM rows).

Datetimes are timezone-aware UTC and serialize as ISO 8601 (``msgspec.json.encode``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

from common.wire import Tier

OnUnattainable = Literal["reject", "downgrade", "accept"]
"""What the gateway does with an RT request whose contract its admission forecast says cannot be
met at the engine's current load (gateway/pipeline/admission.py): refuse it at once (429
`slo_unattainable`), run it as BE instead, or run it as RT anyway (best effort)."""

AdmissionOutcome = Literal["admitted", "unchecked", "accepted", "downgraded", "shed"]
"""How the SLO admission treated an RT request: admitted (its forecast meets the contract),
unchecked (no engine state to forecast from: admitted), accepted (forecast to miss, run as RT
anyway), downgraded (forecast to miss, run as BE) or shed (forecast to miss, refused)."""


class Slo(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's SLO contract. RT tenants set TTFT/TPOT targets; BE tenants may set a deadline."""

    # The targets are *_target_ms in Python (ttft_ms / tpot_ms name measurements: timers, usage
    # records); their JSON keys stay "ttft_ms" / "tpot_ms", the admin API's documented contract.
    ttft_target_ms: float | None = msgspec.field(default=None, name="ttft_ms")
    """Time-to-first-token target, ms after arrival (None: no target). JSON key "ttft_ms"."""
    tpot_target_ms: float | None = msgspec.field(default=None, name="tpot_ms")
    """Time-per-output-token target, mean over the tokens after the first, ms (None: no target).
    JSON key "tpot_ms"."""
    deadline_s: float | None = None
    """BE completion deadline, seconds after arrival (None: no deadline)."""
    allow_rt: bool = False
    """Whether a BE tenant may ask for tier "rt" per request."""
    on_unattainable: OnUnattainable = "reject"
    """What to do with an RT request the admission forecast says will miss its targets (see
    `OnUnattainable`)."""
    weight: float = 1.0
    """The tenant's weight in the engine's fair share between tenants (> 0; relative to the
    other tenants' weights)."""


class Quota(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's limits; None means unlimited."""

    requests_per_min: int | None = None
    """Requests admitted per minute, requests."""
    tokens_per_min: int | None = None
    """Prompt plus completion tokens per minute, tokens."""
    max_concurrent: int | None = None
    """Requests in flight at once, requests."""
    monthly_tokens: int | None = None
    """Prompt plus completion tokens per calendar month (UTC), tokens."""


class Tenant(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant with its contract and quota."""

    id: str
    """Tenant id, "ten_" + 12 hex digits."""
    name: str
    """Unique (among live tenants) human-readable name."""
    tier: Tier
    """Default service tier of the tenant's requests."""
    slo: Slo
    """The SLO contract."""
    quota: Quota
    """The limits."""
    created_at: datetime
    """When the tenant was created (UTC)."""
    updated_at: datetime
    """When the tenant, its contract or its quota last changed (UTC)."""
    deleted: bool = False
    """Soft-deleted: kept so usage stays attributable, but invisible to normal lookups."""


class ApiKey(msgspec.Struct, frozen=True, kw_only=True):
    """An API key's public part (the secret is never stored, only its SHA-256)."""

    id: str
    """Key id, "key_" + 12 hex digits."""
    tenant_id: str
    """The tenant the key belongs to."""
    prefix: str
    """Non-secret lookup handle embedded in the key (see gateway.keys)."""
    name: str | None = None
    """Optional label chosen by the operator."""
    created_at: datetime
    """When the key was created (UTC)."""
    revoked_at: datetime | None = None
    """When the key was revoked (UTC); None while it is valid."""
    last_used_at: datetime | None = None
    """Last authenticated use (UTC), written in batches, so it may lag by seconds."""


class AuthRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What authentication needs for one key prefix, read in one query."""

    key_id: str
    """The key's id."""
    prefix: str
    """The key's prefix."""
    secret_sha256: str
    """Hex SHA-256 of the whole key, compared with gateway.keys.digest_matches."""
    revoked: bool
    """True when the key was revoked or its tenant deleted: reject it."""
    tenant: Tenant
    """The key's tenant with contract and quota."""


class UsageRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished (or failed) request, as written to usage_records."""

    request_id: str
    """The gateway's request id."""
    tenant_id: str
    """The tenant billed."""
    key_id: str | None = None
    """The API key used (None for requests not made with a key)."""
    tier: Tier
    """Tier the request ran in."""
    model: str
    """Model id the client asked for."""
    endpoint: str
    """"chat", "completions", ... (which API was called)."""
    stream: bool = False
    """Whether the response was streamed."""
    prompt_tokens: int = 0
    """Prompt length, tokens."""
    completion_tokens: int = 0
    """Generated tokens."""
    queue_ms: float | None = None
    """Time from arrival to the first scheduling, ms."""
    ttft_ms: float | None = None
    """Time to first token, ms after arrival."""
    tbt_mean_ms: float | None = None
    """Mean time between tokens, ms. Derived, not stored: __post_init__ sets it to tpot_ms (the
    mean gap after the first token is TPOT by definition), replacing any value passed; kept
    because the admin API's /requests output documents it."""
    tbt_max_ms: float | None = None
    """Largest time between two tokens, ms."""
    tpot_ms: float | None = None
    """Time per output token after the first, ms."""
    e2e_ms: float | None = None
    """Arrival to last byte, ms."""
    status: str
    """"ok", or how it failed (gateway.pipeline.outcome.FailureKind): "rate_limited",
    "client_disconnected" (a cancel), "interrupted" (batch work a shutdown cut off: in no
    report), "engine_unavailable", ..."""
    http_status: int
    """HTTP status sent to the client."""
    error: str | None = None
    """Error message, if any."""
    slo_met: bool | None = None
    """Whether the request met its tenant's SLO (None: no SLO applied)."""
    admission: AdmissionOutcome | None = None
    """How the SLO admission treated it (None: it never reached that check — not an RT request,
    refused earlier, or invalid)."""
    engine: str | None = None
    """The engine (replica) it ran on, by its name in `/readyz` and `/metrics` (its URL;
    `<url>#dp<k>` for one rank of SGLang's data parallelism); a request placed again because
    its engine refused the connection names the second. None: it was never placed (invalid,
    or refused before: a quota, a full queue, the SLO admission)."""
    created_at: datetime
    """Request start (arrival at the gateway), UTC."""
    finished_at: datetime
    """When the response ended, UTC."""
    id: int | None = None
    """Row id assigned by the database (None before insert)."""

    def __post_init__(self) -> None:
        # tbt_mean_ms is derived, like a property, so that it can never disagree with tpot_ms,
        # whether the record was built by a handler, copied with msgspec.structs.replace (which
        # passes the old value back in) or read from usage_records (which has no such column).
        msgspec.structs.force_setattr(self, "tbt_mean_ms", self.tpot_ms)
