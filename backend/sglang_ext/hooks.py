"""SGLang glue: the hooks that carry out the :class:`~backend.sglang_ext.directive.Directive` s of
the :class:`~backend.sglang_ext.driver.EngineDriver` at the scheduler's seams.

Every seam is a dotted path in ``backend.sglang_ext.seams``
(``tests/functional/test_sglang_seams.py`` resolves each one in the pinned SGLang, so an upgrade
that moves one fails loudly).
``SCHED`` below is ``sglang.srt.managers.scheduler.Scheduler``.

==========================================  =======  ============================================
seam                                        hook     what tandem does there
==========================================  =======  ============================================
SCHED.get_next_batch_to_run                 AROUND   iteration boundary: feed the last iteration
                                                     back (policy.observe), apply control pushes
SCHED._should_defer_prefill                 REPLACE  plan the iteration (the driver's directive)
                                                     and carry out its first half: evict, park
                                                     the decodes it leaves out, release the
                                                     chunked prompt to the queue when told,
                                                     planned prompts first; skip the prefill
                                                     pass when it says so
SCHED.get_prefill_adder_class               REPLACE  ``prefill_adder.TandemPrefillAdder`` bound to
                                                     the directive: its second half (a chunked
                                                     prompt left out of the plan sits the pass
                                                     out; SGLang's count of its chunks in flight
                                                     is put back after the pass)
SCHED.process_batch_result                  AFTER    finished output lengths; parked rows merged
                                                     back
ScheduleBatch._get_decode_retraction_order  REPLACE  SGLang's out-of-memory retraction takes the
                                                     policy's victim order
SCHED.collect_inflight_reqs                 AFTER    guard: parked requests are in flight (aborts
                                                     find them)
SCHED.is_fully_idle                         AFTER    guard: not idle while rows are parked
==========================================  =======  ============================================

How the hooks communicate: the driver never calls them back; it returns a frozen
:class:`~backend.sglang_ext.directive.Directive` and keeps its own books. :class:`SchedulerHooks`
holds the two values that pass from one seam to a later one, each written in one place: the
iteration's directive (made at the planning seam, handed to the prefill adder as a constructor
argument) and the parked rows (split off at the planning seam, merged back after the batch's
results; the guards read them). The KV layout, when on, is told which rows are parked
(``on_park``) rather than asking.

This module imports no SGLang at import time (the row operations are ``batch_ops``, SGLang's
objects come through ``views``), so the glue runs on stand-ins in unit tests; :meth:`install`
and the prefill adder import it in the scheduler process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from backend.sglang_ext import batch_ops
from backend.sglang_ext.directive import NOTHING_PLANNED, Directive
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
from backend.sglang_ext.views import BatchView, ReqView, SchedulerView


def _no_slack() -> int:
    return 0


def _ignore_parked(reqs: Sequence[ReqView]) -> None:
    pass


def _release_into_prefix_cache(sched: SchedulerView, req: ReqView) -> None:
    """SGLang's own release of a request's KV row, with what it computed kept in the prefix
    cache (``release_kv_cache(..., checkpoint=True)``), so the request resumes from there."""
    from sglang.srt.mem_cache.common import release_kv_cache

    release_kv_cache(req, sched.tree_cache, checkpoint=True)


def cached_prefix_in_tree(sched: SchedulerView, req: ReqView) -> int:
    """How many of waiting *req*'s prompt tokens the prefix cache holds now: SGLang's own match
    (``match_kv_cache``, as its cache-aware queue policies run it on the waiting requests each
    pass; SGLang matches again when it admits the request), capped at all tokens but one (one
    is always computed)."""
    from sglang.srt.mem_cache.common import match_kv_cache

    ids = req.origin_input_ids + req.output_ids if len(req.output_ids) else req.origin_input_ids
    result = match_kv_cache(req, sched.tree_cache, ids, max_prefix_len=max(0, len(ids) - 1))
    return min(int(result.device_prefix_len), max(0, len(ids) - 1))


def admit_ready_grammars(sched: SchedulerView) -> None:
    """Moves the requests whose grammar (`json_schema`, `regex`, `ebnf`) has compiled from
    SGLang's grammar queue into the waiting queue, as SGLang does at the start of its prefill
    pass. tandem plans before that pass and skips it when the waiting queue holds nothing to
    prefill, so without this a constrained request waited in the grammar queue forever (until
    another request arrived to plan a prefill for)."""
    manager = getattr(sched, "grammar_manager", None)
    if manager is not None and manager.has_waiting_grammars():
        for req in manager.get_ready_grammar_requests():
            sched._add_request_to_queue(req)  # through tandem's own hook on it, as SGLang does


class SchedulerHooks:
    """tandem's hooks in one scheduler process, around its :class:`EngineDriver`."""

    def __init__(
        self,
        driver: EngineDriver,
        *,
        prompt_slack_tokens: Callable[[], int] = _no_slack,
        on_park: Callable[[Sequence[ReqView]], None] = _ignore_parked,
        release_kv: Callable[[SchedulerView, ReqView], None] = _release_into_prefix_cache,
    ) -> None:
        """*prompt_slack_tokens*: KV slots the KV layout may lose to each prompt beyond its own
        tokens (``kv_layout_engine.prompt_slack_tokens``); *on_park*: told the requests
        parked right now after every change (the bicache layout makes BE ones dormant);
        *release_kv*: frees a released chunked prompt's KV row, its computed KV kept in the
        prefix cache (SGLang's own release by default)."""
        self.driver = driver
        self._prompt_slack_tokens = prompt_slack_tokens
        self._on_park = on_park
        self._release_kv = release_kv
        self._directive: Directive = NOTHING_PLANNED
        """This iteration's directive: made by the planning seam, given to the prefill adder;
        back to NOTHING_PLANNED at the top of each iteration."""
        self._parked: BatchView | None = None
        """SGLang ``ScheduleBatch`` of the decode rows sitting this iteration out, or None."""
        self._parked_chunk: tuple[ReqView, int] | None = None
        """The chunked prompt sitting this prefill pass out, with its count of chunks in flight
        before the pass (SGLang counts one more for it once the pass builds a batch, though it
        runs none: put back after the pass), or None."""

    def install(self) -> None:
        """Registers the hooks (call from the plugin's ``register`` in the scheduler process)."""
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(NEXT_BATCH_SEAM, self.around_get_next_batch_to_run, HookType.AROUND)
        HookRegistry.register(
            DEFER_PREFILL_SEAM, self.replace_should_defer_prefill, HookType.REPLACE
        )
        HookRegistry.register(
            ADDER_CLASS_SEAM, self.replace_get_prefill_adder_class, HookType.REPLACE
        )
        HookRegistry.register(RESULT_SEAM, self.after_process_batch_result, HookType.AFTER)
        HookRegistry.register(RETRACT_ORDER_SEAM, self.replace_retraction_order, HookType.REPLACE)
        HookRegistry.register(INFLIGHT_SEAM, self.after_collect_inflight_reqs, HookType.AFTER)
        HookRegistry.register(IDLE_SEAM, self.after_is_fully_idle, HookType.AFTER)

    def parked_reqs(self) -> list[ReqView]:
        """Requests parked right now."""
        return [] if self._parked is None else list(self._parked.reqs)

    # --- scheduler hooks -------------------------------------------------------------------

    def around_get_next_batch_to_run(
        self, original: Any, sched: SchedulerView, *args: Any, **kwargs: Any
    ) -> Any:
        drv = self.driver
        start_s = drv.clock()
        drv.begin_iteration()
        self._directive = NOTHING_PLANNED
        if self._parked is not None:  # normally merged back after the last batch's results
            running = self._unpark(_running_arg(args, kwargs))
            kwargs["running_batch"] = sched.running_batch = running
            args = ()
        self._parked_chunk = None
        result = original(sched, *args, **kwargs)
        if self._parked_chunk is not None:
            req, in_flight = self._parked_chunk
            # SGLang adds one to the chunked request's chunks in flight for every prefill
            # batch built while it is the chunked request; a parked one is not in the batch,
            # so the result of the batch would never take it off again, and its last chunk
            # would be taken for a middle one (its first token never sent).
            req.inflight_middle_chunks = min(req.inflight_middle_chunks, in_flight)
            self._parked_chunk = None
        drv.batch_started(result.batch_to_run is not None, start_s)
        return result

    def replace_should_defer_prefill(self, sched: SchedulerView, running_batch: BatchView) -> bool:
        """Called once per iteration after SGLang merged last iteration's prefills into the
        running batch, right before its prefill pass: the moment to plan."""
        drv = self.driver
        admit_ready_grammars(sched)
        directive = drv.plan_iteration(sched, running_batch, self.parked_reqs())
        self._directive = directive
        if directive.own_admission:
            return False
        t0 = drv.clock()
        batch_ops.evict(sched, running_batch, directive.evict)
        if directive.park and not batch_ops.penalizers_required(running_batch):
            # (Penalizers keep per-row state in one shared object that a split would corrupt;
            # such batches decode whole: frequency/presence penalties, min_new_tokens.)
            parked = batch_ops.split_off(running_batch, directive.park)
            if parked is not None:
                self._parked = parked
                drv.note_parked(len(parked.reqs))
                self._on_park(self.parked_reqs())
        released = (
            batch_ops.release_chunked(sched, self._release_kv)
            if directive.release_chunked
            else None
        )
        if released is not None:
            req, cached_tokens = released
            drv.note_chunk_released(str(req.rid), cached_tokens)
        batch_ops.put_first(sched.waiting_queue, directive.prefill_first)
        drv.note_overhead(drv.clock() - t0)
        return directive.skip_prefill

    def replace_get_prefill_adder_class(self, sched: SchedulerView) -> Callable[..., Any]:
        # SGLang only calls what this returns (``self.get_prefill_adder_class()(...)``), so the
        # adder can take this iteration's directive as a constructor argument. Imported here:
        # the adder subclasses SGLang's, and this module stays importable without SGLang.
        from backend.sglang_ext.prefill_adder import TandemPrefillAdder

        return functools.partial(
            TandemPrefillAdder,
            directive=self._directive,
            driver=self.driver,
            slack_tokens=self._prompt_slack_tokens(),
            on_chunk_parked=self._chunk_parked,
        )

    def _chunk_parked(self, req: ReqView) -> None:
        """The prefill adder left the chunked prompt *req* out of this pass."""
        self._parked_chunk = (req, int(req.inflight_middle_chunks))
        self.driver.note_chunk_parked()

    def after_process_batch_result(
        self, result: Any, sched: SchedulerView, batch: BatchView, *args: Any, **kwargs: Any
    ) -> None:
        self.driver.note_finished(batch.reqs)
        if self._parked is not None:
            sched.running_batch = self._unpark(sched.running_batch)

    def replace_retraction_order(self, reqs: Sequence[ReqView]) -> list[int]:
        return self.driver.retraction_order(reqs)

    def after_collect_inflight_reqs(
        self, result: set[Any], sched: SchedulerView, *args: Any, **kwargs: Any
    ) -> set[Any]:
        parked = self.parked_reqs()
        return result | set(parked) if parked else result

    def after_is_fully_idle(
        self, result: bool, sched: SchedulerView, *args: Any, **kwargs: Any
    ) -> bool:
        return bool(result) and not self.parked_reqs()

    def _unpark(self, running_batch: Any) -> Any:
        """Merges the parked rows back; returns the running batch to use."""
        parked, self._parked = self._parked, None
        self._on_park(())
        return batch_ops.merge_back(running_batch, parked)


def _running_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The running batch of a ``get_next_batch_to_run(running_batch, last_batch)`` call, given
    positionally or by keyword; *kwargs* gets ``last_batch`` (the caller passes both by keyword
    from then on, with the merged running batch)."""
    if "running_batch" in kwargs:
        return kwargs["running_batch"]
    kwargs["last_batch"] = args[1] if len(args) > 1 else kwargs.get("last_batch")
    return args[0]
