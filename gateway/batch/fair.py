"""Which batch's line goes to the engine next when batches of several tenants run at once:
weighted fair share among the tenants (the engine's rule, backend.policy.fair_share), each
tenant's own batches by urgency, each batch's lines in its own (prefix-tree) order.

    tenants with a line to send   → the one with the least virtual token counter
    its batches, most urgent first → the first one whose feed hands out a line
    that line's prompt tokens      → charged to the tenant when it is sent (÷ weight)
    its output tokens              → charged when it finishes

A tenant is backlogged while it has a batch being fed; one that comes back after idling starts
level with the least served of the others (no credit for idle time). The batch runner
(gateway/batch/runner.py) asks `pick_lines` once per dispatch round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from backend.policy.fair_share import FairShare

B = TypeVar("B")

DEFAULT_WEIGHT = 1.0
"""The weight of a tenant whose record carries none."""


def tenant_weight(tenant: Any) -> float:
    """A tenant's fair-share weight: its SLO contract's `weight` (`tenant.slo.weight`) when the
    tenant record carries a positive one, else DEFAULT_WEIGHT."""
    weight = getattr(getattr(tenant, "slo", None), "weight", None)
    return float(weight) if isinstance(weight, int | float) and weight > 0 else DEFAULT_WEIGHT


class TenantShares:
    """The batch runner's fair-share state: one virtual token counter per tenant."""

    def __init__(self) -> None:
        self.fair = FairShare()
        """The counters (weighted tokens sent to the engine per tenant)."""

    def set_backlogged(self, tenants: Iterable[str]) -> None:
        """`tenants` have a batch being fed now; every other tenant has none."""
        now = set(tenants)
        for tenant in self.fair.backlogged - now:
            self.fair.set_idle(tenant)
        for tenant in sorted(now - self.fair.backlogged):
            self.fair.set_backlogged(tenant)

    def charge(self, tenant: str, tokens: float, weight: float) -> None:
        """`tokens` of the tenant's lines were sent (prompt) or produced (output)."""
        self.fair.charge(tenant, tokens, weight)

    def pick_lines(
        self,
        batches: Mapping[str, Sequence[B]],
        next_line: Callable[[B], int | None],
        limit: int,
    ) -> Iterator[tuple[B, int]]:
        """Up to `limit` (batch, line) pairs in dispatch order. `batches`: tenant → its batches,
        most urgent first; `next_line(batch)` hands out the batch's next line or None (nothing
        to send now). The caller charges each line as it takes it (`charge`), so the next pick
        sees it. A tenant none of whose batches has a line is passed over for the round."""
        open_tenants = {t: list(bs) for t, bs in batches.items() if bs}
        sent = 0
        while sent < limit and open_tenants:
            tenant = self.fair.pick(open_tenants)
            assert tenant is not None
            for batch in open_tenants[tenant]:
                line = next_line(batch)
                if line is not None:
                    sent += 1
                    yield batch, line
                    break
            else:
                del open_tenants[tenant]
