"""An engine slowdown schedule: how many times slower than its latency model an engine runs,
changing at given seconds of a run. The simulator runs its engine at it (`SimConfig
.engine_slowdown`, `tandem bench --engine-slowdown`); a real engine is stretched to it by
``backend.sglang_ext.pace`` (`EngineConfig.slowdown`): an operator's engine slower than the
profile it was planned with, as on a busier or a slower machine, made reproducible."""

from __future__ import annotations

import bisect
import math

Slowdown = tuple[tuple[float, float], ...]
"""An engine slowdown schedule: (start_s, factor) pairs, the first at 0, starts strictly
increasing, every factor > 0; () = no slowdown."""


def check_slowdown(schedule: Slowdown) -> None:
    """ValueError (one line) unless `schedule` is a valid slowdown schedule."""
    if not schedule:
        return
    if schedule[0][0] != 0.0:
        raise ValueError(f"the first change must be at 0 s, got {schedule[0][0]:g}")
    for i, (start, factor) in enumerate(schedule):
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor {factor:g} at {start:g} s must be a finite number > 0")
        if not math.isfinite(start):
            raise ValueError(f"start time {start:g} must be finite")
        if i and not start > schedule[i - 1][0]:
            raise ValueError(
                f"start times must be strictly increasing, got {schedule[i - 1][0]:g} "
                f"then {start:g}"
            )


def parse_slowdown(spec: str) -> Slowdown:
    """`K` (K× from the start) or `K1@T1,K2@T2,…` (K× from second T of the run) → a schedule;
    ValueError (one line) naming what is wrong."""
    items = [item.strip() for item in spec.split(",")]
    if not spec.strip() or not all(items):
        raise ValueError(f"empty entry in {spec!r} (expected K or K1@T1,K2@T2,…)")
    schedule: list[tuple[float, float]] = []
    for item in items:
        factor_s, at, start_s = item.partition("@")
        if not at and len(items) > 1:
            raise ValueError(f"entry {item!r} has no @T (a schedule is K1@T1,K2@T2,…)")
        try:
            factor = float(factor_s)
            start = float(start_s) if at else 0.0
        except ValueError:
            raise ValueError(f"entry {item!r} is not K or K@T with numbers K and T") from None
        schedule.append((start, factor))
    result = tuple(schedule)
    check_slowdown(result)
    return result


def format_slowdown(schedule: Slowdown) -> str:
    """The schedule as `--engine-slowdown` takes it: `K` for one factor from 0 s, else
    `K1@T1,K2@T2,…`."""
    if len(schedule) == 1:
        return f"{schedule[0][1]:g}"
    return ",".join(f"{factor:g}@{start:g}" for start, factor in schedule)


def factor_at(schedule: Slowdown, t_s: float) -> float:
    """The factor in effect at second `t_s` of the run (1.0 for an empty schedule; the first
    entry's before 0)."""
    if not schedule:
        return 1.0
    i = bisect.bisect_right(schedule, t_s, key=lambda p: p[0]) - 1
    return schedule[max(i, 0)][1]
