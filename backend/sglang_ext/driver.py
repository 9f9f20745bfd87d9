"""The policy inside SGLang's scheduler: snapshot in, plan out, the plan carried out at the seams.

One :class:`EngineDriver` lives in the scheduler process (created by ``backend.sglang_ext.plugin``)
and is called from the hooks of ``backend.sglang_ext.hooks`` once per scheduler iteration::

    get_next_batch_to_run  ──▶ begin_iteration: close the previous iteration (policy.observe with
      │                        its measured time and finished lengths), apply control updates
      ├─ _should_defer_prefill ─▶ plan_iteration: snapshot → policy.plan → evict the plan's
      │                        victims, park the BE decodes the plan leaves out (they keep
      │                        their KV), put the plan's prompts at the head of the waiting
      │                        queue; "defer prefill" when the plan prefills nothing
      ├─ PrefillAdder (hooks.TandemPrefillAdder) admits exactly the planned prompts, each with
      │                        its planned chunk length (planned_tokens)
      └─ update_running_batch / mixed chunk: decodes the rows that were not parked
    process_batch_result   ──▶ end_iteration: finished lengths noted, parked rows merged back

This module imports no sglang (it reads SGLang's objects through the attributes documented in
``mirror``), so its bookkeeping is unit-tested with plain stand-ins; the glue that subclasses
SGLang's classes is ``hooks``.

The scheduler runs without overlap scheduling in tandem mode (the launcher passes
``--disable-overlap-schedule``; SGLang forces it on CPU anyway), so an iteration's batch is
processed before the next one is planned and a parked row is never part of an in-flight batch.
"""

from __future__ import annotations

import logging
import math
import queue
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from backend.policy.tandem import slack
from backend.policy.tandem.victims import victim_order
from backend.policy.time_share import plan_times_s
from backend.policy.types import (
    FinishedRequest,
    IterationResult,
    Plan,
    Policy,
    ReqState,
    Snapshot,
)
from backend.sglang_ext.driver_stats import PLAN_MS_KEPT, DriverStats
from backend.sglang_ext.mirror import ReqMirror

logger = logging.getLogger(__name__)

SWEEP_EVERY = 200
"""Iterations between sweeps of mirrored requests that vanished (aborted while waiting)."""
MIN_CHUNK_TOKENS = 16
"""Chunk given to SGLang's in-progress chunked prefill when the plan leaves it out but prefills
others: SGLang cannot pause it in a prefill pass (one chunked request at a time, and the pass
accounts for it), so it advances by this little."""


class EngineDriver:
    """Runs a policy inside SGLang's scheduler loop (one per scheduler process)."""

    def __init__(
        self,
        policy: Policy,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self.clock = clock
        self.mirror = ReqMirror(clock=clock, wall_clock=wall_clock)
        self.stats = DriverStats(policy=policy.name)
        self.boot_id = uuid.uuid4().hex
        """Identifies this scheduler process (the gateway re-pushes histories when it changes)."""
        self.plan: Plan | None = None
        """The current iteration's plan (None between iterations or when none was made)."""
        self.planned_tokens: dict[str, int] = {}
        """rid → chunk length of each planned prefill of the current iteration."""
        self.fallback = False
        """True for an iteration where SGLang's own admission runs (see stall_fallbacks)."""
        self.parked: Any = None
        """SGLang ``ScheduleBatch`` of the decode rows sitting this iteration out, or None."""
        self.control: queue.SimpleQueue[dict[str, list[int]]] = queue.SimpleQueue()
        """Length-history pushes from the control endpoint's thread, applied by the loop."""
        self._iter_start_s: float | None = None
        self._iter_plan: Plan | None = None
        self._iter_overhead_s = 0.0
        self._iter_rt_frac = 0.0
        self._finished: list[FinishedRequest] = []
        self._reported: set[str] = set()
        self._last_iteration_s: float | None = None

    # --- iteration boundaries ------------------------------------------------------------

    def begin_iteration(self) -> None:
        """Top of ``get_next_batch_to_run``: feeds the previous iteration back to the policy."""
        t0 = self.clock()
        if self._iter_start_s is not None and self._iter_plan is not None:
            duration = t0 - self._iter_start_s
            self._last_iteration_s = duration
            self.stats.iterations += 1
            self.stats.busy_s += duration
            self.stats.rt_busy_s += duration * self._iter_rt_frac
            self.stats.overhead_s += self._iter_overhead_s
            self.policy.observe(
                IterationResult(
                    start_s=self._iter_start_s,
                    duration_s=duration,
                    plan=self._iter_plan,
                    finished=self._finished,
                )
            )
        self._finished = []
        self._iter_start_s = None
        self._iter_plan = None
        self._iter_overhead_s = 0.0
        self._iter_rt_frac = 0.0
        self.plan = None
        self.planned_tokens = {}
        self.fallback = False
        self._apply_control()
        self._iter_overhead_s += self.clock() - t0

    def batch_started(self, ran_batch: bool, start_s: float) -> None:
        """End of ``get_next_batch_to_run``: whether this iteration runs a batch."""
        if ran_batch:
            self._iter_start_s = start_s
            self._iter_plan = self.plan if self.plan is not None else Plan()

    def note_finished(self, reqs: Iterable[Any]) -> None:
        """After a batch's results: every finished request's output length (aborted ones
        excluded: a cut-off length says nothing about the tenant) goes to the policy."""
        t0 = self.clock()
        for req in reqs:
            if not req.finished():
                continue
            rid = str(req.rid)
            if rid in self._reported:
                continue
            self._reported.add(rid)
            state = self.mirror.get(rid)
            if state is not None and not _is_abort(req):
                self._finished.append(
                    FinishedRequest(
                        rid=rid,
                        tier=state.tier,
                        length_key=state.length_key,
                        output_len=len(req.output_ids),
                    )
                )
                self.stats.finished += 1
            self.mirror.forget(rid)
        if len(self._reported) > 100_000:  # rids are unique; only the recent ones can repeat
            self._reported.clear()
        self._iter_overhead_s += self.clock() - t0

    # --- the plan ------------------------------------------------------------------------

    def snapshot(self, sched: Any, running_reqs: list[Any]) -> Snapshot:
        """The engine's state as the policy sees it, at the start of a prefill decision."""
        now = self.clock()
        mirror = self.mirror
        waiting = [mirror.waiting(req, now) for req in sched.waiting_queue]
        running = [mirror.running(req, now) for req in running_reqs]
        chunked = sched.chunked_req
        if chunked is not None:
            running.append(mirror.running(chunked, now, chunked=True))
        allocator = sched.token_to_kv_pool_allocator
        tree_cache = sched.tree_cache
        num_decode = sum(1 for r in running if r.is_decoding)
        chunk_cap = sched.chunked_prefill_size
        if chunk_cap is None or chunk_cap <= 0:
            chunk_cap = sched.max_prefill_tokens
        if sched.is_mixed_chunk:
            chunk_cap -= num_decode  # SGLang charges mixed decode rows to the chunk budget
        return Snapshot(
            now_s=now,
            waiting=waiting,
            running=running,
            waiting_rt=[r for r in waiting if r.tier == "rt"],
            waiting_be=[r for r in waiting if r.tier == "be"],
            kv_capacity_tokens=int(sched.max_total_num_tokens),
            kv_free_tokens=int(allocator.available_size()),
            kv_evictable_tokens=int(tree_cache.evictable_size()),
            last_iteration_s=self._last_iteration_s,
            max_running=int(sched.max_running_requests),
            max_prefill_tokens=max(1, int(chunk_cap)),
            page_size=int(sched.page_size),
        )

    def plan_iteration(
        self, sched: Any, running_batch: Any, evict: Callable[[Any, list[int]], None]
    ) -> bool:
        """Plans this iteration and carries out the parts that happen before SGLang builds its
        batches; returns True when SGLang should skip its prefill pass (the plan prefills
        nothing). *evict(batch, indices)* retracts rows of *running_batch* (SGLang glue)."""
        t0 = self.clock()
        self.stats.plans += 1
        if self.stats.plans % SWEEP_EVERY == 0:
            self._sweep(sched, running_batch)
        snap = self.snapshot(sched, list(running_batch.reqs) + self.parked_reqs())
        self._note_peaks(snap)
        t_plan = self.clock()
        plan = self.policy.plan(snap)
        plan_ms = (self.clock() - t_plan) * 1000.0
        self.plan = plan
        self._note_plan_ms(plan_ms)
        if (
            not (plan.prefills or plan.decodes or plan.evictions)
            and snap.waiting
            and not snap.running
        ):
            # A policy that plans nothing for an idle engine with queued work would leave it
            # idle for good (nothing else changes its state): SGLang admits this time.
            self.fallback = True
            self.stats.stall_fallbacks += 1
            self._iter_overhead_s += self.clock() - t0
            return False
        rows = {str(req.rid): i for i, req in enumerate(running_batch.reqs)}
        victims = [rows[rid] for rid in plan.evictions if rid in rows]
        if victims:
            evict(running_batch, victims)
            self.stats.evictions += len(victims)
        self._iter_rt_frac = self._rt_frac(plan, snap)
        self._park(running_batch, set(plan.decodes), bool(plan.prefills))
        self.planned_tokens = {c.rid: c.tokens for c in plan.prefills}
        self.stats.planned_prefills += len(plan.prefills)
        self._put_planned_first(sched)
        self._iter_overhead_s += self.clock() - t0
        chunked = sched.chunked_req
        chunked_planned = chunked is not None and str(chunked.rid) in self.planned_tokens
        return not (plan.prefills or chunked_planned)

    def _rt_frac(self, plan: Plan, snap: Snapshot) -> float:
        """Share of this iteration's predicted time that its RT work alone would take
        (`backend.policy.time_share`); 0 for a policy without a latency model."""
        latency = getattr(self.policy, "latency", None)
        if latency is None:
            return 0.0
        states = {r.rid: r for r in snap.running}
        states.update((r.rid, r) for r in snap.waiting)
        full_s, rt_s = plan_times_s(latency, plan, states)
        return rt_s / full_s if full_s > 0 else 0.0

    def chunk_for_continuing(self, rid: str) -> int:
        """Chunk length for SGLang's in-progress chunked prefill this pass."""
        return self.planned_tokens.get(rid, MIN_CHUNK_TOKENS)

    def retraction_order(self, reqs: list[Any]) -> list[int]:
        """SGLang's out-of-memory retraction order: indices most-preferred-to-keep first (it
        retracts from the end). BE first (least progress lost), then RT by slack, largest
        first; urgent RT last of all."""
        self.stats.retractions_ordered += 1
        now = self.clock()
        states = [self.mirror.running(req, now) for req in reqs]
        index = {id(s): i for i, s in enumerate(states)}
        be = [s for s in states if s.tier == "be"]
        rt = [s for s in states if s.tier == "rt"]
        iteration_s = self._last_iteration_s or 0.0
        victims = victim_order(be, rt, lambda r: _slack(r, now), iteration_s, include_rt=True)
        chosen = {id(s) for s in victims}
        urgent = sorted((s for s in rt if id(s) not in chosen), key=lambda r: _slack(r, now))
        # Most preferred to keep: the urgent RT (least slack first), then the victims in
        # reverse (SGLang pops the first victim off the end).
        ordered = urgent + list(reversed(victims))
        return [index[id(s)] for s in ordered]

    def unpark(self, running_batch: Any) -> Any:
        """Merges the parked rows back; returns the running batch to use (SGLang glue
        replaces an empty running batch by the parked one)."""
        parked, self.parked = self.parked, None
        if parked is None or parked.is_empty():
            return running_batch
        if running_batch is None or running_batch.is_empty():
            return parked
        running_batch.merge_batch(parked)
        return running_batch

    def parked_reqs(self) -> list[Any]:
        """Requests parked right now (for SGLang's in-flight / idle bookkeeping)."""
        return [] if self.parked is None else list(self.parked.reqs)

    def push_lengths(self, histories: dict[str, list[int]]) -> None:
        """Thread-safe: queue a length-history push (applied at the next iteration)."""
        self.control.put(histories)

    # --- internals -----------------------------------------------------------------------

    def _park(self, batch: Any, decodes: set[str], has_prefill: bool) -> None:
        """Moves the decode rows the plan leaves out into ``self.parked`` (KV kept)."""
        if self.plan is None or (not self.plan.decodes and not has_prefill):
            return  # an empty plan: let SGLang decode as it would
        orchestrator = getattr(
            getattr(batch, "sampling_info", None), "penalizer_orchestrator", None
        )
        if orchestrator is not None and getattr(orchestrator, "is_required", False):
            # Penalizers keep per-row state in one shared object that a split would corrupt;
            # such batches decode whole (rare: frequency/presence penalties, min_new_tokens).
            return
        reqs = batch.reqs
        park = [i for i, req in enumerate(reqs) if str(req.rid) not in decodes]
        if not park:
            return
        keep = [i for i, req in enumerate(reqs) if str(req.rid) in decodes]
        if not keep:
            # SGLang's batch code assumes a non-empty running batch here; keep the row with
            # the most progress (its KV is the most expensive to lose).
            best = max(park, key=lambda i: len(reqs[i].output_ids))
            park.remove(best)
            keep = [best]
        parked = _split_off(batch, park, keep)
        self.parked = parked
        self.stats.parked_decodes += len(park)

    def _put_planned_first(self, sched: Any) -> None:
        """Reorders the waiting queue: the planned prompts first, in plan order, whole prompts
        before the one that will be cut into a chunk (SGLang cuts at most one per pass)."""
        if not self.planned_tokens:
            return
        planned = self.planned_tokens
        order = {rid: i for i, rid in enumerate(planned)}
        first: list[Any] = []
        rest: list[Any] = []
        for req in sched.waiting_queue:
            (first if str(req.rid) in planned else rest).append(req)
        first.sort(key=lambda req: (self._is_partial(req), order[str(req.rid)]))
        sched.waiting_queue[:] = first + rest

    def _is_partial(self, req: Any) -> bool:
        state = self.mirror.get(str(req.rid))
        left = state.prompt_left if state is not None else 0
        return self.planned_tokens.get(str(req.rid), 0) < left

    def _apply_control(self) -> None:
        while True:
            try:
                histories = self.control.get_nowait()
            except queue.Empty:
                return
            lengths = getattr(self.policy, "lengths", None)
            if lengths is None:
                continue  # a policy without a length history (a baseline)
            for key, values in histories.items():
                lengths.replace_history(key, values)
                self.stats.history_lengths += len(values)
            self.stats.history_updates += 1

    def reset_stats(self) -> None:
        """Thread-safe enough for counters: starts a fresh measurement window (the loop may
        add to the old object for one more iteration)."""
        self.stats = DriverStats(policy=self.policy.name)

    def _note_peaks(self, snap: Snapshot) -> None:
        stats = self.stats
        stats.peak_running = max(stats.peak_running, len(snap.running))
        used = snap.kv_capacity_tokens - snap.kv_free_tokens
        stats.peak_kv_used_tokens = max(stats.peak_kv_used_tokens, used)

    def _note_plan_ms(self, plan_ms: float) -> None:
        kept = self.stats.plan_ms
        kept.append(plan_ms)
        if len(kept) > PLAN_MS_KEPT:
            del kept[: len(kept) - PLAN_MS_KEPT]

    def _sweep(self, sched: Any, running_batch: Any) -> None:
        live = {str(r.rid) for r in sched.waiting_queue}
        live.update(str(r.rid) for r in running_batch.reqs)
        live.update(str(r.rid) for r in self.parked_reqs())
        if sched.chunked_req is not None:
            live.add(str(sched.chunked_req.rid))
        dropped = self.mirror.sweep(live)
        if dropped:
            logger.debug("tandem: dropped %d vanished requests from the mirror", dropped)


def _slack(r: ReqState, now_s: float) -> float:
    deadline = slack.rt_deadline(r)
    return math.inf if math.isinf(deadline) else deadline - now_s


def _is_abort(req: Any) -> bool:
    reason = getattr(req, "finished_reason", None)
    return type(reason).__name__ == "FINISH_ABORT"


def _split_off(batch: Any, park: list[int], keep: list[int]) -> Any:
    """Splits *batch* in place: it keeps the rows *keep*; the rows *park* come back as a new
    batch. The copy gets its own sampling info (per-row tensors are sliced by filter_batch)."""
    parked = _shallow_copy(batch)
    parked.filter_batch(keep_indices=park)
    batch.filter_batch(keep_indices=keep)
    return parked


def _shallow_copy(batch: Any) -> Any:
    import copy

    parked = copy.copy(batch)
    if getattr(batch, "sampling_info", None) is not None:
        parked.sampling_info = copy.copy(batch.sampling_info)
    return parked
