"""The patched engine's own counters (its control endpoint's ``GET /stats``) as gauges on the
gateway's ``GET /metrics``: how the engine's busy time splits between RT work and the rest, what
tandem's scheduling costs, and how far the latency profile the policy plans with is from the
engine's real speed (the prediction error, and the calibration's pace factors).

The engine-control loop (`gateway.engine.control`) reads ``/stats`` every couple of seconds;
each gauge covers the interval between the last two readings, so it follows the load as it
changes (a restarted engine — its counters went down — starts a new interval).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from backend.policy.calibration import REGIMES

_SHARES = (
    (
        "tandem_engine_rt_time_share",
        "rt_busy_s",
        "Share of the engine's busy time that RT work accounted for (the rest is BE's marginal "
        "cost) over the last control-endpoint interval.",
    ),
    (
        "tandem_engine_scheduler_overhead_share",
        "overhead_s",
        "Share of the engine's busy time spent in tandem's scheduling code over the last "
        "control-endpoint interval.",
    ),
)


_ERRORS = (
    (
        "tandem_engine_latency_model_error",
        "latency_error",
        "The latency profile's prediction error on the engine's recent iterations, "
        "|predicted - measured| / measured, at the quantile given (before calibration).",
    ),
    (
        "tandem_engine_latency_corrected_error",
        "latency_corrected_error",
        "The same error for the prediction the policy planned with (after its calibration).",
    ),
)
_QUANTILES = (("0.5", "p50"), ("0.99", "p99"))


class EngineStatsWindow:
    """The last two ``/stats`` readings of the engine."""

    def __init__(self) -> None:
        self.previous: dict[str, Any] | None = None
        self.latest: dict[str, Any] | None = None

    def add(self, stats: dict[str, Any]) -> None:
        """A new reading; one with less busy time than the last (the engine restarted) starts
        over."""
        if self.latest is not None and _num(stats, "busy_s") < _num(self.latest, "busy_s"):
            self.latest = None
        self.previous, self.latest = self.latest, stats

    def share(self, key: str) -> float | None:
        """Δkey / Δbusy_s between the last two readings (since the engine started when there
        is one); 0 over an interval without busy time (an idle engine: nothing of its time went
        to *key*, and the gauge must not vanish); None before the first reading."""
        if self.latest is None:
            return None
        before = self.previous or {}
        busy = _num(self.latest, "busy_s") - _num(before, "busy_s")
        if busy <= 0:
            return 0.0
        return min(1.0, max(0.0, (_num(self.latest, key) - _num(before, key)) / busy))

    def calibration_age_s(self, now_unix_s: float | None = None) -> float | None:
        """Seconds since the engine's calibration last learned from an iteration (its factors
        and errors are as of then: an idle engine's grow stale); None before the first one or
        without a calibrating policy. Never negative (the engine's host clock may run ahead)."""
        at = (self.latest or {}).get("latency_calibrated_at_unix_s")
        if not isinstance(at, int | float):
            return None
        return max(0.0, (time.time() if now_unix_s is None else now_unix_s) - float(at))

    def latency_errors(self) -> dict[str, float | None]:
        """The latest reading's prediction errors: error_p50/p99 (the profile's) and
        corrected_error_p50/p99 (the calibrated prediction's), ratios; None where unknown; and
        calibrated_age_s, how old they are (`calibration_age_s`)."""
        latest = self.latest or {}
        out: dict[str, float | None] = {"calibrated_age_s": self.calibration_age_s()}
        for name, key in (
            ("error", "latency_error"),
            ("corrected_error", "latency_corrected_error"),
        ):
            for _, suffix in _QUANTILES:
                value = latest.get(f"{key}_{suffix}")
                out[f"{name}_{suffix}"] = float(value) if isinstance(value, int | float) else None
        return out

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The gauges that have a value (collected at scrape time)."""
        for name, key, doc in _SHARES:
            value = self.share(key)
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        latest = self.latest or {}
        for name, key, doc in _ERRORS:
            errors = GaugeMetricFamily(name, doc, labels=["quantile"])
            for quantile, suffix in _QUANTILES:
                value = latest.get(f"{key}_{suffix}")
                if isinstance(value, int | float):
                    errors.add_metric([quantile], float(value))
            if errors.samples:
                yield errors
        factors = GaugeMetricFamily(
            "tandem_engine_latency_factor",
            "How much slower than its latency profile the engine runs now, per batch regime "
            "(the policy's calibration; 1 = as profiled).",
            labels=["regime"],
        )
        for regime in REGIMES:
            value = latest.get(f"latency_factor_{regime}")
            if isinstance(value, int | float):
                factors.add_metric([regime], float(value))
        if factors.samples:
            yield factors
        age_s = self.calibration_age_s()
        if age_s is not None:
            yield GaugeMetricFamily(
                "tandem_engine_latency_calibration_age_seconds",
                "Seconds since the engine's latency calibration last learned from an iteration: "
                "the factors and errors above are as of then (an idle engine's grow stale).",
                value=age_s,
            )


def _num(stats: dict[str, Any], key: str) -> float:
    value = stats.get(key)
    return float(value) if isinstance(value, int | float) else 0.0
