"""Pure helpers every policy shares: page arithmetic, KV costs, a batch builder that keeps the
plan, its latency-model shape and the KV still available in step, victim choice, length
predictors; the Past-Future peak (`future_peak`, `PeakTracker`) lives in pastfuture.py.

KV accounting seen from a policy (all lower bounds, so a plan built with them always fits)::

    available = kv_free + kv_evictable              (cache blocks are reclaimed on demand)
    decode r            costs 1 slot  (page_size p: p slots when r.kv_tokens % p == 0, else 0)
    chunk c of running r   costs ceil_p(kv + c) − ceil_p(kv)
    chunk c admitting w    costs w.cached_len + ceil_p(c)  (pinning its cached prefix may take
                                                            those blocks out of kv_evictable)
    evicting r          frees ≥ ceil_p(kv_tokens) − kv_shared_tokens
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from backend.policy import pastfuture
from backend.policy.feasibility import SloForecaster
from backend.policy.latency import BatchShape, LatencyModel
from backend.policy.types import IterationResult, Plan, PrefillChunk, ReqState, Snapshot
from common.wire import Tier


def round_up(tokens: int, page: int) -> int:
    """`tokens` rounded up to whole pages."""
    return -(-tokens // page) * page


def decode_cost(req: ReqState, page: int) -> int:
    """KV slots one more decode of `req` takes."""
    if page == 1:
        return 1
    return page if req.kv_tokens % page == 0 else 0


def prefill_cost(req: ReqState, tokens: int, page: int) -> int:
    """KV slots a chunk of `tokens` more prompt tokens of `req` takes (admission included)."""
    if req.is_running:
        return round_up(req.kv_tokens + tokens, page) - round_up(req.kv_tokens, page)
    return req.cached_len + round_up(tokens, page)


def eviction_gain(req: ReqState, page: int) -> int:
    """KV slots evicting running `req` frees at least."""
    return round_up(req.kv_tokens, page) - req.kv_shared_tokens


def affordable_chunk(req: ReqState, kv_avail: int, page: int) -> int:
    """The longest chunk of `req` whose KV cost is ≤ kv_avail (not capped by prompt_left)."""
    if req.is_running:
        return round_up(req.kv_tokens, page) + (kv_avail // page) * page - req.kv_tokens
    return max(0, ((kv_avail - req.cached_len) // page) * page)


def align_chunk(req: ReqState, tokens: int, page: int) -> int:
    """`tokens` capped at the prompt left and, unless it finishes the prompt, cut to pages."""
    left = req.prefill_len - req.prefilled
    if tokens >= left:
        return left
    return tokens - tokens % page if tokens > 0 else 0


class BatchBuilder:
    """One iteration's plan under construction. Every `add_*` checks the KV still available
    and the engine caps and returns False (changing nothing) when the step does not fit."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.page = snapshot.page_size
        self.kv_avail = snapshot.kv_free_tokens + snapshot.kv_evictable_tokens
        """KV slots this plan can still take, lower bound."""
        self.prefill_left = snapshot.max_prefill_tokens
        """Prefill tokens the engine still accepts this iteration."""
        self.running_slots = snapshot.max_running - snapshot.num_running
        """Admissions the engine cap still allows."""
        self.max_running = snapshot.max_running
        """The engine's cap on admitted requests."""
        self.decodes: list[str] = []
        self.prefills: list[PrefillChunk] = []
        self.evictions: list[str] = []
        self.chunked: set[str] = set()
        """Requests with a prefill chunk in this plan."""
        self._decoded: set[str] = set()  # set(self.decodes), rebuilt only when asked
        self.prefill_tokens = 0
        self.num_prefill = 0
        self.prefill_attn = 0.0
        self.prefill_attn_full = 0.0
        self.decode_context = 0
        self.decode_context_sq = 0.0
        self.num_decode = 0

    def add_decode(self, req: ReqState) -> bool:
        """Adds a decode of running, fully prefilled `req` (at most once per plan) if its KV
        slot fits."""
        cost = 1 if self.page == 1 else decode_cost(req, self.page)
        if cost > self.kv_avail:
            return False
        self.kv_avail -= cost
        self.decodes.append(req.rid)
        context = req.prompt_len + req.generated
        self.decode_context += context
        self.decode_context_sq += context * context
        self.num_decode += 1
        return True

    def add_prefill(self, req: ReqState, tokens: int) -> bool:
        """Adds a chunk of `tokens` (already aligned, ≥ 1) for `req` if KV, the prefill cap and
        (for an admission) the running cap allow."""
        cost = prefill_cost(req, tokens, self.page)
        is_new = not req.is_running
        if (
            tokens < 1
            or cost > self.kv_avail
            or tokens > self.prefill_left
            or (is_new and self.running_slots < 1)
        ):
            return False
        self.kv_avail -= cost
        self.prefill_left -= tokens
        self.running_slots -= is_new
        self.prefills.append(PrefillChunk(req.rid, tokens))
        self.chunked.add(req.rid)
        self.prefill_tokens += tokens
        self.num_prefill += 1
        self.prefill_attn += tokens * (req.prefilled + tokens)
        self.prefill_attn_full += (req.prefilled + tokens) ** 2
        return True

    @property
    def scheduled(self) -> set[str]:
        """Requests with a decode or a chunk in this plan (never chosen as victims). Built on
        demand (O(batch)): the per-decode hot path keeps no set."""
        if len(self._decoded) != len(self.decodes):
            self._decoded = set(self.decodes)
        return self._decoded | self.chunked

    def max_chunk(self, req: ReqState, budget_tokens: int) -> int:
        """The longest aligned chunk of `req` within `budget_tokens`, the prefill cap and the
        KV still available (0 if none)."""
        limit = min(
            budget_tokens, self.prefill_left, affordable_chunk(req, self.kv_avail, self.page)
        )
        return align_chunk(req, limit, self.page)

    def evict(self, req: ReqState) -> None:
        """Evicts running `req` (must not be scheduled in this plan)."""
        self.evictions.append(req.rid)
        self.kv_avail += eviction_gain(req, self.page)
        self.running_slots += 1

    def shape(self) -> BatchShape:
        """The latency-model shape of the batch so far."""
        return BatchShape(
            prefill_tokens=self.prefill_tokens,
            num_prefill=self.num_prefill,
            prefill_attn=self.prefill_attn,
            prefill_attn_full=self.prefill_attn_full,
            decode_context_sq=self.decode_context_sq,
            decode_context=self.decode_context,
            num_decode=self.num_decode,
        )

    def plan(self, latency: LatencyModel | None = None) -> Plan:
        """The finished plan, with its predicted duration when a model is given."""
        predicted = latency.predict(self.shape()) if latency is not None else None
        return Plan(
            decodes=self.decodes,
            prefills=self.prefills,
            evictions=self.evictions,
            predicted_s=predicted,
        )


def choose_victims(
    kv_avail: int,
    need_tokens: int,
    victims: Iterable[ReqState],
    page: int,
    skip: set[str] | frozenset[str] = frozenset(),
) -> list[ReqState] | None:
    """The shortest prefix of `victims` (running requests not in `skip`) whose eviction makes
    `need_tokens` fit; [] if it fits already; None if evicting them all would not do."""
    chosen: list[ReqState] = []
    for victim in victims:
        if kv_avail >= need_tokens:
            break
        if victim.rid in skip or not victim.is_running:
            continue
        chosen.append(victim)
        kv_avail += eviction_gain(victim, page)
    return chosen if kv_avail >= need_tokens else None


def make_room(builder: BatchBuilder, need_tokens: int, victims: Iterable[ReqState]) -> bool:
    """Evicts requests from `victims` (in that order, skipping scheduled or already evicted
    ones) until `need_tokens` KV slots are available; evicts nothing and returns False when
    that is impossible."""
    skip = builder.scheduled | set(builder.evictions)
    chosen = choose_victims(builder.kv_avail, need_tokens, victims, builder.page, skip)
    if chosen is None:
        return False
    for victim in chosen:
        builder.evict(victim)
    return True


def waiting_in(snapshot: Snapshot, tier: Tier) -> list[ReqState]:
    """The waiting requests of one tier, in arrival order (the engine's split when it keeps
    one, else filtered here)."""
    split = snapshot.waiting_rt if tier == "rt" else snapshot.waiting_be
    if split is not None:
        return split
    return [r for r in snapshot.waiting if r.tier == tier]


def waiting_tier_first(snapshot: Snapshot) -> Iterator[ReqState]:
    """Waiting RT requests, then waiting BE ones, each in arrival order (lazy)."""
    return itertools.chain(waiting_in(snapshot, "rt"), waiting_in(snapshot, "be"))


def newest_first(reqs: Iterable[ReqState]) -> list[ReqState]:
    """Victim order of vLLM's FCFS preemption: the most recently arrived first."""
    return sorted(reqs, key=lambda r: r.arrival_s, reverse=True)


def be_first_newest(reqs: Iterable[ReqState]) -> list[ReqState]:
    """Victim order that protects RT: BE before RT, the most recently arrived first in each."""
    return sorted(reqs, key=lambda r: (r.tier == "rt", -r.arrival_s))


def tier_first(reqs: Iterable[ReqState]) -> list[ReqState]:
    """Queue order: RT before BE, arrival order inside each tier (stable)."""
    return sorted(reqs, key=lambda r: r.tier != "rt")


def future_peak(items: Sequence[tuple[int, int]]) -> int:
    """Past-Future M* of (current, remaining) pairs (see `pastfuture.future_peak`, the one
    implementation)."""
    if not items:
        return 0
    current, remaining = zip(*items, strict=True)
    return pastfuture.future_peak(
        np.asarray(current, dtype=np.int64), np.asarray(remaining, dtype=np.int64)
    )


class TrueLengthPredictor:
    """The oracle's predictor: the true output length where the engine reveals it, else the
    cap."""

    def predict(self, req: ReqState) -> int:
        return req.true_output_len if req.true_output_len is not None else req.max_new_tokens


class PolicyBase:
    """Shared plumbing: a name, the latency model for `predicted_s`, a no-op `observe`."""

    name = "base"
    needs_true_lengths = False
    """True for the oracle: the engine must reveal true output lengths
    (SimConfig.reveal_lengths)."""
    rt_only = False
    """True for `rt-only`: the runner serves only the RT stream."""

    def __init__(self, latency: LatencyModel) -> None:
        self.latency = latency

    def slo_forecaster(self) -> SloForecaster | None:
        """The SLO admission to put in front of this policy's engine (`backend.policy.
        feasibility`); None: every request is admitted (the stock baselines)."""
        return None

    def latency_factors(self) -> tuple[float, float, float]:
        """The engine's pace per batch regime as the policy has learned it (measured ÷ profile);
        1.0 each for a policy that does not calibrate."""
        return (1.0, 1.0, 1.0)

    def observe(self, result: IterationResult) -> None:
        """Stateless policies learn nothing."""
