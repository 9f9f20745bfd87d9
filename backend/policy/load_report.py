"""The engine's live state for the gateway's SLO admission: a `Snapshot` summed into an
`EngineLoad`.

Both engines (the patched SGLang scheduler, backend/sglang_ext/driver.py; the simulator,
backend/sim/realtime.py) publish one after every iteration on their control endpoint's
`common.wire.CONTROL_LOAD_PATH`; `backend.policy.feasibility` forecasts from it. One pass over
the running requests and the waiting RT ones (the waiting BE queue is only counted, and not even
scanned when the engine keeps the tiers apart): cheap enough to run every iteration.

Pure: the caller passes the iteration counter, the wall-clock instant and the calibration.
"""

from __future__ import annotations

from typing import Any

from backend.policy.common import waiting_in
from backend.policy.types import Snapshot
from common.wire import EngineLoad

NO_CALIBRATION = (1.0, 1.0, 1.0)
"""Latency factors of a policy that does not calibrate: the profile is taken as right."""


def engine_load(
    snap: Snapshot,
    *,
    iteration: int,
    at_unix_s: float,
    latency_factors: tuple[float, float, float] = NO_CALIBRATION,
) -> EngineLoad:
    """The load report for the state *snap* describes, after *iteration* iterations.

    A running request that is not fully prefilled (the chunked prompt) counts as waiting: its
    first token is still to come. `kv_used_tokens` is what requests hold: the prefix cache's
    evictable slots are free on demand, so they are not counted as used."""
    rt_waiting = waiting_in(snap, "rt")
    num_rt_waiting = len(rt_waiting)
    rt_waiting_tokens = sum(r.prompt_left for r in rt_waiting)
    num_be_waiting = len(waiting_in(snap, "be"))
    num_rt_running = num_be_running = 0
    rt_context = be_context = be_kv = 0
    for r in snap.running:
        if r.tier == "rt":
            if r.is_decoding:
                num_rt_running += 1
                rt_context += r.context_len
            else:
                num_rt_waiting += 1
                rt_waiting_tokens += r.prompt_left
        else:
            be_kv += r.kv_tokens
            if r.is_decoding:
                num_be_running += 1
                be_context += r.context_len
            else:
                num_be_waiting += 1
    return EngineLoad(
        iteration=iteration,
        at_unix_s=at_unix_s,
        iteration_s=snap.last_iteration_s or 0.0,
        num_rt_waiting=num_rt_waiting,
        rt_waiting_prompt_tokens=rt_waiting_tokens,
        num_rt_running=num_rt_running,
        rt_context_tokens=rt_context,
        num_be_waiting=num_be_waiting,
        num_be_running=num_be_running,
        be_context_tokens=be_context,
        kv_used_tokens=max(
            0, snap.kv_capacity_tokens - snap.kv_free_tokens - snap.kv_evictable_tokens
        ),
        kv_capacity_tokens=snap.kv_capacity_tokens,
        be_kv_tokens=be_kv,
        max_prefill_tokens=snap.max_prefill_tokens,
        latency_factors=latency_factors,
    )


def policy_factors(policy: Any) -> tuple[float, float, float]:
    """The policy's latency calibration factors (decode, prefill, mixed), or NO_CALIBRATION
    for a policy without a calibration (the baselines)."""
    calib = getattr(policy, "calibration", None)
    if calib is None:
        return NO_CALIBRATION
    d, p, m = calib.factors
    return (float(d), float(p), float(m))
