"""`rr` — round-robin between the tiers (BROS's RR baseline).

Stands for the RR baseline of BROS: the engine serves the RT and the BE tier in alternate
iterations. An RT turn runs only RT work (RT decodes, then RT prefill chunks, vLLM-style under
one token budget), a BE turn only BE work; a turn whose tier has nothing it can run now goes to
the other tier. Admission is FCFS within the tier while the chunk fits now; on KV shortage the
most recently arrived running request of the same tier is preempted.
"""

from __future__ import annotations

from backend.policy.baselines._steps import LazyOrder, decode_all, prefill_queue
from backend.policy.common import BatchBuilder, PolicyBase, newest_first, waiting_in
from backend.policy.latency import LatencyModel
from backend.policy.types import IterationResult, Plan, Snapshot
from common.wire import Tier


class RoundRobinPolicy(PolicyBase):
    """Alternates RT-only and BE-only iterations."""

    name = "rr"

    def __init__(self, latency: LatencyModel, *, token_budget: int = 2048) -> None:
        super().__init__(latency)
        self.token_budget = token_budget
        """Tokens per iteration (decodes count one each)."""
        self.turn: Tier = "rt"
        """The tier whose turn the next iteration is."""
        self._served: Tier | None = None

    def plan(self, snapshot: Snapshot) -> Plan:
        other: Tier = "be" if self.turn == "rt" else "rt"
        b = BatchBuilder(snapshot)
        for tier in (self.turn, other):  # a turn that can run nothing passes to the other tier
            if not _has_work(snapshot, tier):
                continue
            b = self._build(snapshot, tier)
            if b.decodes or b.prefills:
                self._served = tier
                return b.plan(self.latency)
        self._served = None
        return b.plan(self.latency)

    def _build(self, snapshot: Snapshot, tier: Tier) -> BatchBuilder:
        running = [r for r in snapshot.running if r.tier == tier]
        b = BatchBuilder(snapshot)
        victims = LazyOrder(lambda: newest_first(running))
        budget = decode_all(b, running, self.token_budget, victims)
        budget = prefill_queue(b, running, budget, victims)
        if not b.evictions:
            prefill_queue(b, waiting_in(snapshot, tier), budget)
        return b

    def observe(self, result: IterationResult) -> None:
        """The turn passes to the tier not served last."""
        if self._served is not None:
            self.turn = "be" if self._served == "rt" else "rt"


def _has_work(snapshot: Snapshot, tier: Tier) -> bool:
    return bool(waiting_in(snapshot, tier)) or any(r.tier == tier for r in snapshot.running)
