"""The line of RT requests the SLO admission keeps at the gateway for a request slot.

An RT request the SLO admission would refuse only because it would wait for a request slot
(every one held by RT requests) waits at the gateway for the engine's next reports and is
judged again on each (gateway/pipeline/stages.py, `admit_rechecking`). Judged on its own, a
request that arrives a moment later, on about the same engine state, gets in: it has the whole
TTFT target left, where the one kept has only what its wait left of it. Sent to the engine
first, it then takes the slot that frees, and the one kept is refused when its time is up —
in a slot crunch the later arrivals got in and the earlier were refused (the real W1 at the
engine's capacity, bench/results/slo/README.md, session 66: 15 of 15 refusals so).

So the requests kept for a slot form a line per engine, in arrival order: a later RT request
whose forecast would also wait for a slot on that engine waits behind them (`SloCheck`), and
is judged again as they are; once the ones ahead have their verdict (admitted: they are sent
and counted ahead of it; or refused when their time is up), it goes. A request that needs no
slot (one is free for it) is not held: nothing it takes is what the line waits for.
"""

from __future__ import annotations


class SlotLine:
    """RT requests kept at the gateway for a request slot, per engine, by arrival."""

    def __init__(self) -> None:
        self._members: dict[str, tuple[str, float]] = {}
        """rid → (the engine it waits for, its arrival, wall-clock seconds)."""

    def join(self, rid: str, engine: str, arrival_unix_s: float) -> None:
        """Request *rid* (arrived at *arrival_unix_s*) waits for a slot of *engine* (again: a
        request judged on another engine this time moves to that engine's line)."""
        self._members[rid] = (engine, arrival_unix_s)

    def leave(self, rid: str) -> None:
        """Request *rid* has its verdict, or is gone (no-op when it was not in the line)."""
        self._members.pop(rid, None)

    def ahead(self, rid: str, engine: str, arrival_unix_s: float) -> int:
        """How many requests that arrived before *rid* (at *arrival_unix_s*; equal arrivals by
        rid) wait for a slot of *engine*."""
        mine = (arrival_unix_s, rid)
        return sum(
            1
            for other, (waits_for, arrived) in self._members.items()
            if waits_for == engine and (arrived, other) < mine
        )

    def __len__(self) -> int:
        return len(self._members)
