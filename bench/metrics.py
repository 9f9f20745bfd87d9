"""Benchmark metrics (synthesis §5.1) over a simulation's request records and iteration log.

Pure functions: records in, a flat dict of numbers out (None where a metric does not apply, e.g.
RT metrics of a BE-only run). Keys, definitions and units are listed in bench/README.md; the
ones named in API.md's results.json schema are spelled exactly as there.

Conventions:
* The measurement window T is the workload's arrival window, or the run's end for offline and
  closed-loop workloads. Rates are per second of T. RT requests count whenever they finish (all
  arrive inside T); BE requests and tokens count when they complete / are emitted within T.
* A request that never got its first token has its TTFT censored at the run's end and misses
  every SLO. TPOT = mean gap between a request's tokens after the first; MTPOT = its largest gap.
* Token deadlines (AccelGen): the first token is due at arrival + TTFT target, token k at the
  emission of token k−1 + TPOT target; tokens never emitted count as missed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from backend.sim.records import IterationLog, RequestRecord, SimResult

Metrics = dict[str, float | int | None]

WALL_CLOCK_KEYS = frozenset(
    {
        "plan_ms_p50",
        "plan_ms_p99",
        "plan_ms_mean",
        "plan_overhead_frac",
        "placement_us_p50",
        "placement_us_p99",
    }
)
"""Metrics measured on the host's clock (policy planning time): they differ between otherwise
identical runs. Everything else is a function of the seed."""

INTERFERENCE_KEYS = {
    "rt_interference_tbt_p99": "rt_tbt_p99_s",
    "rt_interference_tbt_mean": "rt_tbt_mean_s",
    "rt_interference_ttft_mean": "rt_ttft_mean_s",
    "rt_interference_ttft_p99": "rt_ttft_p99_s",
}
"""Interference ratio (HyGen) → the RT metric it divides by the rt-only run's value."""

_EPS = 1e-9  # float slack when comparing a time with its target


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """The q-th percentile (linear interpolation); None for no values."""
    arr = np.asarray(values, dtype=float)
    return float(np.percentile(arr, q)) if arr.size else None


def mean(values: Sequence[float] | np.ndarray) -> float | None:
    """Arithmetic mean; None for no values."""
    arr = np.asarray(values, dtype=float)
    return float(arr.mean()) if arr.size else None


def token_times(rec: RequestRecord) -> np.ndarray:
    """A request's token emission times as a float array."""
    return np.asarray(rec.token_times, dtype=float)


@dataclass(frozen=True, slots=True)
class RtStats:
    """Per-request RT latency facts."""

    ttft_s: float
    """Time to first token (censored at the run's end if none came)."""
    gaps: np.ndarray
    """Gaps between consecutive tokens, seconds."""
    tpot_s: float | None
    """Mean gap (0 for a finished one-token request; None without a first token)."""
    ttft_met: bool
    tpot_met: bool
    mtpot_met: bool
    """Largest gap within the TPOT target (and finished)."""
    tokens_in_deadline: int
    late_s: np.ndarray
    """Emission times of the tokens that missed their deadline."""
    finished: bool


def rt_stats(rec: RequestRecord, end_s: float) -> RtStats:
    """The latency facts of one RT request."""
    times = token_times(rec)
    finished = rec.finish_s is not None
    ttft = (rec.first_token_s if rec.first_token_s is not None else end_s) - rec.arrival_s
    gaps = np.diff(times)
    tpot = float(gaps.mean()) if gaps.size else (0.0 if times.size else None)
    ttft_target = math.inf if rec.ttft_target_s is None else rec.ttft_target_s
    tpot_target = math.inf if rec.tpot_target_s is None else rec.tpot_target_s
    ttft_met = rec.first_token_s is not None and ttft <= ttft_target + _EPS
    tpot_met = finished and tpot is not None and tpot <= tpot_target + _EPS
    mtpot_met = finished and (not gaps.size or float(gaps.max()) <= tpot_target + _EPS)
    late = times[:0]
    if times.size:
        deadlines = np.empty(times.size)
        deadlines[0] = rec.arrival_s + ttft_target
        deadlines[1:] = times[:-1] + tpot_target
        late = times[times > deadlines + _EPS]
    return RtStats(
        ttft_s=ttft,
        gaps=gaps,
        tpot_s=tpot,
        ttft_met=ttft_met,
        tpot_met=tpot_met,
        mtpot_met=mtpot_met,
        tokens_in_deadline=int(times.size - late.size),
        late_s=late,
        finished=finished,
    )


def iteration_attainment(
    rt: Sequence[RequestRecord], stats: Sequence[RtStats], log: IterationLog
) -> float | None:
    """AccelGen's iteration-level (batch-level) SLO attainment: of the iterations that emitted
    RT tokens, the share in which every RT token met its deadline. Tokens are placed in the
    iteration whose end emitted them; None without an iteration log (live runs, where token
    times are the client's)."""
    if not len(log) or not rt:
        return None
    ends = np.asarray(log.start_s, dtype=float) + np.asarray(log.duration_s, dtype=float)
    emitted = np.concatenate([token_times(r) for r in rt])
    if not emitted.size:
        return None
    late = np.concatenate([s.late_s for s in stats])
    with_rt = np.unique(np.searchsorted(ends, emitted - _EPS))
    missed = np.unique(np.searchsorted(ends, late - _EPS))
    return 1.0 - missed.size / with_rt.size


def _share(flags: Sequence[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def rt_metrics(
    records: Sequence[RequestRecord], end_s: float, window_s: float, log: IterationLog | None = None
) -> Metrics:
    """RT tier: TTFT/TPOT/TBT statistics, SLO attainment in every form, normalised latency."""
    rt = [r for r in records if r.tier == "rt"]
    stats = [rt_stats(r, end_s) for r in rt]
    ttft = [s.ttft_s for s in stats]
    tpots = [
        s.tpot_s
        for s, r in zip(stats, rt, strict=True)
        if s.tpot_s is not None and r.generated >= 2
    ]
    gaps = np.concatenate([s.gaps for s in stats]) if stats else np.zeros(0)
    mtpot = [float(s.gaps.max()) for s in stats if s.gaps.size]
    norm = [
        (r.finish_s - r.arrival_s) / r.generated
        for r in rt
        if r.finish_s is not None and r.generated > 0
    ]
    target_tokens = sum(r.output_len_target for r in rt)
    in_deadline = sum(s.tokens_in_deadline for s in stats)
    return {
        "rt_requests": len(rt),
        "rt_finished": sum(s.finished for s in stats),
        "rt_ttft_attainment": _share([s.ttft_met for s in stats]),
        "rt_tpot_attainment": _share([s.tpot_met for s in stats]),
        "rt_joint_attainment": _share([s.ttft_met and s.tpot_met for s in stats]),
        "rt_strict_attainment": _share([s.ttft_met and s.mtpot_met for s in stats]),
        "rt_token_attainment": in_deadline / target_tokens if target_tokens else None,
        "rt_iteration_attainment": (
            iteration_attainment(rt, stats, log) if log is not None else None
        ),
        "rt_ttft_mean_s": mean(ttft),
        "rt_ttft_p50_s": percentile(ttft, 50),
        "rt_ttft_p90_s": percentile(ttft, 90),
        "rt_ttft_p99_s": percentile(ttft, 99),
        "rt_tpot_mean_s": mean(tpots),
        "rt_tbt_mean_s": mean(gaps),
        "rt_tbt_p99_s": percentile(gaps, 99),
        "rt_mtpot_p99_s": percentile(mtpot, 99),
        "rt_normalized_latency_s": mean(norm),
        "rt_goodput_req_s": sum(s.ttft_met and s.tpot_met for s in stats) / window_s,
        "rt_token_goodput_tok_s": in_deadline / window_s,
        **admission_metrics(rt, stats, sum(r.admission == "downgraded" for r in records)),
    }


def admission_metrics(
    rt: Sequence[RequestRecord], stats: Sequence[RtStats], num_downgraded: int
) -> Metrics:
    """RT admission outcomes (the SLO admission: backend/policy/feasibility.py, at the gateway
    or the simulator's front door). The RT requests offered are the RT records (shed ones
    included: they never ran) plus those downgraded to BE (recorded as BE: they ran as BE).

    * `rt_admitted_attainment`: joint TTFT & TPOT attainment over the RT requests admitted as
      RT (accepted-though-predicted-late ones included);
    * `rt_shed_rate`: share of the RT requests offered that were refused;
    * `rt_downgraded_rate`: share of the RT requests offered that ran as BE;
    * `rt_accepted_late_rate`: share admitted as RT although predicted late (the contract said
      "accept");
    * `rt_admitted_ttft_p99_s`, `rt_admitted_ttft_max_s`: the TTFT tail of the RT requests
      admitted as RT — how late a request the admission let in can come (the plain TTFT
      statistics count a shed request's TTFT as censored at the run's end).

    RT goodput (requests meeting both targets per second, shed and downgraded ones counting as
    missed) is `rt_goodput_req_s`."""
    offered = len(rt) + num_downgraded
    admitted = [s for s, r in zip(stats, rt, strict=True) if r.admission != "shed"]
    num_shed = len(rt) - len(admitted)
    num_accepted = sum(r.admission == "accepted" for r in rt)
    return {
        "rt_admitted_attainment": _share([s.ttft_met and s.tpot_met for s in admitted]),
        "rt_shed_rate": num_shed / offered if offered else None,
        "rt_downgraded_rate": num_downgraded / offered if offered else None,
        "rt_accepted_late_rate": num_accepted / offered if offered else None,
        **admitted_ttft_tail(admitted),
    }


def admitted_ttft_tail(admitted: Sequence[RtStats]) -> Metrics:
    """P99 and max TTFT of admitted RT requests (None without any)."""
    ttft = [s.ttft_s for s in admitted]
    return {
        "rt_admitted_ttft_p99_s": percentile(ttft, 99),
        "rt_admitted_ttft_max_s": max(ttft) if ttft else None,
    }


def be_metrics(records: Sequence[RequestRecord], end_s: float, window_s: float) -> Metrics:
    """BE tier: throughput within the window, waiting (starvation), JCT deadlines."""
    be = [r for r in records if r.tier == "be"]
    done = [r for r in be if r.finish_s is not None and r.finish_s <= window_s + _EPS]
    tokens = sum(int(np.count_nonzero(token_times(r) <= window_s + _EPS)) for r in be)
    waits = [(r.admitted_s if r.admitted_s is not None else end_s) - r.arrival_s for r in be]
    with_deadline = [r for r in be if r.deadline_s is not None]
    jct = [r.finish_s - r.arrival_s for r in be if r.finish_s is not None]
    finishes = [r.finish_s for r in be if r.finish_s is not None]
    return {
        "be_requests": len(be),
        "be_finished": sum(r.finish_s is not None for r in be),
        "be_throughput_tok_s": tokens / window_s,
        "be_throughput_req_s": len(done) / window_s,
        "be_total_tok_s": sum(r.prompt_len + r.generated for r in done) / window_s,
        "be_max_wait_s": max(waits) if waits else None,
        "be_wait_p99_s": percentile(waits, 99),
        "be_jct_mean_s": mean(jct),
        "be_jct_attainment": _share(
            [
                r.finish_s is not None
                and r.deadline_s is not None
                and r.finish_s <= r.deadline_s + _EPS
                for r in with_deadline
            ]
        ),
        "be_makespan_s": (
            max(finishes) - min(r.arrival_s for r in be)
            if be and len(finishes) == len(be)
            else None
        ),
    }


def goodput_metrics(records: Sequence[RequestRecord], rt: Metrics, window_s: float) -> Metrics:
    """Whole system: SLO-good RT requests plus completed BE requests (within their deadline,
    if any), per second of the window; strict variant with MTPOT for RT."""
    be_good = sum(
        1
        for r in records
        if r.tier == "be"
        and r.finish_s is not None
        and r.finish_s <= window_s + _EPS
        and (r.deadline_s is None or r.finish_s <= r.deadline_s + _EPS)
    )
    rt_good = float(rt["rt_goodput_req_s"] or 0.0)
    strict = (rt["rt_strict_attainment"] or 0.0) * int(rt["rt_requests"] or 0) / window_s
    return {
        "goodput_req_s": rt_good + be_good / window_s,
        "goodput_strict_req_s": strict + be_good / window_s,
    }


def _outstanding(records: Sequence[RequestRecord], end_s: float) -> list[tuple[float, float]]:
    """The union of the closed intervals [arrival, finish] of these requests (an unfinished one
    until end_s), as sorted disjoint intervals."""
    return _union(
        [
            (r.arrival_s, r.finish_s if r.finish_s is not None else max(end_s, r.arrival_s))
            for r in records
        ]
    )


def _queued(records: Sequence[RequestRecord], end_s: float) -> list[tuple[float, float]]:
    """The union of the closed intervals [arrival, first admission] of these requests — while
    they waited in the engine's queue (one never admitted: until it finished, or end_s) — as
    sorted disjoint intervals."""
    spans = []
    for r in records:
        stop = next(
            (t for t in (r.admitted_s, r.first_token_s, r.finish_s) if t is not None), end_s
        )
        spans.append((r.arrival_s, max(stop, r.arrival_s)))
    return _union(spans)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Closed intervals merged into sorted disjoint ones."""
    merged: list[tuple[float, float]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def _intersect(
    a: list[tuple[float, float]], b: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """Intersection of two sorted disjoint lists of closed intervals."""
    out: list[tuple[float, float]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, stop = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start <= stop:
            out.append((start, stop))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def served_tokens_within(rec: RequestRecord, window: list[tuple[float, float]]) -> int:
    """Tokens of `rec` served inside `window` (sorted disjoint closed intervals): its prompt
    tokens count at its first-token time (when its prefill has completed), each output token
    at its emission time."""
    if not window or rec.first_token_s is None:
        return 0
    starts = np.array([w[0] for w in window])
    stops = np.array([w[1] for w in window])

    def inside(times: np.ndarray) -> np.ndarray:
        k = np.searchsorted(starts, times, side="right") - 1
        return (k >= 0) & (times <= stops[np.maximum(k, 0)])

    prompt = rec.prompt_len if bool(inside(np.array([rec.first_token_s]))[0]) else 0
    return prompt + int(np.count_nonzero(inside(token_times(rec))))


def tenant_metrics(
    records: Sequence[RequestRecord], tenants: Sequence[Any], end_s: float
) -> dict[str, dict[str, Any]]:
    """Per-tenant metrics, keyed by tenant name, for workloads whose requests carry tenant names
    (`tenants`: bench.workloads.base.TenantSpec, with name, tier and weight; a request belongs
    to tenant X when its tier is X's and its tenant_id — or, where it has none, its
    length_key — is X).

    * `tier`: "rt" or "be"; `requests`: the tenant's requests; `weight`: its fair-share weight
      from the workload.
    * `rt_admitted_attainment` (RT tenants): joint TTFT & TPOT attainment over its admitted
      requests; `rt_shed`: how many of its requests the SLO admission refused;
      `rt_admitted_ttft_p99_s`, `rt_admitted_ttft_max_s`: its admitted requests' TTFT tail.
    * `tokens_in_contended`: its tokens served inside C (below).
    * `contended_s`: length of its tier's contended window C: the times at which every tenant
      of the tier had work outstanding (at least one request arrived and not finished — closed
      interval [arrival, finish], an unfinished request until the run's end).
    * `token_share`: the tenant's tokens served inside C over all tokens served inside C to the
      tier's tenants; a request's prompt tokens count at its first-token time, its output tokens
      at their emission times. Under weighted fairness it would be weight / the tier's weights.
      None when C is empty or no token was served in it.
    * `queued_s`, `tokens_in_queued`, `token_share_queued`: the same over the tier's
      backlogged window Q ⊆ C, the times at which every tenant of the tier had a request
      waiting to be admitted ([arrival, first admission]) — where a fair scheduler has a
      choice to make, so where the shares should follow the weights most closely.
    """
    out: dict[str, dict[str, Any]] = {}
    offered = {
        t.name: [r for r in records if r.tier == t.tier and (r.tenant_id or r.length_key) == t.name]
        for t in tenants
    }
    # A shed request never ran: it holds nothing outstanding and is served no token.
    by_tenant = {name: [r for r in recs if r.admission != "shed"] for name, recs in offered.items()}
    for tier in dict.fromkeys(t.tier for t in tenants):
        members = [t for t in tenants if t.tier == tier]
        window = _common_window([_outstanding(by_tenant[t.name], end_s) for t in members])
        queued = _common_window([_queued(by_tenant[t.name], end_s) for t in members])
        served = {
            t.name: sum(served_tokens_within(r, window) for r in by_tenant[t.name]) for t in members
        }
        served_queued = {
            t.name: sum(served_tokens_within(r, queued) for r in by_tenant[t.name]) for t in members
        }
        total = sum(served.values())
        total_queued = sum(served_queued.values())
        contended = sum(stop - start for start, stop in window)
        for t in members:
            recs = by_tenant[t.name]
            row: dict[str, Any] = {"tier": tier, "weight": float(t.weight)}
            row["requests"] = len(offered[t.name])
            if tier == "rt":
                stats = [rt_stats(r, end_s) for r in recs]
                row["rt_admitted_attainment"] = _share([s.ttft_met and s.tpot_met for s in stats])
                row["rt_shed"] = len(offered[t.name]) - len(recs)
                row.update(admitted_ttft_tail(stats))
            row["contended_s"] = contended
            row["tokens_in_contended"] = served[t.name]
            row["token_share"] = served[t.name] / total if total else None
            row["queued_s"] = sum(stop - start for start, stop in queued)
            row["tokens_in_queued"] = served_queued[t.name]
            row["token_share_queued"] = (
                served_queued[t.name] / total_queued if total_queued else None
            )
            out[t.name] = row
    return out


def _common_window(spans: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The times covered by every one of the interval lists."""
    if not spans:
        return []
    window = spans[0]
    for other in spans[1:]:
        window = _intersect(window, other)
    return window


def _col(log: IterationLog, name: str) -> np.ndarray:
    return np.asarray(getattr(log, name), dtype=float)


def iteration_metrics(log: IterationLog) -> Metrics:
    """KV use, planning overhead, iteration times, latency-prediction error.

    Latency-model error: over the iterations with a prediction (`plan.predicted_s` finite, a
    measured duration > 0), the ratio r = predicted / measured iteration time describes how far
    the engine's truth is from the model the policy plans with (r = 1/K on an engine K× slower
    than the model). `latency_model_error_p50` / `_p99` are the 50th / 99th percentiles of the
    absolute relative error |predicted − measured| / measured = |1 − r| (0.5 at K = 2, 2 at
    K = 1/3); `latency_mape` is its mean. None without predictions."""
    dur = _col(log, "duration_s")
    kv = _col(log, "kv_used_tokens") / max(1, log.kv_capacity_tokens)
    plan = _col(log, "plan_ms")
    total = float(dur.sum())
    return {
        "iterations": len(log),
        "decode_steps": int(np.count_nonzero(_col(log, "num_decode") > 0)),
        "iteration_s_mean": mean(dur),
        "iteration_s_p99": percentile(dur, 99),
        "kv_utilization_mean": float((kv * dur).sum() / total) if total > 0 else None,
        "kv_utilization_peak": float(kv.max()) if kv.size else None,
        "plan_ms_p50": percentile(plan, 50),
        "plan_ms_p99": percentile(plan, 99),
        "plan_ms_mean": mean(plan),
        "plan_overhead_frac": float(plan.sum() / 1000.0 / total) if total > 0 else None,
        **prediction_error_metrics(_col(log, "predicted_s"), dur),
    }


def prediction_error_metrics(predicted_s: np.ndarray, measured_s: np.ndarray) -> Metrics:
    """How far an engine's iterations were from the latency model's predictions for them
    (`iteration_metrics`' definitions): over the iterations with a prediction (finite) and a
    measured duration > 0, `over_predicted_frac` (measured longer than predicted), and the
    relative error |predicted − measured| / measured as `latency_mape` (its mean) and
    `latency_model_error_p50` / `_p99`. None without predictions."""
    has_pred = np.isfinite(predicted_s) & (measured_s > 0)
    pred, dur = predicted_s[has_pred], measured_s[has_pred]
    model_error = np.abs(pred - dur) / dur
    return {
        "over_predicted_frac": float(np.mean(dur > pred * (1 + 1e-9))) if dur.size else None,
        "latency_mape": mean(model_error),
        "latency_model_error_p50": percentile(model_error, 50),
        "latency_model_error_p99": percentile(model_error, 99),
    }


def time_share_metrics(log: IterationLog, window_s: float) -> Metrics:
    """Where the engine's time in the window went: busy at all, busy with RT work (what the
    iterations would have taken with only their RT work, fixed costs included), and the rest —
    BE's marginal cost. Iterations are clipped at the window's end."""
    start = _col(log, "start_s")
    dur = _col(log, "duration_s")
    rt = _col(log, "rt_part_s")
    inside = np.clip(np.minimum(start + dur, window_s) - start, 0.0, None)
    busy = float(inside.sum()) / window_s
    if not rt.size or np.isnan(rt).any():
        return {"engine_busy_frac": busy, "rt_busy_frac": None, "be_busy_frac": None}
    scale = np.divide(inside, dur, out=np.zeros_like(dur), where=dur > 0)
    rt_busy = float((rt * scale).sum()) / window_s
    return {"engine_busy_frac": busy, "rt_busy_frac": rt_busy, "be_busy_frac": busy - rt_busy}


def eviction_metrics(records: Sequence[RequestRecord]) -> Metrics:
    """Share of requests evicted at least once (all, RT, BE) and evictions in total."""

    def rate(tier: str | None) -> float | None:
        chosen = [r for r in records if tier is None or r.tier == tier]
        return _share([r.evictions > 0 for r in chosen])

    return {
        "eviction_rate": rate(None),
        "rt_eviction_rate": rate("rt"),
        "be_eviction_rate": rate("be"),
        "evictions_total": sum(r.evictions for r in records),
    }


def compute_metrics(result: SimResult, window_s: float | None) -> Metrics:
    """Every metric of one policy's run. `window_s`: the arrival window (None: the run's end)."""
    window = window_s if window_s is not None and window_s > 0 else max(result.end_s, _EPS)
    records = result.requests
    rt = rt_metrics(records, result.end_s, window, result.iterations)
    out: Metrics = {**rt, **be_metrics(records, result.end_s, window)}
    out.update(goodput_metrics(records, rt, window))
    out.update(eviction_metrics(records))
    out.update(iteration_metrics(result.iterations))
    out.update(time_share_metrics(result.iterations, window))
    out["prefix_reuse_ratio"] = result.prefix_reuse_ratio
    out["window_s"] = window
    out["sim_end_s"] = result.end_s
    return out


def pool_metrics(placement_us: Sequence[float], requests_per_replica: Sequence[int]) -> Metrics:
    """A pool's own metrics: `replicas`; `placement_us_p50` / `_p99`, the router's decision time
    per request (wall clock, µs); `replica_requests_max_over_mean`, how unevenly the requests
    were spread (1 = evenly; shed ones are not placed)."""
    placed = np.asarray(requests_per_replica, dtype=float)
    mean_placed = float(placed.mean()) if placed.size else 0.0
    return {
        "replicas": len(requests_per_replica),
        "placement_us_p50": percentile(placement_us, 50),
        "placement_us_p99": percentile(placement_us, 99),
        "replica_requests_max_over_mean": (
            float(placed.max()) / mean_placed if mean_placed > 0 else None
        ),
    }


def interference(metrics: Metrics, baseline: Metrics) -> Metrics:
    """HyGen's interference ratios: this run's RT latency over the rt-only run's (1.0 = no
    interference); None where either is missing or the baseline is 0."""
    out: Metrics = {}
    for key, source in INTERFERENCE_KEYS.items():
        value, base = metrics.get(source), baseline.get(source)
        out[key] = (
            float(value) / float(base)
            if value is not None and base is not None and base > 0
            else None
        )
    return out


def rounded(metrics: dict[str, Any], digits: int = 6) -> dict[str, Any]:
    """Floats rounded to `digits` decimals, NaN/inf as None (valid JSON)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, float):
            out[key] = round(value, digits) if math.isfinite(value) else None
        else:
            out[key] = value
    return out
