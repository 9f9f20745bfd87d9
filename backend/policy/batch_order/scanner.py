"""Feeding requests in plan order under a memory budget: the dual scanner (BlendServe, digest 002
§2.8) and a single sequential scanner (FCFS or DFS order, the baselines).

A scanner is asked for the next request whenever the caller (the batch runner, or the bench's
simulated feed) has room; it answers with an item position, or None when the requests it already
handed out fill their memory share. `release` returns a finished request's share.

The dual scanner walks the ρ-sorted unit list from both ends: the left cursor from the most
compute-dense unit rightwards, the right cursor from the most memory-dense unit leftwards. The KV
budget M is split so that the blend of the two current units has the root's density ρ_rt::

    M_L + M_R = M,   M_L·ρ_L + M_R·ρ_R = M·ρ_rt
    ⇒ M_L = M·(ρ_rt − ρ_R) / (ρ_L − ρ_R)     (clamped to [0, M]; M/2 each when ρ_L ≈ ρ_R)

and recomputed whenever a cursor moves to a new unit. When the cursors meet, one stream takes
all of M. A request's share is its lifetime-average KV footprint, prompt + output/2 (§2.8).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backend.policy.batch_order.plan import Unit

_RHO_EQUAL = 1e-9


def footprint_tokens(prompt_len: float, output_len: float) -> float:
    """Average KV a request holds over its life, tokens."""
    return prompt_len + output_len / 2.0


MIN_SHARE = 0.1
"""Least share of M either scanner keeps while both have work. The paper clamps M_L to [0, M];
with very dense units (2-token answers: ρ in the tens) that leaves the dense stream one line at a
time, so its prefix is evicted between two lines of one subject on a small pool, and it stalls."""


def partition(
    memory: float,
    rho_left: float,
    rho_right: float,
    rho_target: float,
    min_share: float = MIN_SHARE,
) -> float:
    """M_L, the left scanner's share of `memory` (digest §2.8, edge cases 1–2), kept within
    [min_share·M, (1 − min_share)·M]."""
    if abs(rho_left - rho_right) <= _RHO_EQUAL * max(1.0, abs(rho_left)):
        return memory / 2.0
    share = memory * (rho_target - rho_right) / (rho_left - rho_right)
    return min(memory * (1.0 - min_share), max(memory * min_share, share))


@dataclass
class _Side:
    unit: int
    """Index of the current unit in the unit list."""
    offset: int = 0
    """Next item of the current unit."""
    used: float = 0.0
    """Footprint of this side's requests in flight, tokens."""
    quota: float = 0.0
    """M_L or M_R, tokens."""
    in_flight: int = 0


class SequentialScanner:
    """One cursor over a fixed order (FCFS order, or DFS of the trie) within `memory` tokens."""

    def __init__(self, order: Sequence[int], footprints: Sequence[float], memory: float) -> None:
        self._order = list(order)
        self._footprints = footprints
        self._memory = memory
        self._next = 0
        self._used = 0.0
        self._in_flight = 0
        self._charged: set[int] = set()

    @property
    def exhausted(self) -> bool:
        """Every request has been handed out."""
        return self._next >= len(self._order)

    def next(self) -> int | None:
        """The next request, or None while the budget is full (or nothing is left)."""
        if self.exhausted:
            return None
        pos = self._order[self._next]
        need = self._footprints[pos]
        if self._in_flight and self._used + need > self._memory:
            return None
        self._next += 1
        self._used += need
        self._in_flight += 1
        self._charged.add(pos)
        return pos

    def release(self, pos: int) -> None:
        """Request `pos` finished (or was dropped): its share is free again."""
        if pos not in self._charged:
            return
        self._charged.discard(pos)
        self._used = max(0.0, self._used - self._footprints[pos])
        self._in_flight -= 1

    def add_memory(self, tokens: float) -> None:
        """Grows the budget (memory held by lines from before this scanner came back)."""
        self._memory += tokens


class DualScanner:
    """BlendServe's dual scanner over ρ-sorted units (see the module docstring)."""

    def __init__(
        self, units: Sequence[Unit], footprints: Sequence[float], memory: float, rho_target: float
    ) -> None:
        self._units = [u for u in units if u.items]
        self._footprints = footprints
        self._memory = memory
        self._rho_target = rho_target
        self._left = _Side(unit=0)
        self._right = _Side(unit=len(self._units) - 1)
        self._side_of: dict[int, _Side] = {}
        self._repartition()

    @property
    def exhausted(self) -> bool:
        """Every request has been handed out."""
        return (
            not self._units
            or self._left.unit > self._right.unit
            or (
                self._left.unit == self._right.unit
                and self._left.offset + self._right.offset
                >= len(self._units[self._left.unit].items)
            )
        )

    @property
    def quotas(self) -> tuple[float, float]:
        """(M_L, M_R) now, tokens."""
        return self._left.quota, self._right.quota

    def _repartition(self) -> None:
        if self.exhausted:
            return
        left, right = self._left, self._right
        if left.unit == right.unit:  # the cursors met: one stream with all of M (edge case 3)
            left.quota, right.quota = self._memory, 0.0
            return
        rho_l, rho_r = self._units[left.unit].rho, self._units[right.unit].rho
        left.quota = partition(self._memory, rho_l, rho_r, self._rho_target)
        right.quota = self._memory - left.quota

    def _take(self, side: _Side) -> int | None:
        """The next item of `side`'s cursor, advancing across units; None if out of work."""
        if self.exhausted:
            return None
        unit = self._units[side.unit]
        met = self._left.unit == self._right.unit
        if met:
            # One unit left: the left cursor takes it from the front, the right one from the
            # back (each item exactly once).
            remaining = len(unit.items) - self._left.offset - self._right.offset
            if remaining <= 0:
                return None
            if side is self._left:
                pos = unit.items[side.offset]
            else:
                pos = unit.items[len(unit.items) - 1 - side.offset]
            side.offset += 1
            return pos
        pos = (
            unit.items[side.offset]
            if side is self._left
            else unit.items[len(unit.items) - 1 - side.offset]
        )
        side.offset += 1
        if side.offset >= len(unit.items):
            side.unit += 1 if side is self._left else -1
            side.offset = 0
            self._repartition()
        return pos

    def next(self) -> int | None:
        """The next request from the side furthest below its share; None while both are full."""
        if self.exhausted:
            return None
        sides = sorted(
            (self._left, self._right),
            key=lambda s: s.used / s.quota if s.quota > 0 else float("inf"),
        )
        for side in sides:
            pos = self._peek(side)
            if pos is None:
                continue
            need = self._footprints[pos]
            # A side with a share always runs at least one request, however large; with no
            # request in flight anywhere, anything runs (the plan must make progress).
            alone = side.in_flight == 0 and side.quota > 0
            idle = self._left.in_flight + self._right.in_flight == 0
            if side.used + need <= side.quota or alone or idle:
                taken = self._take(side)
                assert taken == pos
                side.used += need
                side.in_flight += 1
                self._side_of[pos] = side
                return pos
        return None

    def _peek(self, side: _Side) -> int | None:
        if self.exhausted:
            return None
        unit = self._units[side.unit]
        if self._left.unit == self._right.unit:
            if len(unit.items) - self._left.offset - self._right.offset <= 0:
                return None
            if side.quota <= 0:
                return None
        index = side.offset if side is self._left else len(unit.items) - 1 - side.offset
        return unit.items[index]

    def add_memory(self, tokens: float) -> None:
        """Grows M (memory held by lines from before this scanner came back) and re-splits."""
        self._memory += tokens
        self._repartition()

    def release(self, pos: int) -> None:
        """Request `pos` finished (or was dropped): its side's share is free again."""
        side = self._side_of.pop(pos, None)
        if side is None:
            return
        side.used = max(0.0, side.used - self._footprints[pos])
        side.in_flight -= 1
