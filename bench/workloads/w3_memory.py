"""W3 — memory stress (Past-Future / LightLLM; synthesis §5.3).

Closed-loop clients, each with one request outstanding (the next is sent when the previous
finishes). Length distributions (uniform): D1 prompt 32–4K / output 2K–4K (decode heavy, the
default), D2 3K–5K / 3K–5K, D3 2K–4K / 32–4K (prefill heavy). max_new_tokens is 4096 for every
request (the cap the conservative baseline reserves); the true output length ends the request.
Clients: round(load × 512), so --load 1.0 is the heaviest setting (Past-Future sweeps 16…512).
The requests are RT with the Past-Future SLA as targets: TTFT 10 s, TPOT 1.5 s.
Full size: 10 simulated minutes of submissions (the default), then the drain.
Throughputs are over the whole run (submissions and drain).
"""

from __future__ import annotations

from bench.workloads.base import (
    BuildContext,
    RequestSpec,
    SpecSource,
    Workload,
    WorkloadParams,
    check_variant,
    scaled_duration,
)
from bench.workloads.sampling import rng_for
from bench.workloads.sources import ClosedLoopSource

FULL_DURATION_S = 600.0
DEFAULT_SCALE = 1.0
MAX_CLIENTS = 512
MAX_NEW_TOKENS = 4096
TTFT_SLA_S, MTPOT_SLA_S = 10.0, 1.5
DISTRIBUTIONS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "d1": ((32, 4096), (2048, 4096)),
    "d2": ((3072, 5120), (3072, 5120)),
    "d3": ((2048, 4096), (32, 4096)),
}


def clients_for(load: float) -> int:
    """Client count at this load (1.0 = MAX_CLIENTS)."""
    return max(1, round(load * MAX_CLIENTS))


def client_request(
    params: WorkloadParams, dist: str, client: int, seq: int, arrival_s: float
) -> RequestSpec:
    """Client `client`'s `seq`-th request (its lengths depend only on seed, client and seq)."""
    (p_lo, p_hi), (o_lo, o_hi) = DISTRIBUTIONS[dist]
    rng = rng_for(params.seed, "w3", dist, client, seq)
    prompt = int(rng.integers(p_lo, p_hi + 1))
    output = min(int(rng.integers(o_lo, o_hi + 1)), MAX_NEW_TOKENS)
    return RequestSpec(
        rid=f"c{client:03d}-{seq:04d}",
        tier="rt",
        arrival_s=arrival_s,
        prompt_len=prompt,
        output_len=output,
        max_new_tokens=MAX_NEW_TOKENS,
        ttft_target_s=TTFT_SLA_S,
        tpot_target_s=MTPOT_SLA_S,
        length_key=f"w3-{dist}",
    )


def build(params: WorkloadParams, ctx: BuildContext) -> Workload:
    """W3 as a Workload (no λ*: the load is the client count)."""
    dist = check_variant("W3", params.variant, tuple(DISTRIBUTIONS))
    duration = scaled_duration(params, FULL_DURATION_S, DEFAULT_SCALE)
    clients = clients_for(params.load)

    def make_source(rate: float | None, include_be: bool) -> SpecSource:
        return ClosedLoopSource(
            clients, lambda c, j, t: client_request(params, dist, c, j, t), stop_s=duration
        )

    return Workload(
        name="W3",
        description=f"memory stress: {clients} closed-loop clients, Past-Future {dist.upper()}",
        make_source=make_source,
        longest_prompt=DISTRIBUTIONS[dist][0][1],
        window_s=None,
        rt_poisson=None,
        has_be=False,
        params={
            "duration_s": duration,
            "distribution": dist,
            "clients": clients,
            "max_new_tokens": MAX_NEW_TOKENS,
            "ttft_sla_s": TTFT_SLA_S,
            "mtpot_sla_s": MTPOT_SLA_S,
        },
    )
