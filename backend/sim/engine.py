"""The discrete-event simulator: the policy's plans run on a virtual clock.

Each iteration: pop the arrivals due, snapshot, `policy.plan`, execute (core.apply), advance the
clock by `latency.predict(shape of the executed batch)` (× `SimConfig.engine_slowdown`'s factor
at the iteration's start, `regime_slowdowns`' factor of the batch's regime and `engine_noise`'s
jitter: the engine's truth may diverge from the model the policy plans with), emit tokens
(core.finish), tell the source about finished requests, `policy.observe`. An idle engine jumps
to the next arrival.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

from backend.policy.calibration import regime_of
from backend.policy.latency import BatchShape, LatencyModel
from backend.policy.load_report import observe_pace
from backend.policy.time_share import shape_of
from backend.policy.types import FinishedRequest, IterationResult, Policy, Snapshot
from backend.sim.config import SimConfig
from backend.sim.core import EngineCore
from backend.sim.front_door import FrontDoor, front_door_for
from backend.sim.records import IterationLog, RequestRecord, SimResult
from backend.sim.source import ArrivalSource, SimRequest
from backend.sim.track import Batch, Track

_MAX_IDLE_PLANS = 1000  # consecutive plans that advance no time before the run is declared stuck


class StalledPolicyError(RuntimeError):
    """The policy keeps returning plans that run nothing while work is pending and no arrival
    could change its mind."""


class _Clock:
    """Where the run stands: virtual time and the horizon."""

    def __init__(self, horizon_s: float | None) -> None:
        self.now_s = 0.0
        self.horizon_s = math.inf if horizon_s is None else horizon_s


def simulate(
    source: ArrivalSource,
    policy: Policy,
    latency: LatencyModel,
    config: SimConfig,
    *,
    progress: Callable[[float], None] | None = None,
) -> SimResult:
    """Runs `policy` on the simulated engine until every request finished (or the horizon).

    `progress(now_s)` is called about once per simulated second. Raises InfeasiblePlanError
    when a plan breaks a rule (KV over capacity, a decode of a request that is not running, ...)
    and StalledPolicyError when the policy stops making progress.
    """
    core = EngineCore(config, policy.name)
    door = front_door_for(
        policy,
        config.slo_unattainable,
        ttft_feedback=config.ttft_feedback,
        recheck_frac=config.slo_recheck_frac,
    )
    log = IterationLog(config.kv_capacity_tokens)
    clock = _Clock(config.horizon_s)
    noise = PaceNoise(config.engine_noise, config.engine_noise_seed)
    next_progress = 0.0
    idle_plans = 0
    while clock.now_s < clock.horizon_s:
        if door is not None:  # the ones kept to judge again first: they came first
            for req in door.take_pending():
                _through(door, core, source, req, clock.now_s)
        for req in source.pop_due(clock.now_s):
            if door is not None:
                _through(door, core, source, req, clock.now_s)
            else:
                core.add(req)
        if not core.running and not core.waiting and not (door is not None and door.pending):
            if not _jump_to_arrival(source, clock):
                break
            continue
        slowdown = config.slowdown_at(clock.now_s) * noise.factor()
        snap = core.snapshot(clock.now_s)
        if door is not None:  # every iteration's state, as the engine reports each one
            door.rt_outputs.observe(snap)
        step = start_iteration(
            core,
            policy,
            latency,
            clock.now_s,
            slowdown,
            snap,
            regime_slowdowns=config.regime_slowdowns,
        )
        if isinstance(step, Held):  # idle by choice: until the hold ends or a request arrives
            nxt = source.next_arrival_s()
            clock.now_s = step.until_s if nxt is None else max(clock.now_s, min(step.until_s, nxt))
            continue
        if step is None:  # nothing to run until something arrives
            if not _jump_to_arrival(source, clock):
                if clock.now_s >= clock.horizon_s:
                    break
                raise StalledPolicyError(
                    f"policy {policy.name!r} runs nothing with {len(core.waiting)} waiting and "
                    f"{len(core.running)} running requests at t={clock.now_s:.3f}s and no "
                    f"arrival to come"
                )
            continue
        duration = step.duration_s
        finished = end_iteration(core, policy, source, log, step)
        if door is not None and door.feedback is not None:
            door.iteration_ended(clock.now_s + duration)
            for t in finished:
                door.learn(t.state.rid, t.state.first_token_s, clock.now_s + duration)
        clock.now_s += duration
        if door is not None and duration > 0.0:  # the engine's recent pace, as /load reports it
            observe_pace(door.pace, policy, step.batch.plan, duration)
        idle_plans = idle_plans + 1 if duration <= 0.0 else 0
        if idle_plans > _MAX_IDLE_PLANS:
            raise StalledPolicyError(
                f"policy {policy.name!r}: {idle_plans} plans in a row "
                f"advanced no time at t={clock.now_s:.3f}s"
            )
        if progress is not None and clock.now_s >= next_progress:
            progress(min(clock.now_s, clock.horizon_s))
            next_progress = math.floor(clock.now_s) + 1.0
    if door is not None:  # the run ended before their verdict: their contract's answer
        for req in door.settle_pending():
            core.add(req)
    if progress is not None:
        progress(min(clock.now_s, clock.horizon_s))
    return _result(core, log, policy.name, config.horizon_s, clock.now_s, door)


def _through(
    door: FrontDoor, core: EngineCore, source: ArrivalSource, req: SimRequest, now_s: float
) -> None:
    """*req* through the front door: into the engine, refused, or kept to judge again."""
    verdict = door.admit(req, core.snapshot(now_s), now_s)
    if verdict is None:
        source.on_finish(req.rid, now_s)  # a closed loop hears the refusal
    elif not isinstance(verdict, str):  # else "pending": the door keeps it
        core.add(verdict)


def _jump_to_arrival(source: ArrivalSource, clock: _Clock) -> bool:
    """Moves an idle clock to the next arrival; False when there is none before the horizon."""
    nxt = source.next_arrival_s()
    if nxt is None:
        return False
    if nxt >= clock.horizon_s:
        clock.now_s = clock.horizon_s
        return False
    clock.now_s = max(clock.now_s, nxt)
    return True


class Step:
    """One iteration between its start (planned, KV allocated) and its end (tokens emitted)."""

    __slots__ = (
        "batch",
        "duration_s",
        "kv_used",
        "num_running",
        "num_waiting",
        "plan_ms",
        "rt_part_s",
    )  # fmt: skip

    def __init__(
        self,
        batch: Batch,
        duration_s: float,
        num_running: int,
        num_waiting: int,
        plan_ms: float,
        kv_used: int,
        rt_part_s: float,
    ) -> None:
        self.batch = batch
        self.duration_s = duration_s
        self.num_running = num_running
        self.num_waiting = num_waiting
        self.plan_ms = plan_ms
        self.kv_used = kv_used
        self.rt_part_s = rt_part_s

    @property
    def end_s(self) -> float:
        return self.batch.start_s + self.duration_s


class Held:
    """A plan that runs nothing by choice (`Plan.hold_until_s`): the engine idles until
    `until_s` or the next arrival, whichever comes first, then plans again."""

    __slots__ = ("until_s",)

    def __init__(self, until_s: float) -> None:
        self.until_s = until_s


class PaceNoise:
    """The simulated engine's iteration-to-iteration jitter (`SimConfig.engine_noise`): one
    log-normal factor of mean 1 for each iteration the engine plans, from its own seeded stream
    (so the requests' and the policies' own randomness do not move it)."""

    __slots__ = ("_rng", "_shift", "_sigma")

    def __init__(self, sigma: float, seed: int | str) -> None:
        self._sigma = sigma
        self._shift = -0.5 * sigma * sigma  # E[exp(σZ − σ²/2)] = 1
        self._rng = random.Random(seed) if sigma > 0.0 else None

    def factor(self) -> float:
        """The next iteration's factor (exactly 1 without jitter: no draw is made)."""
        if self._rng is None:
            return 1.0
        return math.exp(self._sigma * self._rng.gauss(0.0, 1.0) + self._shift)


def start_iteration(
    core: EngineCore,
    policy: Policy,
    latency: LatencyModel,
    now_s: float,
    slowdown: float = 1.0,
    snap: Snapshot | None = None,
    *,
    regime_slowdowns: tuple[float, ...] = (),
) -> Step | Held | None:
    """Plans an iteration at `now_s` and starts it (`core.apply`); a `Held` when the policy
    waits by choice, None when the plan was empty. *snap*: the snapshot to plan from, when the
    caller already took it at `now_s`.
    The batch's compute takes `slowdown` × its regime's factor of *regime_slowdowns*
    (`SimConfig.regime_slowdowns`; () = 1) × the model's prediction."""
    num_running, num_waiting = len(core.running), len(core.waiting)
    if snap is None:
        snap = core.snapshot(now_s)
    t0 = time.perf_counter()
    plan = policy.plan(snap)
    plan_ms = (time.perf_counter() - t0) * 1000.0
    if not (plan.decodes or plan.prefills or plan.evictions):
        if plan.hold_until_s is not None and plan.hold_until_s > now_s:
            return Held(plan.hold_until_s)
        return None
    batch = core.apply(plan, now_s)
    kv_used = core.kv.used
    duration = _pace(slowdown, regime_slowdowns, batch.shape) * latency.predict(batch.shape)
    if core.bikv is not None:  # checkpoint and restore traffic of the bicache layout (unscaled)
        duration = core.bikv.iteration_s(duration)
    rt_part_s = _rt_part_s(latency, batch, duration, slowdown, regime_slowdowns)
    return Step(batch, duration, num_running, num_waiting, plan_ms, kv_used, rt_part_s)


def end_iteration(
    core: EngineCore, policy: Policy, source: ArrivalSource, log: IterationLog, step: Step
) -> list[Track]:
    """Ends a started iteration: emits its tokens, logs it, tells the source about finished
    requests and the policy about the result; returns the finished tracks."""
    batch, now_s, duration = step.batch, step.batch.start_s, step.duration_s
    end_s = now_s + duration
    emitted, finished = core.finish(batch, end_s)
    plan = batch.plan
    log.append(
        start_s=now_s,
        duration_s=duration,
        predicted_s=plan.predicted_s,
        plan_ms=step.plan_ms,
        num_prefill=len(batch.prefills),
        num_decode=len(batch.decodes),
        prefill_tokens=batch.shape.prefill_tokens,
        kv_used_tokens=step.kv_used,
        num_running=step.num_running,
        num_waiting=step.num_waiting,
        num_evictions=batch.num_evictions,
        rt_part_s=step.rt_part_s,
    )
    done = [
        FinishedRequest(t.state.rid, t.state.tier, t.state.length_key, t.state.generated)
        for t in finished
    ]
    for t in finished:
        source.on_finish(t.state.rid, end_s)
    policy.observe(
        IterationResult(
            start_s=now_s, duration_s=duration, plan=plan, emitted=emitted, finished=done
        )
    )
    return finished


def _pace(slowdown: float, regime_slowdowns: tuple[float, ...], shape: BatchShape) -> float:
    """How many times the model's prediction a batch of `shape` takes on the simulated engine."""
    if not regime_slowdowns:
        return slowdown
    return slowdown * regime_slowdowns[regime_of(shape.num_prefill, shape.num_decode)]


def _rt_part_s(
    latency: LatencyModel,
    batch: Batch,
    duration_s: float,
    slowdown: float = 1.0,
    regime_slowdowns: tuple[float, ...] = (),
) -> float:
    """What `batch` would have taken with only its RT decodes and RT prompt chunks — the
    iteration's fixed cost included, on the same (slowed) engine — or 0 when it ran no RT work
    (`backend.policy.time_share`).
    Called after `apply`, before `finish`: `prefilled` already counts this iteration's chunks,
    `generated` does not count its decodes yet."""
    decodes = [t.state for t in batch.decodes if t.state.tier == "rt"]
    chunks = [(t.state, n) for t, n in batch.prefills if t.state.tier == "rt"]
    if not decodes and not chunks:
        return 0.0
    if len(decodes) == len(batch.decodes) and len(chunks) == len(batch.prefills):
        return duration_s  # nothing but RT work
    shape = shape_of(
        (s.prompt_len + s.generated for s in decodes), ((n, s.prefilled - n) for s, n in chunks)
    )
    return min(duration_s, _pace(slowdown, regime_slowdowns, shape) * latency.predict(shape))


def _record(t: Track) -> RequestRecord:
    s, req = t.state, t.req
    return RequestRecord(
        rid=s.rid,
        tier=s.tier,
        arrival_s=s.arrival_s,
        prompt_len=s.prompt_len,
        output_len_target=t.target,
        generated=s.generated,
        first_token_s=s.first_token_s,
        finish_s=t.finish_s,
        token_times=t.times,
        evictions=s.num_evictions,
        cached_tokens=t.first_cached or 0,
        ttft_target_s=req.ttft_target_s,
        tpot_target_s=req.tpot_target_s,
        deadline_s=s.deadline_due_s,
        length_key=s.length_key,
        tenant_id=s.tenant_id,
        max_new_tokens=s.max_new_tokens,
        admitted_s=t.admitted_s,
    )


def _records(core: EngineCore, door: FrontDoor | None) -> list[RequestRecord]:
    """Every request's record in arrival order, the shed ones (which never reached the core)
    included, each with how the front door admitted it."""
    records = [_record(t) for t in core.arrived]
    if door is None:
        return records
    for rec in records:
        rec.admission = door.outcomes.get(rec.rid, "admitted")
    return sorted(records + door.shed, key=lambda r: r.arrival_s)


def _result(
    core: EngineCore,
    log: IterationLog,
    policy_name: str,
    horizon_s: float | None,
    end_s: float,
    door: FrontDoor | None = None,
) -> SimResult:
    admitted = [t for t in core.arrived if t.first_cached is not None]
    prompt = sum(t.state.prompt_len for t in admitted)
    cached = sum(t.first_cached or 0 for t in admitted)
    return SimResult(
        policy_name=policy_name,
        requests=_records(core, door),
        iterations=log,
        horizon_s=horizon_s,
        end_s=end_s,
        prefix_reuse_ratio=cached / prompt if prompt else 0.0,
        num_evictions=core.num_evictions,
        kv_layout_stats=core.bikv.stats() if core.bikv is not None else {},
    )
