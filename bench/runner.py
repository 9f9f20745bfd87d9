"""The bench runner: one workload, every chosen policy, one seed; writes results.json, report.md
and the PNG plots (bench/report.py, bench/plots.py).

    config → profile + latency model → workload (built once) → λ* (cached) → for each policy:
    fresh source (identical requests) → simulate → metrics + plot series → interference ratios
    against rt-only → outputs

Only the simulator engine exists so far; `--engine sglang` comes with issue 5.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msgspec.structs import replace as struct_replace
from tqdm import tqdm

from backend.policy.latency import LatencyModel, Profile, load_profile
from backend.policy.profiles import resolve_profile
from backend.sim.config import SimConfig, SloUnattainable
from backend.sim.core import InfeasiblePlanError
from backend.sim.engine import StalledPolicyError, simulate
from backend.sim.source import SimRequest
from bench import capacity as cap
from bench.defaults import DEFAULT_DATA_DIR, DEFAULT_PROFILE
from bench.metrics import Metrics, compute_metrics, interference, pool_metrics, tenant_metrics
from bench.policy_spec import base_name, parse_policy_spec
from bench.series import PolicySeries, compute_series
from bench.trace import DEFAULT_TPOT_S, DEFAULT_TTFT_S, build_trace_workload
from bench.workloads import build_workload
from bench.workloads.base import BuildContext, Workload, WorkloadParams
from bench.workloads.sources import SimSource
from common.slowdown import Slowdown

RT_ONLY = "rt-only"
ORACLE = "oracle"


@dataclass(frozen=True)
class BenchConfig:
    """One `tandem bench` invocation (validated by tandem/bench.py)."""

    workload: str
    """W1…W6, or "trace" (then trace_file)."""
    out_dir: Path
    """Where results.json, report.md and the PNGs go."""
    engine: str = "sim"
    """"sim" (the discrete-event simulator) or "sglang" (issue 5)."""
    policies: tuple[str, ...] | None = None
    """Policy names in run order; None = every registered policy."""
    load: float = 0.75
    """RT rate as a fraction of λ* (W3: of the heaviest client count)."""
    rt_rate_req_s: float | None = None
    """Fixed RT rate, req/s (bypasses the λ* measurement)."""
    profile: str = DEFAULT_PROFILE
    """Latency profile: a name in bench/profiler/ or a file path."""
    kv_scale: float | None = None
    """KV pool = kv_scale × the workload's longest prompt; None = the profile's pool."""
    seed: int = 0
    """Workload seed."""
    data_dir: Path = DEFAULT_DATA_DIR
    """Folder of the Azure trace CSVs."""
    scale: float | None = None
    """Fraction of the full-size workload (None = its default)."""
    duration_s: float | None = None
    """Arrival window, seconds (overrides scale)."""
    variant: str | None = None
    """Workload variant (see bench/README.md)."""
    max_new: str = "cap"
    """max_new_tokens policies see: "exact" (= output_len) or "cap"."""
    trace_file: Path | None = None
    """The trace to replay (workload "trace")."""
    rate_scale: float = 1.0
    """Trace replay speed-up (2 = twice the rate)."""
    trace_ttft_s: float = DEFAULT_TTFT_S
    """TTFT target of RT trace requests, seconds."""
    trace_tpot_s: float = DEFAULT_TPOT_S
    """TPOT target of RT trace requests, seconds."""
    cache_dir: Path = Path.home() / ".cache" / "tandem"
    """Folder of the λ* cache (capacity.json)."""
    capacity_run_s: float = cap.RUN_S
    """Simulated seconds per λ* probe."""
    engine_slowdown: Slowdown = ()
    """The simulated engine runs this many times slower than the latency model the policies
    plan with: (start_s, factor) pairs (`SimConfig.engine_slowdown`); () = as the model says.
    λ* is measured without it, so --load means the same RT rate with and without."""
    replica_slowdowns: tuple[float, ...] = ()
    """In a pool: replica i runs this many times slower again (`SimConfig.replica_slowdowns`;
    past the tuple: 1); () = equal replicas. λ* and the RT rate are those of equal replicas."""
    engine_noise: float = 0.0
    """The simulated engine's iteration-to-iteration jitter, the σ of each iteration's
    log-normal factor of mean 1 (`SimConfig.engine_noise`, drawn from the run's seed); 0 =
    none. λ* is measured without it."""
    on_unattainable: tuple[tuple[str, SloUnattainable], ...] = ()
    """What the front door does with an RT request forecast to miss its contract, by tenant:
    (tenant, outcome) pairs, tenant "" for every tenant not named; () = reject for all
    (`SimConfig.slo_unattainable`, `SimRequest.on_unattainable`)."""
    replicas: int = 1
    """Engine replicas behind the router (> 1, or routers given: the simulator's pool,
    backend/sim/pool.py; the RT rate scales with it: load × N × one replica's λ*)."""
    routers: tuple[str, ...] | None = None
    """Placement policies to compare on the pool (backend/policy/placement.py), each one run
    of the engine policy (`policies`' one name, default tandem); None: the policies are
    compared on one engine."""
    progress: bool = True
    """Show progress bars on stderr."""
    command: str = ""
    """The command line, for the report."""


@dataclass
class PolicyRun:
    """One policy's outcome."""

    metrics: Metrics
    series: PolicySeries
    wall_s: float
    tenants: dict[str, dict[str, Any]] | None = None
    """Per-tenant metrics (bench.metrics.tenant_metrics) when the workload names tenants."""


@dataclass
class BenchRun:
    """Everything the report needs."""

    config: BenchConfig
    workload: Workload
    profile: Profile
    kv_capacity_tokens: int
    rt_capacity_req_s: float | None
    capacity_source: str
    rt_rate_req_s: float | None
    runs: dict[str, PolicyRun] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    """Policies not run, with the reason."""
    failed: dict[str, str] = field(default_factory=dict)
    """Policies whose run raised (a policy bug: an infeasible or stalled plan), with the error."""
    engine_policy: str | None = None
    """With routers: the engine policy every replica runs; `runs` is then keyed by router."""

    @property
    def by_router(self) -> bool:
        """The runs compare routers on a pool (not policies on one engine)."""
        return self.engine_policy is not None


def registered_policies() -> tuple[str, ...]:
    """Every policy name the registry knows, and the BE orderings (bench/batch_order.py)."""
    from backend.policy.registry import POLICY_NAMES
    from bench.batch_order import BE_ORDERINGS

    return (*POLICY_NAMES, *BE_ORDERINGS)


def _make_policy(spec: str, latency: LatencyModel) -> Any:
    """The policy a --policies entry names (`bench/policy_spec.py`: NAME[:KEY=VALUE…]);
    ValueError for a bad name or option."""
    from backend.policy.registry import make_policy
    from bench.batch_order import BE_ORDERINGS, ENGINE_POLICY

    name, options = parse_policy_spec(spec)
    if name in BE_ORDERINGS:  # a BE ordering runs on the fcfs engine policy
        if options:
            raise ValueError(f"policy spec {spec!r}: the BE ordering {name!r} takes no options")
        policy = make_policy(ENGINE_POLICY, latency)
        policy.name = name
        return policy
    return make_policy(name, latency, **options)


def build(config: BenchConfig, latency: LatencyModel, profile: Profile) -> tuple[Workload, int]:
    """The workload and the KV pool size of the run."""
    params = WorkloadParams(
        seed=config.seed,
        load=config.load,
        rt_rate_req_s=config.rt_rate_req_s,
        scale=config.scale,
        duration_s=config.duration_s,
        data_dir=config.data_dir,
        variant=config.variant,
        max_new=config.max_new,  # type: ignore[arg-type]
    )

    def make(kv: int) -> Workload:
        if config.workload == "trace":
            assert config.trace_file is not None
            return build_trace_workload(
                config.trace_file,
                params,
                rate_scale=config.rate_scale,
                ttft_target_s=config.trace_ttft_s,
                tpot_target_s=config.trace_tpot_s,
            )
        ctx = BuildContext(
            latency=latency, kv_capacity_tokens=kv, max_prefill_tokens=profile.max_prefill_tokens
        )
        return build_workload(config.workload, params, ctx)

    kv = profile.kv_capacity_tokens
    workload = make(kv)
    if config.kv_scale is not None:
        kv = int(config.kv_scale * workload.longest_prompt)
        workload = make(kv)
    if kv <= workload.longest_prompt:
        raise ValueError(
            f"KV pool of {kv} tokens cannot hold the longest prompt "
            f"({workload.longest_prompt} tokens): raise --kv-scale"
        )
    return workload, kv


def sim_config(profile: Profile, kv: int, workload: Workload) -> SimConfig:
    """The simulated engine of a run (a generous horizon guards against a runaway policy)."""
    horizon = None if workload.window_s is None else 20 * workload.window_s + 3600.0
    return SimConfig(
        kv_capacity_tokens=kv,
        page_size=profile.page_size,
        max_prefill_tokens=profile.max_prefill_tokens,
        horizon_s=horizon,
    )


def _say(config: BenchConfig, line: str) -> None:
    if config.progress:
        tqdm.write(line, file=sys.stderr)


def measure_rate(
    config: BenchConfig,
    workload: Workload,
    latency: LatencyModel,
    profile_path: Path,
    base: SimConfig,
) -> tuple[float | None, str, float | None]:
    """(λ*, how it was obtained, RT rate of the run)."""
    if workload.rt_poisson is None:
        if config.rt_rate_req_s is not None:
            raise ValueError(
                f"{workload.name} has no open-loop RT stream: use --load, not --rt-rate"
            )
        return None, "n/a (no open-loop RT stream)", None
    key = cap.CapacityKey(
        workload=workload.name,
        variant=str(config.variant or "default"),
        profile=profile_path.stem,
        profile_digest=cap.file_digest(profile_path),
        seed=config.seed,
        kv_capacity_tokens=base.kv_capacity_tokens,
        run_s=config.capacity_run_s,
        code_digest=cap.code_digest(),
        max_running=base.max_running,
    )
    cache = cap.CapacityCache(config.cache_dir)
    if config.rt_rate_req_s is not None:
        cached = cache.get(key)
        return (
            cached,
            "cached" if cached is not None else "not measured (--rt-rate)",
            config.rt_rate_req_s,
        )
    capacity, was_cached = cap.rt_capacity(
        workload,
        key,
        cache,
        make_fcfs=lambda: _make_policy("fcfs", latency),
        latency=latency,
        config=struct_replace(base, horizon_s=None),
        report=lambda line: _say(config, line),
    )
    rate = workload.rt_rate_share * config.load * capacity
    return capacity, "cached" if was_cached else "measured", rate


def run_policy(name: str, run: BenchRun, latency: LatencyModel, base: SimConfig) -> PolicyRun:
    """One policy on a fresh copy of the workload."""
    policy = _make_policy(name, latency)
    include_be = not getattr(policy, "rt_only", False)
    reveal = base_name(name) == ORACLE or bool(getattr(policy, "reveal_lengths", False))
    spec_source = run.workload.source(run.rt_rate_req_s, include_be)
    from bench.batch_order import BE_ORDERINGS, ordered_source

    if name in BE_ORDERINGS:  # dfs / blend: the batch runner's ordered feed
        spec_source = ordered_source(name, spec_source, run.kv_capacity_tokens)
    source = SimSource(spec_source, _requests(run.config))
    bar, progress = _progress_bar(f"{run.workload.name} {name}", run)
    started = time.perf_counter()
    try:
        result = simulate(
            source,
            policy,
            latency,
            _layout(
                struct_replace(
                    base,
                    reveal_lengths=reveal,
                    engine_slowdown=run.config.engine_slowdown,
                    engine_noise=run.config.engine_noise,
                    engine_noise_seed=run.config.seed,
                    slo_unattainable=default_unattainable(run.config),
                ),
                policy,
                run.profile,
            ),
            progress=progress,
        )
    finally:
        bar.close()
    wall = time.perf_counter() - started
    window = run.workload.window_s
    metrics = compute_metrics(result, window)
    series = compute_series(result, window if window is not None else result.end_s)
    tenants = (
        tenant_metrics(result.requests, run.workload.tenants, result.end_s)
        if run.workload.tenants
        else None
    )
    return PolicyRun(metrics=metrics, series=series, wall_s=wall, tenants=tenants)


def _progress_bar(desc: str, run: BenchRun) -> tuple[Any, Callable[[float], None]]:
    """A progress bar over the run's arrival window in simulated seconds (the drain after it
    stretches the total), and the callback the simulator advances it with."""
    span = run.workload.window_s
    bar = tqdm(
        total=round(span) if span else None,
        desc=desc,
        unit="sim-s",
        file=sys.stderr,
        disable=None if run.config.progress else True,
        bar_format="{desc:<22} {n:.0f}/{total_fmt} sim-s |{bar}| {elapsed}",
    )

    def progress(now_s: float) -> None:
        if bar.total is not None and now_s > bar.total:
            bar.total = math.ceil(now_s)
        bar.update(max(0.0, now_s - bar.n))

    return bar, progress


DEFAULT_ENGINE_POLICY = "tandem"
"""The engine policy of a router comparison unless --policies names one."""


def run_router(name: str, run: BenchRun, latency: LatencyModel, base: SimConfig) -> PolicyRun:
    """One router on a pool of `replicas` engines, each running the run's engine policy, on a
    fresh copy of the workload."""
    from backend.policy.feasibility import SloForecaster
    from backend.policy.placement import make_router
    from backend.sim.pool import simulate_pool

    assert run.engine_policy is not None
    replicas = run.config.replicas
    policies = [_make_policy(run.engine_policy, latency) for _ in range(replicas)]
    first = policies[0]
    forecaster = first.slo_forecaster() if hasattr(first, "slo_forecaster") else None
    router = make_router(name, forecaster or SloForecaster(latency))
    include_be = not getattr(first, "rt_only", False)
    source = SimSource(run.workload.source(run.rt_rate_req_s, include_be), _requests(run.config))
    bar, progress = _progress_bar(f"{run.workload.name} {name} ×{replicas}", run)
    config = _layout(
        struct_replace(
            base,
            engine_slowdown=run.config.engine_slowdown,
            replica_slowdowns=run.config.replica_slowdowns,
            engine_noise=run.config.engine_noise,
            engine_noise_seed=run.config.seed,
            slo_unattainable=default_unattainable(run.config),
        ),
        first,
        run.profile,
    )
    started = time.perf_counter()
    try:
        pool = simulate_pool(source, policies, latency, config, router, progress=progress)
    finally:
        bar.close()
    wall = time.perf_counter() - started
    result = pool.result
    window = run.workload.window_s
    metrics = compute_metrics(result, window)
    metrics.update(pool_metrics(pool.placement_us, pool.requests_per_replica))
    for key in ("engine_busy_frac", "rt_busy_frac", "be_busy_frac"):  # per replica, not summed
        value = metrics.get(key)
        metrics[key] = None if value is None else float(value) / replicas
    series = compute_series(result, window if window is not None else result.end_s)
    tenants = (
        tenant_metrics(result.requests, run.workload.tenants, result.end_s)
        if run.workload.tenants
        else None
    )
    return PolicyRun(metrics=metrics, series=series, wall_s=wall, tenants=tenants)


def _check_tenants_named(config: BenchConfig, workload: Workload) -> None:
    """Every tenant `config.on_unattainable` names is one of the workload's RT tenants
    (ValueError naming the first that is not: a misspelt name would change nothing)."""
    rt = [t.name for t in workload.tenants if t.tier == "rt"]
    for tenant, _ in config.on_unattainable:
        if tenant and tenant not in rt:
            has = f"its RT tenants: {', '.join(rt)}" if rt else "it names no RT tenants"
            raise ValueError(
                f"--on-unattainable: {workload.name} has no RT tenant {tenant!r} ({has})"
            )


def default_unattainable(config: BenchConfig) -> SloUnattainable:
    """The front door's outcome for the tenants `config.on_unattainable` does not name."""
    return dict(config.on_unattainable).get("", "reject")


def _requests(config: BenchConfig) -> Callable[..., SimRequest]:
    """Makes the simulator's requests, each RT one with its tenant's outcome for a forecast
    miss where `config.on_unattainable` names the tenant."""
    named = {tenant: outcome for tenant, outcome in config.on_unattainable if tenant}
    if not named:
        return SimRequest

    def make(**fields: Any) -> SimRequest:
        outcome = named.get(fields.get("tenant_id") or "")
        if fields["tier"] == "rt" and outcome is not None:
            fields["on_unattainable"] = outcome
        return SimRequest(**fields)

    return make


def _layout(config: SimConfig, policy: Any, profile: Profile) -> SimConfig:
    """The engine's KV layout as the policy asks (`kv_layout`, default the token pool); the
    bicache layout takes its copy cost from the profile (SimConfig's defaults if absent) and
    models no prefix cache."""
    if getattr(policy, "kv_layout", "token") != "bicache":
        return config
    extra: dict[str, Any] = {}
    if profile.kv_bytes_per_token:
        extra["kv_bytes_per_token"] = profile.kv_bytes_per_token
    if profile.host_copy_gb_s:
        extra["host_copy_gb_s"] = profile.host_copy_gb_s
    return struct_replace(config, kv_layout="bicache", prefix_cache=False, **extra)


def _policy_list(config: BenchConfig, workload: Workload) -> tuple[list[str], dict[str, str]]:
    """Policies to run, and the skipped ones with the reason."""
    from bench.batch_order import BE_ORDERINGS

    # By default every engine policy; the BE orderings (offline jobs only) when asked for.
    names = list(config.policies or [n for n in registered_policies() if n not in BE_ORDERINGS])
    skipped: dict[str, str] = {}
    if RT_ONLY in names and (not workload.has_be or not workload.has_rt):
        skipped[RT_ONLY] = (
            "the workload has no BE stream (rt-only would repeat fcfs)"
            if not workload.has_be
            else "the workload has no RT stream"
        )
        names.remove(RT_ONLY)
    return names, skipped


def run_bench(
    config: BenchConfig, on_policy_done: Callable[[str, PolicyRun], None] | None = None
) -> BenchRun:
    """Runs every policy; returns what the report writes (does not write files)."""
    if config.engine != "sim":
        raise ValueError(f"--engine {config.engine}: not supported yet (issue 5)")
    profile_path = resolve_profile(config.profile)
    profile = load_profile(profile_path)
    latency = LatencyModel.fit(profile.samples)
    workload, kv = build(config, latency, profile)
    _check_tenants_named(config, workload)
    base = sim_config(profile, kv, workload)
    names, skipped = _policy_list(config, workload)
    if config.routers is not None:
        if config.policies is not None and len(config.policies) != 1:
            raise ValueError(
                "--routers compares placement on one engine policy: --policies names "
                f"{len(config.policies)} (give one, or none for {DEFAULT_ENGINE_POLICY})"
            )
        names = list(config.policies or (DEFAULT_ENGINE_POLICY,))
    for name in names:  # a bad option fails now, not after the λ* search and other policies
        _make_policy(name, latency)
    capacity, source, rate = measure_rate(config, workload, latency, profile_path, base)
    run = BenchRun(
        config=config,
        workload=workload,
        profile=profile,
        kv_capacity_tokens=kv,
        rt_capacity_req_s=capacity,
        capacity_source=source,
        rt_rate_req_s=rate,
        skipped=skipped,
    )
    if config.routers is not None:
        run.engine_policy = names[0]
        run.skipped = {}
        if rate is not None:  # the pool's RT rate and capacity: N replicas
            run.rt_rate_req_s = rate * config.replicas
        if capacity is not None:
            run.rt_capacity_req_s = capacity * config.replicas
        names = list(config.routers)
    for name in names:
        try:
            if run.by_router:
                run.runs[name] = run_router(name, run, latency, base)
            else:
                run.runs[name] = run_policy(name, run, latency, base)
        except (InfeasiblePlanError, StalledPolicyError) as exc:
            run.failed[name] = f"{type(exc).__name__}: {exc}"
            _say(config, f"{name} failed: {run.failed[name]}")
            continue
        if on_policy_done is not None:
            on_policy_done(name, run.runs[name])
    baseline = run.runs.get(RT_ONLY)
    if baseline is not None:
        for policy_run in run.runs.values():
            policy_run.metrics.update(interference(policy_run.metrics, baseline.metrics))
    return run
