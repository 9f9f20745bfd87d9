"""W5 — burst adaptivity (HyGen; synthesis §5.3).

RT: the Azure 2023 conversation trace (read at run time from --data-dir), replayed from a
seed-chosen row onwards (wrapping at the end): its token counts as they are, and its arrival
gaps as the fine structure of a 2-state modulated rate. The trace's gaps, divided by their mean,
are unit-rate "operational time"; the rate alternates low/high (high = 3 × low) with dwell times
U[45,75] s (≈ 60 s), and arrival k lands where the integral of the rate reaches the k-th
operational time. The peak (high) rate is load × λ* (or --rt-rate), so the mean is 2/3 of it:
0.5 λ* at the default load 0.75. RT SLOs: TTFT = 0.4 s + 2 × the standalone prefill of the
prompt's 512-bucket, TPOT 0.2 s. λ* itself is measured with Poisson arrivals of the same lengths.
BE: an always-backlogged stream of long documents (prompt lognormal, median 6K, σ 0.5, 512…16K;
output U(128,512)), `backlog` requests outstanding at all times (enough to fill 1.5 × the KV pool).
Full size: 10 simulated minutes; default scale 0.5 (300 s, about five dwell periods).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from bench.workloads.azure import AzureTrace, load_trace, trace_path
from bench.workloads.base import (
    BuildContext,
    RequestSpec,
    SpecSource,
    Workload,
    WorkloadParams,
    check_variant,
    max_new_for,
    scaled_duration,
    ttft_base_s,
)
from bench.workloads.sampling import poisson_times, rng_for
from bench.workloads.sources import ClosedLoopSource, TimedSource, merge

FULL_DURATION_S = 600.0
DEFAULT_SCALE = 0.5
SWING = 3.0
DWELL_S = (45.0, 75.0)
TPOT_S = 0.2
RT_OUTPUT_CAP = 2048
BE_MEDIAN, BE_SIGMA, BE_PROMPT_RANGE = 6000.0, 0.5, (512, 16384)
BE_OUTPUT = (128, 512)
MAX_BACKLOG = 256


def rate_schedule(
    params: WorkloadParams, peak: float, duration_s: float
) -> list[tuple[float, float, float]]:
    """Segments (start_s, end_s, rate) covering [0, duration_s]: low first, then alternating."""
    rng = rng_for(params.seed, "w5", "dwell")
    low = peak / SWING
    segments: list[tuple[float, float, float]] = []
    t, high = 0.0, False
    while t < duration_s:
        end = t + float(rng.uniform(*DWELL_S))
        segments.append((t, end, peak if high else low))
        t, high = end, not high
    return segments


def warp(op_times: np.ndarray, segments: list[tuple[float, float, float]]) -> np.ndarray:
    """Real times at which the integrated rate reaches each operational time (NaN past the
    last segment)."""
    starts = np.array([s for s, _, _ in segments])
    rates = np.array([r for _, _, r in segments])
    lengths = np.array([e - s for s, e, _ in segments])
    cum = np.concatenate([[0.0], np.cumsum(rates * lengths)])
    k = np.searchsorted(cum, op_times, side="right") - 1
    inside = k < len(segments)
    out = np.full(len(op_times), np.nan)
    kk = k[inside]
    out[inside] = starts[kk] + (op_times[inside] - cum[kk]) / rates[kk]
    return out


def _rows(trace: AzureTrace, params: WorkloadParams, n: int) -> np.ndarray:
    """Trace row indices of the first n replayed requests (seeded start, wrapping)."""
    start = int(rng_for(params.seed, "w5", "offset").integers(len(trace)))
    return (start + np.arange(n)) % len(trace)


def _op_times(trace: AzureTrace, rows: np.ndarray) -> np.ndarray:
    """Unit-rate operational arrival times of the replayed rows (first at 0)."""
    gaps = np.diff(trace.times_s, append=trace.times_s[-1] + trace.mean_gap_s)
    return np.concatenate([[0.0], np.cumsum(gaps[rows][:-1])]) / trace.mean_gap_s


def _rt_specs(
    params: WorkloadParams, ctx: BuildContext, trace: AzureTrace, times: np.ndarray
) -> list[RequestSpec]:
    rows = _rows(trace, params, len(times))
    base = functools.cache(lambda bucket: ttft_base_s(ctx, bucket * 512))
    specs = []
    for i, (t, row) in enumerate(zip(times, rows, strict=True)):
        prompt, output = int(trace.prompt_lens[row]), int(trace.output_lens[row])
        specs.append(
            RequestSpec(
                rid=f"rt-{i:06d}",
                tier="rt",
                arrival_s=float(t),
                prompt_len=prompt,
                output_len=output,
                max_new_tokens=max_new_for(params, output, RT_OUTPUT_CAP),
                ttft_target_s=base(math.ceil(prompt / 512)),
                tpot_target_s=TPOT_S,
                length_key="rt-azure-conv",
            )
        )
    return specs


def rt_modulated(
    params: WorkloadParams, ctx: BuildContext, trace: AzureTrace, peak: float, duration_s: float
) -> list[RequestSpec]:
    """The bursty RT stream with peak rate `peak` req/s over [0, duration_s)."""
    if peak <= 0:
        return []
    segments = rate_schedule(params, peak, duration_s)
    budget = sum((e - s) * r for s, e, r in segments)  # expected arrivals
    n = int(budget * 1.5 + 50)
    times = warp(_op_times(trace, _rows(trace, params, n)), segments)
    return _rt_specs(params, ctx, trace, times[times < duration_s])


def backlog_depth(ctx: BuildContext) -> int:
    """BE requests kept outstanding: enough to fill 1.5 × the KV pool (≥ 8, ≤ MAX_BACKLOG)."""
    mean_tokens = BE_MEDIAN * math.exp(BE_SIGMA**2 / 2) + sum(BE_OUTPUT) / 2
    return int(min(MAX_BACKLOG, max(8, math.ceil(1.5 * ctx.kv_capacity_tokens / mean_tokens))))


def be_request(
    params: WorkloadParams, client: int, seq: int, arrival_s: float, depth: int
) -> RequestSpec:
    """Backlog slot `client`'s `seq`-th long document."""
    rng = rng_for(params.seed, "w5", "be", client, seq)
    prompt = int(np.clip(round(rng.lognormal(math.log(BE_MEDIAN), BE_SIGMA)), *BE_PROMPT_RANGE))
    output = int(rng.integers(BE_OUTPUT[0], BE_OUTPUT[1] + 1))
    return RequestSpec(
        rid=f"be-{client:03d}-{seq:05d}",
        tier="be",
        arrival_s=arrival_s,
        prompt_len=prompt,
        output_len=output,
        max_new_tokens=max_new_for(params, output, BE_OUTPUT[1]),
        length_key="be-longdoc",
        order_key=float(seq * depth + client),
    )


def build(params: WorkloadParams, ctx: BuildContext) -> Workload:
    """W5 as a Workload (reads the Azure conversation trace; ValueError if it is missing)."""
    check_variant("W5", params.variant, ("default",))
    trace = load_trace(trace_path(params.data_dir, "conv"))
    duration = scaled_duration(params, FULL_DURATION_S, DEFAULT_SCALE)
    depth = backlog_depth(ctx)

    def make_source(peak: float | None, include_be: bool) -> SpecSource:
        sources: list[SpecSource] = [
            TimedSource(rt_modulated(params, ctx, trace, peak or 0.0, duration))
        ]
        if include_be:
            sources.append(
                ClosedLoopSource(
                    depth, lambda c, j, t: be_request(params, c, j, t, depth), stop_s=duration
                )
            )
        return merge(sources)

    def rt_poisson(rate: float, length_s: float) -> SpecSource:
        times = poisson_times(rng_for(params.seed, "w5", "poisson"), rate, length_s)
        return TimedSource(_rt_specs(params, ctx, trace, times))

    return Workload(
        name="W5",
        description="bursty Azure-conversation RT (3× swing, ≈60 s dwell) + "
        "always-backlogged long-document BE",
        make_source=make_source,
        longest_prompt=max(int(trace.prompt_lens.max()), BE_PROMPT_RANGE[1]),
        window_s=duration,
        rt_poisson=rt_poisson,
        params={
            "duration_s": duration,
            "swing": SWING,
            "dwell_s": list(DWELL_S),
            "be_backlog": depth,
            "trace": trace.path.name,
            "rt_tpot_s": TPOT_S,
        },
    )
