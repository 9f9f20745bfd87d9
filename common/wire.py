"""Wire types shared by the gateway and the backend (the only thing the two share).

The gateway attaches a :class:`RequestMeta` to every engine request as
``sampling_params.custom_params["tandem"]``; SGLang carries ``custom_params`` untouched from its
HTTP server to the scheduler process, where ``backend.sglang_ext`` turns it back into this type.

SGLang's IPC accepts ``custom_params`` values of the shape ``scalar | list[scalar] |
dict[str, scalar]`` only (a deeper dict kills the scheduler under msgpack IPC), so the metadata is
one flat dict of scalars. :func:`meta_to_custom_params` / :func:`meta_from_custom_params` are the
only (de)serialisers; both validate.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

Tier = Literal["rt", "be"]
CUSTOM_PARAMS_KEY = "tandem"

# Stock SGLang priority (higher = more urgent, SGLang's default direction) for the same request,
# so that `--enable-priority-scheduling` and `--retraction-policy priority` order RT before BE
# even with the tandem policy off. The gap is larger than SGLang's default preemption threshold
# (10), so an RT arrival may preempt BE; a BE request with a deadline ranks above one without.
PRIORITY_RT = 100
PRIORITY_BE_DEADLINE = 10
PRIORITY_BE = 0


class RequestMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the scheduler must know about one request beyond its tokens."""

    tier: Tier
    """Service tier of this request: "rt" (TTFT/TPOT targets) or "be" (best effort)."""
    tenant_id: str
    """The tenant the request is billed to."""
    length_key: str
    """Key of the output-length history used to predict this request's output length."""
    arrival_unix_s: float
    """Wall-clock time (time.time(), same host) at which the gateway accepted the request."""
    ttft_target_ms: float | None = None
    """RT: time-to-first-token target, ms after arrival. None for BE."""
    tpot_target_ms: float | None = None
    """RT: time-per-output-token target after the first token, ms. None for BE."""
    deadline_s: float | None = None
    """BE: completion deadline, seconds after arrival (job deadline). None: pure best effort."""
    max_tokens: int | None = None
    """The request's output-length cap (prior for the length predictor)."""
    tenant_weight: float = 1.0
    """The tenant's fair-share weight within its tier (from its contract; > 0): while several
    tenants of a tier have work waiting, the engine serves them tokens in proportion to it."""

    def __post_init__(self) -> None:
        if not (self.tenant_weight > 0 and math.isfinite(self.tenant_weight)):
            raise ValueError(f"tenant_weight must be a finite number > 0, got {self.tenant_weight}")

    @property
    def ttft_due_unix_s(self) -> float | None:
        """Absolute time by which the first token is due (RT), else None."""
        if self.ttft_target_ms is None:
            return None
        return self.arrival_unix_s + self.ttft_target_ms / 1000.0

    @property
    def deadline_due_unix_s(self) -> float | None:
        """Absolute time by which a BE request must finish, else None."""
        if self.deadline_s is None:
            return None
        return self.arrival_unix_s + self.deadline_s

    @property
    def sglang_priority(self) -> int:
        """The stock SGLang `priority` that mirrors this request's tier (see module constants)."""
        if self.tier == "rt":
            return PRIORITY_RT
        return PRIORITY_BE_DEADLINE if self.deadline_s is not None else PRIORITY_BE


def meta_to_custom_params(meta: RequestMeta) -> dict[str, Any]:
    """The ``custom_params`` dict that carries *meta* to the scheduler (flat scalars only)."""
    fields = msgspec.structs.asdict(meta)
    return {CUSTOM_PARAMS_KEY: {k: v for k, v in fields.items() if v is not None}}


def meta_from_custom_params(custom_params: dict[str, Any] | None) -> RequestMeta | None:
    """Parses the metadata back; None when the request carries none (e.g. a direct client).

    Raises msgspec.ValidationError when the dict is present but malformed.
    """
    if not custom_params or CUSTOM_PARAMS_KEY not in custom_params:
        return None
    return msgspec.convert(custom_params[CUSTOM_PARAMS_KEY], RequestMeta)


# --- the engine's control endpoint (a Unix socket served by the patched scheduler) ---------

CONTROL_LENGTHS_PATH = "/length-history"
"""POST a :class:`LengthHistoryPush`: finished output lengths per length-history key."""
CONTROL_STATS_PATH = "/stats"
"""GET: the in-engine policy's counters (JSON object; see backend.sglang_ext.driver_stats)."""
CONTROL_STATS_RESET_PATH = "/stats/reset"
"""POST: zero the counters (a bench starts its measurement window)."""
CONTROL_HEALTH_PATH = "/health"
"""GET: 200 once the scheduler's control endpoint is up."""


class LengthHistoryPush(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Output lengths the gateway's SQL history holds, for the engine's admission predictor.

    Each key's newest window, replacing what the engine holds for that key (SQL is the
    authoritative copy: it includes what the engine saw finish itself). Sent for every key when
    the gateway first reaches an engine (or finds it restarted), then for the keys that changed;
    between pushes the engine adds the requests it finishes itself."""

    histories: dict[str, list[int]]
    """length key → finished output lengths, oldest first, tokens (each ≥ 0)."""

    def __post_init__(self) -> None:
        for key, values in self.histories.items():
            if any(v < 0 for v in values):
                raise ValueError(f"length history {key!r}: output lengths must be >= 0")


CONTROL_LOAD_PATH = "/load"
"""GET (query `after=<iteration>`, `wait_s=<seconds>`): the scheduler's :class:`EngineLoad`
once an iteration later than `after` has run (at once when one already has; after `wait_s`
the current one) — the gateway's SLO admission long-polls it, so its view of the engine is
never more than one iteration old."""
MAX_LOAD_WAIT_S = 30.0
"""Longest an engine holds a `CONTROL_LOAD_PATH` long poll (a client asking for more gets this)."""


def load_query(after: str | None, wait_s: str | None) -> tuple[int, float]:
    """The `after` (iteration; absent: -1, any) and `wait_s` (seconds; absent: 0, at most
    MAX_LOAD_WAIT_S) parameters of a `CONTROL_LOAD_PATH` query, as both engines read them;
    raises ValueError when one is not a number or wait_s is negative."""
    try:
        after_iteration = int(after) if after is not None else -1
        wait = float(wait_s) if wait_s is not None else 0.0
    except ValueError:
        raise ValueError("bad load query: after and wait_s must be numbers") from None
    if not wait >= 0.0:  # NaN too
        raise ValueError("bad load query: wait_s must be >= 0")
    return after_iteration, min(wait, MAX_LOAD_WAIT_S)


CONTROL_ITERATIONS_PATH = "/iterations"
"""GET (query `after=<iteration>`, `wait_s=<seconds>`, as `CONTROL_LOAD_PATH`): the engine's
recent iterations later than `after`, oldest first, as :class:`RecentIterations` — every one, where
a `/load` poll only sees the newest (an observer that falls behind, as one starved of CPU
does, would otherwise see the long iterations and miss the short ones)."""
ITERATION_LOG_SIZE = 1024
"""Iterations an engine keeps for `CONTROL_ITERATIONS_PATH` (older ones are gone)."""


class IterationMix(msgspec.Struct, frozen=True, array_like=True):
    """The token mix of the batch an iteration's plan ran: the latency model's input,
    `backend.policy.latency.BatchShape` field for field (this layer cannot import it). With the
    measured time, one sample of the engine's real speed: the live bench fits its simulator
    twin's engine to them."""

    prefill_tokens: int
    """Prefill chunk tokens in the batch."""
    num_prefill: int
    """Requests with a prefill chunk."""
    prefill_attn: float
    """Σ chunk·(prefix + chunk), token²."""
    prefill_attn_full: float
    """Σ (prefix + chunk)², token²."""
    decode_context: int
    """Σ context length of the decoding requests, tokens."""
    num_decode: int
    """Decoding requests."""
    decode_context_sq: float
    """Σ context² of the decoding requests, token²."""


class IterationRecord(msgspec.Struct, frozen=True, array_like=True):
    """One scheduler iteration: when it ended, how long it took, what the model predicted, and
    what it ran."""

    iteration: int
    at_unix_s: float
    """When it ended (wall clock)."""
    iteration_s: float
    """Its measured duration, seconds."""
    predicted_iteration_s: float
    """The calibrated model's prediction for it when it was planned, seconds (0: none)."""
    mix: IterationMix | None = None
    """The token mix of the plan it ran (None: no plan of tandem's policy ran, as with
    SGLang's own scheduler)."""


class RecentIterations(msgspec.Struct, frozen=True, kw_only=True):
    """The answer of `CONTROL_ITERATIONS_PATH`."""

    iterations: list[IterationRecord]
    """Iterations later than the query's `after`, oldest first (at most ITERATION_LOG_SIZE)."""
    missed: int = 0
    """Iterations later than `after` that are no longer kept (the caller polled too rarely)."""


class TenantLoad(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One RT tenant's part of the engine's RT work: its prompt work not computed yet (what
    weighted fair share weighs against another tenant's when it orders the tier's prompts) and
    whether it is active (the SLO admission's per-tenant view)."""

    tenant_id: str
    """The tenant ("" is the one anonymous tenant, as in `RequestMeta`)."""
    weight: float = 1.0
    """Its fair-share weight within the tier (> 0)."""
    num_waiting: int = 0
    """Its requests whose prompt is not fully computed yet (queued or partly prefilled)."""
    waiting_prompt_tokens: int = 0
    """Prompt tokens those requests still have to compute."""
    num_running: int = 0
    """Its requests decoding (a tenant with none waiting but some decoding is still active:
    it is likely to send more while another tenant's request waits)."""
    fair_counter: float = 0.0
    """Its virtual token counter in the engine's weighted fair share (tokens served, prompt and
    output, ÷ weight; lifted to the least backlogged tenant's when it comes back from idle).
    Only differences between tenants mean anything: the tenant with the least is served next.
    0 for every tenant when the engine's policy keeps no counters."""


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The engine's live state after one iteration: what the SLO admission predicts from.

    Token counts are the scheduler's own (prompt tokens as the engine tokenised them)."""

    iteration: int
    """Iterations the scheduler has run since it started (0: none yet)."""
    at_unix_s: float
    """When the iteration ended and the next was planned (wall clock)."""
    iteration_s: float = 0.0
    """The last iteration's measured duration, seconds (0 before the first)."""
    inflight_predicted_s: float | None = None
    """The iteration the engine started at `at_unix_s`, just after this report was taken: its
    predicted duration at the calibrated pace (the plan's), seconds; 0 when it started none
    (nothing to run). An RT request that arrives while it runs waits for what is left of it
    (an iteration is not preempted: deep into a long prompt on a CPU engine, a BE chunk runs
    for seconds). None: not reported (an engine whose policy predicts nothing): the SLO
    admission then counts `iteration_s` for it."""
    predicted_iteration_s: float = 0.0
    """What the policy's calibrated latency model predicted for that iteration when it planned
    it, seconds (0: no prediction — before the first iteration, or a policy that predicts
    none). predicted ÷ measured, iteration by iteration, is how well the closed loop tracks the
    engine's real pace right now."""
    pace_ratio_p90: float = 1.0
    """p90 of measured ÷ predicted over the engine's last 32 iterations (`PaceSpread` in
    backend/policy/calibration.py; 1.0 from an engine that predicts nothing): how much slower
    than its calibrated model the engine has recently run at worst, but for one iteration in
    ten. The SLO admission scales its forecasts by it when it is above 1."""
    pace_ratio_recent_mean: float | None = None
    """Mean of measured ÷ predicted over the engine's last 8 iterations
    (`PaceSpread.recent_mean`): the pace it runs at now. A forecast of many iterations (a
    request slot's wait of tens of decode steps) is stretched by this plus the gap to
    `pace_ratio_p90` over the square root of their number (`feasibility.pace_stretch`); None:
    not reported, every wait is stretched by `pace_ratio_p90`."""
    num_rt_waiting: int = 0
    """RT requests whose prompt is not fully computed yet (queued or partly prefilled)."""
    rt_waiting_prompt_tokens: int = 0
    """Prompt tokens those RT requests still have to compute."""
    num_rt_running: int = 0
    """RT requests decoding."""
    rt_context_tokens: int = 0
    """Σ context length (prompt + generated) of the decoding RT requests, tokens."""
    num_rt_prefilling: int = 0
    """RT requests admitted with their prompt partly computed (a chunked prompt): counted in
    `num_rt_waiting`, but already holding a request slot."""
    max_running_requests: int = 0
    """The engine's cap on requests holding a slot (running or prefilling; SGLang's
    `max_running_requests`); 0: none reported. BE gives its slots up to RT, so only RT's count
    against an RT prompt: with every slot RT's, a new prompt waits for an RT request to finish."""
    rt_decode_steps_left: tuple[int, ...] = ()
    """For k = 1, 2, … (at most 128): the decode steps within which k of the running RT decodes
    will have finished and freed their slots, at the policy's quantile
    (`backend.policy.feasibility.RtOutputs.slots_free_steps`; non-decreasing); (): not reported,
    or RT requests (running and waiting) fill less than half the slots: no slot wait is
    forecast."""
    rt_new_decode_steps: int = 0
    """Decode steps an RT request that starts now is expected to take (the mean over the RT
    requests the engine finished lately), reported with `rt_decode_steps_left`: when more slots
    are needed than RT decodes run, the requests that take the freed slots hold them this long;
    0: not reported, or no RT request finished yet."""
    num_be_waiting: int = 0
    be_waiting_prompt_tokens: int = 0
    """Prompt tokens the waiting BE requests still have to compute (their part of the engine's
    load: the placement's least-load and leftover-capacity measures)."""
    num_be_running: int = 0
    be_context_tokens: int = 0
    """Σ context length of the decoding BE requests, tokens."""
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    be_kv_tokens: int = 0
    """KV held by BE requests (RT may take it: BE is paused or evicted first)."""
    max_prefill_tokens: int = 8192
    """Largest prefill the engine runs in one iteration, tokens."""
    latency_factors: tuple[float, float, float] = (1.0, 1.0, 1.0)
    """The calibration's pace per batch regime (decode, prefill, mixed): measured ÷ profile
    (backend/policy/calibration.py); 1.0 where the profile is right."""
    calibration_samples: int = 0
    """Iterations the calibration has learned from (0: none yet, or a policy that does not
    calibrate): a forecast no measured iteration has checked yet is the profile's word alone,
    and a profile measured on a busy machine can be many times too slow."""
    rt_tpot_target_min_s: float | None = None
    """The tightest TPOT target among the RT requests decoding, seconds (None: none decoding,
    or none with a target). Their next tokens bound every iteration — and, where prompts run in
    an iteration of their own, the prompts' iteration and the decodes' together: what RT
    prompts get beside the decodes (the SLO admission's TTFT forecast)."""
    rt_decode_margin: float = 0.0
    """The share of that target the engine's policy keeps as its safety margin (tandem's ε:
    an iteration may take (1 − ε) of the time to the next RT token due)."""
    rt_by_tenant: tuple[TenantLoad, ...] = ()
    """`num_rt_waiting`, `rt_waiting_prompt_tokens` and `num_rt_running` split by tenant, in
    the order the tenants were first seen (empty from an engine that does not report it: the
    admission then counts all waiting RT work as ahead of every request, as before)."""
