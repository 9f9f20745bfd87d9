"""W1 — hybrid core (BROS + HyGen; synthesis §5.3).

RT: ShareGPT-like chat, lognormal lengths fitted to prompt 223±256 and output 235±269 tokens,
Poisson arrivals at load × λ*. BE: batches of 256 requests, prompt U(512,1024), output
U(32,128); the next batch is submitted when the previous one has finished. RT SLOs: the BROS
class SLO (TTFT 0.4 s, TPOT 0.2 s; variant "class", the default) or heterogeneous AccelGen-style
targets around it (variant "hetero": TTFT × U[0.5,1.5], TPOT × U[0.75,1.25]).
Full size: 10 simulated minutes; default scale 0.25 (150 s).

Variant "cpu": the same shape scaled to what the tiny model on a 2-core CPU serves (the real
engine bench, `--engine sglang`, and its simulator twin): lengths ÷ 4 (RT prompt 56±64, output
59±67 tokens; BE prompt U(128,256), output U(8,32)), BE batches of 32, and class SLOs scaled to
the CPU's iteration times (TTFT 1.5 s, TPOT 0.25 s: about 4 prefill iterations of a 512-token
chunk and 3–5 decode iterations, as BROS's 0.4 s / 0.2 s are to an H100's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.workloads.base import (
    BuildContext,
    RequestSpec,
    SpecSource,
    Workload,
    WorkloadParams,
    check_variant,
    max_new_for,
    scaled_duration,
)
from bench.workloads.sampling import lognormal_ints, poisson_times, rng_for, uniform_ints
from bench.workloads.sources import BatchSource, TimedSource, merge

FULL_DURATION_S = 600.0
DEFAULT_SCALE = 0.25
RT_PROMPT_MEAN, RT_PROMPT_STD, RT_PROMPT_MAX = 223.0, 256.0, 4096
RT_OUTPUT_MEAN, RT_OUTPUT_STD, RT_OUTPUT_MAX = 235.0, 269.0, 2048
BE_BATCH_SIZE = 256
BE_PROMPT = (512, 1024)
BE_OUTPUT = (32, 128)
TTFT_S, TPOT_S = 0.4, 0.2
TTFT_SCALE, TPOT_SCALE = (0.5, 1.5), (0.75, 1.25)
VARIANTS = ("class", "hetero", "cpu")


@dataclass(frozen=True)
class Shape:
    """Lengths, batch size and SLOs of one W1 variant."""

    rt_prompt: tuple[float, float, int]
    """RT prompt lognormal mean, std, max (tokens)."""
    rt_output: tuple[float, float, int]
    """RT output lognormal mean, std, max (tokens)."""
    be_batch_size: int
    be_prompt: tuple[int, int]
    """BE prompt uniform range (tokens)."""
    be_output: tuple[int, int]
    """BE output uniform range (tokens)."""
    ttft_target_s: float
    tpot_target_s: float


FULL_SHAPE = Shape(
    rt_prompt=(RT_PROMPT_MEAN, RT_PROMPT_STD, RT_PROMPT_MAX),
    rt_output=(RT_OUTPUT_MEAN, RT_OUTPUT_STD, RT_OUTPUT_MAX),
    be_batch_size=BE_BATCH_SIZE,
    be_prompt=BE_PROMPT,
    be_output=BE_OUTPUT,
    ttft_target_s=TTFT_S,
    tpot_target_s=TPOT_S,
)
CPU_SHAPE = Shape(
    rt_prompt=(56.0, 64.0, 1024),
    rt_output=(59.0, 67.0, 512),
    be_batch_size=32,
    be_prompt=(128, 256),
    be_output=(8, 32),
    ttft_target_s=1.5,
    tpot_target_s=0.25,
)


def rt_requests(
    params: WorkloadParams,
    rate: float,
    duration_s: float,
    *,
    hetero: bool,
    label: str = "w1",
    shape: Shape = FULL_SHAPE,
) -> list[RequestSpec]:
    """The RT chat stream at `rate` req/s over [0, duration_s). Lengths and SLO scales come
    from streams independent of the rate: request i is the same at every rate."""
    times = poisson_times(rng_for(params.seed, label, "rt-gaps"), rate, duration_s)
    n = len(times)
    # one generator per field, so that request i is the same whatever n is
    p_mean, p_std, p_max = shape.rt_prompt
    o_mean, o_std, o_max = shape.rt_output
    prompts = lognormal_ints(
        rng_for(params.seed, label, "rt-prompt"), p_mean, p_std, n, low=4, high=p_max
    )
    outputs = lognormal_ints(
        rng_for(params.seed, label, "rt-output"), o_mean, o_std, n, low=1, high=o_max
    )
    ttft = np.full(n, shape.ttft_target_s)
    tpot = np.full(n, shape.tpot_target_s)
    if hetero:
        ttft = shape.ttft_target_s * rng_for(params.seed, label, "rt-ttft").uniform(*TTFT_SCALE, n)
        tpot = shape.tpot_target_s * rng_for(params.seed, label, "rt-tpot").uniform(*TPOT_SCALE, n)
    return [
        RequestSpec(
            rid=f"rt-{i:06d}",
            tier="rt",
            arrival_s=float(times[i]),
            prompt_len=int(prompts[i]),
            output_len=int(outputs[i]),
            max_new_tokens=max_new_for(params, int(outputs[i]), o_max),
            ttft_target_s=float(ttft[i]),
            tpot_target_s=float(tpot[i]),
            length_key="rt-chat",
        )
        for i in range(n)
    ]


def be_batch(
    params: WorkloadParams, index: int, arrival_s: float, shape: Shape = FULL_SHAPE
) -> list[RequestSpec]:
    """BE batch `index` (the same lengths whenever it is submitted)."""
    rng = rng_for(params.seed, "w1", "be-batch", index)
    size = shape.be_batch_size
    prompts = uniform_ints(rng, *shape.be_prompt, size)
    outputs = uniform_ints(rng, *shape.be_output, size)
    return [
        RequestSpec(
            rid=f"be-{index:04d}-{j:03d}",
            tier="be",
            arrival_s=arrival_s,
            prompt_len=int(prompts[j]),
            output_len=int(outputs[j]),
            max_new_tokens=max_new_for(params, int(outputs[j]), shape.be_output[1]),
            length_key="be-batch",
            order_key=float(j),
        )
        for j in range(size)
    ]


def build(params: WorkloadParams, ctx: BuildContext) -> Workload:
    """W1 as a Workload."""
    variant = check_variant("W1", params.variant, VARIANTS)
    hetero = variant == "hetero"
    shape = CPU_SHAPE if variant == "cpu" else FULL_SHAPE
    duration = scaled_duration(params, FULL_DURATION_S, DEFAULT_SCALE)

    def make_source(rate: float | None, include_be: bool) -> SpecSource:
        sources: list[SpecSource] = [
            TimedSource(rt_requests(params, rate or 0.0, duration, hetero=hetero, shape=shape))
        ]
        if include_be:
            sources.append(BatchSource(lambda k, t: be_batch(params, k, t, shape), stop_s=duration))
        return merge(sources)

    def rt_poisson(rate: float, length_s: float) -> SpecSource:
        return TimedSource(rt_requests(params, rate, length_s, hetero=hetero, shape=shape))

    return Workload(
        name="W1",
        description="hybrid: Poisson ShareGPT-like RT chat + BE batches of 256",
        make_source=make_source,
        longest_prompt=max(shape.rt_prompt[2], shape.be_prompt[1]),
        window_s=duration,
        rt_poisson=rt_poisson,
        params={
            "duration_s": duration,
            "slo": variant,
            "be_batch_size": shape.be_batch_size,
            "rt_ttft_s": shape.ttft_target_s,
            "rt_tpot_s": shape.tpot_target_s,
        },
    )
