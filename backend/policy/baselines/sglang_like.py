"""`priority`, `aggressive`, `conservative` — SGLang-style scheduling (pinned SGLang 0.5.23).

Stands for SGLang's scheduler with `--enable-priority-scheduling`: RT is queued before BE.
Iterations are either a prefill batch or a decode batch (SGLang's default): whenever a
chunked prompt is in flight or a waiting request can be admitted, the iteration prefills (up to
`chunk_tokens`, one chunked prompt per batch) and running decodes wait. With `mixed_chunk`
(SGLang's `--enable-mixed-chunk`, which tandem's launcher passes to every engine it starts, the
stock baselines' of the live bench included) the running decodes ride along with the prefill
batch instead: its chunk budget is `chunk_tokens` less one token per running request, and the
decodes sit the iteration out only when their KV does not fit after the prefill (a mixed
iteration retracts no one).

Admission (SGLang's PrefillAdder): a request is admitted when its prompt plus its own output
reservation stays under

    rem_total = free + evictable − Σ_running [ratio · min(max_new_tokens − generated, 4096)
                                             + rest of an in-flight prompt + a page]

and its chunk fits now. An RT request that does not fit preempts running BE requests, most
recently arrived first (SGLang's priority preemption); so does one that finds every request
slot taken (`max_running_requests`: SGLang preempts for a full batch as for memory, one BE
request per RT request admitted). A decode batch that does not fit retracts
requests (lower tier first, then fewest generated tokens, then longest prompt) and resets
the ratio to SGLang's estimate; every decode batch otherwise decays it.

The three names differ in the output reservation (and `priority` alone preempts for RT, so
that the other two isolate the admission rule: they never evict except by decode retraction):

* `priority`: SGLang's default — running requests reserve `new_token_ratio`, which starts at
  0.7, decays by (0.7 − 0.7·0.14)/600 ≈ 0.001 per decode batch down to 0.7·0.14, and is reset
  on retraction; a new request reserves its full remaining max_new_tokens.
* `aggressive`: reserve nothing (admit while the prompt fits now).
* `conservative`: reserve the full max_new_tokens of every request (ratio pinned to 1.0).
"""

from __future__ import annotations

from typing import Literal

from backend.policy.baselines._steps import LazyOrder, prefill_queue
from backend.policy.common import (
    BatchBuilder,
    PolicyBase,
    decode_cost,
    eviction_gain,
    prefill_cost,
    waiting_tier_first,
)
from backend.policy.latency import LatencyModel
from backend.policy.types import IterationResult, Plan, ReqState, Snapshot

CLIP_MAX_NEW_TOKENS = 4096
"""SGLang clips each request's output reservation to this many tokens."""
RETRACT_DECODE_STEPS = 20
"""SGLang's ratio estimate after a retraction counts this many more steps per request."""
Reserve = Literal["ratio", "none", "full"]


class SglangLikePolicy(PolicyBase):
    """SGLang-style prefill-first scheduling with `new_token_ratio` admission."""

    name = "priority"

    def __init__(
        self,
        latency: LatencyModel,
        *,
        reserve: Reserve = "ratio",
        chunk_tokens: int = 8192,
        ratio_init: float = 0.7,
        ratio_min_factor: float = 0.14,
        decay_steps: int = 600,
        priority_preemption: bool = True,
        mixed_chunk: bool = False,
    ) -> None:
        super().__init__(latency)
        if reserve not in ("ratio", "none", "full"):
            raise ValueError(f"reserve must be 'ratio', 'none' or 'full', got {reserve!r}")
        self.reserve: Reserve = reserve
        self.chunk_tokens = chunk_tokens
        """SGLang's chunked_prefill_size, tokens per prefill batch."""
        self.ratio_init = ratio_init
        self.ratio_min = ratio_init * ratio_min_factor
        self.ratio_decay = (self.ratio_init - self.ratio_min) / decay_steps
        self.priority_preemption = priority_preemption
        self.mixed_chunk = mixed_chunk
        """Decodes ride along with prefill batches (SGLang's `--enable-mixed-chunk`)."""
        self.ratio = {"ratio": ratio_init, "none": 0.0, "full": 1.0}[reserve]
        """Share of the remaining max_new_tokens reserved per running request."""
        self._next_ratio = self.ratio

    def _held(self, r: ReqState, page: int) -> float:
        """KV a running request may still take: its output reservation, the rest of an
        in-flight prompt, and a page of rounding."""
        out = self.ratio * min(r.max_new_tokens - r.generated, CLIP_MAX_NEW_TOKENS)
        return out + (r.prefill_len - r.prefilled) + (page - 1)

    def _own(self, r: ReqState, page: int) -> int:
        """Output reservation a new request is admitted with (plus a page of rounding)."""
        if self.reserve == "none":
            return page - 1
        return max(0, min(r.max_new_tokens - r.generated, CLIP_MAX_NEW_TOKENS)) + page - 1

    def plan(self, snapshot: Snapshot) -> Plan:
        b = BatchBuilder(snapshot)
        self._next_ratio = self.ratio if snapshot.running else self._initial_ratio()
        self._prefill_batch(snapshot, b)
        if not b.prefills:
            self._decode_batch(snapshot, b)
        elif self.mixed_chunk:
            self._mixed_decodes(snapshot, b)
        return b.plan(self.latency)

    def _initial_ratio(self) -> float:
        return self.ratio_init if self.reserve == "ratio" else self.ratio

    def _prefill_batch(self, snap: Snapshot, b: BatchBuilder) -> None:
        page = b.page
        reserved = sum(self._held(r, page) for r in snap.running)  # rem_total = avail − this
        partial = [r for r in snap.running if r.prefilled < r.prefill_len]
        # SGLang's PrefillAdder takes one token a running request off a mixed batch's chunk
        chunk_left = max(self.chunk_tokens - (len(snap.running) if self.mixed_chunk else 0), 0)
        if partial:  # the chunked prompt in flight may retract others if KV ran out
            victims = LazyOrder(lambda: sorted(snap.running, key=_keep_key))
            chunk_left = prefill_queue(b, partial, chunk_left, victims)
            reserved -= self.chunk_tokens - chunk_left  # that much of their rest is allocated
        for w in waiting_tier_first(snap):
            left = w.prefill_len - w.prefilled
            total = prefill_cost(w, left, page) + self._own(w, page)
            if b.running_slots < 1:  # every request slot taken (`max_running_requests`)
                if not (self.priority_preemption and w.tier == "rt"):
                    break
                # one request's KV at least: the newest running BE request, for its slot
                released = self._preempt_for(snap, b, 1)
                if released is None:
                    break
                reserved -= released
            if total >= b.kv_avail - reserved:
                if not (self.priority_preemption and w.tier == "rt"):
                    break
                freed = self._preempt_for(snap, b, total - (b.kv_avail - reserved) + 1)
                if freed is None:
                    break
                reserved -= freed
            before = chunk_left
            chunk_left = prefill_queue(b, (w,), chunk_left)
            if chunk_left == before:
                break
            reserved += left - (before - chunk_left) + self._own(w, page)
            if before - chunk_left < left or chunk_left <= 0:
                break  # one chunked prompt per batch; the batch is full

    def _preempt_for(self, snap: Snapshot, b: BatchBuilder, need: float) -> float | None:
        """Evicts running BE requests (newest first) whose KV and reservations cover `need`;
        returns the reservations released (their KV is back in b.kv_avail), or None
        (evicting nothing) when they cannot."""
        busy = b.scheduled | set(b.evictions)
        victims = sorted(
            (r for r in snap.running if r.tier == "be" and r.rid not in busy),
            key=lambda r: -r.arrival_s,
        )
        chosen: list[ReqState] = []
        gained = released = 0.0
        for v in victims:
            if gained >= need:
                break
            chosen.append(v)
            held = self._held(v, b.page)
            gained += eviction_gain(v, b.page) + held
            released += held
        if gained < need:
            return None
        for v in chosen:
            b.evict(v)
        return released

    def _mixed_decodes(self, snap: Snapshot, b: BatchBuilder) -> None:
        """The running decodes of a mixed prefill batch: all of them when their KV fits after
        the prefill, else none (they decode in the next decode batch; no retraction here)."""
        decoding = _decodable(snap, b)
        if sum(decode_cost(r, b.page) for r in decoding) > b.kv_avail:
            return
        for r in decoding:
            b.add_decode(r)

    def _decode_batch(self, snap: Snapshot, b: BatchBuilder) -> None:
        page = b.page
        decoding = _decodable(snap, b)
        need = sum(decode_cost(r, page) for r in decoding)
        if need > b.kv_avail and len(decoding) > 1:
            # keep-order: higher tier, more generated, shorter prompt; retract from the end
            decoding.sort(key=_keep_key, reverse=True)
            while need > b.kv_avail and len(decoding) > 1:
                victim = decoding.pop()
                need -= decode_cost(victim, page)
                b.evict(victim)
            if self.reserve == "ratio":
                done = sum(r.generated for r in decoding)
                cap = sum(r.max_new_tokens for r in decoding)
                self._next_ratio = min(
                    1.0, (done + RETRACT_DECODE_STEPS * len(decoding)) / (cap + 1)
                )
        elif self.reserve == "ratio" and decoding:
            self._next_ratio = max(self.ratio - self.ratio_decay, self.ratio_min)
        for r in decoding:
            b.add_decode(r)

    def observe(self, result: IterationResult) -> None:
        """Applies the ratio change the last plan decided (decay, retraction estimate, reset)."""
        self.ratio = self._next_ratio


def _decodable(snap: Snapshot, b: BatchBuilder) -> list[ReqState]:
    """The running, fully prefilled requests this plan has not evicted (BE preempted for an RT
    prompt that still did not fit, or for its slot)."""
    gone = set(b.evictions)
    return [r for r in snap.running if r.prefilled >= r.prefill_len and r.rid not in gone]


def _keep_key(r: ReqState) -> tuple[bool, int, int]:
    """SGLang's retraction order, most worth keeping last: higher tier, more generated tokens,
    shorter prompt."""
    return (r.tier == "rt", r.generated, -r.prompt_len)
