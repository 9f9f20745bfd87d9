"""The waiting queue: requests not holding KV, in arrival order, plus the same split by tier
(policies read all three; a 40K-request BE backlog must not cost a scan per iteration)."""

from __future__ import annotations

import bisect

from backend.policy.types import ReqState


def _insert(reqs: list[ReqState], state: ReqState) -> None:
    """Keeps arrival order (new arrivals append; evicted requests go back to their place)."""
    if reqs and reqs[-1].arrival_s > state.arrival_s:
        bisect.insort(reqs, state, key=lambda r: r.arrival_s)
    else:
        reqs.append(state)


def _drop_running(reqs: list[ReqState], n: int) -> list[ReqState]:
    """`reqs` without its `n` admitted (is_running) requests. Admissions are usually near the
    head, so the head is filtered and the untouched tail spliced on in one copy."""
    if n == 0:
        return reqs
    head: list[ReqState] = []
    seen = 0
    for i, s in enumerate(reqs):
        if not s.is_running:
            head.append(s)
            continue
        seen += 1
        if seen == n:
            return head + reqs[i + 1 :]
    return head


class WaitQueue:
    """Waiting requests: `all` in arrival order, `rt` and `be` its tier subsequences. The lists
    are replaced (not edited) when admitted requests leave, so a snapshot holding the old ones
    stays consistent."""

    def __init__(self) -> None:
        self.all: list[ReqState] = []
        self.rt: list[ReqState] = []
        self.be: list[ReqState] = []

    def __len__(self) -> int:
        return len(self.all)

    def push(self, state: ReqState) -> None:
        _insert(self.all, state)
        _insert(self.rt if state.tier == "rt" else self.be, state)

    def drop_admitted(self, num_rt: int, num_be: int) -> None:
        """Removes the requests just admitted (now is_running): num_rt RT and num_be BE."""
        self.all = _drop_running(self.all, num_rt + num_be)
        self.rt = _drop_running(self.rt, num_rt)
        self.be = _drop_running(self.be, num_be)

    def remove(self, state: ReqState) -> None:
        """Removes one waiting request (an abort)."""
        self.all = [s for s in self.all if s is not state]
        if state.tier == "rt":
            self.rt = [s for s in self.rt if s is not state]
        else:
            self.be = [s for s in self.be if s is not state]
