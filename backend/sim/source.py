"""What the simulator serves: requests with their true lengths, and where they come from.

A workload is an `ArrivalSource`. Open-loop traces are a `ListSource`; closed-loop sources (a fixed
number of clients that each send the next request when the previous one finishes, W3) implement
the same protocol and use `on_finish` to emit the follow-up.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import msgspec

from backend.sim.config import SloUnattainable
from common.wire import Tier


class SimRequest(msgspec.Struct, kw_only=True):
    """One request of a workload, including what only the workload knows (its true length)."""

    rid: str
    """Unique request id."""
    tier: Tier
    """"rt" or "be"."""
    arrival_s: float
    """Arrival time on the simulated clock, seconds."""
    prompt_len: int
    """Prompt length, tokens (≥ 1)."""
    output_len: int
    """True output length, tokens (forced, like ignore_eos + max_tokens). Hidden from every
    policy except the oracle."""
    max_new_tokens: int
    """Output cap the policy sees, tokens (the request ends at min(output_len, max_new_tokens))."""
    ttft_target_s: float | None = None
    """RT: time-to-first-token target, seconds after arrival."""
    tpot_target_s: float | None = None
    """RT: time-per-output-token target, seconds."""
    deadline_s: float | None = None
    """BE: completion deadline, seconds after arrival."""
    length_key: str = ""
    """Output-length history key (tenant or job)."""
    tenant_id: str | None = None
    """The tenant it is served for (fair share within its tier); None: its `length_key`."""
    tenant_weight: float = 1.0
    """The tenant's fair-share weight within its tier (> 0)."""
    on_unattainable: SloUnattainable | None = None
    """RT: what its tenant's contract makes of a forecast miss at the front door (reject,
    downgrade, accept); None: the run's one outcome (`SimConfig.slo_unattainable`)."""
    order_key: float = 0.0
    """BE order given by the caller (lower first)."""
    prefix_hashes: tuple[int, ...] = ()
    """One hash per prefix-cache block of the prompt (block i covers tokens
    [i·block, (i+1)·block)); equal leading hashes are shared prefixes."""


class ArrivalSource(Protocol):
    """Where requests come from. The simulator asks `next_arrival_s` to jump an idle clock,
    `pop_due` at the start of every iteration, and tells it about every finish."""

    def next_arrival_s(self) -> float | None:
        """Arrival time of the next pending request; None when none is pending (now or, if
        `exhausted`, ever)."""
        ...

    def pop_due(self, now_s: float) -> list[SimRequest]:
        """Removes and returns the requests with arrival_s ≤ now_s, in arrival order."""
        ...

    def on_finish(self, rid: str, now_s: float) -> None:
        """Request `rid` finished at `now_s` (closed-loop sources emit follow-ups here)."""
        ...

    @property
    def exhausted(self) -> bool:
        """True when no request will ever be emitted again."""
        ...


class ListSource:
    """An open-loop trace: a fixed list of requests (sorted by arrival here)."""

    def __init__(self, requests: Iterable[SimRequest]) -> None:
        self._requests = sorted(requests, key=lambda r: r.arrival_s)
        self._next = 0

    def next_arrival_s(self) -> float | None:
        if self._next < len(self._requests):
            return self._requests[self._next].arrival_s
        return None

    def pop_due(self, now_s: float) -> list[SimRequest]:
        start = end = self._next
        reqs = self._requests
        while end < len(reqs) and reqs[end].arrival_s <= now_s:
            end += 1
        self._next = end
        return reqs[start:end]

    def on_finish(self, rid: str, now_s: float) -> None:
        """Open loop: finishes do not change the trace."""

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self._requests)
