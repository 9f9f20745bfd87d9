"""`tandem bench WORKLOAD --engine sglang`: the workload against the real engine, through the
gateway, and the same workload in the simulator beside it.

For each policy a fresh `tandem serve` runs in a subprocess (gateway + engine, SQLite in a temp
folder), configured as

* ``tandem``   — the patched engine with tandem's policy in charge (engine.policy = tandem);
* ``fcfs``     — stock SGLang (patch off), its default FCFS scheduling;
* ``priority`` — stock SGLang with ``--enable-priority-scheduling`` (the gateway's RT/BE
  priorities: RT 100, BE 0).

Tenants and keys are made through the admin API (one RT tenant per SLO class, one BE tenant;
a workload's named tenants, W6's, each one of its own with its weight);
the workload's requests are replayed on the wall clock through the OpenAI completions API with
exact token-id prompts, greedy decoding and ``ignore_eos`` (so every request produces its
workload length), all streamed: the client stamps each token chunk, which gives TTFT, TBT and
the BE token times the simulator's metrics code (bench/metrics.py) expects. The RT rate is a
fraction of λ* measured in the simulator with the same CPU profile and KV pool (the real engine
is too slow to search λ* on). Then every policy runs in the simulator on the identical workload
(same seed, RT rate, KV pool, profile, policy options), and the report gives the sim/real ratio
of each headline metric. The twin is the real run's: its engine runs each batch regime at the
pace tandem's calibration measured over its run (Σ measured ÷ Σ predicted), and its requests'
tokens come the serving overhead later (HTTP, gateway, tokenizer, detokenizer: a client's TTFT
less the engine's prefill step, measured on the idle engine before each replay), which the
simulator does not model.

Policies see exact output lengths here (``max_tokens`` = the workload's length with
``ignore_eos``): a random-weight model cannot be made to stop at a hidden length.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import yaml
from msgspec.structs import replace as struct_replace

from backend.policy.calibration import regime_of
from backend.policy.latency import BatchShape, LatencyModel, Profile, ProfileSample, load_profile
from backend.policy.profiles import resolve_profile
from backend.policy.registry import make_policy
from backend.policy.tandem.config import TandemConfig
from backend.sim.engine import simulate
from backend.sim.records import IterationLog, RequestRecord, SimResult
from backend.sim.source import SimRequest
from bench.calibration_recovery import (
    ERROR_BAND,
    ERROR_WINDOW_S,
    error_timeline,
    ratio_timeline,
    recovery_s,
)
from bench.capacity import RUN_S, search_capacity_sustained
from bench.live_client import DRAIN_TIMEOUT_S, TenantKeys, replay, replay_source, send
from bench.metrics import (
    Metrics,
    compute_metrics,
    mean,
    percentile,
    prediction_error_metrics,
    rt_metrics,
    tenant_metrics,
)
from bench.policy_spec import base_name, parse_policy_spec
from bench.profiler.probe import engine_prefill_busy_s
from bench.runner import BenchConfig, build, measure_rate, sim_config
from bench.series import PolicySeries, compute_series
from bench.workloads.base import RequestSpec, SpecSource, Workload
from bench.workloads.sources import SimSource
from common.config import DEFAULT_CONFIG_PATH, GatewayConfig
from common.slowdown import Slowdown, factor_at, format_slowdown
from common.sockets import free_port
from common.wire import CONTROL_ITERATIONS_PATH, IterationRecord, RecentIterations

LIVE_POLICIES = ("tandem", "fcfs", "priority")
"""What `--engine sglang` can run, in run order. tandem may carry options on top of the shipped
ones (`tandem:rt_stretch=0.6`, `bench/policy_spec.py`), so one run compares settings on the
real engine; stock SGLang's fcfs and priority take none."""
LIVE_WORKLOADS = ("W1", "W5", "W6")
"""The workloads `--engine sglang` replays: open-loop RT next to BE (W6: several tenants of each
tier, each a tenant of the gateway with its weight)."""
DEFAULT_PROFILE = "cpu-tiny"
DEFAULT_VARIANT = {"W1": "cpu", "W6": "cpu"}
"""The workload variant sized for the CPU engine, where the workload has one."""
_SHIPPED_ENGINE: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())["engine"]
CPU_POLICY_OPTIONS: dict[str, Any] = dict(_SHIPPED_ENGINE["policy_options"])
"""tandem's options for the tiny model on CPU: exactly what config.yaml ships, what a user's
`tandem serve` runs with (the sim twin uses the same)."""
CPU_THREADS: int | None = _SHIPPED_ENGINE.get("cpu_threads")
"""The engine's torch threads on CPU, as config.yaml ships them (`engine.cpu_threads`), for
every policy alike: with torch's default of one per core, the engine's iterations take every
core of this small host, and the gateway, SGLang's tokenizer and detokenizer and the bench's
own client wait for them (a TTFT tail that is not the scheduler's)."""
MAX_RUNNING = 64
SLOWDOWN_START_FILE = "slowdown-start"
"""In a policy's run folder, with `--engine-slowdown`: written as its replay starts, second 0 of
the engine's slowdown (`engine.slowdown_start_file`)."""
READY_TIMEOUT_S = 420.0
CAPACITY_PROBE_S = 20.0
"""Arrival window of a short λ* probe on the real engine, seconds: the short probes only find
where attainment first fails (`search_capacity_sustained`)."""
CAPACITY_SUSTAINED_S = RUN_S
"""Arrival window of a long λ* probe, seconds: the simulator's probe length (`bench.capacity`),
so the real λ* is what the engine sustains, as the simulator's is. Short probes passed rates the
engine could not keep: the issue's W1 command on 2026-12-03 measured λ* 16 req/s with 20-s
probes, and tandem's run at 0.75 of it kept the engine busy the whole time, at every one of its
64 request slots (the simulator, on an engine as slow: 14.5 req/s with 20-s probes, 11.5 with
60-s ones)."""
CAPACITY_DRAIN_S = 30.0
"""A probe's requests still running this long after its window count as misses."""
CAPACITY_TOLERANCE = 0.15
"""The real λ* search stops when its bracket is this narrow (each probe costs ~a minute)."""
RATIO_KEYS = (
    "rt_ttft_p50_s",
    "rt_ttft_p99_s",
    "rt_admitted_ttft_p99_s",
    "rt_tpot_mean_s",
    "be_throughput_tok_s",
    "rt_ttft_attainment",
    "rt_tpot_attainment",
)
"""Metrics compared between the simulator and the real engine. The TTFT p99 over every RT
request offered counts a shed request's TTFT as censored at the run's end (`bench.metrics`), so
where more than 1 % are shed it is the run's length, not a latency: the admitted requests' p99
is the tail the two can be compared on then."""


@dataclass
class LiveRun:
    """Everything the live report needs."""

    config: BenchConfig
    workload: Workload
    profile_name: str
    kv_capacity_tokens: int
    rt_capacity_req_s: float | None
    rt_rate_req_s: float | None
    policy_options: dict[str, Any]
    """tandem's options as config.yaml ships them; a row `tandem:K=V…` runs these with its own
    on top (`options_of`)."""
    sim_capacity_req_s: float | None = None
    """λ* of the same workload in the simulator (for comparison; the run uses the real one)."""
    capacity_probes: list[tuple[float, float, float]] = field(default_factory=list)
    """(RT rate, joint attainment, arrival window in seconds) of each probe of the real λ*
    search, in order."""
    real: dict[str, Metrics] = field(default_factory=dict)
    sim: dict[str, Metrics] = field(default_factory=dict)
    series: dict[str, PolicySeries] = field(default_factory=dict)
    tenants: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """Per policy, per named tenant of the workload (W6): `bench.metrics.tenant_metrics` of the
    real run; empty for a workload without named tenants."""
    sim_tenants: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """The same for the simulator twin's run."""
    engine_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    """tandem's in-engine counters (control endpoint) per policy that has them."""
    failed: dict[str, str] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)
    sim_pace: float = 1.0
    """How much slower than its profile the simulator twin runs: the real engine's pace over
    tandem's run (the geometric mean of `sim_regime_pace`; for an engine that does not report
    its mean pace, of the calibration's factors at the end of the run); 1 until tandem has run.
    The profile was measured on another machine, or on this one at another time: a twin at
    the profile's pace predicts a different engine."""
    serving_overhead_s: dict[str, float] = field(default_factory=dict)
    """Per policy: what a request spends outside the engine's iterations as the bench's client
    sees it (`measure_serving_overhead`), measured on its idle engine before the replay; the
    twin adds it to every request's token times (the simulator models the iterations only)."""
    sim_regime_pace: tuple[float, ...] = ()
    """The same per batch regime (decode, prefill, mixed: Σ measured ÷ Σ predicted over
    tandem's run, `learned_regime_pace`), which the twin runs at
    (`SimConfig.regime_slowdowns`): a real engine departs from its profile by different
    amounts per regime, and one mean pace makes, e.g., the twin's prompts too fast where
    prefill runs slower than decode. () until tandem has run."""
    sim_engine: LatencyModel | None = None
    """The twin's engine: a latency model fitted to the real engine's own iterations over
    tandem's run (each one's token mix and measured time, `fit_engine`). The simulator runs
    every policy's batches at its times while the policy plans with the profile, as it did on
    the real engine. A per-regime pace keeps the profile's shape, and the engine's differs (on
    the CPU engine small decode batches run faster than profiled and large ones slower); None
    until tandem has run, or when its engine logged too few iterations: the twin then runs the
    profile at `sim_regime_pace`."""
    sim_engine_iterations: int = 0
    """Iterations `sim_engine` was fitted to."""
    replay_start_unix_s: dict[str, float] = field(default_factory=dict)
    """Per policy: when its replay's second 0 was, Unix time (`requests.json` and the engine's
    `iterations.json` meet on it); with `--engine-slowdown`, also second 0 of the schedule the
    engine was slowed to (`engine.slowdown_start_file`)."""
    calibration_recovery: dict[str, list[dict[str, float | None]]] = field(default_factory=dict)
    """Per policy that predicts its iterations (tandem), with `--engine-slowdown`: for each
    change of the schedule's factor, how many seconds its calibrated model's prediction error
    took to come back within `ERROR_BAND` (`slowdown_recovery`)."""
    sim_engine_error: dict[str, float] = field(default_factory=dict)
    """How well the twin's engine predicts the real one's iterations: median and p90 of
    |predicted ÷ measured − 1| over them, for `sim_engine` ("fitted") and for the profile at
    `sim_regime_pace` ("regime_pace")."""

    def options_of(self, name: str) -> dict[str, Any]:
        """The policy options row *name* runs with: tandem's shipped ones with the row's own on
        top; none for stock SGLang's policies."""
        policy, options = parse_policy_spec(name)
        return {**self.policy_options, **options} if policy == "tandem" else {}


def live_config(config: BenchConfig) -> BenchConfig:
    """The config as the live run uses it: the CPU profile and workload variant unless given,
    exact output lengths, the three engine policies by default."""
    profile = config.profile if config.profile != "h100-llama8b-analytic" else DEFAULT_PROFILE
    variant = config.variant or DEFAULT_VARIANT.get(config.workload)
    policies = config.policies or LIVE_POLICIES
    unknown = [p for p in policies if base_name(p) not in LIVE_POLICIES]
    if unknown:
        raise ValueError(
            f"--engine sglang runs {', '.join(LIVE_POLICIES)}; not {', '.join(unknown)}"
        )
    for spec in policies:
        policy, options = parse_policy_spec(spec)
        if not options:
            continue
        if policy != "tandem":
            raise ValueError(
                f"policy spec {spec!r}: stock SGLang's {policy} takes no options on the real "
                "engine (only tandem's do)"
            )
        try:  # a bad option fails here, before any engine starts
            TandemConfig(**{**CPU_POLICY_OPTIONS, **options})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"policy spec {spec!r}: {exc}") from None
    if config.workload not in LIVE_WORKLOADS:
        raise ValueError(
            f"--engine sglang runs W1, W5 and W6 (open-loop RT next to BE); not {config.workload}"
        )
    return replace(
        config, profile=profile, variant=variant, policies=tuple(policies), max_new="exact"
    )


def run_live(config: BenchConfig) -> LiveRun:
    """Every policy on the real engine, then in the simulator; returns the comparison."""
    config = live_config(config)
    profile_path = resolve_profile(config.profile)
    profile = load_profile(profile_path)
    latency = LatencyModel.fit(profile.samples)
    workload, kv = build(config, latency, profile)
    # the real engine's request slots, for the simulator's λ* as for the twin
    base = struct_replace(sim_config(profile, kv, workload), max_running=MAX_RUNNING)
    sim_capacity, _, _ = measure_rate(
        replace(config, rt_rate_req_s=None), workload, latency, profile_path, base
    )
    run = LiveRun(
        config=config,
        workload=workload,
        profile_name=profile_path.stem,
        kv_capacity_tokens=kv,
        rt_capacity_req_s=None,
        rt_rate_req_s=None,
        policy_options=dict(CPU_POLICY_OPTIONS),
        sim_capacity_req_s=sim_capacity,
    )
    if config.rt_rate_req_s is not None:
        run.rt_rate_req_s = config.rt_rate_req_s
    else:
        run.rt_capacity_req_s = measure_live_capacity(run, profile, profile_path)
        run.rt_rate_req_s = workload.rt_rate_share * config.load * run.rt_capacity_req_s
    assert config.policies is not None
    for name in config.policies:
        started = time.perf_counter()
        try:
            result, stats, iterations = run_real(name, run, profile, profile_path)
        except (RuntimeError, OSError, aiohttp.ClientError) as exc:
            run.failed[name] = f"{type(exc).__name__}: {exc}"
            _say(config, f"{name} failed: {run.failed[name]}")
            continue
        run.wall_s[name] = time.perf_counter() - started
        window = workload.window_s
        run.real[name] = compute_metrics(result, window)
        if iterations:
            run.real[name].update(engine_iteration_metrics(iterations))
        run.series[name] = compute_series(result, window or result.end_s)
        if workload.tenants:
            run.tenants[name] = tenant_metrics(result.requests, workload.tenants, result.end_s)
        if stats:
            run.engine_stats[name] = stats
            run.sim_regime_pace = learned_regime_pace(stats)
            run.sim_pace = (
                geometric_mean(run.sim_regime_pace) if run.sim_regime_pace else learned_pace(stats)
            )
        if iterations:
            _save_iterations(run.config.out_dir / "live" / name / "iterations.json", iterations)
            if config.engine_slowdown and name in run.replay_start_unix_s:
                start_unix_s = run.replay_start_unix_s[name]
                run.calibration_recovery[name] = slowdown_recovery(
                    iterations, config.engine_slowdown, start_unix_s
                )
                # the twin runs the engine's own pace with the schedule on top, as the real one
                iterations = unslowed(iterations, config.engine_slowdown, start_unix_s)
                if pace := iteration_regime_pace(iterations, latency):
                    run.sim_regime_pace, run.sim_pace = pace, geometric_mean(pace)
            samples = engine_samples(iterations)
            if len(samples) >= MIN_ENGINE_SAMPLES:
                run.sim_engine = fit_engine(samples, paced_samples(profile, run.sim_regime_pace))
                run.sim_engine_iterations = len(samples)
                run.sim_engine_error = {
                    **_spread("fitted", run.sim_engine.predict, samples),
                    **_spread("regime_pace", _paced(latency, run.sim_regime_pace), samples),
                }
        sim_result = run_sim(name, run, latency, base)
        run.sim[name] = compute_metrics(sim_result, window)
        if workload.tenants:
            run.sim_tenants[name] = tenant_metrics(
                sim_result.requests, workload.tenants, sim_result.end_s
            )
        _say(config, f"{name}: real {_brief(run.real[name])} | sim {_brief(run.sim[name])}")
    return run


# --- the real engine -------------------------------------------------------------------------


def engine_section(
    name: str, run: LiveRun, profile: Profile, profile_path: Path, port: int, log_file: Path
) -> dict[str, Any]:
    """The `engine:` config of policy *name*."""
    section: dict[str, Any] = {
        "kind": "sglang",
        "port": port,
        "launch": True,
        "device": "cpu",
        "max_total_tokens": run.kv_capacity_tokens,
        "max_running_requests": MAX_RUNNING,
        "chunked_prefill_size": profile.max_prefill_tokens,
        "log_file": str(log_file),
        "startup_timeout_s": READY_TIMEOUT_S,
    }
    if CPU_THREADS is not None:
        section["cpu_threads"] = CPU_THREADS
    if run.config.engine_slowdown:
        # every policy's engine alike, from its replay's start (`_replay_all` writes the file)
        section["slowdown"] = format_slowdown(run.config.engine_slowdown)
        section["slowdown_start_file"] = str(log_file.with_name(SLOWDOWN_START_FILE))
    if base_name(name) == "tandem":
        section.update(
            patch=True,
            policy="tandem",
            profile=str(profile_path),
            policy_options=run.options_of(name),
        )
    else:
        section.update(patch=False, enable_priority_scheduling=name == "priority")
    return section


def run_real(
    name: str, run: LiveRun, profile: Profile, profile_path: Path
) -> tuple[SimResult, dict[str, Any], list[IterationRecord]]:
    """One policy on a fresh gateway + engine; its records as a SimResult, tandem's in-engine
    counters and the engine's log of its iterations (both empty for stock SGLang)."""
    workdir = run.config.out_dir / "live" / name
    with _stack(name, run, profile, profile_path, workdir) as (base_url, token, engine):
        records, end_s, overhead_s, iterations = asyncio.run(
            _replay_all(base_url, token, run, engine, name=name, follow=base_name(name) == "tandem")
        )
        if overhead_s is not None:
            run.serving_overhead_s[name] = overhead_s
        stats = _engine_stats(engine) if base_name(name) == "tandem" else {}
        if stats:
            stats["gateway_slo_rechecks"] = gateway_slo_rechecks(base_url, token)
    save_requests(workdir / "requests.json", records, run.replay_start_unix_s.get(name))
    result = SimResult(
        policy_name=name,
        requests=records,
        iterations=IterationLog(run.kv_capacity_tokens),
        horizon_s=None,
        end_s=end_s,
        prefix_reuse_ratio=0.0,
    )
    return result, stats, iterations


@contextmanager
def _stack(
    name: str, run: LiveRun, profile: Profile, profile_path: Path, workdir: Path
) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """A fresh `tandem serve` for policy *name*; yields (gateway URL, admin token, engine
    config section, with the engine's API key under "api_key": the bench reads the engine's
    own /v1/loads)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tandem.db").unlink(missing_ok=True)  # a rerun into the same folder
    (workdir / SLOWDOWN_START_FILE).unlink(missing_ok=True)
    engine_port, gateway_port = free_port(), free_port()
    engine = engine_section(name, run, profile, profile_path, engine_port, workdir / "engine.log")
    cfg = {
        "gateway": {"host": "127.0.0.1", "port": gateway_port},
        "database": {"url": f"sqlite+aiosqlite:///{workdir / 'tandem.db'}"},
        "engine": engine,
    }
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    token, engine_key = secrets.token_hex(16), secrets.token_hex(16)
    with served(config_path, token, workdir / "gateway.log", gateway_port, engine_key) as url:
        yield url, token, {**engine, "api_key": engine_key}


def engine_headers(engine: dict[str, Any]) -> dict[str, str]:
    """The headers of a request to the engine of a `_stack` (its API key)."""
    key = engine.get("api_key")
    return {"Authorization": f"Bearer {key}"} if key else {}


@contextmanager
def served(
    config_path: Path,
    admin_token: str,
    log_path: Path,
    port: int,
    engine_api_key: str | None = None,
) -> Iterator[str]:
    """`tandem serve --config …` in its own process group until the block ends; yields the
    gateway URL once /readyz answers 200. *engine_api_key*: the key its engine requires (by
    environment, not in the config file; by default `tandem serve` makes one up)."""
    env = {**os.environ, "TANDEM_ADMIN_TOKEN": admin_token}
    if engine_api_key is not None:
        env["TANDEM_ENGINE__API_KEY"] = engine_api_key
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(config_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    with _exit_on_sigterm():
        try:
            _wait_ready(proc, base_url, log_path)
            yield base_url
        finally:
            _stop(proc)


@contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """A SIGTERM (a `kill`, a CI timeout) raises SystemExit in the main thread while the block
    runs, so the `finally` clauses that stop the servers run too: Python's default action for
    SIGTERM ends the process at once and would leave them running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _wait_ready(proc: subprocess.Popen[bytes], base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"tandem serve exited ({proc.returncode}): {log_path.read_text()[-2000:]}"
            )
        try:
            with urllib.request.urlopen(base_url + "/readyz", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(
        f"tandem serve not ready after {READY_TIMEOUT_S:.0f} s: {log_path.read_text()[-2000:]}"
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def gateway_slo_rechecks(base_url: str, token: str) -> dict[str, float] | str:
    """The RT requests the gateway's SLO admission judged again as request slots freed, by
    their verdict (`tandem_slo_rechecks_total` on its /metrics, summed over tenants); the
    error's text when /metrics cannot be read."""
    request = urllib.request.Request(
        f"{base_url}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10.0) as resp:
            text = resp.read().decode()
    except (OSError, urllib.error.URLError) as exc:
        return str(exc)
    return rechecks_of(text)


def rechecks_of(metrics_text: str) -> dict[str, float]:
    """`tandem_slo_rechecks_total` in a Prometheus text body, summed by outcome."""
    counts: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line.startswith("tandem_slo_rechecks_total{"):
            continue
        labels, _, value = line.rpartition(" ")
        outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
        counts[outcome] = counts.get(outcome, 0.0) + float(value)
    return counts


def _engine_stats(engine: dict[str, Any]) -> dict[str, Any]:
    """The engine's counters from its control endpoint (`GET /stats` on its Unix socket)."""
    from common.wire import CONTROL_STATS_PATH

    status, body = engine_control_get(int(engine["port"]), CONTROL_STATS_PATH, 10.0)
    if status != 200 or not isinstance(body, dict):
        return {"error": body if status == 0 else f"GET {CONTROL_STATS_PATH}: HTTP {status}"}
    return body


def engine_control_get(port: int, path: str, timeout_s: float) -> tuple[int, Any]:
    """`GET path` on the control endpoint (Unix socket) of the engine serving on *port*: the
    HTTP status and the decoded JSON body; (0, the error's text) when it cannot be reached
    (stock SGLang has no control endpoint)."""
    from common.config import EngineConfig

    conn = _UnixHTTPConnection(EngineConfig(port=port).control_socket_path, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return 0, str(exc)
    finally:
        conn.close()


async def follow_iterations(
    port: int, records: list[IterationRecord], stop: asyncio.Event, every_s: float = 0.0
) -> None:
    """Long-polls the `/iterations` log of the engine serving on *port* until *stop* is set,
    appending every iteration's record to *records*, oldest first (a `/load` poll sees only the
    newest: a follower starved of CPU would keep the long iterations and miss the short ones in
    between). An engine without a control endpoint (stock SGLang) adds none. *every_s*: at
    least this long between polls (the engine keeps the last `ITERATION_LOG_SIZE`), so that on
    a small host the follower does not compete with what it measures at every iteration."""
    after = 0
    while not stop.is_set():
        if after and every_s > 0.0:
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
        status, body = await asyncio.to_thread(
            engine_control_get, port, f"{CONTROL_ITERATIONS_PATH}?after={after}&wait_s=1", 5.0
        )
        if status != 200 or not isinstance(body, dict):
            await asyncio.sleep(0.2)
            continue
        recent = msgspec.convert(body, RecentIterations)
        records.extend(recent.iterations)
        if recent.iterations:
            after = recent.iterations[-1].iteration


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a Unix socket (the engine's control endpoint)."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._socket_path)
        self.sock = sock


def measure_live_capacity(run: LiveRun, profile: Profile, profile_path: Path) -> float:
    """λ* on the real engine: the largest RT-only Poisson rate at which stock SGLang FCFS,
    behind the gateway, keeps joint TTFT+TPOT attainment ≥ 90 % (bench/capacity.py's
    definition): short probes bracket it, probes as long as the simulator's decide it
    (`search_capacity_sustained`), to CAPACITY_TOLERANCE; one engine for all of them."""
    workdir = run.config.out_dir / "live" / "capacity"
    rt_poisson = run.workload.rt_poisson
    assert rt_poisson is not None

    def attainment(session_url: str, token: str, window_s: float) -> Callable[[float], float]:
        def probe(rate: float) -> float:
            source = rt_poisson(rate, window_s)
            records, end_s = asyncio.run(
                replay_source(session_url, token, source, window_s, CAPACITY_DRAIN_S)
            )
            value = float(rt_metrics(records, end_s, window_s)["rt_joint_attainment"] or 0.0)
            run.capacity_probes.append((rate, value, window_s))
            _say(
                run.config,
                f"real λ* search: {rate:.3f} req/s for {window_s:g} s → joint attainment "
                f"{value:.3f}",
            )
            _wait_idle(engine_url, engine_headers(engine))  # the next probe starts empty
            return value

        return probe

    with _stack("fcfs", run, profile, profile_path, workdir) as (base_url, token, engine):
        engine_url = f"http://127.0.0.1:{engine['port']}"
        return search_capacity_sustained(
            attainment(base_url, token, CAPACITY_PROBE_S),
            attainment(base_url, token, CAPACITY_SUSTAINED_S),
            rel_tolerance=CAPACITY_TOLERANCE,
        )


def _wait_idle(
    engine_url: str, headers: dict[str, str], timeout_s: float = 120.0, poll_s: float = 1.0
) -> None:
    """Waits until the engine runs and queues nothing (requests a probe gave up on are aborted
    by the gateway, but the engine needs a moment to drop them). An engine that refuses the
    question is an error (it was once a 401 taken for idle); one that is gone is left to the
    next probe to find."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            request = urllib.request.Request(engine_url + "/v1/loads", headers=headers)
            with urllib.request.urlopen(request, timeout=5) as resp:
                loads = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{engine_url}/v1/loads answered HTTP {exc.code}") from exc
        except OSError:
            return
        rows = loads.get("loads", []) if isinstance(loads, dict) else loads
        busy = sum(
            int(r.get("num_running_reqs", 0) or 0) + int(r.get("num_waiting_reqs", 0) or 0)
            for r in rows
            if isinstance(r, dict)
        )
        if busy == 0:
            return
        time.sleep(poll_s)


async def _replay_all(
    base_url: str,
    admin_token: str,
    run: LiveRun,
    engine: dict[str, Any],
    *,
    name: str,
    follow: bool,
) -> tuple[list[RequestRecord], float, float | None, list[IterationRecord]]:
    """The workload through the gateway at *base_url* (policy *name*'s): its records and end,
    the serving overhead measured on the idle engine just before (None where it could not be),
    and, with *follow*, the engine's record of every iteration of the replay
    (`follow_iterations`). With a slowdown, the engine is slowed from the replay's start on."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=DRAIN_TIMEOUT_S)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        keys = TenantKeys(base_url, admin_token, session)
        # Tenants exist before the clock starts; a warm-up request wakes the engine's caches.
        warm = RequestSpec(
            rid="warm-up", tier="be", arrival_s=0.0, prompt_len=16, output_len=4, max_new_tokens=4
        )
        await send(session, base_url, await keys.key_for(warm), warm, time.perf_counter())
        overhead_s = None
        probe = _first_rt_spec(run.workload.source(run.rt_rate_req_s, True))
        if probe is not None:
            overhead_s = await measure_serving_overhead(
                session, base_url, await keys.key_for(probe), engine, probe
            )
        source = run.workload.source(run.rt_rate_req_s, True)
        iterations: list[IterationRecord] = []
        stop = asyncio.Event()
        follower = (
            asyncio.create_task(follow_iterations(int(engine["port"]), iterations, stop))
            if follow
            else None
        )
        start_file = engine.get("slowdown_start_file")
        run.replay_start_unix_s[name] = time.time()
        if start_file:
            Path(start_file).write_text(f"{run.replay_start_unix_s[name]:.6f}\n")
        try:
            records, end_s = await replay(
                session, base_url, keys, source, run.workload.window_s or 0.0
            )
        finally:
            stop.set()
            if follower is not None:
                await follower
        return records, end_s, overhead_s, iterations


def _first_rt_spec(source: SpecSource) -> RequestSpec | None:
    """The first RT request a source sends (None when it sends none)."""
    while (at := source.next_arrival_s()) is not None:
        for spec in source.pop_due(at):
            if spec.tier == "rt":
                return spec
    return None


SERVING_PROBES = 7
"""Sequential requests that measure the serving overhead (their median counts)."""


async def measure_serving_overhead(
    session: aiohttp.ClientSession,
    base_url: str,
    key: str,
    engine: dict[str, Any],
    like: RequestSpec,
) -> float | None:
    """What a request spends outside the engine's iterations, as the bench's client sees it,
    seconds: the median over SERVING_PROBES sequential requests on the idle engine (shaped
    like *like*, 4 output tokens) of the client's TTFT less the engine's own prefill step
    (SGLang's cumulative `total_prefill_busy_us` on /v1/loads, read before and after). It is
    the HTTP hops, the gateway, tokenization, the scheduler's pick-up, detokenization (which
    holds back a token that ends mid-character) and the stream back — none of which the
    simulator models. None when the engine does not report its prefill time."""
    values = []
    for i in range(SERVING_PROBES):
        spec = replace(like, rid=f"overhead-{i}", arrival_s=0.0, output_len=4, max_new_tokens=4)
        engine_url, headers = f"http://127.0.0.1:{engine['port']}", engine_headers(engine)
        before = await engine_prefill_busy_s(session, engine_url, headers)
        record = await send(session, base_url, key, spec, time.perf_counter())
        after = await engine_prefill_busy_s(session, engine_url, headers)
        if before is None or after is None or record.first_token_s is None:
            return None
        values.append(max(0.0, record.first_token_s - (after - before)))
    return float(np.median(values))


# --- the simulator twin ----------------------------------------------------------------------


SIM_POLICY = {"tandem": "tandem", "fcfs": "fcfs", "priority": "priority"}
"""The simulator's model of each engine policy (registry names)."""
SIM_STOCK_OPTIONS: dict[str, dict[str, Any]] = {"priority": {"mixed_chunk": True}}
"""The twin's options for a stock row: the engines the live bench starts run SGLang's
`--enable-mixed-chunk` (`backend.launch.sglang`), so stock priority's decodes ride along with
its prefill batches. Without it the twin's priority paused every decode for each arrival's
prefill: at 13.5 req/s (W1 cpu, session 61) its BE was 0.33× the real one's and its TPOT
1.24×; with it, 0.55× and 1.15×, on the same fitted engine."""


def run_sim(name: str, run: LiveRun, latency: LatencyModel, base: Any) -> SimResult:
    """The identical workload in the simulator (tandem with the row's policy options, as its
    engine ran them)."""
    base_policy = base_name(name)
    options = (
        run.options_of(name) if base_policy == "tandem" else SIM_STOCK_OPTIONS.get(base_policy, {})
    )
    policy = make_policy(SIM_POLICY[base_policy], latency, **options)
    source = SimSource(run.workload.source(run.rt_rate_req_s, True), SimRequest)
    # the engine's request cap, and its speed, as the real engine has them: fitted to its
    # iterations, else the profile at its pace per batch regime; the SLO admission learns from
    # outcomes, as the gateway's does (without it the twin admitted, and missed, the requests
    # the gateway had shed: at 9 req/s, shed 0 against the real 4-17 %)
    engine = latency
    schedule = run.config.engine_slowdown  # `--engine-slowdown`: as the real engine was slowed
    base = struct_replace(
        base,
        max_running=MAX_RUNNING,
        ttft_feedback=True,
        engine_slowdown=schedule,
        # the served gateway's (its default): a request refused only for a request slot is
        # judged again on the engine's next reports
        slo_recheck_frac=GatewayConfig().slo_recheck_frac,
    )
    if run.sim_engine is not None:
        sim, engine = base, run.sim_engine
    elif run.sim_regime_pace:
        sim = struct_replace(base, regime_slowdowns=run.sim_regime_pace)
    else:
        paced = tuple((t_s, k * run.sim_pace) for t_s, k in schedule or ((0.0, 1.0),))
        sim = struct_replace(base, engine_slowdown=paced)
    return shifted(simulate(source, policy, engine, sim), run.serving_overhead_s.get(name, 0.0))


def shifted(result: SimResult, overhead_s: float) -> SimResult:
    """*result* with every request's tokens (first, each, last) *overhead_s* later: the serving
    path's time outside the engine, which the client of the real run sees in each of them."""
    if overhead_s <= 0.0:
        return result
    for r in result.requests:
        if r.first_token_s is not None:
            r.first_token_s += overhead_s
        if r.finish_s is not None:
            r.finish_s += overhead_s
        r.token_times = array("d", (t + overhead_s for t in r.token_times))
    return result


_FACTOR_KEYS = ("latency_factor_decode", "latency_factor_prefill", "latency_factor_mixed")
"""tandem's `/stats` keys of its calibration factors, in regime order."""


def learned_pace(stats: dict[str, Any]) -> float:
    """The engine's pace relative to its profile from tandem's `/stats` (the geometric mean of
    the calibration's factors); 1.0 when they are missing."""
    factors = [
        float(stats[key])
        for key in _FACTOR_KEYS
        if isinstance(stats.get(key), int | float) and stats[key] > 0
    ]
    return geometric_mean(factors) if factors else 1.0


def geometric_mean(values: Sequence[float]) -> float:
    """The geometric mean of positive *values* (not empty)."""
    return float(np.exp(np.mean(np.log(values))))


_MEAN_PACE_KEYS = (
    "latency_mean_pace_decode",
    "latency_mean_pace_prefill",
    "latency_mean_pace_mixed",
)
"""tandem's `/stats` keys of each regime's pace over the whole run, in regime order."""


MIN_ENGINE_SAMPLES = 200
"""Fewest logged iterations the twin's engine is fitted to (fewer: the profile at the learned
pace per regime)."""


def engine_iteration_metrics(iterations: Sequence[IterationRecord]) -> Metrics:
    """The real engine's iteration metrics from the iterations the bench recorded of its run
    (the simulator's come from its own log): how many, how long, and how far the calibrated
    latency model the policy planned them with was from their measured time
    (`latency_model_error_p50` / `_p99`, `prediction_error_metrics`; an iteration planned
    without a prediction counts in none of these)."""
    measured_s = np.asarray([r.iteration_s for r in iterations], dtype=float)
    predicted_s = np.asarray(
        [r.predicted_iteration_s if r.predicted_iteration_s > 0 else math.nan for r in iterations],
        dtype=float,
    )
    return {
        "iterations": len(iterations),
        "iteration_s_mean": mean(measured_s),
        "iteration_s_p99": percentile(measured_s, 99),
        **prediction_error_metrics(predicted_s, measured_s),
    }


def engine_samples(iterations: Sequence[IterationRecord]) -> list[ProfileSample]:
    """The real engine's iterations that ran a plan of known token mix, as latency samples
    (their measured time, which includes the scheduler's own work between batches: what the
    twin's engine has to take per iteration too)."""
    return [
        ProfileSample(shape=BatchShape(**msgspec.structs.asdict(r.mix)), seconds=r.iteration_s)
        for r in iterations
        if r.mix is not None and r.iteration_s > 0.0 and (r.mix.num_prefill or r.mix.num_decode)
    ]


def fit_engine(
    samples: Sequence[ProfileSample], anchors: Sequence[ProfileSample] = ()
) -> LatencyModel:
    """The twin's engine: the latency model's form fitted to the real engine's iterations
    (`LatencyModel.fit`: relative error, non-negative weights, two pieces where they fit
    clearly better), with *anchors* for the shapes tandem's run did not have (the profile's
    samples at the run's pace: the stock baselines run large mixed batches that tandem, which
    runs prompts and decodes apart on this engine, hardly ever does)."""
    return LatencyModel.fit([*samples, *anchors])


def paced_samples(profile: Profile, regime_pace: tuple[float, ...]) -> list[ProfileSample]:
    """The profile's samples at *regime_pace* (unchanged where it is empty)."""
    if not regime_pace:
        return list(profile.samples)
    return [
        ProfileSample(
            shape=s.shape,
            seconds=s.seconds * regime_pace[regime_of(s.shape.num_prefill, s.shape.num_decode)],
        )
        for s in profile.samples
    ]


def _paced(latency: LatencyModel, regime_pace: tuple[float, ...]) -> Callable[[BatchShape], float]:
    """The profile's prediction at *regime_pace* (1 where it is empty): the twin's engine
    without a fit."""

    def predict(shape: BatchShape) -> float:
        pace = regime_pace[regime_of(shape.num_prefill, shape.num_decode)] if regime_pace else 1.0
        return pace * latency.predict(shape)

    return predict


def _spread(
    name: str, predict: Callable[[BatchShape], float], samples: Sequence[ProfileSample]
) -> dict[str, float]:
    """Median and p90 of |predicted ÷ measured − 1| over *samples*, keyed `<name>_p50` and
    `<name>_p90`."""
    errors = np.abs(np.array([predict(s.shape) / s.seconds for s in samples]) - 1.0)
    return {
        f"{name}_p50": round(float(np.percentile(errors, 50)), 4),
        f"{name}_p90": round(float(np.percentile(errors, 90)), 4),
    }


def save_requests(
    path: Path, records: Sequence[RequestRecord], replay_start_unix_s: float | None
) -> None:
    """Every request of a policy's run as the bench's client saw it (times in seconds from the
    replay's start, *replay_start_unix_s*; each token's time to the 0.1 ms), kept beside its
    gateway's and engine's logs: what a miss in the report is looked up by — with the gateway
    log's line for each admitted request that missed, and tandem's `iterations.json`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in records:
        row = msgspec.structs.asdict(r)
        row["token_times"] = [round(t, 4) for t in r.token_times]
        rows.append(row)
    body = {"replay_start_unix_s": replay_start_unix_s, "requests": rows}
    path.write_bytes(msgspec.json.encode(body))


def _save_iterations(path: Path, iterations: Sequence[IterationRecord]) -> None:
    """The engine's iteration log of a run (what the twin's engine was fitted to), kept beside
    the run's engine log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode(list(iterations)))


def slowdown_recovery(
    iterations: Sequence[IterationRecord], schedule: Slowdown, start_unix_s: float
) -> list[dict[str, float | None]]:
    """For each change of *schedule*'s factor (the first against the engine's own pace, 1),
    from *start_unix_s* on: when (`at_s`, the schedule's second), from which factor to which,
    and how many seconds the prediction error of the iterations that had a prediction took to
    come back within `ERROR_BAND` — the median |predicted ÷ measured − 1| over a trailing
    `ERROR_WINDOW_S` (`error_back_within_band_s`) and |p50 of predicted ÷ measured − 1| over
    it, the issue's "ratio p50 over a window" (`ratio_p50_back_within_band_s`); 0 when it
    never left the band, None when it never came back (`bench.calibration_recovery`). Empty
    for a policy without predictions (stock SGLang)."""
    if not any(r.predicted_iteration_s > 0 for r in iterations):
        return []
    samples = [
        {
            "at_unix_s": r.at_unix_s,
            "measured_s": r.iteration_s,
            "predicted_s": r.predicted_iteration_s,
        }
        for r in iterations
    ]
    errors = error_timeline(samples, ERROR_WINDOW_S)
    ratios = ratio_timeline(samples, ERROR_WINDOW_S)
    changes: list[dict[str, float | None]] = []
    previous = 1.0
    for at_s, factor in schedule:
        if factor != previous:
            changed_unix_s = start_unix_s + at_s
            changes.append(
                {
                    "at_s": at_s,
                    "from_factor": previous,
                    "factor": factor,
                    "error_back_within_band_s": recovery_s(errors, changed_unix_s, ERROR_BAND),
                    "ratio_p50_back_within_band_s": recovery_s(ratios, changed_unix_s, ERROR_BAND),
                }
            )
        previous = factor
    return changes


def unslowed(
    iterations: Sequence[IterationRecord], schedule: Slowdown, start_unix_s: float
) -> list[IterationRecord]:
    """*iterations* of an engine slowed to *schedule* from *start_unix_s* on
    (`engine.slowdown`), each at the time it would have taken at the engine's own pace: its
    measured time ÷ the factor in effect when it started (the engine sleeps (K − 1) × its
    forward pass; the scheduler's own work between passes, which is not stretched, is divided
    too — a small part of an iteration on this engine)."""
    return [
        msgspec.structs.replace(
            r,
            iteration_s=r.iteration_s
            / factor_at(schedule, r.at_unix_s - r.iteration_s - start_unix_s),
        )
        for r in iterations
    ]


def iteration_regime_pace(
    iterations: Sequence[IterationRecord], latency: LatencyModel
) -> tuple[float, ...]:
    """The engine's pace per batch regime (decode, prefill, mixed) from its iterations of known
    token mix: Σ measured ÷ Σ the profile's prediction, as `learned_regime_pace` reads it from
    tandem's statistics (which count a slowed engine's pace, where this takes the iterations
    `unslowed`). A regime without iterations takes the mean of the others'; () when none."""
    measured = [0.0, 0.0, 0.0]
    predicted = [0.0, 0.0, 0.0]
    for r in iterations:
        if r.mix is None or r.iteration_s <= 0.0 or not (r.mix.num_prefill or r.mix.num_decode):
            continue
        regime = regime_of(r.mix.num_prefill, r.mix.num_decode)
        measured[regime] += r.iteration_s
        predicted[regime] += latency.predict(BatchShape(**msgspec.structs.asdict(r.mix)))
    return _filled(
        [m / p if m > 0 and p > 0 else None for m, p in zip(measured, predicted, strict=True)]
    )


def learned_regime_pace(stats: dict[str, Any]) -> tuple[float, ...]:
    """The real engine's pace per batch regime (decode, prefill, mixed) over tandem's whole run
    (Σ measured ÷ Σ predicted, from its `/stats`): what the twin replays. Not the calibration's
    factors, which follow the last seconds (a run ends with BE draining alone). A regime the
    run never had takes the mean of the others'; () when none is there."""
    values = [stats.get(key) for key in _MEAN_PACE_KEYS]
    return _filled(
        [float(v) if isinstance(v, int | float) and 0 < v < math.inf else None for v in values]
    )


def _filled(paces: Sequence[float | None]) -> tuple[float, ...]:
    """Per-regime paces with each missing one (None) at the geometric mean of the others; ()
    when none is known."""
    known = [p for p in paces if p is not None]
    if not known:
        return ()
    fill = geometric_mean(known)
    return tuple(fill if p is None else p for p in paces)


def sim_real_ratios(run: LiveRun) -> dict[str, dict[str, float | None]]:
    """Per policy and metric: simulator ÷ real engine."""
    out: dict[str, dict[str, float | None]] = {}
    for name, real in run.real.items():
        sim = run.sim.get(name, {})
        out[name] = {key: _ratio(sim.get(key), real.get(key)) for key in RATIO_KEYS}
    return out


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or not np.isfinite(a) or not np.isfinite(b) or b == 0:
        return None
    return float(a) / float(b)


def _brief(m: Metrics) -> str:
    def f(key: str) -> str:
        v = m.get(key)
        return "-" if v is None else f"{v:.3g}"

    return (
        f"TTFT att {f('rt_ttft_attainment')} TPOT att {f('rt_tpot_attainment')} "
        f"BE {f('be_throughput_tok_s')} tok/s"
    )


def _say(config: BenchConfig, line: str) -> None:
    if config.progress:
        print(line, file=sys.stderr, flush=True)
