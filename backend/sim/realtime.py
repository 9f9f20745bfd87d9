"""The simulated engine on the real clock: an asyncio task plans, sleeps the predicted iteration
time, and emits tokens to the waiting HTTP streams (used by backend/sim/server.py).

Aborts are applied between iterations (at most one iteration late), so a plan in flight never
loses a request under it.

After every iteration the engine's live state (`common.wire.EngineLoad`, the same report the
patched SGLang scheduler publishes) is kept in `load` and handed to the `CONTROL_LOAD_PATH` long
polls waiting in `wait_load` (the server's handlers, on the same event loop).
"""

from __future__ import annotations

import asyncio
import logging
import time

from backend.policy.calibration import PaceSpread
from backend.policy.feasibility import RtOutputs, load_of
from backend.policy.latency import LatencyModel
from backend.policy.load_report import (
    observe_pace,
    policy_calibration_samples,
    policy_factors,
    policy_rt_decode_margin,
    policy_rt_fair_counters,
    policy_rt_late_bound_frac,
    policy_slot_free_quantile,
)
from backend.policy.types import FinishedRequest, IterationResult, Policy
from backend.sim.config import SimConfig
from backend.sim.core import EngineCore
from backend.sim.source import SimRequest
from backend.sim.track import Track
from common.wire import EngineLoad

log = logging.getLogger(__name__)

FinishReason = dict[str, object]


class Stream:
    """One request's progress as its HTTP handler sees it."""

    def __init__(self, track: Track) -> None:
        self.track = track
        self.finish_reason: FinishReason | None = None
        """None while running; SGLang's {"type": "length"|"abort", ...} at the end."""
        self.changed = asyncio.Event()
        """Set whenever tokens were emitted or the request ended."""

    @property
    def rid(self) -> str:
        return self.track.state.rid

    @property
    def completion_tokens(self) -> int:
        return self.track.state.generated

    def end(self, reason: FinishReason) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
        self.changed.set()


class RealtimeEngine:
    """EngineCore driven by `policy` on the wall clock (seconds since start)."""

    def __init__(
        self, policy: Policy, latency: LatencyModel, config: SimConfig, *, time_scale: float = 1.0
    ) -> None:
        self.policy = policy
        self.latency = latency
        self.config = config
        self.time_scale = time_scale
        """Multiplies every iteration's duration (tests run faster than the profile)."""
        self.core = EngineCore(config, policy.name)
        self.streams: dict[str, Stream] = {}
        self.error: str | None = None
        """Set when the engine loop died (a policy bug); new requests are then refused."""
        self._t0 = time.monotonic()
        self._wake = asyncio.Event()
        self._aborts: list[str] = []
        self.iterations = 0
        """Iterations run since start."""
        self._pace = PaceSpread()  # measured ÷ predicted of the recent iterations
        # how long RT requests run: when slots free up
        self._rt_outputs = RtOutputs(quantile=policy_slot_free_quantile(policy))
        self.load = EngineLoad(
            iteration=0,
            at_unix_s=time.time(),
            kv_capacity_tokens=config.kv_capacity_tokens,
            max_prefill_tokens=config.max_prefill_tokens,
            latency_factors=policy_factors(policy),
        )
        """The state after the latest iteration (the long poll's answer)."""
        self._load_published = asyncio.Event()  # set (and replaced) at each publish

    def now(self) -> float:
        return time.monotonic() - self._t0

    def submit(self, req: SimRequest) -> Stream:
        """Queues a request; raises ValueError for a duplicate rid."""
        stream = Stream(self.core.add(req))
        self.streams[req.rid] = stream
        self._wake.set()
        return stream

    def abort(self, rid: str) -> None:
        """Asks for `rid` to be dropped before the next iteration (unknown rids are ignored)."""
        if rid in self.streams:
            self._aborts.append(rid)
            self._wake.set()

    async def run(self) -> None:
        """The engine loop (runs until cancelled)."""
        try:
            while True:
                self._apply_aborts()
                if not await self._iterate():
                    self._wake.clear()
                    await self._wake.wait()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a policy bug: report it on every open stream
            log.exception("simulated engine stopped")
            self.error = f"{exc.__class__.__name__}: {exc}"
            for stream in list(self.streams.values()):
                stream.end({"type": "abort", "message": self.error})
            self.streams.clear()

    async def _iterate(self) -> bool:
        """One iteration; False when there was nothing to run."""
        core = self.core
        if not core.waiting and not core.running:
            return False
        start = self.now()
        plan = self.policy.plan(core.snapshot(start))
        if not (plan.decodes or plan.prefills or plan.evictions):
            return False
        batch = core.apply(plan, start)
        duration = self.latency.predict(batch.shape)
        if core.bikv is not None:  # checkpoint and restore traffic of the bicache layout
            duration = core.bikv.iteration_s(duration)
        await asyncio.sleep(duration * self.time_scale)
        end = self.now()
        emitted, finished = core.finish(batch, end)
        for rid in emitted:
            stream = self.streams.get(rid)
            if stream is not None:
                stream.changed.set()
        done = []
        for t in finished:
            s = t.state
            done.append(FinishedRequest(s.rid, s.tier, s.length_key, s.generated))
            stream = self.streams.pop(s.rid, None)
            if stream is not None:
                stream.end({"type": "length", "length": s.generated})
        self.policy.observe(
            IterationResult(
                start_s=start, duration_s=end - start, plan=plan, emitted=emitted, finished=done
            )
        )
        self.iterations += 1
        observe_pace(self._pace, self.policy, plan, end - start)
        self._publish_load(end)
        return True

    def _publish_load(self, now_s: float) -> None:
        """The state the next iteration will plan from, to the long polls (an idle engine
        changes only by arrivals, which the next iteration reports)."""
        snapshot = self.core.snapshot(now_s)
        self._rt_outputs.observe(snapshot)
        factors = policy_factors(self.policy)
        self.load = load_of(
            snapshot,
            iteration=self.iterations,
            at_unix_s=time.time(),
            iteration_s=self.core.last_iteration_s or 0.0,
            latency_factors=factors,
            pace_ratio_p90=self._pace.upper(factors),
            pace_ratio_recent_mean=self._pace.recent_mean(factors),
            calibration_samples=policy_calibration_samples(self.policy),
            rt_fair_counters=policy_rt_fair_counters(self.policy),
            rt_late_bound_frac=policy_rt_late_bound_frac(self.policy),
            rt_decode_margin=policy_rt_decode_margin(self.policy),
            rt_outputs=self._rt_outputs,
        )
        published, self._load_published = self._load_published, asyncio.Event()
        published.set()

    async def wait_load(self, after_iteration: int, wait_s: float) -> EngineLoad:
        """The load once an iteration past *after_iteration* has run (at once when one has),
        else after *wait_s* seconds the newest (`common.wire.CONTROL_LOAD_PATH`)."""
        deadline_s = time.monotonic() + wait_s
        while self.load.iteration <= after_iteration:
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                break
            try:
                await asyncio.wait_for(self._load_published.wait(), left_s)
            except TimeoutError:
                break
        return self.load

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for rid in aborts:
            stream = self.streams.pop(rid, None)
            if stream is not None:
                self.core.abort(rid)
                stream.end({"type": "abort", "message": "aborted"})

    def loads(self) -> dict[str, object]:
        """SGLang's per-rank `/v1/loads` entry."""
        kv = self.core.kv
        return {
            "dp_rank": 0,
            "num_running_reqs": len(self.core.running),
            "num_waiting_reqs": len(self.core.waiting),
            "num_total_reqs": len(self.core.running) + len(self.core.waiting),
            "token_usage": round((kv.used - kv.evictable) / kv.capacity, 4),
            "max_total_num_tokens": kv.capacity,
            "max_running_requests": self.config.max_running,
        }
