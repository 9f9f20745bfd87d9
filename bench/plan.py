"""Capacity planning by simulation: the fewest engine replicas that meet every tenant's contract
for a trace (`tandem plan`, tandem/plan.py).

    trace (+ contracts) → for a replica count N: the simulator's pool (backend/sim/pool.py:
    N replicas of the engine policy behind the router, the gateway's own placement code) →
    per-tenant attainment → does every tenant reach the target?

Search (`search_replicas`): up from N = 1, at most doubling, until a count meets the target
(or `max_replicas`), then inward between the last count that failed and the first that met it
— each next count where the last failure's miss share puts the answer (a failure costs a
fraction of a run, a count that meets the whole run), safeguarded to shrink the bracket as
bisection would. Same answer as trying every count, when more replicas never do worse.

Attainment of a tenant, over every request it offered in the trace:
* RT: the share that met both its TTFT and its TPOT target (a shed or downgraded request
  missed; so did one unfinished when the run ended);
* BE with a deadline: the share finished within it; BE without one has no contract (reported,
  as the share finished, but not a criterion).

Three things keep the search within minutes on a one-hour trace of a large pool:
* a trace longer than `window_s` + `warmup_s` is judged on its busiest window (`busiest_window`:
  the `window_s` seconds that offer the judged tenants the most tokens, sliding by a quarter
  window), simulated from `warmup_s` before it so the pool is in its steady state when judging
  starts (requests arriving in the warm-up are served, not judged). A pool sized for the peak
  serves every quieter window too (more replicas never do worse, nor does less load), so the
  count is the one the whole trace would give or, where a quieter window could have absorbed
  the peak's misses, more — the capacity planner's rule of sizing for the peak. A BE deadline
  is judged on the window's own batch lines: a backlog built up over the rest of the trace is
  not seen (`window_s` 0 simulates the whole trace);
* a run stops as soon as some tenant's requests known to have missed (shed, or finished out of
  contract) put it below the target whatever its other requests do (an undersized pool is
  recognised in the first minutes of its trace, not at the end; a count that meets the target
  is never stopped, so the answer is the same as running every count to the end);
* past `sample_replicas` replicas, a count N is judged on a sub-pool: `sample_replicas` of the N
  replicas, fed the requests that would go to them — those whose group (a prompt-prefix root,
  so a conversation or a batch group stays whole; else the request itself) falls in the
  sample's share of N, an even K/N of the trace spread over its whole hour — placed by the same
  router among them. The full pool pools more (a burst spreads over N, not K), so the
  sub-pool's attainment is a lower bound and the count it gives an upper bound; `plan.json`
  says per row how many replicas were simulated.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec
import yaml

from backend.policy.latency import LatencyModel, Profile, load_profile
from backend.policy.placement import make_router
from backend.policy.profiles import resolve_profile
from backend.sim.config import SimConfig, SloUnattainable
from backend.sim.records import RequestRecord
from backend.sim.source import SimRequest
from bench.defaults import DEFAULT_PROFILE
from bench.metrics import rt_stats
from bench.trace import DEFAULT_TPOT_S, DEFAULT_TTFT_S, read_trace, trace_requests
from bench.workloads.base import RequestSpec, WorkloadParams
from bench.workloads.sources import SimSource, TimedSource

TARGET = 0.99
"""Attainment every tenant with a contract must reach."""
ANONYMOUS = "(none)"
"""The tenant of trace lines that name none."""


class Contract(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One tenant's contract in the `--tenants` file (the admin API's SLO keys)."""

    tier: Literal["rt", "be"] | None = None
    """Its lines' tier; None: as the trace says."""
    ttft_ms: float | None = None
    """RT: time-to-first-token target, ms after arrival."""
    tpot_ms: float | None = None
    """RT: time-per-output-token target, ms."""
    deadline_s: float | None = None
    """BE: completion deadline, seconds after arrival."""
    weight: float = 1.0
    """Fair-share weight within its tier (> 0)."""
    on_unattainable: SloUnattainable = "reject"
    """What the admission does with an RT request predicted to miss."""

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "deadline_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value:g}")
        if not self.weight > 0:
            raise ValueError(f"weight must be > 0, got {self.weight:g}")


def load_contracts(path: Path) -> dict[str, Contract]:
    """The `--tenants` file: a mapping tenant name → contract, e.g.::

        chat:  {tier: rt, ttft_ms: 400, tpot_ms: 200, weight: 2}
        batch: {tier: be, deadline_s: 3600}

    ValueError naming the file and the tenant on a bad entry."""
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"--tenants {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--tenants {path}: not YAML ({exc})") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"--tenants {path}: expected a mapping of tenant name to contract")
    contracts: dict[str, Contract] = {}
    for name, body in raw.items():
        try:
            contracts[str(name)] = msgspec.convert(body or {}, Contract)
        except (msgspec.ValidationError, ValueError) as exc:
            raise ValueError(f"--tenants {path}: tenant {name!r}: {exc}") from None
    return contracts


@dataclass(frozen=True)
class PlanConfig:
    """One `tandem plan` invocation (validated by tandem/plan.py)."""

    trace_file: Path
    out_dir: Path
    tenants_file: Path | None = None
    profile: str = DEFAULT_PROFILE
    policy: str = "tandem"
    """The engine policy every replica runs."""
    router: str = "slo"
    """The placement policy in front of them (backend/policy/placement.py)."""
    target: float = TARGET
    max_replicas: int = 1024
    sample_replicas: int = 8
    """Largest pool simulated whole; a larger count is judged on a sub-pool of this many."""
    ttft_s: float = DEFAULT_TTFT_S
    """TTFT target of RT lines of a tenant without a contract, seconds."""
    tpot_s: float = DEFAULT_TPOT_S
    """TPOT target of RT lines of a tenant without a contract, seconds."""
    rate_scale: float = 1.0
    """Replay speed (2 = the trace's arrivals twice as fast)."""
    window_s: float = 300.0
    """A longer trace is judged on its busiest window of this many seconds (`busiest_window`);
    0: the whole trace."""
    warmup_s: float = 60.0
    """Simulated before the judged window, not judged: the pool's queues and caches reach their
    steady state first."""
    command: str = ""


@dataclass(frozen=True)
class Window:
    """The part of a trace a plan judges (`busiest_window`)."""

    start_s: float
    """Judged from here (the trace's clock), seconds."""
    end_s: float
    """Until here (arrivals before it), seconds."""
    warmup_s: float
    """Simulated before `start_s`, not judged, seconds (less than asked when the window starts
    sooner: the trace's start is as cold as the planned pool's)."""
    tokens: int
    """Prompt and output tokens of the judged tenants' requests arriving in it."""
    mean_tokens: float
    """The same per window of its length, averaged over the whole trace."""

    def row(self) -> dict[str, float]:
        return {
            "start_s": round(self.start_s, 3),
            "end_s": round(self.end_s, 3),
            "warmup_s": round(self.warmup_s, 3),
            "tokens": self.tokens,
            "peak_to_mean": round(self.tokens / self.mean_tokens, 4) if self.mean_tokens else 0.0,
        }


def busiest_window(
    specs: Sequence[RequestSpec], judged: dict[str, bool], window_s: float, warmup_s: float
) -> Window | None:
    """The `window_s` seconds of the trace offering the judged tenants (RT, BE with a
    deadline) the most prompt + output tokens — BE without a deadline yields to them, so it
    does not make a window harder — over windows sliding by a quarter of `window_s`; None when
    the trace is not longer than `window_s` + `warmup_s` (or `window_s` is 0): judge it all."""
    if window_s <= 0 or not specs:
        return None
    duration_s = max(s.arrival_s for s in specs)
    if duration_s <= window_s + warmup_s:
        return None
    step_s = window_s / 4.0
    buckets = [0] * (math.floor(duration_s / step_s) + 1)
    for s in specs:
        if judged.get(s.tenant_id or ANONYMOUS, True):
            buckets[int(s.arrival_s // step_s)] += s.prompt_len + s.output_len
    # whole windows only; one at the trace's start has the trace's own (empty) start before it
    last = len(buckets) - 4
    best, best_tokens = 0, -1
    for i in range(last + 1):
        tokens = sum(buckets[i : i + 4])
        if tokens > best_tokens:
            best, best_tokens = i, tokens
    start_s = best * step_s
    return Window(
        start_s=start_s,
        end_s=start_s + window_s,
        warmup_s=min(warmup_s, start_s),
        tokens=best_tokens,
        mean_tokens=sum(buckets) * window_s / (len(buckets) * step_s),
    )


def window_specs(specs: Sequence[RequestSpec], window: Window) -> list[RequestSpec]:
    """The requests arriving in the window or its warm-up, on a clock starting at the warm-up
    (so the judged part starts at `window.warmup_s`)."""
    origin = window.start_s - window.warmup_s
    return [
        replace(s, arrival_s=s.arrival_s - origin)
        for s in specs
        if origin <= s.arrival_s < window.end_s
    ]


@dataclass
class Trial:
    """One replica count tried."""

    replicas: int
    simulated_replicas: int
    requests: int
    """Requests simulated (the sub-pool's share when sampled; with a window, its warm-up's
    too)."""
    tenants: dict[str, dict[str, Any]]
    meets: bool
    stopped_early: bool
    wall_s: float
    duration_s: float
    cpu_s: float = 0.0
    """CPU time the simulation took (this process), seconds."""
    missed_share: float | None = None
    """The worst judged tenant's share of its requests that missed, of those that arrived
    before the run ended — for a run stopped early, of those decided (shed or finished) that
    arrived since its first known miss (None: nothing to go by) — what the search's guess
    reads."""

    def guess(self, target: float) -> int | None:
        """The count this trial suggests, for one that failed: an undersized pool sheds the
        load beyond what it can serve, so a miss share f at N replicas says they serve about
        (1 − f) of what they are offered, and target ÷ (1 − f) × N replicas would miss no
        more than the target allows. Queueing near capacity misses more than that, so the
        guess tends to be low (a cheap failure); None without a usable share."""
        f = self.missed_share
        if self.meets or f is None or not 0.0 < f < 1.0:
            return None
        return math.ceil(target * self.replicas / (1.0 - f) - 1e-9)

    @property
    def min_attainment(self) -> float | None:
        judged = [t["attainment"] for t in self.tenants.values() if t["judged"]]
        return min(judged) if judged else None

    def row(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "meets_target": self.meets,
            "min_attainment": _round(self.min_attainment),
            "cost_replica_s": round(self.replicas * self.duration_s, 3),
            "cost_replica_h": round(self.replicas * self.duration_s / 3600.0, 4),
            "tenants": {
                name: {k: _round(v) if isinstance(v, float) else v for k, v in t.items()}
                for name, t in self.tenants.items()
            },
            "simulated_replicas": self.simulated_replicas,
            "simulated_requests": self.requests,
            "stopped_early": self.stopped_early,
            "missed_share": _round(self.missed_share),
            "wall_s": round(self.wall_s, 3),
            "cpu_s": round(self.cpu_s, 3),
        }


@dataclass
class Plan:
    config: PlanConfig
    profile: Profile
    duration_s: float
    requests: int
    trials: dict[int, Trial] = field(default_factory=dict)
    replicas_needed: int | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0
    """CPU time of the whole search (this process), seconds."""
    window: Window | None = None
    """The part of the trace judged (None: all of it)."""


def trace_specs(config: PlanConfig) -> tuple[list[RequestSpec], dict[str, Contract]]:
    """The trace's requests with each tenant's contract applied (targets, weight, tier)."""
    rows = read_trace(config.trace_file)
    contracts = load_contracts(config.tenants_file) if config.tenants_file else {}
    specs = trace_requests(
        rows,
        WorkloadParams(),
        rate_scale=config.rate_scale,
        ttft_target_s=config.ttft_s,
        tpot_target_s=config.tpot_s,
    )
    if not contracts:
        return specs, {}
    named = {s.tenant_id or ANONYMOUS for s in specs}
    missing = sorted(named - set(contracts))
    if missing:
        raise ValueError(
            f"--tenants {config.tenants_file}: no contract for tenant "
            f"{', '.join(repr(m) for m in missing)} of the trace"
        )
    out = []
    for s in specs:
        c = contracts[s.tenant_id or ANONYMOUS]
        tier = c.tier or s.tier
        rt = tier == "rt"
        out.append(
            replace(
                s,
                tier=tier,
                ttft_target_s=(c.ttft_ms / 1000.0 if c.ttft_ms else config.ttft_s) if rt else None,
                tpot_target_s=(c.tpot_ms / 1000.0 if c.tpot_ms else config.tpot_s) if rt else None,
                deadline_s=None if rt else c.deadline_s,
                tenant_weight=c.weight,
                on_unattainable=c.on_unattainable if rt else None,
            )
        )
    return out, contracts


def sub_pool(specs: Sequence[RequestSpec], replicas: int, sample: int) -> list[RequestSpec]:
    """The requests a sample of *sample* of *replicas* replicas serves: those whose group (the
    prompt's first prefix block, else the request) falls in the first *sample* of *replicas*
    shares — an even sample/replicas of the trace, groups kept whole."""
    if sample >= replicas:
        return list(specs)
    return [
        s
        for i, s in enumerate(specs)
        if (_spread(s.prefix_hashes[0]) if s.prefix_hashes else i) % replicas < sample
    ]


_GOLDEN_64 = 0x9E3779B97F4A7C15  # 2^64 / φ, odd: Fibonacci hashing
_MASK_64 = (1 << 64) - 1


def _spread(key: int) -> int:
    """A group key's share bucket source: the high bits of key × 2^64/φ (mod 2^64). Prefix
    hashes are ids, not hashes — `bench.trace` numbers a conversation's blocks
    `conversation × 4096 + j`, so `key % replicas` would put every conversation in share 0
    for any power-of-two count; the product's high bits spread them evenly."""
    return ((key * _GOLDEN_64) & _MASK_64) >> 32


def is_met(record: RequestRecord, tenant_tier: str, end_s: float) -> bool:
    """Did the request meet its tenant's contract? RT: both TTFT and TPOT targets, as RT (a
    shed or downgraded request missed); BE: finished within its deadline, if it has one. A
    finished request's answer is final (it does not depend on *end_s*)."""
    if record.admission == "shed":
        return False
    if tenant_tier == "rt":
        if record.tier != "rt":
            return False
        s = rt_stats(record, end_s)
        return bool(s.ttft_met and s.tpot_met)
    return record.finish_s is not None and (
        record.deadline_s is None or record.finish_s <= record.deadline_s
    )


_CLEAR_S = 1e-6
"""How far inside its targets a request must be for `_clearly_met` (far above the float error
of a mean of token gaps, ~1e-12 s)."""


def _clearly_met(record: RequestRecord, tenant_tier: str) -> bool:
    """A finished RT request well inside both its targets: `is_met` without numpy (its mean
    token gap is (last − first) ÷ (tokens − 1), up to float error; a request within
    `_CLEAR_S` of a target is left to `is_met`). False says nothing."""
    times = record.token_times
    if (
        tenant_tier != "rt"
        or record.tier != "rt"
        or record.admission == "shed"
        or record.finish_s is None
        or record.first_token_s is None
        or not times
    ):
        return False
    ttft_target = math.inf if record.ttft_target_s is None else record.ttft_target_s
    tpot_target = math.inf if record.tpot_target_s is None else record.tpot_target_s
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return (
        record.first_token_s - record.arrival_s < ttft_target - _CLEAR_S
        and tpot < tpot_target - _CLEAR_S
    )


def tenant_attainment(
    records: Sequence[RequestRecord],
    offered: dict[str, tuple[str, int]],
    end_s: float,
    stopped: bool = False,
    missed: dict[str, int] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per tenant (*offered*: name → (tier, requests offered)): requests, met, attainment, shed
    — over what it offered, so a shed request missed. A run *stopped* early says only what the
    requests known to have missed allow (*missed*: per tenant, those shed or finished out of
    contract when it stopped; default the sheds): attainment ≤ 1 − missed ÷ offered
    (`upper_bound`)."""
    met: dict[str, int] = dict.fromkeys(offered, 0)
    shed: dict[str, int] = dict.fromkeys(offered, 0)
    for r in records:
        name = r.tenant_id or ANONYMOUS
        if r.admission == "shed":
            shed[name] += 1
        else:
            met[name] += is_met(r, offered[name][0], end_s)
    known = shed if missed is None else missed
    out: dict[str, dict[str, Any]] = {}
    for name, (tier, count) in offered.items():
        out[name] = {
            "tier": tier,
            "requests": count,
            "met": met[name],
            "shed": shed[name],
            "attainment": (
                None
                if not count
                else (count - known.get(name, 0) if stopped else met[name]) / count
            ),
            "upper_bound": stopped,
            "judged": True,
        }
    return out


def run_trial(
    config: PlanConfig,
    specs: Sequence[RequestSpec],
    replicas: int,
    latency: LatencyModel,
    sim: SimConfig,
    judged: dict[str, bool],
    duration_s: float,
    *,
    early_stop: bool = True,
    judge_from_s: float = 0.0,
) -> Trial:
    """Simulates *replicas* (or a sub-pool of them) on the trace; the per-tenant attainments
    of the requests arriving from *judge_from_s* on (those before are a warm-up). *early_stop*
    off runs the whole trace even once the answer is known (tests compare)."""
    from backend.policy.feasibility import SloForecaster
    from backend.sim.pool import simulate_pool
    from bench.runner import _make_policy

    started, cpu_started = time.perf_counter(), time.process_time()
    simulated = min(replicas, config.sample_replicas)
    chosen = sub_pool(specs, replicas, simulated)
    offered: dict[str, tuple[str, int]] = {}
    for s in chosen:
        if s.arrival_s < judge_from_s:
            continue
        name = s.tenant_id or ANONYMOUS
        tier, count = offered.get(name, (s.tier, 0))
        offered[name] = (tier, count + 1)
    missed: dict[str, int] = {}
    first_miss_s: dict[str, float] = {}  # per tenant, the arrival of its first known miss

    def stop(record: RequestRecord) -> bool:
        """Called with each request shed or finished: True once its tenant's requests known to
        have missed put it below the target whatever the rest do (the same comparison as
        `meets`, so a count that meets the target is never stopped)."""
        if record.arrival_s < judge_from_s:
            return False  # the warm-up's
        name = record.tenant_id or ANONYMOUS
        tier, count = offered[name]
        if _clearly_met(record, tier) or is_met(record, tier, 0.0):  # final: it finished
            return False
        known = missed[name] = missed.get(name, 0) + 1
        first_miss_s[name] = min(first_miss_s.get(name, math.inf), record.arrival_s)
        return judged.get(name, True) and (count - known) / count < config.target

    policies = [_make_policy(config.policy, latency) for _ in range(simulated)]
    first = policies[0]
    forecaster = first.slo_forecaster() if hasattr(first, "slo_forecaster") else None
    router = make_router(config.router, forecaster or SloForecaster(latency))
    source = SimSource(TimedSource(chosen), SimRequest)
    pool = simulate_pool(source, policies, latency, sim, router, stop=stop if early_stop else None)
    result = pool.result
    records = [r for r in result.requests if r.arrival_s >= judge_from_s]
    tenants = tenant_attainment(records, offered, result.end_s, pool.stopped, missed)
    for name, row in tenants.items():
        row["judged"] = judged.get(name, True)
    stopped = pool.stopped
    # the miss share the search's guess reads: of a stopped run, over the requests decided
    # (shed or finished) of those that arrived since its first known miss — the minutes before
    # the pool fell behind would dilute it, and so would the requests still queued when it
    # stopped (most of which would miss too)
    arrived: dict[str, int] = {}
    for r in records:
        name = r.tenant_id or ANONYMOUS
        if not stopped or (
            r.arrival_s >= first_miss_s.get(name, math.inf)
            and (r.admission == "shed" or r.finish_s is not None)
        ):
            arrived[name] = arrived.get(name, 0) + 1
    shares = [
        (missed.get(name, 0) if stopped else row["requests"] - row["met"]) / arrived[name]
        for name, row in tenants.items()
        if row["judged"] and arrived.get(name)
    ]
    meets = not stopped and all(
        t["attainment"] is not None and t["attainment"] >= config.target
        for t in tenants.values()
        if t["judged"]
    )
    return Trial(
        replicas=replicas,
        simulated_replicas=simulated,
        requests=len(chosen),
        tenants=tenants,
        meets=meets,
        stopped_early=stopped,
        wall_s=time.perf_counter() - started,
        duration_s=duration_s,
        cpu_s=time.process_time() - cpu_started,
        missed_share=max(shares) if shares else None,
    )


def plan(config: PlanConfig, report: Callable[[Trial], None] | None = None) -> Plan:
    """Searches the fewest replicas meeting the target (module doc)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    profile = load_profile(resolve_profile(config.profile))
    latency = LatencyModel.fit(profile.samples)
    with _collector_paused():
        specs, _ = trace_specs(config)
        longest = max(s.prompt_len for s in specs)
        if longest >= profile.kv_capacity_tokens:
            raise ValueError(
                f"the trace's longest prompt ({longest} tokens) does not fit the profile's KV "
                f"pool ({profile.kv_capacity_tokens} tokens)"
            )
        duration_s = max(s.arrival_s for s in specs) or 1.0
        judged: dict[str, bool] = {}  # BE without a deadline has no contract to judge
        for s in specs:
            name = s.tenant_id or ANONYMOUS
            judged[name] = judged.get(name, False) or s.tier == "rt" or s.deadline_s is not None
        window = busiest_window(specs, judged, config.window_s, config.warmup_s)
        simulated = specs if window is None else window_specs(specs, window)
        num_requests = len(specs)
        del specs  # a window's plan simulates a tenth of an hour's: the rest can go
    judge_from_s = 0.0 if window is None else window.warmup_s
    run_s = max((s.arrival_s for s in simulated), default=0.0) or 1.0
    sim = SimConfig(
        kv_capacity_tokens=profile.kv_capacity_tokens,
        page_size=profile.page_size,
        max_prefill_tokens=profile.max_prefill_tokens,
        horizon_s=2.0 * run_s + 600.0,
    )
    result = Plan(
        config=config, profile=profile, duration_s=duration_s, requests=num_requests, window=window
    )

    def trial(n: int) -> Trial:
        t = run_trial(
            config, simulated, n, latency, sim, judged, duration_s, judge_from_s=judge_from_s
        )
        result.trials[n] = t
        if report is not None:
            report(t)
        return t

    high = search_replicas(trial, config.max_replicas, config.target)
    result.replicas_needed = high
    result.wall_s = time.perf_counter() - started
    result.cpu_s = time.process_time() - cpu_started
    return result


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while a trace is read: the millions of objects it makes
    all live (none is garbage), and the collections they set off each scanned them all again —
    half the CPU of reading a one-hour fleet trace (69 s of it, 35 s without)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _Tried(Protocol):
    """What the search reads of a trial."""

    @property
    def meets(self) -> bool: ...

    @property
    def missed_share(self) -> float | None: ...

    def guess(self, target: float) -> int | None: ...


CURVE_MAX_SHARE = 0.25
"""Miss shares up to which two failures are read as one curve (`_curve_guess`): below it an
undersized pool misses by queueing, its miss share falling about exponentially with the count;
above it, by shedding what it cannot serve, which `Trial.guess` reads better."""


def _crossing(lower: tuple[int, float], upper: tuple[int, float], goal: float) -> float | None:
    """The count where ln(miss share) drawn straight through two trials' (count, share) reaches
    *goal*; None unless the share falls as the count grows."""
    (n1, f1), (n2, f2) = lower, upper
    if not (n1 < n2 and 0.0 < f2 < f1):
        return None
    slope = (math.log(f2) - math.log(f1)) / (n2 - n1)
    return n2 + (math.log(goal) - math.log(f2)) / slope


def _curve_guess(failed: list[tuple[int, float]], target: float) -> float | None:
    """Where the answer lies judging by the last two failures (count, miss share), both missing
    by queueing (share ≤ `CURVE_MAX_SHARE`), or None. One failure's guess (`Trial.guess`, every
    miss read as shed load) runs low there, since queueing misses more; the miss share drawn
    as a straight line in its logarithm runs high, since it falls ever faster towards the
    answer (the one-hour fleet plan: ln share fell 0.22 per replica from 32 to 36 replicas,
    0.29 to 38, 0.37 to 40, 0.76 to 41). The answer is between the two, and the geometric mean
    is the guess."""
    if len(failed) < 2:
        return None
    (n1, f1), (n2, f2) = failed[-2], failed[-1]
    if f1 > CURVE_MAX_SHARE:
        return None
    line = _crossing((n1, f1), (n2, f2), 1.0 - target)
    shed = target * n2 / (1.0 - f2)
    if line is None or line <= shed:
        return None
    return math.sqrt(shed * line)


def search_replicas(
    trial: Callable[[int], _Tried], max_replicas: int, target: float = TARGET
) -> int | None:
    """The fewest replicas whose trial meets the target (None: not even *max_replicas*),
    assuming more replicas never do worse — the answer of trying every count from 1 up.

    A bracket [low, high] (the largest count known to fail, the smallest known to meet)
    narrows until they are adjacent. A count that meets runs its whole trace, and one that
    fails stops as soon as its misses decide it (the further below the answer, the sooner; a
    count just under it runs nearly whole), so the search tries to land on the answer and the
    count under it, and on little else:
    * while nothing has met, the next count is where the last failure's miss share guesses the
      answer (`Trial.guess`), or, once the last two failures both miss by queueing, between
      that and their curve's guess (`_curve_guess`), safeguarded: at most 2× the last count
      (the old doubling) and, after two smaller steps in a row, at least 1.25× it;
    * once something has, where the miss share drawn through the bracket's two ends (the
      failure's and the success's, in its logarithm) crosses the target's, else the last
      failure's guess, else (no share to go by) a quarter of the bracket up from its low end,
      since a count under the answer fails part-way, cheaper than a whole run over it; always
      at least a quarter of the bracket's width from either end, so it shrinks by a quarter
      or more each time when guesses are poor."""
    if max_replicas < 1:
        raise ValueError(f"max_replicas must be ≥ 1, got {max_replicas}")
    low, high = 0, None
    failed: list[tuple[int, float]] = []  # (count, miss share), counts rising
    met: tuple[int, float] | None = None  # the smallest count that met, with its miss share
    n = 1
    creeping = 0  # steps in a row of less than 1.25× while nothing has met
    while True:
        t = trial(n)
        share = t.missed_share
        if t.meets:
            high = n
            met = (n, share) if share is not None else None
        else:
            low = n
            if share is not None:
                failed.append((n, share))
        if high is None and n >= max_replicas:
            return None
        if high is not None and high - low <= 1:
            return high
        guess: float | None = None if t.meets else t.guess(target)
        if high is None:
            curve = _curve_guess(failed, target) if failed and failed[-1][0] == n else None
            if curve is not None:
                guess = max(guess or 0, math.ceil(curve - 1e-9))
            least = n + (max(1, n // 4) if creeping >= 2 else 1)
            step = min(max(int(guess or 2 * n), least), 2 * n, max_replicas)
            creeping = creeping + 1 if 4 * step < 5 * n else 0
            n = step
            continue
        margin = max(1, (high - low) // 4)
        if failed and failed[-1][0] == low and met is not None:
            crossing = _crossing(failed[-1], met, 1.0 - target)
            if crossing is not None:
                guess = math.ceil(crossing - 1e-9)
        # no guess (the last count met, no shares): a quarter in from below, a count under
        # the answer costs less
        n = low + margin if guess is None else min(max(int(guess), low + margin), high - margin)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
