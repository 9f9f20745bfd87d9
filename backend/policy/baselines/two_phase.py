"""`static-chunk` and `fixed-offline` — two-phase online-first scheduling.

Both build every iteration in two phases, RT first: all RT decodes (stall-free), then RT prefill
chunks (running ones, then waiting ones in arrival order); then BE work — BE decodes, BE partial
prefills, BE admissions, oldest first. RT may preempt BE (most recently arrived first) when its
KV runs out; BE in flight preempts only newer BE (never RT). Admission checks only that the
chunk fits now.

* `static-chunk` (Sarathi-Serve / HyGen's "Sarathi++"): one static token budget per iteration
  (`chunk_tokens`, 512 by default) shared by everything; decodes count one token each; BE fills
  whatever RT leaves.
* `fixed-offline` (HyGen's fixed-rate offline baseline): RT gets a token budget
  (`token_budget`); BE gets a fixed share of `be_tokens` tokens every iteration whatever the
  RT load (BE decodes beyond it sit the iteration out and keep their KV).
"""

from __future__ import annotations

from backend.policy.baselines._steps import LazyOrder, decode_all, prefill_queue
from backend.policy.common import BatchBuilder, PolicyBase, be_first_newest, waiting_in
from backend.policy.latency import LatencyModel
from backend.policy.types import Plan, ReqState, Snapshot


def _split(reqs: list[ReqState]) -> tuple[list[ReqState], list[ReqState]]:
    rt = [r for r in reqs if r.tier == "rt"]
    be = [r for r in reqs if r.tier != "rt"]
    return rt, be


def _rt_phase(b: BatchBuilder, snap: Snapshot, budget: int) -> int:
    """RT decodes (never limited by the budget), then RT prefills within it."""
    rt_running, _ = _split(snap.running)
    victims = LazyOrder(lambda: be_first_newest(snap.running))
    used = len(rt_running)
    decode_all(b, rt_running, used + 1, victims)
    budget -= len(b.decodes)
    budget = prefill_queue(b, rt_running, budget, victims)
    if not b.evictions:  # an RT admission may preempt BE only
        be_victims = LazyOrder(lambda: be_first_newest(_split(snap.running)[1]))
        budget = prefill_queue(b, waiting_in(snap, "rt"), budget, be_victims)
    return budget


def _be_phase(b: BatchBuilder, snap: Snapshot, budget: int) -> None:
    """BE decodes, partial prefills and admissions within `budget`, oldest first. BE never
    preempts RT; when BE work in flight runs out of KV the newest BE request is preempted (else
    a full pool of half-done BE requests would wait for each other forever)."""
    if budget <= 0:
        return
    _, be_running = _split(snap.running)
    be_running = [r for r in be_running if r.rid not in b.evictions]
    be_running.sort(key=lambda r: r.arrival_s)
    victims = LazyOrder(lambda: be_running[::-1])
    budget = decode_all(b, be_running, budget, victims)
    budget = prefill_queue(b, be_running, budget, victims)
    if not b.evictions:
        prefill_queue(b, waiting_in(snap, "be"), budget)


class StaticChunkPolicy(PolicyBase):
    """Sarathi-like: one static chunk budget, online first, BE fills the rest."""

    name = "static-chunk"

    def __init__(self, latency: LatencyModel, *, chunk_tokens: int = 512) -> None:
        super().__init__(latency)
        self.chunk_tokens = chunk_tokens
        """Tokens per iteration, decodes included."""

    def plan(self, snapshot: Snapshot) -> Plan:
        b = BatchBuilder(snapshot)
        left = _rt_phase(b, snapshot, self.chunk_tokens)
        _be_phase(b, snapshot, left)
        return b.plan(self.latency)


class FixedOfflinePolicy(PolicyBase):
    """HyGen's fixed-rate baseline: online first, BE at a fixed token share per iteration."""

    name = "fixed-offline"

    def __init__(self, latency: LatencyModel, *, token_budget: int = 2048,
                 be_tokens: int = 256) -> None:
        super().__init__(latency)
        self.token_budget = token_budget
        """RT tokens per iteration (prefill chunks plus decodes)."""
        self.be_tokens = be_tokens
        """BE tokens every iteration (decodes plus prefill chunks), independent of RT load."""

    def plan(self, snapshot: Snapshot) -> Plan:
        b = BatchBuilder(snapshot)
        _rt_phase(b, snapshot, self.token_budget)
        _be_phase(b, snapshot, self.be_tokens)
        return b.plan(self.latency)
