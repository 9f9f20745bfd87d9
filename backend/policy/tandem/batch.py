"""The iteration being planned: `common.BatchBuilder` (plan + KV still available + engine caps)
plus the planner's clock — its predicted time, and the exact-fill chunk for a time budget.

    time_s()                       predicted duration of what is in the batch so far
    on_tokens(reqs, tokens)        told of every token scheduled (chunks and decodes): the
                                   policy charges the tenants' fair-share counters
    chunk_for(req, limit_s)        the longest chunk of req that keeps time_s() ≤ limit_s and
                                   fits KV and the caps ("latency inversion", AccelGen's exact
                                   fill: the cut falls where the budget ends, not at a fixed size)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from backend.policy.common import BatchBuilder, affordable_chunk, align_chunk, decode_cost
from backend.policy.latency import LatencyModel
from backend.policy.tandem.timing import Timer
from backend.policy.types import Plan, ReqState, Snapshot


class TandemBatch(BatchBuilder):
    """A BatchBuilder (which keeps the latency-model totals, F_p inputs included) that answers
    time questions through a `Timer` and adds decodes in bulk."""

    def __init__(
        self,
        snapshot: Snapshot,
        timer: Timer,
        *,
        min_chunk_tokens: int = 1,
        least_chunk_stretch: float = 0.0,
        on_tokens: Callable[[Sequence[ReqState], int], None] | None = None,
    ) -> None:
        super().__init__(snapshot)
        self.timer = timer
        self.on_tokens = on_tokens
        """Called with requests scheduled in this plan and the tokens each is served (a
        chunk's length, 1 for decodes)."""
        self.min_chunk_tokens = min_chunk_tokens
        """Chunks shorter than this are not worth a slot (unless they finish the prompt)."""
        self.least_chunk_stretch = least_chunk_stretch
        """How much longer than the least chunk's iteration `least_chunk` lets a longer chunk's
        run (0: the least chunk as it is); `chunk_for` grows a chunk the same way where its
        cost is mostly its prefix."""
        self.first_tokens = 0
        """RT prompts this batch finishes (each emits its first token when it ends)."""
        self.rt_deadline_s = math.inf
        """Earliest deadline of an RT token this batch emits (the feedback checks it)."""
        self.rt_allowance_s = math.inf
        """That token's allowance when planned (deadline − start), for the near-miss test."""

    def time_s(self) -> float:
        """Predicted duration of the batch so far, seconds."""
        return self.timer.predict(self)

    def add_decodes(self, reqs: list[ReqState]) -> bool:
        """Adds a decode for every request of `reqs` (running, fully prefilled, none decoded yet
        in this plan) if all their KV slots fit; else adds none and returns False."""
        if not reqs:
            return True
        cost = len(reqs) if self.page == 1 else sum(decode_cost(r, self.page) for r in reqs)
        if cost > self.kv_avail:
            return False
        self.kv_avail -= cost
        self.decodes.extend(r.rid for r in reqs)
        contexts = [r.prompt_len + r.generated for r in reqs]
        self.decode_context += sum(contexts)
        self.decode_context_sq += sum([c * c for c in contexts])
        self.num_decode += len(reqs)
        if self.on_tokens is not None:
            self.on_tokens(reqs, 1)
        return True

    def add_decode(self, req: ReqState) -> bool:
        if not super().add_decode(req):
            return False
        if self.on_tokens is not None:
            self.on_tokens((req,), 1)
        return True

    def add_prefill(self, req: ReqState, tokens: int) -> bool:
        if not super().add_prefill(req, tokens):
            return False
        if self.on_tokens is not None:
            self.on_tokens((req,), tokens)
        return True

    def chunk_for(self, req: ReqState, time_limit_s: float) -> int:
        """The longest chunk of `req` that keeps the batch within `time_limit_s` and fits the KV
        still available and the engine caps (page-aligned unless it finishes the prompt); 0 when
        it would be shorter than `min_chunk_tokens` without finishing the prompt."""
        left = req.prefill_len - req.prefilled
        cap = min(left, self.prefill_left, affordable_chunk(req, self.kv_avail, self.page))
        if cap <= 0 or (not req.is_running and self.running_slots < 1):
            return 0
        tokens = align_chunk(
            req, self.timer.max_chunk(self, time_limit_s, prefix=req.prefilled, cap=cap), self.page
        )
        if tokens < left and tokens < self.min_chunk_tokens:
            return 0
        if 0 < tokens < cap and self.least_chunk_stretch > 0.0:
            # Where a chunk's cost is its prefix (the least chunk costs nearly as much as this
            # one), cutting the prompt here saves this iteration little and pays the prefix
            # again in the next: the chunk grows as `least_chunk` does. On the CPU engine a
            # conversation's 251-token turn after 2,190 cached tokens was cut in three, each
            # as long as the whole: TTFT 0.69 s where the turn before took 0.19 s.
            # (marginal costs: what the chunk adds to the batch, so that a batch full of
            # decodes does not make every chunk look cheap)
            least = align_chunk(req, min(tokens, max(1, self.min_chunk_tokens)), self.page)
            base_s = self.time_s()
            least_s = self.timer.with_chunk(self, least, req.prefilled) - base_s
            limit_s = base_s + (1.0 + self.least_chunk_stretch) * least_s
            if self.timer.with_chunk(self, tokens, req.prefilled) <= limit_s:
                longer = self.timer.max_chunk(self, limit_s, prefix=req.prefilled, cap=cap)
                tokens = max(tokens, align_chunk(req, longer, self.page))
        return tokens

    def least_chunk(self, req: ReqState) -> int:
        """The chunk of `req` that an engine with nothing else to run computes whatever the time
        budget says: `min_chunk_tokens` (or the rest of the prompt), within the KV available
        and the engine caps; 0 when even that does not fit. Progress before budgets: a model
        that overestimates the engine (a profile measured on a busy machine) must not leave it
        idle with work queued.

        The chunk grows while the batch stays within `least_chunk_stretch` of the least
        chunk's predicted time: where a chunk's cost is mostly its prefix (attention that reads
        a long prompt's whole KV, on every chunk of it), a chunk many times longer costs little
        more, and a long prompt cut into least chunks pays its prefix over and over (on the CPU
        engine, an 8K prompt's 16-token chunks took 0.5–1 s each)."""
        left = req.prefill_len - req.prefilled
        cap = min(left, self.prefill_left, affordable_chunk(req, self.kv_avail, self.page))
        if cap <= 0 or (not req.is_running and self.running_slots < 1):
            return 0
        least = align_chunk(req, min(cap, max(1, self.min_chunk_tokens)), self.page)
        if least >= cap or self.least_chunk_stretch <= 0.0:
            return least
        limit_s = (1.0 + self.least_chunk_stretch) * self.timer.with_chunk(
            self, least, req.prefilled
        )
        longer = self.timer.max_chunk(self, limit_s, prefix=req.prefilled, cap=cap)
        return max(least, align_chunk(req, longer, self.page))

    def note_rt_token(self, deadline_s: float, allowance_s: float) -> None:
        """Records that this batch emits an RT token due at `deadline_s`."""
        if deadline_s < self.rt_deadline_s:
            self.rt_deadline_s = deadline_s
            self.rt_allowance_s = allowance_s

    def plan(self, latency: LatencyModel | None = None) -> Plan:
        """The finished plan with the planner's own prediction (`latency` is not needed)."""
        return Plan(
            decodes=self.decodes,
            prefills=self.prefills,
            evictions=self.evictions,
            predicted_s=self.time_s() if (self.decodes or self.prefills) else None,
        )
