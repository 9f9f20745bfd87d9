"""The limiter: per-tenant admission against the tenant's quota, and this gateway instance's share
of every limit, kept in step with the other instances. Entirely in memory (pure; no I/O).

`QuotaLimiter.admit` is called once per request before it reaches the engine and either returns
a `Ticket` or raises `QuotaExceeded`; `release` is called exactly once when the request ends,
with the tokens it really used. The limiter holds every tenant's state on this instance (token
buckets, in-flight and month counts, recent demand) and sizes each tenant's buckets and
concurrency slots to this instance's share of the limit. The share comes from `apply_sync`, fed
by gateway.quotas.sync with the figures every instance writes to the database (`SyncView`);
`sync_out` hands this instance's own demand (`DemandReport`) and month token counts to that
writer. The split itself is gateway.quotas.shares.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from gateway.quotas.bucket import TokenBucket
from gateway.quotas.shares import allocate, weights
from gateway.store.types import Quota, Tenant

IDLE_FORGET_S = 600.0
"""A tenant with nothing in flight and no request for this long is forgotten (its state and its
demand row go; it starts afresh, with full buckets, on its next request)."""
_DEMAND_DECAY = 0.5
"""Smoothed demand falls by this factor per sync without traffic (rises at once with it)."""


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


class RequestTooLarge(Exception):
    """A request that no wait could admit: it needs more tokens than its tenant's whole
    tokens_per_min limit. Answered 400 (not 429: retrying it unchanged cannot help)."""

    def __init__(self, message: str, needed_tokens: int, limit_tokens: int) -> None:
        super().__init__(message)
        self.message = message
        self.needed_tokens = needed_tokens
        """Prompt plus output cap, tokens."""
        self.limit_tokens = limit_tokens
        """The tenant's tokens_per_min."""


class LimitIsZero(Exception):
    """A request of a tenant one of whose limits is 0 (requests_per_min, max_concurrent,
    monthly_tokens; tokens_per_min 0 is a `RequestTooLarge`): no request of it can ever pass,
    so it is refused for good (403), not told to retry (429)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit
        """The limit that is 0 (a quota field name)."""
        self.message = message


_ZERO_LIMITS = ("requests_per_min", "max_concurrent", "monthly_tokens")
"""Limits whose value 0 admits no request at all (checked for interactive requests; a batch
line is held to monthly_tokens only)."""


@dataclass
class Ticket:
    """An admitted request's hold on its tenant's quota, given back by `release`."""

    tenant_id: str
    reserved_tokens: int
    """Prompt plus max output tokens, counted against tokens/min at admission."""
    interactive: bool = True
    """False for a Batch-API line: it counts toward the monthly budget only."""
    released: bool = False


@dataclass(frozen=True)
class LimitStatus:
    """Where a tenant stands against one per-minute limit on this instance (the
    `x-ratelimit-*` response headers)."""

    limit: int
    """The tenant's limit per minute (requests or tokens), all instances together."""
    remaining: int
    """What this instance would admit now (its bucket's whole units; 0 when in debt)."""
    reset_s: float
    """Seconds until this instance's bucket is full again (0: it is full)."""


@dataclass
class DemandReport:
    """One tenant's demand on this instance since the previous sync, per second, smoothed."""

    tenant_id: str
    requests: float
    tokens: float
    concurrency: float
    in_flight: int


@dataclass
class SyncView:
    """What the database says at a sync: live instances and every instance's demand."""

    instances: list[str]
    """Live gateway instances (this one included), in a stable order."""
    demand: dict[str, dict[str, DemandReport]]
    """tenant id → instance id → that instance's latest demand report."""
    monthly_tokens: dict[str, int]
    """tenant id → tokens used this month by all instances (what has been synced)."""
    month: str
    """The month these totals are for, "YYYY-MM"."""
    epoch: int = 0
    """A counter the same on every instance (time // 10 s), rotating ties in slot allocation."""


@dataclass
class _Window:
    requests: int = 0
    tokens: int = 0
    concurrency: int = 0


@dataclass
class TenantState:
    """One tenant's quota state on this instance."""

    quota: Quota
    name: str
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    in_flight: int = 0
    reserved_tokens: int = 0
    spent_since_sync: int = 0
    """Tokens used by requests finished since the last sync (not in `month_used` yet)."""
    pushing: int = 0
    """Tokens handed to a sync still under way (in `month_used` once it has answered)."""
    month_used: int = 0
    """Tokens used this month by all instances, as of the last sync."""
    month: str = ""
    w_requests: float | None = None
    w_tokens: float | None = None
    w_concurrency: dict[str, float] | None = None
    slots: int | None = None
    """Concurrency slots of this instance (None: no max_concurrent), kept with the shares."""
    window: _Window = field(default_factory=_Window)
    smoothed: DemandReport | None = None
    last_seen_s: float = 0.0


class QuotaLimiter:
    """Admission control for every tenant's quota on this gateway instance, against this
    instance's share of each limit."""

    def __init__(
        self,
        instance_id: str,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.instance_id = instance_id
        self._clock = clock
        self._wall_clock = wall_clock
        self._tenants: dict[str, TenantState] = {}
        self._instances: list[str] = [instance_id]
        self._epoch = 0
        self._last_sync_s = clock()
        self._unsynced_month: dict[tuple[str, str], int] = {}
        """(tenant id, month) → tokens used here and not yet added to the shared total."""
        self._month_totals: dict[str, int] = {}
        self._view_month = ""
        self._month_cache = ("", -1.0)
        """(month key, clock reading until which it is valid): no calendar work per request."""

    @property
    def instances(self) -> int:
        """Live gateway instances sharing the limits, as of the last sync (this one included)."""
        return len(self._instances)

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per tenant id (tenants with none omitted)."""
        return {t: s.in_flight for t, s in self._tenants.items() if s.in_flight}

    # ------------------------------------------------------------------ requests

    def admit(
        self, tenant: Tenant, prompt_tokens: int, max_tokens: int, *, interactive: bool = True
    ) -> Ticket:
        """Admits a request of *tenant* needing up to prompt + max_tokens tokens, or raises
        QuotaExceeded naming the first limit it is over (RequestTooLarge when it needs more
        than the whole tokens_per_min, LimitIsZero when a limit is 0). Unlimited tenants cost a
        dict lookup.

        A Batch-API line (*interactive* False) is held to the monthly budget only: like
        OpenAI's, batches do not draw on the per-minute limits, and the batch runner paces them
        (and keeps the engine's RT headroom) on its own."""
        now = self._clock()
        state = self._state(tenant, now)
        quota = state.quota
        amount = prompt_tokens + max_tokens
        for limit in _ZERO_LIMITS if interactive else ("monthly_tokens",):
            if getattr(quota, limit) == 0:
                raise LimitIsZero(
                    limit,
                    f"tenant {tenant.name!r} may send no requests: its {limit} limit is 0; no "
                    "retry can pass until an operator raises it (PATCH /admin/v1/tenants/{id})",
                )
        if interactive and quota.tokens_per_min is not None and amount > quota.tokens_per_min:
            # first: whatever else it is over, waiting cannot help this one
            raise RequestTooLarge(
                f"request too large for tenant {tenant.name!r}: it needs up to {amount} tokens "
                f"(prompt {prompt_tokens} + output cap {max_tokens}: its max_tokens, or the "
                "gateway's default cap gateway.default_max_tokens when it sets none), more than "
                f"its whole tokens_per_min limit of {quota.tokens_per_min}; no retry can pass: "
                "lower max_tokens (or the prompt)",
                amount,
                quota.tokens_per_min,
            )
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

    def limit_status(self, tenant_id: str) -> tuple[LimitStatus | None, LimitStatus | None]:
        """(requests/min, tokens/min) status of *tenant_id* now; None for a limit the tenant
        does not have (or a tenant this instance has not seen). With several instances, each
        admits its share of a limit (see the package doc): `remaining` and `reset_s` are this
        instance's, `limit` the tenant's."""
        state = self._tenants.get(tenant_id)
        if state is None:
            return None, None
        now = self._clock()
        quota = state.quota
        return (
            _status(state.requests, quota.requests_per_min, now),
            _status(state.tokens, quota.tokens_per_min, now),
        )

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

    # ---------------------------------------------------------------------- sync

    def sync_out(self) -> tuple[list[DemandReport], dict[tuple[str, str], int]]:
        """This instance's demand per tenant, and the month token counts to add to the shared
        totals (taken out of the limiter: give them back with `sync_failed` if the write fails).
        Forgets idle tenants."""
        now = self._clock()
        elapsed = max(now - self._last_sync_s, 1e-3)
        self._last_sync_s = now
        reports = []
        for tenant_id, state in list(self._tenants.items()):
            if state.in_flight == 0 and now - state.last_seen_s > IDLE_FORGET_S:
                del self._tenants[tenant_id]
                continue
            reports.append(self._smooth(tenant_id, state, elapsed))
        deltas, self._unsynced_month = self._unsynced_month, {}
        for state in self._tenants.values():
            state.pushing += state.spent_since_sync
            state.spent_since_sync = 0
        return reports, deltas

    def sync_failed(self, deltas: dict[tuple[str, str], int]) -> None:
        """Keeps month counts whose write failed, for the next sync."""
        for key, tokens in deltas.items():
            self._unsynced_month[key] = self._unsynced_month.get(key, 0) + tokens
        for state in self._tenants.values():
            state.spent_since_sync += state.pushing
            state.pushing = 0

    def apply_sync(self, view: SyncView) -> None:
        """Sets every tenant's share of its limits from the shared view."""
        self._instances = list(view.instances) or [self.instance_id]
        if self.instance_id not in self._instances:
            self._instances.append(self.instance_id)
        self._epoch = view.epoch
        now = self._clock()
        for tenant_id, state in self._tenants.items():
            demand = view.demand.get(tenant_id, {})
            if state.smoothed is not None:
                demand = {**demand, self.instance_id: state.smoothed}
            state.w_requests = weights(self._instances, {i: d.requests for i, d in demand.items()})[
                self.instance_id
            ]
            state.w_tokens = weights(self._instances, {i: d.tokens for i, d in demand.items()})[
                self.instance_id
            ]
            state.w_concurrency = weights(
                self._instances, {i: d.concurrency for i, d in demand.items()}
            )
            state.month = view.month
            state.month_used = view.monthly_tokens.get(tenant_id, 0)
            state.pushing = 0
            self._resize(state, now)
        self._month_totals = dict(view.monthly_tokens)
        self._view_month = view.month

    # ------------------------------------------------------------------- helpers

    def _state(self, tenant: Tenant, now: float) -> TenantState:
        state = self._tenants.get(tenant.id)
        if state is None:
            state = TenantState(quota=tenant.quota, name=tenant.name, last_seen_s=now)
            if self._view_month == self._month():
                state.month = self._view_month
                state.month_used = self._month_totals.get(tenant.id, 0)
            self._tenants[tenant.id] = state
            self._resize(state, now)
        elif state.quota != tenant.quota:  # changed through the admin API: applies at once
            state.quota = tenant.quota
            self._resize(state, now, limit_changed=True)
        return state

    def _shared_wait(self, wait_s: float, amount: int, per_min: int) -> float:
        """The Retry-After of a bucket: its own wait when this instance is alone; with others,
        at most what the whole limit needs to refill *amount* (the shares move meanwhile)."""
        if wait_s <= 0 or len(self._instances) == 1 or per_min <= 0:
            return wait_s
        return min(wait_s, max(60.0 * amount / per_min, 1e-3))

    def _even(self) -> float:
        return 1.0 / max(len(self._instances), 1)

    def _resize(self, state: TenantState, now: float, limit_changed: bool = False) -> None:
        # a new share (sync) only resizes: growing the level with every share change would let
        # oscillating shares mint tokens; a raised limit (admin) grants its extra burst at once
        quota = state.quota
        state.slots = self._slots(state) if quota.max_concurrent is not None else None
        if quota.requests_per_min is None:
            state.requests = None
        else:
            w = state.w_requests if state.w_requests is not None else self._even()
            state.requests = _sized(state.requests, quota.requests_per_min * w, now, limit_changed)
        if quota.tokens_per_min is None:
            state.tokens = None
        else:
            w = state.w_tokens if state.w_tokens is not None else self._even()
            state.tokens = _sized(state.tokens, quota.tokens_per_min * w, now, limit_changed)

    def _slots(self, state: TenantState) -> int:
        limit = state.quota.max_concurrent or 0
        fractions = state.w_concurrency or {i: self._even() for i in self._instances}
        if self.instance_id not in fractions:
            fractions = {i: self._even() for i in self._instances}
        return allocate(limit, fractions, self._epoch)[self.instance_id]

    def _smooth(self, tenant_id: str, state: TenantState, elapsed_s: float) -> DemandReport:
        win, prev = state.window, state.smoothed
        current = DemandReport(
            tenant_id,
            win.requests / elapsed_s,
            win.tokens / elapsed_s,
            float(max(win.concurrency, state.in_flight)),
            state.in_flight,
        )
        if prev is not None:
            current.requests = max(current.requests, prev.requests * _DEMAND_DECAY)
            current.tokens = max(current.tokens, prev.tokens * _DEMAND_DECAY)
            current.concurrency = max(current.concurrency, prev.concurrency * _DEMAND_DECAY)
        state.smoothed = current
        state.window = _Window()
        return current

    def _month(self) -> str:
        month, valid_until = self._month_cache
        now = self._clock()
        if now >= valid_until:
            month = month_key(self._wall_clock())
            self._month_cache = (month, now + 1.0)
        return month


def month_key(when: datetime) -> str:
    """ "YYYY-MM" of *when* in UTC."""
    return when.astimezone(UTC).strftime("%Y-%m")


def _status(bucket: TokenBucket | None, per_min: int | None, now: float) -> LimitStatus | None:
    if bucket is None or per_min is None:
        return None
    bucket.refill(now)
    missing = bucket.capacity - bucket.level
    reset_s = missing / bucket.rate_per_s if missing > 0 and bucket.rate_per_s > 0 else 0.0
    return LimitStatus(limit=per_min, remaining=max(0, math.floor(bucket.level)), reset_s=reset_s)


def _sized(
    bucket: TokenBucket | None, per_min: float, now: float, grant_growth: bool
) -> TokenBucket:
    if bucket is None:
        return TokenBucket.full(per_min, per_min / 60.0, now)
    bucket.resize(per_min, per_min / 60.0, now, grant_growth=grant_growth)
    return bucket


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
