"""How one tenant's limits are split among the gateway instances sharing a database (pure).

Every instance computes the same split from the same table snapshot, so the parts add up to the
limit. A part is a floor (`FLOOR_SHARE` of the limit, evenly over the live instances, so an
instance that has seen no traffic for the tenant can still serve its first request) plus the rest
in proportion to each instance's recent demand.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

FLOOR_SHARE = 0.1
"""Part of every limit split evenly among live instances regardless of demand."""


def weights(instances: Sequence[str], demand: Mapping[str, float]) -> dict[str, float]:
    """Each live instance's fraction of a limit (they sum to 1); *demand* may omit instances."""
    if not instances:
        return {}
    n = len(instances)
    total = sum(max(demand.get(i, 0.0), 0.0) for i in instances)
    if total <= 0:
        return {i: 1.0 / n for i in instances}
    return {
        i: FLOOR_SHARE / n + (1.0 - FLOOR_SHARE) * max(demand.get(i, 0.0), 0.0) / total
        for i in instances
    }


def allocate(limit: int, fractions: Mapping[str, float], epoch: int = 0) -> dict[str, int]:
    """Whole units of *limit* per instance, in proportion to *fractions* (largest remainder).

    Ties on the remainder go in an order that rotates with *epoch* (the same on every instance),
    so with a limit smaller than the number of instances no instance is always the one left out.
    """
    if not fractions:
        return {}
    exact = {i: limit * f for i, f in fractions.items()}
    parts = {i: int(v) for i, v in exact.items()}
    left = limit - sum(parts.values())
    order = sorted(exact, key=lambda i: (-(exact[i] - parts[i]), _rotation(i, epoch)))
    for i in order[: max(left, 0)]:
        parts[i] += 1
    return parts


def _rotation(instance_id: str, epoch: int) -> str:
    return hashlib.sha1(f"{epoch}:{instance_id}".encode()).hexdigest()
