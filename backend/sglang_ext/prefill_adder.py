"""The prefill pass under tandem: :class:`TandemPrefillAdder`, SGLang's ``PrefillAdder``
restricted to one iteration's :class:`~backend.sglang_ext.directive.Directive` (installed by
``backend.sglang_ext.hooks`` through ``Scheduler.get_prefill_adder_class``).

Memory admission: SGLang reserves ``new_token_ratio × max_new_tokens`` for every running
request and ``max_new_tokens`` for each candidate. Under tandem the policy's Past-Future
admission has already decided, so the adder reserves nothing for future tokens (running offsets
0, candidates charged only the KV their chunk needs now, plus the KV layout's per-prompt slack);
a decode that later finds the pool full goes through SGLang's retraction, in the policy's victim
order.

SGLang tracks one chunked prefill at a time (``Scheduler.chunked_req`` is a scalar; a second cut
prompt in one pass trips an assertion), so a planned prompt that would have to be cut while
another is mid-prefill waits a pass (counted as a refused prefill) — unless the planning seam
sent the in-progress one back to the queue first (``Directive.release_chunked``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.prefill_budget import PrefillBudget

from backend.sglang_ext.directive import Directive
from backend.sglang_ext.driver import EngineDriver


class TandemPrefillAdder(PrefillAdder):  # type: ignore[misc]  # SGLang is untyped here
    """SGLang's prefill pass, restricted to the *directive*: a waiting request is admitted only
    when the directive prefills it, with at most its planned chunk; the in-progress chunked
    request advances by its planned chunk, or sits the pass out (``on_chunk_parked`` is told)
    when the plan leaves it out; no KV is reserved for future tokens (the policy's admission
    decided). With ``directive.own_admission`` it is SGLang's own adder."""

    rem_chunk_tokens: int | None
    """SGLang's: chunk tokens left in this pass (None: no chunking); narrowed per prompt here."""

    def __init__(
        self,
        *args: Any,
        directive: Directive,
        driver: EngineDriver,
        slack_tokens: int,
        on_chunk_parked: Callable[[Any], None],
        **kwargs: Any,
    ) -> None:
        # Set before SGLang's __init__: it calls _get_running_request_total_token_offset.
        self._directive = directive
        self._driver = driver
        self._on_chunk_parked = on_chunk_parked
        super().__init__(*args, **kwargs)
        self._planned_left = len(directive.prefill_tokens)
        if type(self.memory_budget) is PrefillBudget and not directive.own_admission:
            # Plain token pool (what CPU and dense GPU models use): charge only what the chunk
            # needs now. Other budgets (SWA, Mamba) keep SGLang's reservation.
            budget = self.memory_budget
            budget.check_prefill = _immediate_check(budget, slack_tokens)
            budget.reserve = _immediate_reserve(budget, slack_tokens)

    def _get_running_request_total_token_offset(self, req: Any) -> int:
        if self._directive.own_admission:  # SGLang's own admission, reservation included
            return int(super()._get_running_request_total_token_offset(req))
        return 0

    def add_chunked_req(self, req: Any) -> Any:
        directive = self._directive
        if directive.own_admission:
            return super().add_chunked_req(req)
        chunk = directive.chunk_for_continuing(str(req.rid))
        if chunk is None:
            # The plan leaves it out: it sits this pass out with its KV (SGLang's own way of
            # parking a chunk: the request comes back unchanged and stays the chunked one).
            self._on_chunk_parked(req)
            return req
        self._planned_left -= 1
        self.chunked_req_limit = max(1, chunk)
        return super().add_chunked_req(req)

    def add_one_req(
        self, req: Any, has_chunked_req: bool, truncation_align_size: int | None
    ) -> AddReqResult:
        directive = self._directive
        if directive.own_admission:
            return super().add_one_req(req, has_chunked_req, truncation_align_size)
        planned = directive.prefill_tokens.get(str(req.rid))
        if planned is None:
            # Not in the plan: skip it and keep scanning (any other result ends the pass),
            # unless every planned prompt was seen.
            return AddReqResult.CONTINUE if self._planned_left > 0 else AddReqResult.OTHER
        self._planned_left -= 1
        extend = len(req.full_untruncated_fill_ids) - req.prefix_len
        saved = self.rem_chunk_tokens
        # SGLang cuts the prompt to the pass's remaining chunk budget as well as to the plan's.
        cut = min(planned, saved if saved is not None else planned) < extend
        if cut and (has_chunked_req or self.new_chunked_req is not None):
            # SGLang tracks one chunked prefill at a time (a second one trips its assertion);
            # this prompt waits for a pass where it can be cut.
            self._driver.note_prefill(admitted=False)
            return self._next()
        cap = planned if cut else extend
        if saved is not None:
            self.rem_chunk_tokens = min(saved, max(cap, 1))
        before = len(self.can_run_list)
        try:
            super().add_one_req(req, has_chunked_req, truncation_align_size)
        finally:
            if saved is not None:
                used = min(saved, max(cap, 1)) - (self.rem_chunk_tokens or 0)
                self.rem_chunk_tokens = saved - used
        self._driver.note_prefill(admitted=len(self.can_run_list) > before)
        if self.new_chunked_req is not None:
            return AddReqResult.OTHER  # the cut prompt is the last one this pass
        return self._next()

    def _next(self) -> AddReqResult:
        if self._planned_left <= 0:
            return AddReqResult.OTHER
        state = self.budget_state()
        return AddReqResult.CONTINUE if state == AddReqResult.NO_TOKEN else state


def _immediate_check(budget: PrefillBudget, slack_tokens: int = 0) -> Any:
    """``PrefillBudget.check_prefill`` that asks only for the KV the prompt needs now (plus
    `slack_tokens` the KV layout may lose to it: ``kv_layout_engine.prompt_slack_tokens``)."""

    def check_prefill(
        *,
        extend_input_len: int,
        total_tokens: int,
        max_new_tokens: int,
        input_tokens: int,
        swa_host_hit_length: int,
        chunk_limit: int | None,
        auxiliary_swa_host_hit_length: int = 0,
    ) -> tuple[bool, int | None]:
        need = budget.ceil_paged_tokens(min(extend_input_len, chunk_limit or extend_input_len))
        need += slack_tokens
        fits = need + budget.page_size <= budget.remaining_current
        return (True, chunk_limit) if fits else (False, None)

    return check_prefill


def _immediate_reserve(budget: PrefillBudget, slack_tokens: int = 0) -> Any:
    """``PrefillBudget.reserve`` without the future tokens (tandem's admission decided), with
    `slack_tokens` more per prompt (see `_immediate_check`)."""
    original = budget.reserve

    def reserve(extend_input_len: int, max_new_tokens: int, **kwargs: Any) -> None:
        kwargs["extra_tokens"] = kwargs.get("extra_tokens", 0) + slack_tokens
        original(extend_input_len, 0, **kwargs)

    return reserve
