"""`fcfs` — vLLM-like first-come-first-served scheduling (also `rt-only`).

Stands for vLLM v1's default scheduler with chunked prefill: every iteration mixes decodes and
prefill chunks under one token budget (`token_budget`, a decode counts one token). Running
requests go first, in admission order; when one of them cannot get its KV, the most recently
arrived running request is preempted (recompute), possibly the one in hand. Waiting requests are
then admitted strictly in arrival order while their chunk fits in KV *now* (no reservation for
outputs), stopping at the first that does not (head of line), and not at all in an iteration
that preempted. Tiers are ignored.

`rt-only` is this policy with `rt_only = True`: the bench runner drops the BE stream, so the run
measures RT alone (the interference reference).
"""

from __future__ import annotations

from backend.policy.baselines._steps import LazyOrder, decode_all, prefill_queue
from backend.policy.common import BatchBuilder, PolicyBase, newest_first
from backend.policy.latency import LatencyModel
from backend.policy.types import Plan, Snapshot


class FcfsPolicy(PolicyBase):
    """vLLM-like FCFS with chunked prefill and newest-first recompute preemption."""

    name = "fcfs"

    def __init__(
        self, latency: LatencyModel, *, token_budget: int = 2048, rt_only: bool = False
    ) -> None:
        super().__init__(latency)
        if token_budget < 1:
            raise ValueError(f"token_budget must be ≥ 1, got {token_budget}")
        self.token_budget = token_budget
        """Tokens per iteration (decodes count one each), vLLM's max_num_batched_tokens."""
        self.rt_only = rt_only
        """True for `rt-only`: the runner serves only the RT stream."""
        if rt_only:
            self.name = "rt-only"

    def plan(self, snapshot: Snapshot) -> Plan:
        b = BatchBuilder(snapshot)
        victims = LazyOrder(lambda: newest_first(snapshot.running))
        budget = self.token_budget
        add_decode = b.add_decode
        for r in snapshot.running:  # admission order: decodes and partial prefills alike
            if budget <= 0:
                break
            if b.evictions and r.rid in b.evictions:
                continue
            if r.prefilled >= r.prefill_len:
                if add_decode(r):  # the common case, kept cheap
                    budget -= 1
                    continue
                left = decode_all(b, (r,), budget, victims)
            else:
                left = prefill_queue(b, (r,), budget, victims)
            if left == budget:
                break  # it could not be scheduled even after preempting
            budget = left
        if not b.evictions:
            prefill_queue(b, snapshot.waiting, budget)
        return b.plan(self.latency)
