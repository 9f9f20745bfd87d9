"""What an engine adds to its live-state report beside the snapshot: its policy's calibration.

Both engines (the patched SGLang scheduler, backend/sglang_ext/driver.py; the simulator,
backend/sim/realtime.py) publish an `EngineLoad` after every iteration on their control
endpoint's `common.wire.CONTROL_LOAD_PATH`, built by `backend.policy.feasibility.load_of` from
the snapshot the next plan uses and these factors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backend.policy.calibration import PaceSpread, regime_of
from backend.policy.feasibility import SLOT_FREE_QUANTILE
from backend.policy.types import Plan

NO_CALIBRATION = (1.0, 1.0, 1.0)
"""Latency factors of a policy that does not calibrate: the profile is taken as right."""


def policy_factors(policy: Any) -> tuple[float, float, float]:
    """The policy's latency calibration factors (decode, prefill, mixed), or NO_CALIBRATION
    for a policy without a calibration (the baselines)."""
    calib = getattr(policy, "calibration", None)
    if calib is None:
        return NO_CALIBRATION
    d, p, m = calib.factors
    return (float(d), float(p), float(m))


def policy_plan_factor(policy: Any, plan: Any) -> float:
    """The calibration factor the policy scaled *plan*'s predicted time with (1.0 for a
    policy that does not calibrate: its prediction is the profile's)."""
    plan_factor = getattr(policy, "plan_factor", None)
    return 1.0 if plan_factor is None else float(plan_factor(plan))


def observe_pace(spread: PaceSpread, policy: Any, plan: Plan, measured_s: float) -> None:
    """Feeds one iteration that ran *plan* in *measured_s* to the engine's *spread* (what its
    report's `pace_ratio_p90` is), against the profile: with the plan's batch regime and the
    factor the policy predicted it with. Call it before the policy plans again."""
    if plan.predicted_s is not None:
        regime = regime_of(len(plan.prefills), len(plan.decodes))
        spread.observe(plan.predicted_s, measured_s, regime, policy_plan_factor(policy, plan))


def policy_calibration_samples(policy: Any) -> int:
    """Iterations the policy's latency calibration has learned from (0 without one)."""
    calib = getattr(policy, "calibration", None)
    return 0 if calib is None else int(calib.samples)


def policy_rt_fair_counters(policy: Any) -> Mapping[str, float]:
    """The policy's RT fair-share counters by tenant (`FairShare.counters`, live: read, not
    kept), or none for a policy without weighted fair share (the baselines)."""
    return getattr(getattr(policy, "rt_fair", None), "counters", None) or {}


def policy_rt_late_bound_frac(policy: Any) -> float | None:
    """How far past its TTFT deadline a waiting RT prompt is served first (a fraction of its
    target: `TandemConfig.rt_late_bound_frac`), or None for a policy without that bound."""
    value = getattr(getattr(policy, "config", None), "rt_late_bound_frac", None)
    return None if value is None else float(value)


def policy_rt_decode_margin(policy: Any) -> float:
    """The policy's safety margin on the RT decodes' next tokens (tandem's AIMD ε: an iteration
    may take (1 − ε) of the time to the next RT token due), or 0 for a policy without one."""
    return float(getattr(getattr(policy, "feedback", None), "eps", 0.0))


def policy_slot_free_quantile(policy: Any) -> float | None:
    """The quantile at which the policy's engine reports when its RT requests free their slots
    (tandem's `slo_slot_free_quantile`; `feasibility.SLOT_FREE_QUANTILE` for a policy without
    the option: the gateway forecasts slot waits for every policy's engine)."""
    config = getattr(policy, "config", None)
    if config is None or not hasattr(config, "slo_slot_free_quantile"):
        return SLOT_FREE_QUANTILE
    value = config.slo_slot_free_quantile
    return None if value is None else float(value)


def policy_slo_slot_line(policy: Any) -> bool:
    """Whether the SLO admission in front of the policy's engine keeps the requests it holds
    for a request slot in a line (tandem's `slo_slot_line`; on for a policy without the
    option, as the gateway's line is)."""
    return bool(getattr(getattr(policy, "config", None), "slo_slot_line", True))


def policy_slo_slot_wait_feedback(policy: Any) -> bool:
    """Whether the SLO admission in front of the policy's engine learns how much shorter its
    request slots' waits come out than forecast (tandem's `slo_slot_wait_feedback`; on for a
    policy without the option, as the gateway's feedback is)."""
    return bool(getattr(getattr(policy, "config", None), "slo_slot_wait_feedback", True))
