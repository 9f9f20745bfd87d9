"""What every workload shares: the request spec, the parameters, the build context, and the
`Workload` object the runner drives.

A workload is a *recipe*: `Workload.source(rt_rate_req_s, include_be)` returns a fresh arrival
source (bench/workloads/sources.py) each time it is called, so every policy of one run sees the
identical request stream (same seed, same lengths, same open-loop arrival times; closed-loop and
batch streams submit the same requests in the same per-client order).

Output lengths: `RequestSpec.output_len` is the true length, known to the workload and forced on
the engine (max tokens + ignore EOS); only the oracle policy is shown it. What policies see is
`max_new_tokens`: by default the request class's cap (what a real client sends; the engine still
stops at `output_len`), or with `max_new="exact"` equal to `output_len` (what a benchmark client
sends with ignore_eos — which leaks the true length to every policy, so it is not the default).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

from backend.policy.latency import BatchShape, LatencyModel
from backend.sim.config import SloUnattainable
from bench.defaults import DEFAULT_DATA_DIR
from common.wire import Tier

MaxNew = Literal["exact", "cap"]


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request as the workload defines it (engine independent)."""

    rid: str
    """Unique request id within a run."""
    tier: Tier
    """"rt" (TTFT/TPOT targets) or "be" (best effort, optional JCT deadline)."""
    arrival_s: float
    """Submission time, seconds from the start of the run."""
    prompt_len: int
    """Prompt length, tokens."""
    output_len: int
    """True output length, tokens (forced; hidden from policies except the oracle)."""
    max_new_tokens: int
    """Output cap the engine and policies see, tokens (≥ output_len)."""
    ttft_target_s: float | None = None
    """RT: time-to-first-token target, seconds."""
    tpot_target_s: float | None = None
    """RT: time-per-output-token target after the first, seconds."""
    deadline_s: float | None = None
    """BE: job completion deadline relative to arrival, seconds."""
    length_key: str = ""
    """Request class (output-length history key for predicting policies)."""
    tenant_id: str = ""
    """The tenant it is served for (fair share within its tier); "" — every workload but
    W6 — is one anonymous tenant per tier (length keys there are request classes or jobs, not
    tenants)."""
    tenant_weight: float = 1.0
    """The tenant's fair-share weight within its tier (its TenantSpec's weight)."""
    on_unattainable: SloUnattainable | None = None
    """RT: what its tenant's contract makes of a forecast miss (`SimRequest.on_unattainable`);
    None: the run's one."""
    order_key: float = 0.0
    """BE submission order within its job (lower first)."""
    prefix_hashes: tuple[int, ...] = ()
    """One hash per full 512-token prompt block; equal hashes mean a shared prefix."""


class SpecSource(Protocol):
    """An arrival source of RequestSpecs (the simulator's ArrivalSource protocol, engine
    independent; bench.workloads.sources.SimSource adapts it to SimRequests)."""

    def next_arrival_s(self) -> float | None:
        """Time of the next scheduled arrival; None if none is scheduled now."""
        ...

    def pop_due(self, now_s: float) -> list[RequestSpec]:
        """Requests whose arrival time is ≤ now_s, in arrival order (removed)."""
        ...

    def on_finish(self, rid: str, now_s: float) -> None:
        """Feedback: request `rid` finished at now_s (closed-loop sources submit the next)."""
        ...

    @property
    def exhausted(self) -> bool:
        """True when no request will ever arrive again."""
        ...


class WorkloadParams(msgspec.Struct, frozen=True, kw_only=True):
    """What the command line sets for a workload."""

    seed: int = 0
    """Random seed; the same seed gives the same requests."""
    load: float = 0.75
    """RT arrival rate as a fraction of λ* (W3: fraction of the heaviest client count; W5: peak
    of the modulated rate, so the mean is 2/3 of it)."""
    rt_rate_req_s: float | None = None
    """A fixed RT arrival rate, req/s, instead of load × λ* (W5: the peak rate)."""
    scale: float | None = None
    """Fraction of the full-size workload (duration, or request count for W4); None = the
    workload's default (see bench/README.md)."""
    duration_s: float | None = None
    """Arrival window, seconds; overrides scale for the time-based workloads."""
    data_dir: Path = DEFAULT_DATA_DIR
    """Folder with the Azure trace CSVs (W5; default bench/data)."""
    variant: str | None = None
    """Workload variant: W1 slo class|hetero, W3 d1|d2|d3, W4 p35|p5; None = the default."""
    max_new: MaxNew = "cap"
    """max_new_tokens policies see: "exact" = output_len (ignore_eos); "cap" = class cap."""


@dataclass(frozen=True)
class BuildContext:
    """Engine facts a workload needs to set SLOs, deadlines and backlog depth."""

    latency: LatencyModel
    """Iteration latency model of the profile (standalone times for SLOs and JCT deadlines)."""
    kv_capacity_tokens: int
    """KV pool size of the run, tokens."""
    max_prefill_tokens: int = 8192
    """Largest prefill chunk per iteration, tokens."""

    def prefill_s(self, prompt_len: int) -> float:
        """Standalone prefill time of a prompt (chunked at max_prefill_tokens), seconds."""
        total, done = 0.0, 0
        while done < prompt_len:
            chunk = min(self.max_prefill_tokens, prompt_len - done)
            total += self.latency.predict(BatchShape().with_prefill(chunk, done))
            done += chunk
        return total

    def standalone_s(self, prompt_len: int, output_len: int, samples: int = 16) -> float:
        """Standalone JCT: prefill plus output_len - 1 single-request decodes, the decode sum
        approximated at `samples` evenly spaced context lengths."""
        decodes = max(0, output_len - 1)
        if decodes == 0:
            return self.prefill_s(prompt_len)
        points = min(samples, decodes)
        step_total = sum(
            self.latency.predict(BatchShape().with_decode(prompt_len + 1 + (i * decodes) // points))
            for i in range(points)
        )
        return self.prefill_s(prompt_len) + step_total * decodes / points


def ttft_base_s(ctx: BuildContext, prompt_len: int, floor_s: float = 0.4) -> float:
    """Base TTFT target for mixed prompt lengths: `floor_s` plus twice the standalone prefill
    of the prompt's 512-token bucket (its upper bound), so even long prompts are feasible in
    isolation (AccelGen's per-bucket SLO, calibrated to this engine)."""
    bucket_top = 512 * max(1, math.ceil(prompt_len / 512))
    return floor_s + 2.0 * ctx.prefill_s(bucket_top)


SourceFactory = Callable[[float | None, bool], SpecSource]


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A named tenant of a workload: its requests carry `length_key == name` (the simulator's
    tenant key) and the tier `tier`; per-tenant metrics (bench.metrics.tenant_metrics) are
    computed for the workloads that declare tenants."""

    name: str
    tier: Tier
    weight: float = 1.0
    """Fair-share weight within its tier (what a weighted-fair scheduler should give it)."""


@dataclass
class Workload:
    """A built workload: a recipe for identical arrival sources, plus its facts."""

    name: str
    """W1…W6 or "trace"."""
    description: str
    """One line for the report."""
    make_source: SourceFactory
    """(rt_rate_req_s, include_be) → a fresh source; rt_rate is None for workloads without an
    open-loop RT stream."""
    longest_prompt: int
    """Largest prompt the workload can produce, tokens (--kv-scale is relative to it)."""
    window_s: float | None
    """Arrival window, seconds (throughputs are per second of it); None = the run's end
    (offline workloads: throughput over the makespan)."""
    rt_poisson: Callable[[float, float], SpecSource] | None = None
    """(rate, duration) → the RT stream alone with Poisson arrivals (capacity search); None when
    λ* does not apply (closed loop, offline)."""
    rt_rate_share: float = 1.0
    """RT rate = rt_rate_share × load × λ* (W2: 0.65, so that RT and BE together arrive at
    load × λ*; --rt-rate sets the RT rate directly)."""
    has_rt: bool = True
    """Whether the workload has RT requests."""
    has_be: bool = True
    """Whether the workload has a BE stream (rt-only differs from fcfs only then)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Parameters worth printing in the report."""
    tenants: tuple[TenantSpec, ...] = ()
    """Named tenants (W6, traces with `tenant` fields); () = no per-tenant metrics."""

    def source(self, rt_rate_req_s: float | None, include_be: bool = True) -> SpecSource:
        """A fresh source (same requests every call)."""
        return self.make_source(rt_rate_req_s, include_be)


def scaled_duration(params: WorkloadParams, full_s: float, default_scale: float) -> float:
    """The arrival window: --duration-s, else full_s × (--scale or the workload default)."""
    if params.duration_s is not None:
        return float(params.duration_s)
    return full_s * (params.scale if params.scale is not None else default_scale)


def check_variant(name: str, variant: str | None, allowed: Sequence[str]) -> str:
    """The chosen variant (first allowed one by default); ValueError naming the choices."""
    if variant is None:
        return allowed[0]
    if variant not in allowed:
        raise ValueError(f"{name} has no variant {variant!r} (choose from {', '.join(allowed)})")
    return variant


def max_new_for(params: WorkloadParams, output_len: int, cap: int) -> int:
    """max_new_tokens shown to policies (see the module docstring)."""
    return output_len if params.max_new == "exact" else max(cap, output_len)
