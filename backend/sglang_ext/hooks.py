"""SGLang glue: the hooks that let :class:`~backend.sglang_ext.driver.EngineDriver` steer the
scheduler, and the ``PrefillAdder`` subclass that admits exactly the planned prompts.

Every seam is a dotted path in ``backend.sglang_ext.seams`` (``tests/unit/test_sglang_seams.py``
resolves each one in the pinned SGLang, so an upgrade that moves one fails loudly).
``SCHED`` below is
``sglang.srt.managers.scheduler.Scheduler``.

==========================================  =======  ============================================
seam                                        hook     what tandem does there
==========================================  =======  ============================================
SCHED.get_next_batch_to_run                 AROUND   iteration boundary: feed the last iteration
                                                     back (policy.observe), apply control pushes
SCHED._should_defer_prefill                 REPLACE  (a) + (b) + (d): plan the iteration, evict
                                                     the plan's victims, park the BE decodes it
                                                     leaves out, skip the prefill pass when the
                                                     plan prefills nothing
SCHED.get_prefill_adder_class               REPLACE  (a) + (c): :class:`TandemPrefillAdder`
SCHED.process_batch_result                  AFTER    (e): finished output lengths; parked rows
                                                     merged back
ScheduleBatch._get_decode_retraction_order  REPLACE  (d): SGLang's out-of-memory retraction takes
                                                     the policy's victim order
SCHED.collect_inflight_reqs                 AFTER    guard: parked requests are in flight (aborts
                                                     find them)
SCHED.is_fully_idle                         AFTER    guard: not idle while rows are parked
==========================================  =======  ============================================

Memory admission (c): SGLang reserves ``new_token_ratio × max_new_tokens`` for every running
request and ``max_new_tokens`` for each candidate. Under tandem the policy's Past-Future
admission has already decided, so :class:`TandemPrefillAdder` reserves nothing for future tokens
(running offsets 0, candidates charged only the KV their chunk needs now); a decode that later
finds the pool full goes through SGLang's retraction, in the policy's victim order.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.prefill_budget import PrefillBudget

from backend.sglang_ext import kv_layout_engine
from backend.sglang_ext.driver import EngineDriver
from backend.sglang_ext.seams import (
    ADDER_CLASS_SEAM,
    DEFER_PREFILL_SEAM,
    IDLE_SEAM,
    INFLIGHT_SEAM,
    NEXT_BATCH_SEAM,
    RESULT_SEAM,
    RETRACT_ORDER_SEAM,
)

logger = logging.getLogger(__name__)

_driver: EngineDriver | None = None


def install(driver: EngineDriver) -> None:
    """Registers the hooks (call from the plugin's ``register`` in the scheduler process)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global _driver
    _driver = driver
    HookRegistry.register(NEXT_BATCH_SEAM, around_get_next_batch_to_run, HookType.AROUND)
    HookRegistry.register(DEFER_PREFILL_SEAM, replace_should_defer_prefill, HookType.REPLACE)
    HookRegistry.register(ADDER_CLASS_SEAM, replace_get_prefill_adder_class, HookType.REPLACE)
    HookRegistry.register(RESULT_SEAM, after_process_batch_result, HookType.AFTER)
    HookRegistry.register(RETRACT_ORDER_SEAM, replace_retraction_order, HookType.REPLACE)
    HookRegistry.register(INFLIGHT_SEAM, after_collect_inflight_reqs, HookType.AFTER)
    HookRegistry.register(IDLE_SEAM, after_is_fully_idle, HookType.AFTER)


def driver() -> EngineDriver:
    """The driver installed in this process."""
    if _driver is None:
        raise RuntimeError("tandem hooks are not installed in this process")
    return _driver


# --- scheduler hooks -----------------------------------------------------------------------


def around_get_next_batch_to_run(original: Any, sched: Any, *args: Any, **kwargs: Any) -> Any:
    drv = driver()
    start_s = drv.clock()
    drv.begin_iteration()
    if drv.parked is not None:  # normally merged back after the last batch's results
        kwargs["running_batch"] = sched.running_batch = drv.unpark(_running_arg(args, kwargs))
        args = ()
    result = original(sched, *args, **kwargs)
    drv.batch_started(result.batch_to_run is not None, start_s)
    return result


def replace_should_defer_prefill(sched: Any, running_batch: Any) -> bool:
    """Called once per iteration after SGLang merged last iteration's prefills into the running
    batch, right before its prefill pass: the moment to plan."""
    return driver().plan_iteration(sched, running_batch, lambda b, idx: _evict(sched, b, idx))


def replace_get_prefill_adder_class(sched: Any) -> type[PrefillAdder]:
    return TandemPrefillAdder


def after_process_batch_result(
    result: Any, sched: Any, batch: Any, *args: Any, **kwargs: Any
) -> None:
    drv = driver()
    drv.note_finished(batch.reqs)
    if drv.parked is not None:
        sched.running_batch = drv.unpark(sched.running_batch)


def replace_retraction_order(reqs: list[Any]) -> list[int]:
    return driver().retraction_order(reqs)


def after_collect_inflight_reqs(
    result: set[Any], sched: Any, *args: Any, **kwargs: Any
) -> set[Any]:
    parked = driver().parked_reqs()
    return result | set(parked) if parked else result


def after_is_fully_idle(result: bool, sched: Any, *args: Any, **kwargs: Any) -> bool:
    return bool(result) and not driver().parked_reqs()


# --- carrying out the plan -----------------------------------------------------------------


def _running_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if "running_batch" in kwargs:
        return kwargs["running_batch"]
    kwargs["last_batch"] = args[1] if len(args) > 1 else kwargs.get("last_batch")
    return args[0]


def _evict(sched: Any, batch: Any, indices: list[int]) -> None:
    """Retracts rows *indices* of the running *batch* the way SGLang's own out-of-memory
    retraction does: KV freed (not cached), request re-queued to resume by recomputation."""
    keep = [i for i in range(len(batch.reqs)) if i not in set(indices)]
    victims = [batch.reqs[i] for i in indices]
    released = []
    for n, idx in enumerate(indices):
        if batch.release_req(idx, len(keep) + len(indices) - n - 1):
            released.append(batch.reqs[idx])
    batch.filter_batch(keep_indices=keep)
    batch.batch_is_full = False
    for req in released:
        sched._add_request_to_queue(req, is_retracted=True)
    if len(released) < len(victims):
        logger.warning(
            "tandem: %d evicted requests had no way to resume", len(victims) - len(released)
        )


class TandemPrefillAdder(PrefillAdder):
    """SGLang's prefill pass, restricted to the plan: a waiting request is admitted only when
    the plan prefills it, with at most its planned chunk; the in-progress chunked request
    advances by its planned chunk (or a minimal one); no KV is reserved for future tokens (the
    policy's admission decided)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._drv = driver()
        self._planned_left = sum(1 for _ in self._drv.planned_tokens)
        if type(self.memory_budget) is PrefillBudget and not self._drv.fallback:
            # Plain token pool (what CPU and dense GPU models use): charge only what the chunk
            # needs now. Other budgets (SWA, Mamba) keep SGLang's reservation.
            budget = self.memory_budget
            slack = kv_layout_engine.prompt_slack_tokens()
            budget.check_prefill = _immediate_check(budget, slack)
            budget.reserve = _immediate_reserve(budget, slack)

    def _get_running_request_total_token_offset(self, req: Any) -> int:
        if driver().fallback:  # SGLang's own admission, reservation included
            return int(super()._get_running_request_total_token_offset(req))
        return 0

    def add_chunked_req(self, req: Any) -> Any:
        if self._drv.fallback:
            return super().add_chunked_req(req)
        rid = str(req.rid)
        self.chunked_req_limit = max(1, self._drv.chunk_for_continuing(rid))
        if rid in self._drv.planned_tokens:
            self._planned_left -= 1
        return super().add_chunked_req(req)

    def add_one_req(
        self, req: Any, has_chunked_req: bool, truncation_align_size: int | None
    ) -> AddReqResult:
        drv = self._drv
        if drv.fallback:
            return super().add_one_req(req, has_chunked_req, truncation_align_size)
        planned = drv.planned_tokens.get(str(req.rid))
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
            drv.stats.refused_prefills += 1
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
        if len(self.can_run_list) > before:
            drv.stats.admitted_prefills += 1
        else:
            drv.stats.refused_prefills += 1
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
