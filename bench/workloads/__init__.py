"""Benchmark workloads W1…W6 (synthesis §5.3), deterministic by seed. See bench/README.md.

`build_workload("W1", WorkloadParams(seed=0), ctx)` returns a `Workload`, whose
`source(rt_rate, include_be)` gives a fresh arrival source of RequestSpecs for each policy.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.defaults import WORKLOAD_NAMES
from bench.workloads import w1_hybrid, w2_mixed, w3_memory, w4_offline, w5_bursty, w6_fairness
from bench.workloads.base import BuildContext, Workload, WorkloadParams

BUILDERS: dict[str, Callable[[WorkloadParams, BuildContext], Workload]] = {
    "W1": w1_hybrid.build,
    "W2": w2_mixed.build,
    "W3": w3_memory.build,
    "W4": w4_offline.build,
    "W5": w5_bursty.build,
    "W6": w6_fairness.build,
}
assert tuple(BUILDERS) == WORKLOAD_NAMES


def build_workload(name: str, params: WorkloadParams, ctx: BuildContext) -> Workload:
    """The named workload; ValueError for an unknown name or bad parameters."""
    try:
        builder = BUILDERS[name.upper()]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r} (choose from {', '.join(WORKLOAD_NAMES)}, trace)"
        ) from None
    return builder(params, ctx)


__all__ = ["BUILDERS", "build_workload"]
