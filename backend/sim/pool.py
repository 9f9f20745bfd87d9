"""N simulated engine replicas behind one router: the discrete-event simulator of a pool.

Each replica is the single-engine simulator's core and policy (backend/sim/engine.py: the same
iteration start and end), with its own clock: an iteration in flight ends at its own time.
The pool's loop takes the earliest event — an arrival, or a replica's iteration end — in
time order::

    arrival   router.choose(ask, views)        the placement code the gateway runs
              (backend/policy/placement.py) → the SLO admission on the chosen replica (the
              contract's outcome when it is predicted to miss: the front door's) → the
              request waits in the replica's inbox (sent, not yet in its queue) or, on an
              idle replica, enters at once and an iteration starts
    end       core.finish → the inbox enters the queue → a report (`load_of` on the snapshot
              the next plan uses, as the real engine publishes after every iteration) → the
              next iteration starts (or the replica idles); each request that finished and
              whose placement took part of its prompt as cached tells the router how much its
              replica really held (`router.observe_cached`, as the gateway's record stage does)

The router sees each replica as the gateway sees an engine: its last report and the RT sent
since (`Backlog`, from the inbox). A replica whose policy runs nothing while it has work idles
until the next arrival anywhere (the single engine's rule).
"""

from __future__ import annotations

import heapq
import math
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from backend.policy.calibration import PaceSpread
from backend.policy.feasibility import Backlog, RtOutputs, SloForecaster, load_of
from backend.policy.latency import LatencyModel
from backend.policy.load_report import (
    observe_pace,
    policy_calibration_samples,
    policy_rt_decode_margin,
    policy_rt_fair_counters,
    policy_rt_late_bound_frac,
    policy_slot_free_quantile,
)
from backend.policy.placement import PlaceAsk, Replica, Router, prefix_keys
from backend.policy.types import Policy, Snapshot
from backend.sim.config import SimConfig
from backend.sim.core import EngineCore
from backend.sim.engine import (
    Held,
    PaceNoise,
    StalledPolicyError,
    Step,
    end_iteration,
    start_iteration,
)
from backend.sim.engine import _record as engine_record
from backend.sim.engine import _records as engine_records
from backend.sim.front_door import FrontDoor, front_door_for, slo_ask
from backend.sim.records import IterationLog, RequestRecord, SimResult
from backend.sim.source import ArrivalSource, SimRequest
from backend.sim.track import Track
from common.wire import TenantLoad


class _Member:
    """One replica: its core, policy, iteration in flight, inbox and last report."""

    def __init__(self, index: int, policy: Policy, config: SimConfig) -> None:
        self.index = index
        self.name = str(index)
        self.policy = policy
        self.core = EngineCore(config, policy.name)
        self.log = IterationLog(config.kv_capacity_tokens)
        self.pace = PaceSpread()
        self.noise = PaceNoise(config.engine_noise, f"{config.engine_noise_seed}:{index}")
        """Its own jitter (`SimConfig.engine_noise`): replicas do not stall together."""
        self.rt_outputs = RtOutputs(quantile=policy_slot_free_quantile(policy))
        """How long its RT requests run, for its slots' turnover as the real engine reports it."""
        self.step: Step | None = None
        """The iteration in flight (None: idle)."""
        self.inbox: list[SimRequest] = []
        """Requests placed on it during the iteration in flight (they enter at its end)."""
        self.unreported: list[SimRequest] = []
        """Requests placed on it since its last report."""
        self.iterations = 0
        self.view = Replica(name=self.name, load=None)
        """What the router sees of it (rebuilt when its report or its inbox changes)."""

    @property
    def has_work(self) -> bool:
        return bool(self.core.running or self.core.waiting or self.inbox)

    def report(self, now_s: float) -> Snapshot:
        """Publishes its state after an iteration; returns the snapshot it was taken from (the
        one the next plan uses: the policy plans from it, not from a second one)."""
        policy = self.policy
        factors = getattr(policy, "latency_factors", None)
        latency_factors = factors() if factors is not None else (1.0, 1.0, 1.0)
        snap = self.core.snapshot(now_s)
        self.rt_outputs.observe(snap)
        load = load_of(
            snap,
            iteration=self.iterations,
            at_unix_s=now_s,
            iteration_s=self.core.last_iteration_s or 0.0,
            latency_factors=latency_factors,
            pace_ratio_p90=self.pace.upper(latency_factors),
            pace_ratio_recent_mean=self.pace.recent_mean(latency_factors),
            calibration_samples=policy_calibration_samples(policy),
            rt_fair_counters=policy_rt_fair_counters(policy),
            rt_late_bound_frac=policy_rt_late_bound_frac(policy),
            rt_decode_margin=policy_rt_decode_margin(policy),
            rt_outputs=self.rt_outputs,
        )
        self.view = Replica(name=self.name, load=load)
        self.unreported.clear()
        return snap

    def started(self, at_s: float) -> None:
        """Its next iteration started at *at_s*: its report says what it runs, as the real
        engine's does (`EngineLoad.inflight_predicted_s`), so that a request placed while it
        runs is forecast to wait for what is left of it."""
        load, step = self.view.load, self.step
        if load is None or step is None:
            return
        load = msgspec.structs.replace(
            load, at_unix_s=at_s, inflight_predicted_s=step.batch.plan.predicted_s
        )
        self.view = Replica(self.name, load, self.view.backlog)

    def sent(self, req: SimRequest) -> None:
        """A request was placed on it: it waits in the inbox while an iteration is in flight
        (else it entered the queue at once); either way the next report is the first to show
        it, so until then RT counts in the backlog the router sees."""
        if self.step is not None:
            self.inbox.append(req)
        self.unreported.append(req)
        if req.tier == "rt":
            self.view = Replica(self.name, self.view.load, _backlog(self.unreported))


def _backlog(requests: Sequence[SimRequest]) -> Backlog:
    """The RT work among *requests*, in total and by tenant."""
    by_tenant: dict[str, list[float]] = {}
    count = tokens = 0
    for r in requests:
        if r.tier != "rt":
            continue
        count += 1
        tokens += r.prompt_len
        tenant = r.length_key if r.tenant_id is None else r.tenant_id
        entry = by_tenant.setdefault(tenant, [r.tenant_weight, 0, 0])
        entry[1] += 1
        entry[2] += r.prompt_len
    return Backlog(
        num_requests=count,
        prompt_tokens=tokens,
        by_tenant=tuple(
            TenantLoad(tenant_id=t, weight=w, num_waiting=int(n), waiting_prompt_tokens=int(p))
            for t, (w, n, p) in by_tenant.items()
        ),
    )


@dataclass
class PoolResult:
    """The outcome of `simulate_pool`: the pool as one engine (every request, every replica's
    iterations), and what is particular to a pool."""

    result: SimResult
    replicas: int
    placement_us: list[float] = field(default_factory=list)
    """Wall time of each placement decision (`router.choose`), microseconds."""
    requests_per_replica: list[int] = field(default_factory=list)
    """Requests placed on each replica (shed ones excluded)."""
    stopped: bool = False
    """The `stop` callback ended the run early."""


def simulate_pool(
    source: ArrivalSource,
    policies: Sequence[Policy],
    latency: LatencyModel,
    config: SimConfig,
    router: Router,
    *,
    forecaster: SloForecaster | None = None,
    progress: Callable[[float], None] | None = None,
    stop: Callable[[RequestRecord], bool] | None = None,
) -> PoolResult:
    """Runs one replica per policy behind *router* until every request finished (or the
    horizon). The SLO admission is the first policy's (`PolicyBase.slo_forecaster`; none for
    the stock baselines); *forecaster* forecasts RT requests the router did not (defaults to
    the admission's). *stop(record)* is asked with the record of each request shed and of each
    request that finished (final: its tokens all emitted): True ends the run there (a planner
    that already knows the pool is too small).

    Raises what the single-engine simulator raises (InfeasiblePlanError, StalledPolicyError)."""
    if not policies:
        raise ValueError("a pool needs at least one replica")
    if config.ttft_feedback:
        raise ValueError("ttft_feedback is modelled for one engine (simulate), not for a pool")
    members = [_Member(i, p, config) for i, p in enumerate(policies)]
    door = front_door_for(
        policies[0], config.slo_unattainable, recheck_frac=config.slo_recheck_frac
    )
    forecaster = forecaster or (door.forecaster if door is not None else None)
    block = config.prefix_block_tokens
    horizon = math.inf if config.horizon_s is None else config.horizon_s
    ends: list[tuple[float, int]] = []  # (iteration end, replica) of the iterations in flight
    wakes: list[tuple[float, int]] = []  # (hold end, replica) of replicas idle by choice
    stalled: set[int] = set()  # idle replicas with work their policy would not run
    decisions: list[float] = []
    placed = [0] * len(members)
    # rid → prompt tokens the placement took as cached on its replica: once the request ran,
    # the router hears how much the replica really held, as the gateway's record stage tells it
    claims: dict[str, int] = {}
    now = 0.0
    next_progress = 0.0
    for m in members:
        m.report(0.0)

    def start(m: _Member, at_s: float, snap: Snapshot | None = None) -> None:
        slowdown = config.slowdown_at(at_s) * config.replica_slowdown(m.index) * m.noise.factor()
        step = start_iteration(
            m.core,
            m.policy,
            latency,
            at_s,
            slowdown,
            snap,
            regime_slowdowns=config.regime_slowdowns,
        )
        if isinstance(step, Held):  # idle by choice until then (or an arrival starts it)
            m.step = None
            stalled.discard(m.index)
            heapq.heappush(wakes, (step.until_s, m.index))
            return
        m.step = step
        if m.step is None:
            if m.has_work:
                stalled.add(m.index)
            return
        stalled.discard(m.index)
        heapq.heappush(ends, (m.step.end_s, m.index))
        m.started(at_s)

    def place(req: SimRequest, at_s: float) -> bool:
        """Routes and admits one arrival; False when the run should stop."""
        rt_slo = req.tier == "rt" and req.ttft_target_s is not None
        ask = PlaceAsk(
            tier=req.tier,
            prompt_tokens=req.prompt_len,
            prefix_keys=prefix_keys(req.prefix_hashes[: req.prompt_len // block]),
            block_tokens=block,
            slo=slo_ask(req, at_s) if rt_slo else None,
        )
        views = [m.view for m in members]
        t0 = time.perf_counter()
        decision = router.choose(ask, views)
        decisions.append((time.perf_counter() - t0) * 1e6)
        m = members[decision.index]
        if door is not None and rt_slo and ask.slo is not None:
            forecast = decision.forecast
            if forecast is None:
                assert forecaster is not None
                load = m.view.load
                assert load is not None
                forecast = forecaster.forecast(load, ask.slo, m.view.backlog)
            if door.kept(req, forecast, ask.slo):
                door.pending.append(req)  # placed again after the next iteration ends
                return True
            admitted = door.outcome(req, forecast.feasible)
            if admitted is None:
                source.on_finish(req.rid, at_s)  # a closed loop hears the refusal
                return stop is None or not stop(door.shed[-1])
            req = admitted
        placed[m.index] += 1
        if decision.cached_tokens > 0:
            claims[req.rid] = decision.cached_tokens
        idle = m.step is None
        m.sent(req)
        if idle:  # it takes the request now
            m.core.add(req)
            start(m, at_s)
        return True

    stopped = False
    while not stopped:
        next_arrival = source.next_arrival_s()
        next_end = ends[0][0] if ends else None
        if wakes and all(
            wakes[0][0] < t for t in (next_arrival, next_end) if t is not None
        ):  # a hold ends first: that replica plans again (an arrival may have started it)
            wake_s, index = heapq.heappop(wakes)
            now = max(now, wake_s)
            if now >= horizon:
                break
            if members[index].step is None:
                start(members[index], now)
            continue
        if next_arrival is None and next_end is None:
            if stalled:
                m = members[min(stalled)]
                raise StalledPolicyError(
                    f"policy {m.policy.name!r} runs nothing on replica {m.index} with "
                    f"{len(m.core.waiting)} waiting and {len(m.core.running)} running requests "
                    f"at t={now:.3f}s and no arrival to come"
                )
            break
        if next_end is None or (next_arrival is not None and next_arrival <= next_end):
            assert next_arrival is not None
            now = max(now, next_arrival)
            if now >= horizon:
                break
            for req in source.pop_due(now):
                if not place(req, now):
                    stopped = True
                    break
            for index in sorted(stalled):  # an arrival may change an idle policy's mind
                if members[index].step is None:
                    start(members[index], now)
        else:
            now, index = heapq.heappop(ends)
            if now >= horizon:
                break
            m = members[index]
            step = m.step
            assert step is not None
            m.step = None
            finished = end_iteration(m.core, m.policy, source, m.log, step)
            for track in finished:
                if (claim := claims.pop(track.state.rid, 0)) > 0:
                    router.observe_cached(claim, track.first_cached or 0)
            if stop is not None and finished and _stop_on_finished(finished, door, stop):
                stopped = True
            if step.duration_s > 0.0:  # the engine's recent pace, as /load reports it
                observe_pace(m.pace, m.policy, step.batch.plan, step.duration_s)
            m.iterations += 1
            for req in m.inbox:
                m.core.add(req)
            m.inbox.clear()
            start(m, now, m.report(now))
            if door is not None and door.pending:  # a slot may be free now: judged again
                again = door.take_pending()
                for i, req in enumerate(again):
                    if not place(req, now):
                        stopped = True
                        door.pending[:0] = again[i + 1 :]  # kept for the run's end
                        break
        if progress is not None and now >= next_progress:
            progress(min(now, horizon))
            next_progress = math.floor(now) + 1.0
    end_s = min(now, horizon)
    if door is not None:  # the run ended before their verdict: their contract's answer
        for req in door.settle_pending():
            members[0].core.add(req)  # as BE, never run: recorded unfinished
    if progress is not None:
        progress(end_s)
    return PoolResult(
        result=_pool_result(members, door, policies[0].name, config.horizon_s, end_s),
        replicas=len(members),
        placement_us=decisions,
        requests_per_replica=placed,
        stopped=stopped,
    )


def _stop_on_finished(
    finished: Sequence[Track],
    door: FrontDoor | None,
    stop: Callable[[RequestRecord], bool],
) -> bool:
    """Asks *stop* about each finished request's record (as the result will hold it)."""
    for t in finished:
        rec = engine_record(t)
        if door is not None:
            rec.admission = door.outcomes.get(rec.rid, "admitted")
        if stop(rec):
            return True
    return False


def _pool_result(
    members: Sequence[_Member],
    door: FrontDoor | None,
    policy_name: str,
    horizon_s: float | None,
    end_s: float,
) -> SimResult:
    """The pool as one engine: every replica's requests (and the shed ones), every replica's
    iterations in order of their ends, the prefix reuse over every admitted request."""
    records: list[RequestRecord] = []
    for m in members:
        records += engine_records(m.core, None)
    if door is not None:
        for rec in records:
            rec.admission = door.outcomes.get(rec.rid, "admitted")
        records += door.shed
    records.sort(key=lambda r: r.arrival_s)
    admitted = [t for m in members for t in m.core.arrived if t.first_cached is not None]
    prompt = sum(t.state.prompt_len for t in admitted)
    cached = sum(t.first_cached or 0 for t in admitted)
    return SimResult(
        policy_name=policy_name,
        requests=records,
        iterations=merge_logs([m.log for m in members]),
        horizon_s=horizon_s,
        end_s=end_s,
        prefix_reuse_ratio=cached / prompt if prompt else 0.0,
        num_evictions=sum(m.core.num_evictions for m in members),
    )


def merge_logs(logs: Sequence[IterationLog]) -> IterationLog:
    """The replicas' iteration logs as one, in order of the iterations' ends (the metrics place
    a token in the iteration whose end emitted it)."""
    merged = IterationLog(logs[0].kv_capacity_tokens if logs else 1)
    if not logs:
        return merged
    columns = [log.columns() for log in logs]
    ends = np.concatenate(
        [np.frombuffer(c["start_s"]) + np.frombuffer(c["duration_s"]) for c in columns]
    )
    order = np.argsort(ends, kind="stable")
    for name, first in columns[0].items():
        joined = np.concatenate([np.frombuffer(c[name], dtype=first.typecode) for c in columns])
        setattr(merged, name, array(first.typecode, joined[order].tobytes()))
    return merged
