"""The in-engine driver's counters (served by the control endpoint's ``GET /stats``)."""

from __future__ import annotations

from typing import Any

import msgspec

PLAN_MS_KEPT = 2048
"""Most recent per-iteration planning times (and latency-model errors) kept for the
statistics."""


class DriverStats(msgspec.Struct, kw_only=True):
    """What the driver did since start (served by the control endpoint's ``GET /stats``)."""

    policy: str = ""
    """Name of the policy in charge."""
    iterations: int = 0
    """Iterations that ran a batch."""
    busy_s: float = 0.0
    """Total duration of those iterations (scheduler loop time, start to start), seconds."""
    rt_busy_s: float = 0.0
    """Of `busy_s`, the share RT work accounts for: each iteration's duration × what the policy's
    latency model predicts for its RT work alone over the whole plan (fixed costs included;
    iterations where SGLang's own admission ran count none)."""
    overhead_s: float = 0.0
    """Of `busy_s`, time spent in tandem's code (snapshot, plan, carrying it out), seconds."""
    plans: int = 0
    """Plans made."""
    parked_decodes: int = 0
    """Decode rows that sat an iteration out (kept their KV)."""
    evictions: int = 0
    """Requests the plan evicted (KV freed, re-queued, resumed later)."""
    retractions_ordered: int = 0
    """Times SGLang's out-of-memory retraction asked the policy for its victim order."""
    planned_prefills: int = 0
    """Prefill chunks planned."""
    admitted_prefills: int = 0
    """Planned chunks SGLang's prefill pass actually took."""
    refused_prefills: int = 0
    """Planned chunks the engine could not take (SGLang's one-chunked-request rule, KV)."""
    parked_chunks: int = 0
    """Prefill passes in which SGLang's in-progress chunked prompt sat out, its KV kept, because
    the plan left it out (an RT prompt ran without waiting for a chunk of a long BE prompt)."""
    released_chunks: int = 0
    """In-progress chunked prompts sent back to the waiting queue, the KV they had computed
    kept in the prefix cache, so that a planned prompt could be cut (SGLang cuts one prompt at
    a time); each resumes from its cached prefix."""
    prefix_matches: int = 0
    """Prefix-cache matches run for waiting requests (each new one once, then a few a plan
    again: `driver.PREFIX_RECHECK_S`), so a prompt is planned from the prefix the cache holds."""
    waiting_cached_tokens: int = 0
    """Σ of the prompt tokens those matches found in the prefix cache (a renewed match counts
    again): prompt work the plans did not count as to be computed."""
    finished: int = 0
    """Requests that finished (their output length went into the length history)."""
    history_updates: int = 0
    """Length-history pushes applied from the control endpoint."""
    history_lengths: int = 0
    """Output lengths received through those pushes."""
    holds: int = 0
    """Times the policy held BE back for an RT request it expected any moment (tandem's
    `rt_anticipation_s`): one per wait, however often SGLang's loop asked during it."""
    held_plans: int = 0
    """Plans during those waits (SGLang's loop asks again at once while nothing runs)."""
    stall_fallbacks: int = 0
    """Iterations where the policy planned nothing for an idle engine with requests waiting, so
    SGLang's own admission ran instead (an engine must never sit idle on queued work)."""
    peak_running: int = 0
    """Most requests holding KV at once (running + mid-prefill), seen at planning time."""
    peak_kv_used_tokens: int = 0
    """Most KV slots in use at once (requests and prefix cache), seen at planning time."""
    plan_ms: list[float] = msgspec.field(default_factory=list)
    """Recent planning times, ms (the last PLAN_MS_KEPT)."""
    latency_factor_decode: float = 1.0
    """The policy's latency calibration (`backend.policy.calibration`): how much slower than its
    profile the engine runs decode-only batches now (corrected prediction = factor × profile's);
    1.0 for a policy without one."""
    latency_factor_prefill: float = 1.0
    """The same for prefill-only batches."""
    latency_factor_mixed: float = 1.0
    """The same for batches with both."""
    latency_mean_pace_decode: float | None = None
    """How many times the profile's time the decode-only batches took over the engine's whole
    run (Σ measured ÷ Σ predicted, `LatencyCalibration.mean_pace`): the pace a simulator
    replays this run at; None before the first such batch."""
    latency_mean_pace_prefill: float | None = None
    """The same for prefill-only batches."""
    latency_mean_pace_mixed: float | None = None
    """The same for batches with both."""
    latency_error: list[float] = msgspec.field(default_factory=list)
    """Recent |predicted − measured| / measured of the profile's own (uncorrected) prediction,
    one per calibrated iteration (the last PLAN_MS_KEPT)."""
    latency_corrected_error: list[float] = msgspec.field(default_factory=list)
    """The same for the calibrated prediction the plan was made with."""
    rider_cost_factor: float = 1.0
    """How many times its predicted cost BE work riding in RT iterations really took, recently
    (tandem with `rt_stretch`: `feedback.RiderCost`, which divides BE's allowance there by it;
    1.0 otherwise)."""
    latency_calibrated_at_unix_s: float | None = None
    """When the calibration last learned from an iteration (Unix seconds, the engine host's
    clock): the factors and errors above are as of then. An idle engine learns nothing, so they
    grow stale while it idles (the gateway's SLO admission judges an idle engine at its
    profile's pace for that reason); None before the first calibrated iteration."""
    latency_warnings: int = 0
    """Episodes in which a factor stayed outside the tolerated band long enough to warn (the
    profile does not describe this engine)."""

    @property
    def mean_iteration_ms(self) -> float:
        return 1000.0 * self.busy_s / self.iterations if self.iterations else 0.0

    @property
    def overhead_frac(self) -> float:
        """Share of the busy time spent in tandem's code."""
        return self.overhead_s / self.busy_s if self.busy_s > 0 else 0.0

    @property
    def rt_time_frac(self) -> float:
        """Share of the busy time RT work accounts for (the rest is BE's marginal cost)."""
        return self.rt_busy_s / self.busy_s if self.busy_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The counters plus derived figures, JSON-ready."""
        out: dict[str, Any] = msgspec.structs.asdict(self)
        for name in ("plan_ms", "latency_error", "latency_corrected_error"):
            out[f"{name}_p50"], out[f"{name}_p99"] = _p50_p99(out.pop(name))
        out["mean_iteration_ms"] = self.mean_iteration_ms
        out["overhead_frac"] = self.overhead_frac
        out["rt_time_frac"] = self.rt_time_frac
        return out


def _p50_p99(values: list[float]) -> tuple[float | None, float | None]:
    """Nearest-rank p50 and p99 (None for no values)."""
    if not values:
        return None, None
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2], ordered[min(n - 1, int(0.99 * n))]
