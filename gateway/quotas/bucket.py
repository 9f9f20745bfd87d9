"""A token bucket whose size and rate can change while it is in use (pure; no I/O)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class TokenBucket:
    """Holds up to `capacity` units and refills at `rate_per_s`.

    A take may drive the level below zero when the amount is larger than the whole bucket (a
    request bigger than this instance's share of a limit): it is admitted once the bucket is full
    and the debt is paid back by the refill, so the long-run rate still holds.
    """

    capacity: float
    """Most units the bucket holds (the burst)."""
    rate_per_s: float
    """Refill, units per second."""
    level: float
    """Units available now (negative: a debt)."""
    updated_s: float
    """Clock reading of the last refill, seconds."""

    @classmethod
    def full(cls, capacity: float, rate_per_s: float, now_s: float) -> TokenBucket:
        return cls(capacity=capacity, rate_per_s=rate_per_s, level=capacity, updated_s=now_s)

    def refill(self, now_s: float) -> None:
        elapsed = max(0.0, now_s - self.updated_s)
        self.level = min(self.capacity, self.level + elapsed * self.rate_per_s)
        self.updated_s = now_s

    def wait_s(self, amount: float, now_s: float) -> float:
        """Seconds until *amount* can be taken (0: now; inf: never at this rate)."""
        self.refill(now_s)
        need = min(amount, self.capacity)
        if self.level >= need and self.capacity > 0:
            return 0.0
        if self.rate_per_s <= 0:
            return math.inf
        return max(need - self.level, 0.0) / self.rate_per_s if self.capacity > 0 else math.inf

    def take(self, amount: float) -> None:
        """Takes *amount* (call after `wait_s` returned 0)."""
        self.level -= amount

    def give(self, amount: float, now_s: float) -> None:
        """Returns *amount* unused units (never beyond capacity); a negative amount takes more."""
        self.refill(now_s)
        self.level = min(self.capacity, self.level + amount)

    def resize(
        self, capacity: float, rate_per_s: float, now_s: float, *, grant_growth: bool = False
    ) -> None:
        """New size and rate from now on; the level never exceeds the new size. With
        *grant_growth* a larger size also adds the difference to the level (an operator raised
        the limit: the tenant gets the extra burst at once)."""
        if capacity == self.capacity and rate_per_s == self.rate_per_s:
            return
        self.refill(now_s)
        if grant_growth and capacity > self.capacity:
            self.level += capacity - self.capacity
        self.capacity = capacity
        self.rate_per_s = rate_per_s
        self.level = min(self.level, capacity)
