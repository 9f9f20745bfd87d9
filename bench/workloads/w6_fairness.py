"""W6 — multi-tenant fairness (issue 15): two RT tenants of equal weight, one of them bursty,
and two BE tenants of equal weight, each with its own backlog.

Tenants (weight 1.0 each; the tenant name is every request's `tenant_id` and `length_key`,
and its weight from TENANTS the request's `tenant_weight`):

* `rt-steady`: W1's RT chat requests (lognormal lengths, prompt 223±256, output 235±269 tokens;
  class SLO TTFT 0.4 s, TPOT 0.2 s), Poisson arrivals at s = R / 2 req/s all the time.
* `rt-burst`: the same kind of requests, on/off arrivals with period 20 s: off (no arrivals)
  for the first 16 s of each period, on for the last 4 s ([16, 20), [36, 40), …), with Poisson
  arrivals at 5 s req/s while on. Over whole periods both RT tenants send the same number of
  requests on average (s each: their fair share), but during a burst the burster sends 5× the
  steady tenant's rate (5/6 of the RT arrivals), and the total RT arrival rate is 6 s = 3 R.
  At --load 0.75 (R = 0.75 λ*) that is 2.25 λ* during a burst: RT queues build while the
  burster bursts, both RT tenants have requests waiting, and the backlog drains in the off time
  (at 0.375 λ* arrivals) before the next burst.
* `be-a`, `be-b`: each a stream of BE batches of 256 requests (W1's BE lengths: prompt
  U(512,1024), output U(32,128)); a tenant's next batch is submitted when its previous one has
  finished, until the end of the arrival window, so both BE tenants are backlogged all along.
  The two tenants' batches are drawn from independent streams of the same distribution.

R, the mean RT rate of both tenants together, is load × λ* (λ*: the capacity of the same chat
stream as one Poisson stream, found as for W1) or --rt-rate. Arrival times are deterministic by
seed: the burster's arrivals are a Poisson process of rate 5 s in "on time" (the concatenated
bursts), mapped onto the bursts, so the draws are the same at every rate, only scaled.
Full size: 10 simulated minutes; default scale 0.25 (150 s).

Variant "cpu" (the real engine bench, `--engine sglang`, and its simulator twin): W1's "cpu"
shape for both tiers — RT lengths ÷ 4 and class SLOs TTFT 1.5 s, TPOT 0.25 s; BE batches of 32
with prompt U(128,256), output U(8,32) — so the tiny model on a 2-core CPU serves the same
contention. The default, "full", is W1's full shape.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.workloads.base import (
    BuildContext,
    RequestSpec,
    SpecSource,
    TenantSpec,
    Workload,
    WorkloadParams,
    check_variant,
    max_new_for,
    scaled_duration,
)
from bench.workloads.sampling import lognormal_ints, poisson_times, rng_for, uniform_ints
from bench.workloads.sources import BatchSource, TimedSource, merge
from bench.workloads.w1_hybrid import CPU_SHAPE, FULL_SHAPE, Shape, rt_requests

FULL_DURATION_S = 600.0
DEFAULT_SCALE = 0.25
PERIOD_S = 20.0
"""Burst period of rt-burst, seconds."""
BURST_S = 4.0
"""Length of a burst (the last BURST_S seconds of each period), seconds."""
BURST_RATIO = 5.0
"""rt-burst's rate during a burst over rt-steady's rate."""
VARIANTS = ("full", "cpu")
SHAPES = {"full": FULL_SHAPE, "cpu": CPU_SHAPE}
"""Each variant's lengths, BE batch size and RT SLOs (W1's shapes)."""
RT_STEADY, RT_BURST, BE_A, BE_B = "rt-steady", "rt-burst", "be-a", "be-b"
TENANTS = (
    TenantSpec(RT_STEADY, "rt", 1.0),
    TenantSpec(RT_BURST, "rt", 1.0),
    TenantSpec(BE_A, "be", 1.0),
    TenantSpec(BE_B, "be", 1.0),
)
WEIGHTS = {t.name: t.weight for t in TENANTS}
"""Each tenant's fair-share weight, as its requests carry it (`tenant_weight`)."""


def burst_times(params: WorkloadParams, steady_rate: float, duration_s: float) -> list[float]:
    """rt-burst's arrival times on [0, duration_s): Poisson at BURST_RATIO × steady_rate during
    the bursts [k·PERIOD_S + PERIOD_S − BURST_S, (k+1)·PERIOD_S), none between them."""
    full, rest = divmod(duration_s, PERIOD_S)
    on_total = full * BURST_S + max(0.0, rest - (PERIOD_S - BURST_S))
    on = poisson_times(
        rng_for(params.seed, "w6", RT_BURST, "gaps"), BURST_RATIO * steady_rate, on_total
    )
    out = []
    for tau in on:
        k, within = divmod(float(tau), BURST_S)
        out.append(k * PERIOD_S + (PERIOD_S - BURST_S) + within)
    return [t for t in out if t < duration_s]


def in_burst(t: float) -> bool:
    """Whether time t lies in one of rt-burst's bursts."""
    return t % PERIOD_S >= PERIOD_S - BURST_S


def tenant_rt_requests(
    params: WorkloadParams, tenant: str, times: list[float], shape: Shape = FULL_SHAPE
) -> list[RequestSpec]:
    """One RT tenant's requests at the given arrival times (lengths from the tenant's own
    streams: request i is the same at every rate)."""
    n = len(times)
    p_mean, p_std, p_max = shape.rt_prompt
    o_mean, o_std, o_max = shape.rt_output
    prompts = lognormal_ints(
        rng_for(params.seed, "w6", tenant, "prompt"), p_mean, p_std, n, low=4, high=p_max
    )
    outputs = lognormal_ints(
        rng_for(params.seed, "w6", tenant, "output"), o_mean, o_std, n, low=1, high=o_max
    )
    return [
        RequestSpec(
            rid=f"{tenant}-{i:06d}",
            tier="rt",
            arrival_s=float(times[i]),
            prompt_len=int(prompts[i]),
            output_len=int(outputs[i]),
            max_new_tokens=max_new_for(params, int(outputs[i]), o_max),
            ttft_target_s=shape.ttft_target_s,
            tpot_target_s=shape.tpot_target_s,
            length_key=tenant,
            tenant_id=tenant,
            tenant_weight=WEIGHTS[tenant],
        )
        for i in range(n)
    ]


def rt_streams(
    params: WorkloadParams, rate: float, duration_s: float, shape: Shape = FULL_SHAPE
) -> list[RequestSpec]:
    """Both RT tenants' requests at mean total rate `rate` req/s, in arrival order."""
    steady = rate / 2.0
    steady_times = poisson_times(rng_for(params.seed, "w6", RT_STEADY, "gaps"), steady, duration_s)
    specs = tenant_rt_requests(params, RT_STEADY, [float(t) for t in steady_times], shape)
    specs += tenant_rt_requests(params, RT_BURST, burst_times(params, steady, duration_s), shape)
    return sorted(specs, key=lambda s: (s.arrival_s, s.rid))


def be_batch(
    params: WorkloadParams, tenant: str, index: int, arrival_s: float, shape: Shape = FULL_SHAPE
) -> list[RequestSpec]:
    """BE tenant `tenant`'s batch `index` (the same lengths whenever it is submitted)."""
    rng = rng_for(params.seed, "w6", tenant, "batch", index)
    prompts = uniform_ints(rng, *shape.be_prompt, shape.be_batch_size)
    outputs = uniform_ints(rng, *shape.be_output, shape.be_batch_size)
    return [
        RequestSpec(
            rid=f"{tenant}-{index:04d}-{j:03d}",
            tier="be",
            arrival_s=arrival_s,
            prompt_len=int(prompts[j]),
            output_len=int(outputs[j]),
            max_new_tokens=max_new_for(params, int(outputs[j]), shape.be_output[1]),
            length_key=tenant,
            tenant_id=tenant,
            tenant_weight=WEIGHTS[tenant],
            order_key=float(j),
        )
        for j in range(shape.be_batch_size)
    ]


def be_maker(
    params: WorkloadParams, tenant: str, shape: Shape = FULL_SHAPE
) -> Callable[[int, float], list[RequestSpec]]:
    """(batch index, arrival) → BE tenant `tenant`'s batch, for its BatchSource."""
    return lambda index, arrival_s: be_batch(params, tenant, index, arrival_s, shape)


def build(params: WorkloadParams, ctx: BuildContext) -> Workload:
    """W6 as a Workload."""
    variant = check_variant("W6", params.variant, VARIANTS)
    shape = SHAPES[variant]
    duration = scaled_duration(params, FULL_DURATION_S, DEFAULT_SCALE)

    def make_source(rate: float | None, include_be: bool) -> SpecSource:
        sources: list[SpecSource] = [TimedSource(rt_streams(params, rate or 0.0, duration, shape))]
        if include_be:
            sources += [
                BatchSource(be_maker(params, t, shape), stop_s=duration) for t in (BE_A, BE_B)
            ]
        return merge(sources)

    def rt_poisson(rate: float, length_s: float) -> SpecSource:
        # λ*: the same chat requests as one Poisson stream (W1's RT part, W6's own seed label)
        return TimedSource(
            rt_requests(params, rate, length_s, hetero=False, label="w6", shape=shape)
        )

    return Workload(
        name="W6",
        description="fairness: RT rt-steady + bursty rt-burst (5× in bursts), BE be-a + be-b",
        make_source=make_source,
        longest_prompt=max(shape.rt_prompt[2], shape.be_prompt[1]),
        window_s=duration,
        rt_poisson=rt_poisson,
        params={
            "duration_s": duration,
            "burst_period_s": PERIOD_S,
            "burst_s": BURST_S,
            "burst_ratio": BURST_RATIO,
            "be_batch_size": shape.be_batch_size,
            "rt_ttft_s": shape.ttft_target_s,
            "rt_tpot_s": shape.tpot_target_s,
        },
        tenants=TENANTS,
    )
