"""Per-tenant admission against the tenant's quota, entirely in memory (pure; no I/O).

`QuotaLimiter.admit` is called once per request before it reaches the engine and either returns
a `Ticket` or raises `QuotaExceeded`; `release` is called exactly once when the request ends,
with the tokens it really used. What this instance may use of each limit (its share) is set by
`apply_sync`, from the figures every instance writes to the database (see gateway.quotas.sync);
the per-tenant state and the shares are `SharedLimits` (gateway.quotas.sharing), which
`QuotaLimiter` extends with the admission checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

from gateway.quotas.sharing import IDLE_FORGET_S as IDLE_FORGET_S
from gateway.quotas.sharing import DemandReport as DemandReport
from gateway.quotas.sharing import SharedLimits, TenantState
from gateway.quotas.sharing import SyncView as SyncView
from gateway.quotas.sharing import month_key as month_key
from gateway.store.types import Tenant


class QuotaExceeded(Exception):
    """A request over one of its tenant's limits: answered 429 with Retry-After."""

    def __init__(self, limit: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.limit = limit
        """The quota field that refused it: requests_per_min, tokens_per_min, max_concurrent or
        monthly_tokens."""
        self.message = message
        self.retry_after_s = retry_after_s
        """When a retry may succeed, seconds (whole, at least 1)."""


@dataclass
class Ticket:
    """An admitted request's hold on its tenant's quota, given back by `release`."""

    tenant_id: str
    reserved_tokens: int
    """Prompt plus max output tokens, counted against tokens/min at admission."""
    interactive: bool = True
    """False for a Batch-API line: it counts toward the monthly budget only."""
    released: bool = False


class QuotaLimiter(SharedLimits):
    """Admission control for every tenant's quota on this gateway instance."""

    # ------------------------------------------------------------------ requests

    def admit(
        self, tenant: Tenant, prompt_tokens: int, max_tokens: int, *, interactive: bool = True
    ) -> Ticket:
        """Admits a request of *tenant* needing up to prompt + max_tokens tokens, or raises
        QuotaExceeded naming the first limit it is over. Unlimited tenants cost a dict lookup.

        A Batch-API line (*interactive* False) is held to the monthly budget only: like
        OpenAI's, batches do not draw on the per-minute limits, and the batch runner paces them
        (and keeps the engine's RT headroom) on its own."""
        now = self._clock()
        state = self._state(tenant, now)
        quota = state.quota
        amount = prompt_tokens + max_tokens
        if not interactive:
            self._check_monthly(state, tenant)
            state.reserved_tokens += amount
            state.last_seen_s = now
            return Ticket(tenant_id=tenant.id, reserved_tokens=amount, interactive=False)
        state.window.requests += 1
        state.window.tokens += amount
        state.window.concurrency = max(state.window.concurrency, state.in_flight + 1)
        state.last_seen_s = now
        self._check_concurrency(state, tenant)
        self._check_monthly(state, tenant)
        if quota.requests_per_min is not None:
            assert state.requests is not None
            wait = self._shared_wait(state.requests.wait_s(1, now), 1, quota.requests_per_min)
            if wait > 0:
                raise _over(
                    tenant, "requests_per_min", quota.requests_per_min, "requests per minute", wait
                )
        if quota.tokens_per_min is not None:
            assert state.tokens is not None
            if amount > quota.tokens_per_min:
                raise QuotaExceeded(
                    "tokens_per_min",
                    f"request too large for tenant {tenant.name!r}: it needs up to {amount} "
                    f"tokens (prompt {prompt_tokens} + max_tokens {max_tokens}), more than the "
                    f"tokens_per_min limit of {quota.tokens_per_min}; lower max_tokens",
                    60.0,
                )
            wait = self._shared_wait(state.tokens.wait_s(amount, now), amount, quota.tokens_per_min)
            if wait > 0:
                raise _over(
                    tenant,
                    "tokens_per_min",
                    quota.tokens_per_min,
                    "tokens per minute",
                    wait,
                    needed=amount,
                )
        # every check passed: take from each limit at once (a refusal above takes nothing)
        if state.requests is not None:
            state.requests.take(1)
        if state.tokens is not None:
            state.tokens.take(amount)
        state.in_flight += 1
        state.reserved_tokens += amount
        return Ticket(tenant_id=tenant.id, reserved_tokens=amount)

    def release(self, ticket: Ticket, used_tokens: int) -> None:
        """Ends an admitted request that used *used_tokens* (prompt + completion; 0 if it never
        ran): frees its concurrency slot and gives back to tokens/min what it did not use."""
        if ticket.released:
            return
        ticket.released = True
        state = self._tenants.get(ticket.tenant_id)
        if state is None:
            return
        now = self._clock()
        state.reserved_tokens = max(0, state.reserved_tokens - ticket.reserved_tokens)
        if ticket.interactive:
            state.in_flight = max(0, state.in_flight - 1)
            if state.tokens is not None:
                state.tokens.give(ticket.reserved_tokens - used_tokens, now)
        if used_tokens > 0:
            state.spent_since_sync += used_tokens
            key = (ticket.tenant_id, self._month())
            self._unsynced_month[key] = self._unsynced_month.get(key, 0) + used_tokens
        state.last_seen_s = now

    def _check_concurrency(self, state: TenantState, tenant: Tenant) -> None:
        slots = state.slots
        if slots is None:
            return
        limit = state.quota.max_concurrent
        if state.in_flight >= slots:
            raise QuotaExceeded(
                "max_concurrent",
                f"rate limit reached for tenant {tenant.name!r}: max_concurrent is {limit} "
                f"requests in flight at once ({state.in_flight} running here); retry when one "
                "finishes",
                1.0,
            )

    def _check_monthly(self, state: TenantState, tenant: Tenant) -> None:
        budget = state.quota.monthly_tokens
        if budget is None:
            return
        month = self._month()
        used = state.month_used if state.month == month else 0
        share = state.w_tokens if state.w_tokens is not None else self._even()
        allowance = max(budget - used, 0) * share
        spent_here = state.spent_since_sync + state.pushing
        if spent_here + state.reserved_tokens < allowance:
            return
        raise QuotaExceeded(
            "monthly_tokens",
            f"monthly token budget exhausted for tenant {tenant.name!r}: monthly_tokens is "
            f"{budget} and {min(used + spent_here, budget)} have been used in {month}",
            _seconds_to_next_month(self._wall_clock()),
        )


def _over(
    tenant: Tenant, limit: str, value: int, unit: str, wait_s: float, needed: int | None = None
) -> QuotaExceeded:
    retry = _whole_seconds(wait_s)
    need = f" (this request needs {needed})" if needed is not None else ""
    return QuotaExceeded(
        limit,
        f"rate limit reached for tenant {tenant.name!r}: {limit} is {value} {unit}{need}; "
        f"retry after {retry} s",
        retry,
    )


def _whole_seconds(wait_s: float) -> float:
    if math.isinf(wait_s):
        return 60.0
    return float(max(1, math.ceil(wait_s)))


def _seconds_to_next_month(now: datetime) -> float:
    now = now.astimezone(UTC)
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = start.replace(year=now.year + (now.month == 12), month=now.month % 12 + 1)
    return float(max(1, math.ceil((end - now).total_seconds())))
