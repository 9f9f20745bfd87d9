"""`static-chunk` and `fixed-offline` — two-phase online-first scheduling.

Both build every iteration in two phases, RT first: all RT decodes (stall-free), then RT prefill
chunks (running ones, then waiting ones in arrival order); then BE work — BE decodes, BE partial
prefills, BE admissions, oldest first. RT may preempt BE (most recently arrived first) when its
KV runs out; BE in flight preempts only newer BE (never RT). Admission checks only that the
chunk fits now.

* `static-chunk` (Sarathi-Serve / HyGen's "Sarathi++"): one static token budget per iteration
  (`chunk_tokens`, 512 by default) shared by everything; decodes count one token each; BE fills
  whatever RT leaves.
* `fixed-offline` (HyGen's "HyGen*", its throughput baseline; digest 003 §4.1): Sarathi++ —
  one token budget per iteration (`token_budget`, the rt-only reference's 2048), RT first, BE
  fills what is left up to the budget and KV — with BE *admissions* at a fixed offline rate
  (`be_rate_req_s`, a token bucket holding at most one admission), whatever the RT load. In
  the paper that rate is profiled offline by binary search as the largest that keeps the RT
  SLO metrics within the tolerance of the online-only run; the default is the rate profiled
  that way for W5 (bench/studies/profile_tolerance.py, README there).
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


def _be_phase(b: BatchBuilder, snap: Snapshot, budget: int, admit: int | None = None) -> int:
    """BE decodes, partial prefills and admissions (at most `admit` new ones, None = no limit)
    within `budget`, oldest first; returns the number admitted. BE never preempts RT; when BE
    work in flight runs out of KV the newest BE request is preempted (else a full pool of
    half-done BE requests would wait for each other forever)."""
    if budget <= 0:
        return 0
    _, be_running = _split(snap.running)
    be_running = [r for r in be_running if r.rid not in b.evictions]
    be_running.sort(key=lambda r: r.arrival_s)
    victims = LazyOrder(lambda: be_running[::-1])
    budget = decode_all(b, be_running, budget, victims)
    budget = prefill_queue(b, be_running, budget, victims)
    if b.evictions or admit == 0:
        return 0
    waiting = waiting_in(snap, "be")
    before = len(b.prefills)
    prefill_queue(b, waiting if admit is None else waiting[:admit], budget)
    return len(b.prefills) - before


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


DEFAULT_BE_RATE_REQ_S = 0.17
"""The rate profiled for W5 at load 0.75 on the analytic H100 profile, req/s: the largest
keeping RT P99 TBT and mean TTFT within 5 % of rt-only (binary search, 0.1719 req/s;
bench/studies/profile_tolerance.py)."""


class FixedOfflinePolicy(PolicyBase):
    """HyGen*: Sarathi++ (online first, one shared token budget) with BE admitted at a fixed
    rate."""

    name = "fixed-offline"

    def __init__(
        self, latency: LatencyModel, *, token_budget: int = 2048, be_rate_req_s: float | None = None
    ) -> None:
        super().__init__(latency)
        if token_budget < 1:
            raise ValueError(f"token_budget must be ≥ 1, got {token_budget}")
        rate = DEFAULT_BE_RATE_REQ_S if be_rate_req_s is None else be_rate_req_s
        if rate < 0:
            raise ValueError(f"be_rate_req_s must be ≥ 0, got {rate}")
        self.token_budget = token_budget
        """Tokens per iteration for both tiers (prefill chunks plus decodes), RT first."""
        self.be_rate_req_s = rate
        """BE admissions per second, independent of the RT load (the profiled offline QPS)."""
        self._credit = 0.0
        self._last_s: float | None = None

    def plan(self, snapshot: Snapshot) -> Plan:
        now = snapshot.now_s
        if self._last_s is not None:
            # a bucket of one: an admission slot unused (no KV, no budget) is lost, as with a
            # client that sends at a fixed rate
            self._credit = min(1.0, self._credit + self.be_rate_req_s * (now - self._last_s))
        self._last_s = now
        b = BatchBuilder(snapshot)
        left = _rt_phase(b, snapshot, self.token_budget)
        self._credit -= _be_phase(b, snapshot, left, admit=int(self._credit))
        if not (b.decodes or b.prefills or b.evictions) and snapshot.waiting:
            # an idle engine: the simulator cannot wait for the next admission slot without an
            # arrival, so the slot is taken now and paid for later (credit goes negative; the
            # long-run rate is unchanged, the baseline only gains the idle wait)
            self._credit -= _be_phase(b, snapshot, left, admit=1)
        return b.plan(self.latency)
