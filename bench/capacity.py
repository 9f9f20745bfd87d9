"""RT capacity λ*: the largest Poisson RT arrival rate at which ≥ 90 % of RT requests meet both
their TTFT and TPOT targets (joint attainment), with the workload's RT stream alone on the fcfs
policy (DistServe-style; synthesis §5.1). Every arrival rate of a run is a fraction of it.

Search: short runs (`run_s` simulated seconds each, then the drain); from 1 req/s, double while
the target holds (or halve while it does not) to bracket λ*, then bisect until the bracket is
within 2 %. Results are cached in a small JSON file (`capacity.json` in the cache folder) keyed
by workload, variant, profile (name and content digest), seed, KV capacity, run length and a
digest of the code λ* depends on (simulator, policies, workloads), so the search runs once per
setting and a code change re-measures; `--rt-rate` bypasses it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from backend.policy.latency import LatencyModel
from backend.sim.config import SimConfig
from backend.sim.engine import simulate
from backend.sim.source import SimRequest
from bench.metrics import rt_metrics
from bench.workloads.base import Workload
from bench.workloads.sources import SimSource

TARGET_ATTAINMENT = 0.9
RUN_S = 60.0
REL_TOLERANCE = 0.02
MAX_RATE = 8192.0
MIN_RATE = 1.0 / 256


@dataclass(frozen=True)
class CapacityKey:
    """What λ* depends on."""

    workload: str
    variant: str
    profile: str
    profile_digest: str
    seed: int
    kv_capacity_tokens: int
    run_s: float
    code_digest: str = ""
    max_running: int = 1024
    """The engine's request slots (`SimConfig.max_running`): the live bench's twin has the real
    engine's 64, and with them a lower λ*."""

    def __str__(self) -> str:
        return (
            f"{self.workload}/{self.variant}|{self.profile}@{self.profile_digest[:12]}|"
            f"seed={self.seed}|kv={self.kv_capacity_tokens}|slots={self.max_running}|"
            f"run={self.run_s:g}s|code@{self.code_digest[:12]}"
        )


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (a regenerated profile invalidates cached capacities)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


_REPO = Path(__file__).resolve().parent.parent
CODE_PACKAGES = ("backend/sim", "backend/policy", "bench/workloads")
"""Source folders whose code decides λ* (relative to the repository)."""


def code_digest(root: Path = _REPO) -> str:
    """sha256 over the .py files of CODE_PACKAGES (names and contents)."""
    digest = hashlib.sha256()
    for package in CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class CapacityCache:
    """capacity.json: {key string: {"rt_capacity_req_s": λ*, "probes": [[rate, attainment]…]}}."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / "capacity.json"

    def _load(self) -> dict[str, dict[str, object]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: CapacityKey) -> float | None:
        """The cached λ* for this key, if any."""
        entry = self._load().get(str(key))
        value = entry.get("rt_capacity_req_s") if isinstance(entry, dict) else None
        return float(value) if isinstance(value, int | float) else None

    def put(self, key: CapacityKey, capacity: float, probes: list[tuple[float, float]]) -> None:
        """Stores λ* (best effort: an unwritable cache folder is not an error)."""
        data = self._load()
        data[str(key)] = {
            "rt_capacity_req_s": capacity,
            "probes": [[round(r, 6), round(a, 6)] for r, a in probes],
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        except OSError:
            pass


PolicyFactory = Callable[[], object]


def joint_attainment(
    workload: Workload,
    rate: float,
    *,
    make_fcfs: PolicyFactory,
    latency: LatencyModel,
    config: SimConfig,
    run_s: float = RUN_S,
) -> float:
    """RT joint attainment of the workload's Poisson RT stream at `rate` (fcfs, no BE)."""
    if workload.rt_poisson is None:
        raise ValueError(f"{workload.name} has no open-loop RT stream (λ* does not apply)")
    source = SimSource(workload.rt_poisson(rate, run_s), SimRequest)
    result = simulate(source, make_fcfs(), latency, config)  # type: ignore[arg-type]
    if not result.requests:
        return 1.0
    value = rt_metrics(result.requests, result.end_s, run_s)["rt_joint_attainment"]
    return float(value) if value is not None else 1.0


def search_capacity(
    attainment: Callable[[float], float],
    *,
    target: float = TARGET_ATTAINMENT,
    rel_tolerance: float = REL_TOLERANCE,
    on_probe: Callable[[float, float], None] | None = None,
) -> float:
    """The largest rate with attainment(rate) ≥ target, assuming attainment falls with the
    rate: bracket by doubling/halving from 1 req/s, then bisect to rel_tolerance."""

    def probe(rate: float) -> bool:
        value = attainment(rate)
        if on_probe is not None:
            on_probe(rate, value)
        return value >= target

    rate = 1.0
    if probe(rate):
        lo, hi = rate, None
        while hi is None:
            if lo * 2 > MAX_RATE:
                raise ValueError(f"RT capacity above {MAX_RATE:g} req/s: check the profile")
            if probe(lo * 2):
                lo *= 2
            else:
                hi = lo * 2
    else:
        lo, hi = 0.0, rate
        while lo == 0.0:
            if hi / 2 < MIN_RATE:
                return 0.0
            if probe(hi / 2):
                lo = hi / 2
            else:
                hi /= 2
    return _bisect(probe, lo, hi, rel_tolerance)


def rt_capacity(
    workload: Workload,
    key: CapacityKey,
    cache: CapacityCache,
    *,
    make_fcfs: PolicyFactory,
    latency: LatencyModel,
    config: SimConfig,
    report: Callable[[str], None] | None = None,
) -> tuple[float, bool]:
    """(λ*, was_cached): from the cache, or measured and stored."""
    cached = cache.get(key)
    if cached is not None:
        return cached, True
    probes: list[tuple[float, float]] = []

    def on_probe(rate: float, value: float) -> None:
        probes.append((rate, value))
        if report is not None:
            report(f"λ* search {workload.name}: {rate:.3f} req/s → joint attainment {value:.3f}")

    capacity = search_capacity(
        lambda r: joint_attainment(
            workload, r, make_fcfs=make_fcfs, latency=latency, config=config, run_s=key.run_s
        ),
        on_probe=on_probe,
    )
    cache.put(key, capacity, probes)
    return capacity, False


def search_capacity_sustained(
    short: Callable[[float], float],
    long: Callable[[float], float],
    *,
    target: float = TARGET_ATTAINMENT,
    rel_tolerance: float = REL_TOLERANCE,
    on_probe: Callable[[float, float, bool], None] | None = None,
) -> float:
    """λ* where a probe costs its window in wall time (the real engine): short probes bracket,
    long ones decide. `short(rate)` and `long(rate)` are the attainment of a probe of each
    length; `on_probe(rate, value, is_long)` sees every verdict.

    A short probe from an empty engine overestimates what the engine sustains: an overloaded
    engine's queue needs time to grow past the TTFT target, and a window shorter than that
    passes a rate the engine cannot keep (W1's CPU variant on an engine 1.56× slower than its
    profile, 64 request slots, in the simulator: λ* 14.5 req/s with 20-s probes, 11.5 with 40-
    or 60-s ones, 11.0 with 120-s ones). So the short probes only find where attainment first
    fails, doubling from 1 req/s (a short probe that fails, a long one fails too); the long
    probes then start at the last rate the short ones passed, halve until one passes, and
    bisect to *rel_tolerance*: the answer is theirs alone. Long probes at low rates, which the
    plain doubling search (`search_capacity`) would spend its time on, are never run."""

    def passes(rate: float, is_long: bool) -> bool:
        value = (long if is_long else short)(rate)
        if on_probe is not None:
            on_probe(rate, value, is_long)
        return value >= target

    hi = 1.0
    while passes(hi, False):
        if hi * 2 > MAX_RATE:
            raise ValueError(f"RT capacity above {MAX_RATE:g} req/s: check the profile")
        hi *= 2
    lo, candidate = 0.0, hi / 2
    while lo == 0.0:
        if candidate < MIN_RATE:
            return 0.0
        if passes(candidate, True):
            lo = candidate
        else:
            hi, candidate = candidate, candidate / 2
    return _bisect(lambda rate: passes(rate, True), lo, hi, rel_tolerance)


def _bisect(passes: Callable[[float], bool], lo: float, hi: float, rel_tolerance: float) -> float:
    """The largest rate found to pass, bisecting from *lo* (passes) and *hi* (fails) until the
    bracket is within *rel_tolerance* of *hi*."""
    while (hi - lo) / hi > rel_tolerance:
        mid = (lo + hi) / 2
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo
