"""Named configurations of tandem for a stated RT interference tolerance (HyGen's setting,
../shared/digests/003_hygen.md §2.3): the operator says "RT's P99 TBT and mean TTFT may be at
most 5 % worse than without BE", and the latency budget L is profiled offline for it by binary
search (bench/studies/profile_tolerance.py), as HyGen profiles its own.

Under such a tolerance two rules change besides L:

* an iteration that emits RT first tokens carries no BE beyond the starvation floor
  (`first_token_be_frac = 0`): every second of BE work in it is a second of TTFT for each;
* RT prompts are prefilled as fast as the rt-only engine would (`rt_prefill_floor_tokens` =
  its 2048-token budget), not cut at L: each extra chunk is one more iteration of TTFT.

The default tandem keeps L = 30 ms and neither rule: it trades RT latency for BE throughput
differently (W1's targets), so one default cannot serve both (bench/results/tandem/README.md).
"""

from __future__ import annotations

from typing import Any

from backend.policy.latency import LatencyModel
from backend.policy.tandem.policy import TandemPolicy

TOL5_LATENCY_BUDGET_S = 0.0145
"""L profiled for W5 (load 0.75, analytic H100 profile) at a 5 % tolerance on P99 TBT and mean
TTFT: the largest L that keeps both, by binary search over [5, 60] ms in 6 steps
(`profile_tolerance.py W5 --policy tandem-tol5 --param latency_budget_s --lo 0.005 --hi 0.06
--steps 6`: 14.5 ms; TTFT ×1.039, TBT P99 ×1.019)."""

TOLERANCE_RULES: dict[str, Any] = {"first_token_be_frac": 0.0, "rt_prefill_floor_tokens": 2048}
"""The two rule changes of a mean-TTFT tolerance (module docstring)."""


def tolerance_5pct(latency: LatencyModel, **options: Any) -> TandemPolicy:
    """`tandem-tol5`: tandem under a 5 % P99-TBT / mean-TTFT tolerance (its profiled L and
    the tolerance rules; `options` override any of them)."""
    policy = TandemPolicy(
        latency, **{**TOLERANCE_RULES, "latency_budget_s": TOL5_LATENCY_BUDGET_S, **options}
    )
    policy.name = "tandem-tol5"
    return policy
