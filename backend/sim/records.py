"""What a simulation run records: one record per request, one row per iteration."""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Literal

import msgspec

from common.wire import Tier

Admission = Literal["admitted", "shed", "downgraded", "accepted"]
"""How the SLO admission let a request in: "admitted" (its contract was predicted to hold, or it
has none), "shed" (refused: it never reached the engine), "downgraded" (an RT request run as BE),
"accepted" (run as RT although its contract was predicted to fail: the contract said so)."""


class RequestRecord(msgspec.Struct, kw_only=True):
    """One request's life. Times are seconds on the simulated clock."""

    rid: str
    tier: Tier
    arrival_s: float
    prompt_len: int
    """Prompt tokens."""
    output_len_target: int
    """Tokens it would generate if run to completion: min(true output length, max_new_tokens)."""
    generated: int
    """Tokens actually emitted (< target when the run ended first)."""
    first_token_s: float | None
    finish_s: float | None
    """None when the run ended before the request finished."""
    token_times: Sequence[float]
    """Emission time of every output token, the first included (an array('d'); len ==
    generated; `np.frombuffer(rec.token_times)` gives a numpy view)."""
    evictions: int
    """How often it was evicted (and its KV recomputed)."""
    cached_tokens: int
    """Prompt tokens served from the prefix cache at its first admission."""
    ttft_target_s: float | None
    """RT TTFT target, seconds after arrival."""
    tpot_target_s: float | None
    """RT TPOT target, seconds."""
    deadline_s: float | None
    """BE completion deadline, absolute simulated time."""
    length_key: str
    tenant_id: str = ""
    """The tenant it was served for ("" where the source named none)."""
    max_new_tokens: int = 0
    """The output cap the policy saw."""
    admitted_s: float | None = None
    """When it was first admitted (queueing delay = admitted_s − arrival_s)."""
    admission: Admission = "admitted"
    """How the SLO admission let it in (a downgraded request runs, and is recorded, as BE)."""


_FLOAT_COLUMNS = ("start_s", "duration_s", "predicted_s", "plan_ms", "rt_part_s")
_INT_COLUMNS = (
    "num_prefill",
    "num_decode",
    "prefill_tokens",
    "kv_used_tokens",
    "num_running",
    "num_waiting",
    "num_evictions",
)


class IterationLog:
    """Per-iteration columns (struct of arrays; `np.frombuffer(log.start_s)` views one).

    start_s, duration_s: when the iteration started and how long it took (simulated s).
    predicted_s: the policy's `plan.predicted_s` (NaN when it gave none).
    plan_ms: wall time spent in `policy.plan`, ms.
    rt_part_s: what the iteration would have taken with only its RT work (its fixed cost
    included; 0 when it ran no RT work, NaN when not computed), simulated s.
    num_prefill, num_decode: requests with a prefill chunk / a decode.
    prefill_tokens: prefill tokens computed (cache hits excluded).
    kv_used_tokens: KV slots in use during the iteration (after its allocations, before its
    finishes free anything), of `kv_capacity_tokens`.
    num_running, num_waiting: queue lengths at the start of the iteration.
    num_evictions: requests the plan evicted.
    """

    def __init__(self, kv_capacity_tokens: int) -> None:
        self.kv_capacity_tokens = kv_capacity_tokens
        self.start_s = array("d")
        self.duration_s = array("d")
        self.predicted_s = array("d")
        self.plan_ms = array("d")
        self.rt_part_s = array("d")
        self.num_prefill = array("q")
        self.num_decode = array("q")
        self.prefill_tokens = array("q")
        self.kv_used_tokens = array("q")
        self.num_running = array("q")
        self.num_waiting = array("q")
        self.num_evictions = array("q")

    def __len__(self) -> int:
        return len(self.start_s)

    def append(
        self,
        *,
        start_s: float,
        duration_s: float,
        predicted_s: float | None,
        plan_ms: float,
        num_prefill: int,
        num_decode: int,
        prefill_tokens: int,
        kv_used_tokens: int,
        num_running: int,
        num_waiting: int,
        num_evictions: int,
        rt_part_s: float | None = None,
    ) -> None:
        self.start_s.append(start_s)
        self.duration_s.append(duration_s)
        self.predicted_s.append(math.nan if predicted_s is None else predicted_s)
        self.plan_ms.append(plan_ms)
        self.rt_part_s.append(math.nan if rt_part_s is None else rt_part_s)
        self.num_prefill.append(num_prefill)
        self.num_decode.append(num_decode)
        self.prefill_tokens.append(prefill_tokens)
        self.kv_used_tokens.append(kv_used_tokens)
        self.num_running.append(num_running)
        self.num_waiting.append(num_waiting)
        self.num_evictions.append(num_evictions)

    def columns(self) -> dict[str, array[float] | array[int]]:
        """Every column by name."""
        return {name: getattr(self, name) for name in _FLOAT_COLUMNS + _INT_COLUMNS}


class SimResult(msgspec.Struct, kw_only=True):
    """The outcome of `simulate`."""

    policy_name: str
    requests: list[RequestRecord]
    """Every request that arrived (finished or not), in arrival order."""
    iterations: IterationLog
    horizon_s: float | None
    """The configured horizon (None: ran until every request finished)."""
    end_s: float
    """Simulated time when the run stopped."""
    prefix_reuse_ratio: float
    """Σ cached prompt tokens / Σ prompt tokens over admitted requests (first admission)."""
    num_evictions: int = 0
    """Evictions over the run."""
    kv_layout_stats: dict[str, int] = msgspec.field(default_factory=dict)
    """Counters of the bicache layout (checkpointed, restored tokens, ...); empty for the token
    pool."""
