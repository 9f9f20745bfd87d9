"""The policy inside SGLang's scheduler: snapshot in, plan out, a :class:`Directive` for the hooks.

One :class:`EngineDriver` lives in the scheduler process (created by ``backend.sglang_ext.plugin``)
and is called from the hooks of ``backend.sglang_ext.hooks`` once per scheduler iteration::

    get_next_batch_to_run  ──▶ begin_iteration: close the previous iteration (policy.observe with
      │                        its measured time and finished lengths), apply control updates
      ├─ _should_defer_prefill ─▶ plan_iteration: snapshot → policy.plan → a Directive (who is
      │                        evicted, who sits out, which prompts go first with which chunk,
      │                        whether the prefill pass runs); the hooks carry it out
      ├─ PrefillAdder (hooks.TandemPrefillAdder) admits exactly the directive's prompts, each
      │                        with its chunk; note_prefill counts what it took
      └─ update_running_batch / mixed chunk: decodes the rows that were not parked
    process_batch_result   ──▶ note_finished: finished lengths noted (the hooks merge the parked
                               rows back)

The driver decides and keeps the policy's books; it never changes SGLang's objects and never
calls the hooks. It reads SGLang's objects through the Protocols of ``views`` (no sglang
import), so it is unit-tested with plain stand-ins.

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType

import msgspec

from backend.policy.calibration import DECODE, MIXED, PREFILL, PaceSpread
from backend.policy.feasibility import RtOutputs, load_of
from backend.policy.load_report import (
    observe_pace,
    policy_calibration_samples,
    policy_factors,
    policy_rt_decode_margin,
    policy_rt_fair_counters,
    policy_rt_late_bound_frac,
    policy_slot_free_quantile,
)
from backend.policy.tandem import slack
from backend.policy.tandem.victims import victim_order
from backend.policy.time_share import plan_shape, plan_times_s
from backend.policy.types import (
    FinishedRequest,
    IterationResult,
    Plan,
    Policy,
    ReqState,
    Snapshot,
)
from backend.sglang_ext.directive import Directive
from backend.sglang_ext.driver_stats import PLAN_MS_KEPT, DriverStats
from backend.sglang_ext.load_board import LoadBoard
from backend.sglang_ext.mirror import ReqMirror
from backend.sglang_ext.views import BatchView, ReqView, SchedulerView
from common.wire import EngineLoad, IterationMix

logger = logging.getLogger(__name__)

SWEEP_EVERY = 200
"""Iterations between sweeps of mirrored requests that vanished (aborted while waiting)."""
CALIBRATION_BAND = (0.8, 1.25)
"""Latency-calibration factors inside this band mean the profile describes the engine well
enough; one outside it for longer than CALIBRATION_WARN_S starts a warning episode."""
CALIBRATION_WARN_S = 10.0
"""Seconds a factor must stay outside CALIBRATION_BAND before the (single) warning."""
PREFIX_NEW_MATCHES = 64
"""Waiting requests matched against the prefix cache per plan the first time they are seen
(the rest of a flood of arrivals in the next plans; one not matched yet is planned from its
first token, as before matching)."""
PREFIX_RECHECK_S = 0.5
"""A waiting request's prefix match is renewed after this long (the cache changes under it:
another request computes a prefix it shares, an eviction takes one), seconds."""
PREFIX_RECHECKS = 8
"""Renewed matches per plan at most, in queue order (the prompts tandem planned first lead
it): each costs SGLang's match over the prompt."""


class EngineDriver:
    """Runs a policy inside SGLang's scheduler loop (one per scheduler process)."""

    def __init__(
        self,
        policy: Policy,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        profile: str = "",
        profile_matches: bool | None = None,
        kv_unfreeable: Callable[[str], int] = lambda rid: 0,
        cached_prefix: Callable[[SchedulerView, ReqView], int] | None = None,
    ) -> None:
        self.policy = policy
        self.cached_prefix = cached_prefix
        """(scheduler, waiting request) → how many of its prompt tokens the prefix cache holds
        now (SGLang's own match; at most all but one); None: not matched, every waiting prompt
        is planned from its first token (but one sent back mid-prefill)."""
        self.kv_unfreeable = kv_unfreeable
        """rid → how many of a running request's KV slots evicting it would not add to the
        allocator's ``available_size`` (``kv_layout_engine.unfreeable_tokens``; 0 without a KV
        layout): the policy is told them as shared, so it never plans on slots counted twice."""
        self.profile = profile
        """Name of the latency profile the policy plans with (for the calibration warning)."""
        self.profile_matches = profile_matches
        """True when that profile was measured on this engine (its key is the engine's), False
        when not (or it is unkeyed), None when the engine's key is unknown."""
        self.clock = clock
        """The scheduler's clock (monotonic seconds): every instant the policy sees."""
        self.wall_clock = wall_clock
        self.mirror = ReqMirror(clock=clock, wall_clock=wall_clock)
        self.stats = DriverStats(policy=policy.name)
        self.boot_id = uuid.uuid4().hex
        """Identifies this scheduler process (the gateway re-pushes histories when it changes)."""
        self.control: queue.SimpleQueue[dict[str, list[int]]] = queue.SimpleQueue()
        """Length-history pushes from the control endpoint's thread, applied by the loop."""
        self.loads = LoadBoard(EngineLoad(iteration=0, at_unix_s=wall_clock()))
        """The engine's live state after each iteration, for the control endpoint's long poll
        (`common.wire.CONTROL_LOAD_PATH`): published at the next plan, from its snapshot."""
        self.iterations = 0
        """Iterations that ran a batch since the scheduler started (never reset, unlike the
        stats: the gateway's long poll counts on it)."""
        self._plan: Plan | None = None  # this iteration's plan, for policy.observe
        self._plan_mix: IterationMix | None = None  # its token mix, for the iteration log
        self._iter_start_s: float | None = None
        self._iter_plan: Plan | None = None
        self._iter_mix: IterationMix | None = None
        self._iter_overhead_s = 0.0
        self._iter_rt_frac = 0.0
        self._finished: list[FinishedRequest] = []
        self._reported: set[str] = set()
        self._last_iteration_s: float | None = None
        self._last_predicted_s = 0.0  # what the plan of that iteration predicted (0: nothing)
        self._last_mix: IterationMix | None = None  # the token mix that iteration ran
        self._pace = PaceSpread()  # measured ÷ predicted of the recent iterations
        # how long RT requests run: when slots free up
        self._rt_outputs = RtOutputs(quantile=policy_slot_free_quantile(policy))
        self._calib_samples = 0  # calibration samples already copied into the stats
        self._calib_off_since: float | None = None  # a factor left the band at this instant
        self._calib_warned = False  # this episode's warning was logged
        self._parked_every_row = False  # this iteration's directive parks every decode row
        self._stalled_full_park = False  # the last one did, and its prompt was not admitted
        self._holding = False  # the last plan held BE back (anticipation)

    # --- iteration boundaries ------------------------------------------------------------

    def begin_iteration(self) -> None:
        """Top of ``get_next_batch_to_run``: feeds the previous iteration back to the policy."""
        t0 = self.clock()
        if self._iter_start_s is not None and self._iter_plan is not None:
            duration = t0 - self._iter_start_s
            self._last_iteration_s = duration
            self._last_predicted_s = self._iter_plan.predicted_s or 0.0
            self._last_mix = self._iter_mix
            observe_pace(self._pace, self.policy, self._iter_plan, duration)
            self.iterations += 1
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
            self._note_calibration(t0)
        self._finished = []
        self._iter_start_s = None
        self._iter_plan = None
        self._iter_mix = None
        self._iter_overhead_s = 0.0
        self._iter_rt_frac = 0.0
        self._plan = None
        self._plan_mix = None
        self._apply_control()
        self._iter_overhead_s += self.clock() - t0

    def batch_started(self, ran_batch: bool, start_s: float) -> None:
        """End of ``get_next_batch_to_run``: whether this iteration runs a batch."""
        # Every decode row sat out for a prompt that SGLang then did not admit: nothing ran.
        # The next plan keeps a row decoding, so that a prompt refused again and again (KV the
        # decodes hold) never stops the decodes that would free it.
        self._stalled_full_park = self._parked_every_row and not ran_batch
        self._parked_every_row = False
        if ran_batch:
            self._iter_start_s = start_s
            self._iter_plan = self._plan if self._plan is not None else Plan()
            self._iter_mix = self._plan_mix if self._plan is not None else None

    def note_finished(self, reqs: Iterable[ReqView]) -> None:
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

    def note_overhead(self, seconds: float) -> None:
        """Time the hooks spent carrying out this iteration's directive (tandem's overhead)."""
        self._iter_overhead_s += seconds

    def note_parked(self, rows: int) -> None:
        """The hooks split *rows* decode rows off the running batch for this iteration (not
        counted during a hold: no iteration runs, and SGLang's loop asks again at once)."""
        if not self._holding:
            self.stats.parked_decodes += rows

    def note_chunk_parked(self) -> None:
        """SGLang's in-progress chunked prompt sat this prefill pass out (the plan left it out)."""
        self.stats.parked_chunks += 1

    def note_chunk_released(self, rid: str, cached_tokens: int) -> None:
        """SGLang's in-progress chunked prompt *rid* went back to the waiting queue, the KV of
        its first *cached_tokens* tokens kept in the prefix cache."""
        self.stats.released_chunks += 1
        self.mirror.note_cached(rid, cached_tokens)

    def note_prefill(self, *, admitted: bool) -> None:
        """The prefill pass took a planned chunk (*admitted*) or could not (SGLang's
        one-chunked-request rule, KV)."""
        if admitted:
            self.stats.admitted_prefills += 1
        else:
            self.stats.refused_prefills += 1

    # --- the plan ------------------------------------------------------------------------

    def snapshot(self, sched: SchedulerView, running_reqs: Sequence[ReqView]) -> Snapshot:
        """The engine's state as the policy sees it, at the start of a prefill decision."""
        now = self.clock()
        mirror = self.mirror
        self._match_prefixes(sched, now)
        waiting, waiting_rt, waiting_be = mirror.waiting_states(sched.waiting_queue, now)
        running = [mirror.running(req, now) for req in running_reqs]
        chunked = sched.chunked_req
        if chunked is not None:
            running.append(mirror.running(chunked, now, chunked=True))
        for state in running:
            unfreeable = min(self.kv_unfreeable(state.rid), state.kv_tokens)
            state.kv_shared_tokens = max(state.kv_shared_tokens, unfreeable)
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
            waiting_rt=waiting_rt,
            waiting_be=waiting_be,
            kv_capacity_tokens=int(sched.max_total_num_tokens),
            kv_free_tokens=int(allocator.available_size()),
            kv_evictable_tokens=int(tree_cache.evictable_size()),
            last_iteration_s=self._last_iteration_s,
            max_running=int(sched.max_running_requests),
            max_prefill_tokens=max(1, int(chunk_cap)),
            page_size=int(sched.page_size),
        )

    def _match_prefixes(self, sched: SchedulerView, now_s: float) -> None:
        """Notes the prefix the cache holds for waiting requests: every new one (up to
        PREFIX_NEW_MATCHES a plan), and up to PREFIX_RECHECKS whose match is older than
        PREFIX_RECHECK_S. A conversation's next turn finds its history there, a batch line its
        shared instructions once another line computed them: planned as the few tokens SGLang
        will compute, not the whole prompt (else the plan, the latency model's calibration and
        the SLO admission all count work that never runs)."""
        match = self.cached_prefix
        if match is None or not sched.waiting_queue:
            return
        if not sched.tree_cache.supports_prefix_sharing():
            return
        mirror = self.mirror
        stats = self.stats
        new = PREFIX_NEW_MATCHES
        renew = PREFIX_RECHECKS
        for req in sched.waiting_queue:
            rid = str(req.rid)
            at = mirror.matched_at(rid)
            if at is None:
                if new <= 0:
                    continue
                new -= 1
            elif now_s - at < PREFIX_RECHECK_S or renew <= 0:
                continue
            else:
                renew -= 1
            tokens = match(sched, req)
            mirror.note_match(rid, tokens, now_s)
            stats.prefix_matches += 1
            stats.waiting_cached_tokens += tokens
            if new <= 0 and renew <= 0:
                return

    def plan_iteration(
        self, sched: SchedulerView, running_batch: BatchView, parked: Sequence[ReqView] = ()
    ) -> Directive:
        """Plans this iteration: what SGLang does before and in its prefill pass. Reads
        *sched*, *running_batch* and the rows still *parked* (normally none: they are merged
        back after each batch); changes none of them."""
        t0 = self.clock()
        self.stats.plans += 1
        if self.stats.plans % SWEEP_EVERY == 0:
            self._sweep(sched, running_batch, parked)
        running = list(running_batch.reqs)
        snap = self.snapshot(sched, running + list(parked))
        self._note_peaks(snap)
        t_plan = self.clock()
        plan = self.policy.plan(snap)
        plan_ms = (self.clock() - t_plan) * 1000.0
        self._plan = plan
        self._note_plan_ms(plan_ms)
        self._publish_load(snap, plan)
        held = plan.hold_until_s is not None and plan.is_empty and not plan.evictions
        if held:
            self.stats.held_plans += 1
            self.stats.holds += not self._holding
        self._holding = held
        if (
            not (plan.prefills or plan.decodes or plan.evictions)
            and snap.waiting
            and not snap.running
            and not held
        ):
            # A policy that plans nothing for an idle engine with queued work would leave it
            # idle for good (nothing else changes its state): SGLang admits this time.
            self.stats.stall_fallbacks += 1
            self._iter_overhead_s += self.clock() - t0
            return Directive(own_admission=True)
        rids = {str(req.rid) for req in running}
        evict = tuple(rid for rid in plan.evictions if rid in rids)
        self.stats.evictions += len(evict)
        states = self.mirror.states  # every request of the snapshot, and only the plan's are read
        self._iter_rt_frac = self._rt_frac(plan, states)
        self._plan_mix = IterationMix(**msgspec.structs.asdict(plan_shape(plan, states)))
        evicted = set(evict)
        kept = [req for req in running if str(req.rid) not in evicted]
        if held:
            # the policy waits for an RT request on its way (anticipation): nothing runs, and
            # SGLang asks again at once (its loop takes in arrivals first)
            park = tuple(str(req.rid) for req in kept)
        else:
            park = self._park(plan, kept, keep_one=self._stalled_full_park)
        # (a hold is no stall: the next plan may hold again, with every row sitting out)
        self._parked_every_row = bool(park) and len(park) == len(kept) and not held
        prefill_tokens = {c.rid: c.tokens for c in plan.prefills}
        self.stats.planned_prefills += len(plan.prefills)
        prefill_first = _prefill_first(prefill_tokens, states)
        chunked = sched.chunked_req
        chunked_planned = chunked is not None and str(chunked.rid) in prefill_tokens
        release_chunked = False
        if (
            chunked is not None
            and not chunked_planned
            and any(_is_cut(rid, prefill_tokens, states) for rid in prefill_tokens)
        ):
            # SGLang cuts one prompt at a time: the in-progress one must make way, or a planned
            # prompt that must be cut waits for all of it.
            if sched.tree_cache.supports_prefix_sharing():
                release_chunked = True  # back to the queue, its KV cached
            else:
                # Nowhere to keep its KV: it runs to its end in this pass (SGLang then lets the
                # planned prompt be cut after it), rather than sit out while that prompt waits.
                state = states.get(str(chunked.rid))
                if state is not None and state.prompt_left > 0:
                    prefill_tokens[str(chunked.rid)] = state.prompt_left
                    chunked_planned = True
        directive = Directive(
            evict=evict,
            park=park,
            prefill_first=prefill_first,
            prefill_tokens=MappingProxyType(prefill_tokens),
            skip_prefill=not (plan.prefills or chunked_planned),
            release_chunked=release_chunked,
        )
        self._iter_overhead_s += self.clock() - t0
        return directive

    def _rt_frac(self, plan: Plan, states: Mapping[str, ReqState]) -> float:
        """Share of this iteration's predicted time that its RT work alone would take
        (`backend.policy.time_share`); 0 for a policy without a latency model."""
        latency = getattr(self.policy, "latency", None)
        if latency is None:
            return 0.0
        full_s, rt_s = plan_times_s(latency, plan, states)
        return rt_s / full_s if full_s > 0 else 0.0

    def retraction_order(self, reqs: Sequence[ReqView]) -> list[int]:
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

    def push_lengths(self, histories: dict[str, list[int]]) -> None:
        """Thread-safe: queue a length-history push (applied at the next iteration)."""
        self.control.put(histories)

    # --- internals -----------------------------------------------------------------------

    @staticmethod
    def _park(plan: Plan, rows: Sequence[ReqView], keep_one: bool = False) -> tuple[str, ...]:
        """The decode *rows* (the running batch after the evictions) the plan leaves out;
        never every row when *keep_one* (the last time every row sat out, nothing ran), and
        never a row being aborted: its next decode ends it and frees its KV and its slot (a
        client gone, a batch cancelled), which a parked row would hold for as long as the plan
        leaves it out."""
        if not plan.decodes and not plan.prefills:
            return ()  # an empty plan: let SGLang decode as it would
        decodes = set(plan.decodes)
        park = [
            i
            for i, req in enumerate(rows)
            if str(req.rid) not in decodes and getattr(req, "to_finish", None) is None
        ]
        if park and len(park) == len(rows) and (keep_one or not plan.prefills):
            # With no prompt to run, SGLang goes on to decode the running batch, and its batch
            # code assumes that one is not empty: keep the row with the most progress (its KV
            # is the most expensive to lose). With a prompt, an empty running batch is what
            # SGLang has before any decode: the prompt runs alone (a mixed batch of one decode
            # row and an RT prompt took 2-3x the prompt alone on the CPU engine: 20-27 ms
            # against 8, the RT request's TTFT).
            park.remove(max(park, key=lambda i: len(rows[i].output_ids)))
        return tuple(str(rows[i].rid) for i in park)

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

    def _publish_load(self, snap: Snapshot, plan: Plan) -> None:
        """After each completed iteration, the state the next one plans from, and what *plan*
        predicts that iteration takes, go to the control endpoint's long polls (once: the
        scheduler also plans while idle, and an idle engine's state only changes by arrivals,
        which the next iteration reports)."""
        if self.iterations == self.loads.latest.iteration:
            return
        self._rt_outputs.observe(snap)
        factors = policy_factors(self.policy)
        self.loads.publish(
            load_of(
                snap,
                iteration=self.iterations,
                at_unix_s=self.wall_clock(),
                iteration_s=self._last_iteration_s or 0.0,
                predicted_iteration_s=self._last_predicted_s,
                inflight_predicted_s=_inflight_predicted_s(plan, snap),
                latency_factors=factors,
                pace_ratio_p90=self._pace.upper(factors),
                pace_ratio_recent_mean=self._pace.recent_mean(factors),
                calibration_samples=policy_calibration_samples(self.policy),
                rt_fair_counters=policy_rt_fair_counters(self.policy),
                rt_late_bound_frac=policy_rt_late_bound_frac(self.policy),
                rt_decode_margin=policy_rt_decode_margin(self.policy),
                rt_outputs=self._rt_outputs,
            ),
            self._last_mix,
        )

    def _note_peaks(self, snap: Snapshot) -> None:
        stats = self.stats
        stats.peak_running = max(stats.peak_running, len(snap.running))
        used = snap.kv_capacity_tokens - snap.kv_free_tokens
        stats.peak_kv_used_tokens = max(stats.peak_kv_used_tokens, used)

    def _note_calibration(self, now_s: float) -> None:
        """Copies the policy's latency calibration into the stats (a policy without one has
        none) and logs one warning per episode of a factor outside CALIBRATION_BAND for more
        than CALIBRATION_WARN_S."""
        calib = getattr(self.policy, "calibration", None)
        if calib is None:
            return
        stats = self.stats
        riders = getattr(self.policy, "riders", None)
        if riders is not None:
            stats.rider_cost_factor = riders.factor
        factors = tuple(calib.factors)
        stats.latency_factor_decode, stats.latency_factor_prefill, stats.latency_factor_mixed = (
            factors
        )
        if calib.samples != self._calib_samples and calib.last_error is not None:
            self._calib_samples = calib.samples
            stats.latency_calibrated_at_unix_s = self.wall_clock()
            (
                stats.latency_mean_pace_decode,
                stats.latency_mean_pace_prefill,
                stats.latency_mean_pace_mixed,
            ) = (calib.mean_pace(regime) for regime in (DECODE, PREFILL, MIXED))
            for kept, value in (
                (stats.latency_error, calib.last_error),
                (stats.latency_corrected_error, calib.last_corrected_error),
            ):
                kept.append(value)
                if len(kept) > PLAN_MS_KEPT:
                    del kept[: len(kept) - PLAN_MS_KEPT]
        lo, hi = CALIBRATION_BAND
        if all(lo <= f <= hi for f in factors):
            self._calib_off_since, self._calib_warned = None, False  # the episode is over
            return
        if self._calib_off_since is None:
            self._calib_off_since = now_s
        elif not self._calib_warned and now_s - self._calib_off_since > CALIBRATION_WARN_S:
            self._calib_warned = True
            stats.latency_warnings += 1
            logger.warning(
                "tandem: the engine has run off its latency profile %r for %.0f s: "
                "calibration factors decode %.2f, prefill %.2f, mixed %.2f (outside "
                "[%.2f, %.2f]; predictions are corrected, but re-profile this engine)",
                self.profile or "(unnamed)",
                now_s - self._calib_off_since,
                *factors,
                lo,
                hi,
            )

    def _note_plan_ms(self, plan_ms: float) -> None:
        kept = self.stats.plan_ms
        kept.append(plan_ms)
        if len(kept) > PLAN_MS_KEPT:
            del kept[: len(kept) - PLAN_MS_KEPT]

    def _sweep(
        self, sched: SchedulerView, running_batch: BatchView, parked: Sequence[ReqView]
    ) -> None:
        live = {str(r.rid) for r in sched.waiting_queue}
        live.update(str(r.rid) for r in running_batch.reqs)
        live.update(str(r.rid) for r in parked)
        if sched.chunked_req is not None:
            live.add(str(sched.chunked_req.rid))
        dropped = self.mirror.sweep(live)
        if dropped:
            logger.debug("tandem: dropped %d vanished requests from the mirror", dropped)


def _slack(r: ReqState, now_s: float) -> float:
    deadline = slack.rt_deadline(r)
    return math.inf if math.isinf(deadline) else deadline - now_s


def _is_abort(req: ReqView) -> bool:
    reason = getattr(req, "finished_reason", None)
    return type(reason).__name__ == "FINISH_ABORT"


def _inflight_predicted_s(plan: Plan, snap: Snapshot) -> float | None:
    """What the iteration about to run is predicted to take: the plan's prediction; 0 when
    nothing will run (nothing planned, waiting or running); None when unknown (a policy that
    predicts nothing, or SGLang admitting on its own after an empty plan)."""
    if plan.prefills or plan.decodes or plan.evictions:
        return plan.predicted_s
    return 0.0 if not (snap.waiting or snap.running) else None


def _is_cut(rid: str, prefill_tokens: Mapping[str, int], states: Mapping[str, ReqState]) -> bool:
    """True when the planned prompt *rid* is planned a chunk shorter than what it has left to
    compute, so the pass must cut it (as the mirror sees it: a prefix-cache hit the pass finds
    may make the prompt fit after all)."""
    state = states.get(rid)
    return state is not None and prefill_tokens[rid] < state.prompt_left


def _prefill_first(
    prefill_tokens: Mapping[str, int], states: Mapping[str, ReqState]
) -> tuple[str, ...]:
    """The planned prompts in queue order: plan order, whole prompts before the one that will
    be cut into a chunk (SGLang cuts at most one per pass)."""
    order = {rid: i for i, rid in enumerate(prefill_tokens)}
    return tuple(
        sorted(prefill_tokens, key=lambda rid: (_is_cut(rid, prefill_tokens, states), order[rid]))
    )
