"""`oracle` — admission with perfect knowledge of output lengths (an upper reference).

Sees `ReqState.true_output_len` (the engine reveals it to this policy only; the runner sets
SimConfig.reveal_lengths because `needs_true_lengths` is True). Every iteration decodes every
running request (RT first) and continues partial prefills, vLLM-style under one token budget;
then admits waiting requests, RT first and BE filling, in arrival order, exactly while the true
future KV peak (Past-Future M*, `pastfuture.PeakTracker`) of the running set plus the newcomer stays
within the capacity. Since every admitted request decodes every iteration, usage never exceeds
that peak and nothing is ever evicted (eviction is kept only as a safety net).
"""

from __future__ import annotations

from backend.policy.baselines._steps import LazyOrder, decode_all, prefill_queue
from backend.policy.common import (
    BatchBuilder,
    PolicyBase,
    TrueLengthPredictor,
    be_first_newest,
    tier_first,
    waiting_tier_first,
)
from backend.policy.latency import LatencyModel
from backend.policy.pastfuture import PeakTracker
from backend.policy.types import Plan, ReqState, Snapshot


class OraclePolicy(PolicyBase):
    """Admits exactly while the true future KV peak fits."""

    name = "oracle"
    needs_true_lengths = True

    def __init__(
        self, latency: LatencyModel, *, token_budget: int = 2048, reserve_frac: float = 0.0
    ) -> None:
        super().__init__(latency)
        self.token_budget = token_budget
        """Tokens per iteration for prefill chunks (decodes are never limited)."""
        self.reserve_frac = reserve_frac
        """Share of the KV capacity kept out of admission."""
        self._lengths = TrueLengthPredictor()

    def _item(self, r: ReqState, page: int) -> tuple[int, int]:
        """(KV it holds once prefilled, iterations it keeps growing) for the peak."""
        out_left = self._lengths.predict(r) - r.generated
        left = r.prefill_len - r.prefilled
        slack = page - 1  # its private KV is page-rounded: ≤ tokens + page − 1 slots
        if left <= 0:
            return r.kv_tokens + slack, out_left
        iters = -(-left // self.token_budget)  # prefill iterations before it decodes
        return r.prefill_len + slack, out_left - 1 + iters

    def plan(self, snapshot: Snapshot) -> Plan:
        b = BatchBuilder(snapshot)
        page = snapshot.page_size
        running = tier_first(snapshot.running)
        victims = LazyOrder(lambda: be_first_newest(snapshot.running))
        decode_all(b, running, len(running) + 1, victims)
        budget = prefill_queue(b, running, self.token_budget, victims)
        if budget <= 0 or b.evictions or not snapshot.waiting:
            return b.plan(self.latency)
        peaks = PeakTracker(self._item(r, page) for r in running)
        limit = snapshot.kv_capacity_tokens * (1.0 - self.reserve_frac)
        for w in waiting_tier_first(snapshot):
            if budget <= 0:
                break
            item = self._item(w, page)
            if peaks.peak_with(item) > limit:
                break  # RT first: a BE request never takes the room an RT one waits for
            before = budget
            budget = prefill_queue(b, (w,), budget)
            if budget == before:
                break
            peaks.add(item)
        return b.plan(self.latency)
