"""The admit stage: may this request go to an engine now, and on what terms?

Admission is a sequence of checks (`ADMISSION_CHECKS` builds it from the app). Each check looks
at the request as admitted so far (`Admitted`) and returns either

* an `Admitted` — the same one, one with a hold added (a resource it reserved for the request,
  given back by the record stage), or one with a changed request (a check may change its terms),
* or a `Refused` (gateway/pipeline/outcome.py): HTTP status, OpenAI code, message, whether a retry
  may succeed and when.

The first refusal ends admission, and the holds the earlier checks took are given back at once.
Today there is one check, the tenant's quota (gateway/quotas). The next ones slot in after it:

* **SLO feasibility** — predict from the engine's live state whether the RT contract (TTFT,
  TPOT) can be met; its outcomes are `Refused(429, code="slo_unattainable", retryable=True)`,
  an `Admitted` whose request was rebuilt for tier "be" (a downgrade: `build_engine_request`
  with tier "be" gives the BE metadata and priority; the response's id, the usage record and
  the engine all follow the admitted request), or the `Admitted` it was given (accept).
* **per-tenant fairness** — a tenant over its fair share of the engine while others wait:
  `Refused(429, retryable=True)` with a short `retry_after_s`, or a hold on its share.

A check that needs the engine's state reads it through the app (it is given the app when
`ADMISSION_CHECKS` builds it), so `admit_through` itself stays a pure function of its checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from aiohttp import web

from gateway.metrics import GatewayMetrics
from gateway.pipeline.outcome import Refused
from gateway.pipeline.prepare import EngineRequest
from gateway.quotas.limiter import QuotaExceeded, QuotaLimiter, Ticket
from gateway.state import METRICS, QUOTAS
from gateway.store.types import Tenant

Origin = Literal["api", "batch"]
"""Where a request came from: a client's HTTP call, or a line of a Batch-API batch (which the
batch runner paces itself, so it counts toward the monthly token budget only)."""


class Hold(Protocol):
    """A resource an admission check reserved for a request, held until it ends."""

    def release(self, used_tokens: int) -> None:
        """Gives the resource back; *used_tokens* (prompt + completion, 0 if the request never
        ran) is what the request really cost. Called exactly once."""


@dataclass(frozen=True)
class Admitted:
    """A request that passed the admission checks run so far, with what they hold for it."""

    tenant: Tenant
    origin: Origin
    request: EngineRequest
    """The request to run (a check may have changed its terms, e.g. its tier)."""
    holds: tuple[Hold, ...] = ()
    """Given back by the record stage when the request ends (or by `admit_through` when a later
    check refuses it)."""

    def holding(self, hold: Hold) -> Admitted:
        """This admission with one more hold."""
        return replace(self, holds=(*self.holds, hold))


AdmissionCheck = Callable[[Admitted], Admitted | Refused]
"""One admission check: the request as admitted so far → admitted (perhaps on changed terms,
perhaps holding more) or refused."""


def admit_through(checks: Sequence[AdmissionCheck], candidate: Admitted) -> Admitted | Refused:
    """Runs *checks* in order; the first refusal wins and releases what earlier checks hold."""
    admitted = candidate
    for check in checks:
        outcome = check(admitted)
        if isinstance(outcome, Refused):
            release_holds(admitted.holds, used_tokens=0)
            return outcome
        admitted = outcome
    return admitted


def release_holds(holds: Sequence[Hold], used_tokens: int) -> None:
    """Gives back every hold of a request that used *used_tokens*."""
    for hold in holds:
        hold.release(used_tokens)


def admission_checks(app: web.Application) -> tuple[AdmissionCheck, ...]:
    """The checks every request passes, in order (the cheapest and most final first)."""
    return (QuotaCheck(app[QUOTAS], app[METRICS]),)


# ---------------------------------------------------------------------------------- quotas


@dataclass(frozen=True)
class QuotaHold:
    """A request's hold on its tenant's quota (a `Ticket` of the limiter)."""

    limiter: QuotaLimiter
    ticket: Ticket

    def release(self, used_tokens: int) -> None:
        self.limiter.release(self.ticket, used_tokens)


@dataclass(frozen=True)
class QuotaCheck:
    """The tenant's requests/min, tokens/min, concurrency and monthly budget (in memory, no I/O).

    A request counts its prompt plus its output cap when admitted; batch lines count toward
    the monthly budget only (gateway/quotas/__init__.py explains why)."""

    limiter: QuotaLimiter
    metrics: GatewayMetrics

    def __call__(self, admitted: Admitted) -> Admitted | Refused:
        request = admitted.request
        try:
            ticket = self.limiter.admit(
                admitted.tenant,
                len(request.input_ids),
                request.max_tokens,
                interactive=admitted.origin == "api",
            )
        except QuotaExceeded as exc:
            self.metrics.quota_rejected(admitted.tenant.id, exc.limit)
            return Refused(
                kind="rate_limited",
                http_status=429,
                message=exc.message,
                code=f"{exc.limit}_exceeded",
                retryable=True,
                retry_after_s=int(exc.retry_after_s),
            )
        return admitted.holding(QuotaHold(self.limiter, ticket))
