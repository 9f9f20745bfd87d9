"""The policy interface: an engine snapshot in, an iteration plan out, the result fed back.

Every engine (the discrete-event simulator, the patched SGLang scheduler) drives a policy the
same way, once per iteration::

    plan = policy.plan(snapshot)    # which decodes run, which prefills with what chunk length,
                                    # which requests are evicted
    ...engine executes plan...
    policy.observe(result)          # iteration time, tokens emitted, finished output lengths

Shape (after vLLM's `SchedulerOutput`): plain data, a comment on every field, no behaviour beyond
derived properties. The request objects are owned and updated by the engine and handed to the
policy by reference every iteration (rebuilding thousands of objects per iteration would cost more
than planning); a policy reads them and never writes them.

Times are seconds on the engine's clock (virtual in the simulator, monotonic in SGLang); token
counts are tokens.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from common.wire import Tier


class ReqState(msgspec.Struct, kw_only=True):
    """One request as the scheduler sees it (engine-owned; read-only for policies)."""

    rid: str
    """Engine request id."""
    tier: Tier
    """Service tier: "rt" (TTFT/TPOT targets) or "be" (best effort, optional deadline)."""
    arrival_s: float
    """When the request reached the engine."""
    prompt_len: int
    """Prompt length, tokens."""
    max_new_tokens: int
    """Output cap, tokens (the request ends at this length or at EOS)."""
    length_key: str = ""
    """Key of the output-length history that predicts this request (tenant or job)."""
    tenant_id: str = ""
    """The tenant it is served for: the unit of weighted fair share within its tier
    (backend.policy.fair_share); "" is one anonymous tenant."""
    tenant_weight: float = 1.0
    """The tenant's fair-share weight within its tier (> 0; from its contract)."""
    is_probe: bool = False
    """No tenant sent it: the engine's own health probe, or a client talking to the engine
    directly. Served as RT (never starved behind BE), but it says nothing about RT traffic:
    it never makes a policy think RT users are active."""
    ttft_due_s: float | None = None
    """RT: the instant (engine clock) by which the first token is due: arrival + the contract's
    `ttft_target_ms`."""
    tpot_target_s: float | None = None
    """RT: the contract's `tpot_target_ms`, in seconds: target time per output token after the
    first."""
    deadline_due_s: float | None = None
    """BE: the instant (engine clock) by which the job must finish: arrival + the contract's
    `deadline_s`; None when the job has no deadline."""
    order_key: float = 0.0
    """BE order given by the caller (batch runner's prefix-tree order); lower runs first."""
    prefix_hashes: tuple[int, ...] = ()
    """One hash per prefix-cache block of the prompt; equal hashes are shared prefixes."""

    # --- progress, updated by the engine ---
    prefill_len: int = 0
    """Tokens that must be in KV before the next decode: the prompt, or after an eviction the
    prompt plus everything generated so far (recompute). Set to prompt_len on arrival."""
    prefilled: int = 0
    """Tokens of `prefill_len` whose KV exists (computed or hit in the prefix cache)."""
    cached_len: int = 0
    """Of `prefilled`, tokens served from the prefix cache (not computed)."""
    generated: int = 0
    """Output tokens emitted so far."""
    kv_tokens: int = 0
    """KV tokens this request holds now: its private tokens plus the prefix-cache blocks it
    references (with page_size > 1 its private part occupies whole pages)."""
    kv_shared_tokens: int = 0
    """Of `kv_tokens`, tokens in prefix-cache blocks (possibly shared with other requests, and
    kept cached after it leaves): evicting it frees at least kv_tokens − kv_shared_tokens."""
    first_token_s: float | None = None
    """When the first output token was emitted."""
    last_token_s: float | None = None
    """When the latest output token was emitted."""
    num_evictions: int = 0
    """How often this request was evicted and re-queued."""
    is_running: bool = False
    """True while admitted (holding KV); False while waiting (new or evicted)."""

    # --- visible to the oracle baseline only (None for every other policy) ---
    true_output_len: int | None = None
    """The real output length, known to the workload; engines set it only for an oracle."""

    @property
    def prompt_left(self) -> int:
        """Tokens still to prefill before this request can decode."""
        return self.prefill_len - self.prefilled

    @property
    def is_decoding(self) -> bool:
        """Admitted and fully prefilled: the next step emits a token."""
        return self.is_running and self.prefilled >= self.prefill_len

    @property
    def context_len(self) -> int:
        """Tokens its next decode attends to (prompt + generated)."""
        return self.prompt_len + self.generated

    def ttft_lateness(self, now_s: float) -> float:
        """How far past its TTFT deadline it is at `now_s` while its first token has not come,
        as a fraction of its TTFT target (> 0: late; 0 without a target or once the token
        came)."""
        due = self.ttft_due_s
        if due is None or self.first_token_s is not None:
            return 0.0
        return (now_s - due) / max(due - self.arrival_s, 1e-9)


class Snapshot(msgspec.Struct, kw_only=True):
    """The engine's state at the start of an iteration."""

    now_s: float
    """Current engine time."""
    waiting: list[ReqState]
    """Requests not holding KV, in arrival order: new ones and evicted ones (re-queued)."""
    running: list[ReqState]
    """Admitted requests holding KV: partially prefilled (chunked) or decoding."""
    waiting_rt: list[ReqState] | None = None
    """The RT requests of `waiting`, in the same order, when the engine keeps them apart (a
    long BE backlog then costs no scan); None otherwise. Read via `common.waiting_in`."""
    waiting_be: list[ReqState] | None = None
    """The BE requests of `waiting`, likewise."""
    kv_capacity_tokens: int
    """Size of the KV pool, tokens."""
    kv_free_tokens: int
    """Slots free right now, tokens."""
    kv_evictable_tokens: int = 0
    """Slots held only by the prefix cache (freed on demand, without evicting a request)."""
    last_iteration_s: float | None = None
    """Duration of the previous iteration (None before the first)."""
    max_running: int = 1 << 30
    """Engine cap on admitted requests."""
    max_prefill_tokens: int = 1 << 30
    """Engine cap on prefill tokens in one iteration."""
    page_size: int = 1
    """Allocation granularity of the KV pool, tokens (chunk lengths are multiples, except a
    prompt's last chunk)."""

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)


class PrefillChunk(msgspec.Struct, frozen=True):
    """Prefill `tokens` more prompt tokens of request `rid` this iteration."""

    rid: str
    """A waiting request (admitted by this chunk) or a running, partially prefilled one."""
    tokens: int
    """Chunk length, tokens (1 ≤ tokens ≤ its prompt_left)."""


class Plan(msgspec.Struct, kw_only=True):
    """What one iteration runs. The engine executes it as given, evictions first; a plan that
    does not fit in KV memory is a policy bug (engines assert it)."""

    decodes: list[str] = msgspec.field(default_factory=list)
    """Running, fully prefilled requests that emit one token each. A decoding request left out
    sits this iteration out and keeps its KV."""
    prefills: list[PrefillChunk] = msgspec.field(default_factory=list)
    """Prefill chunks, in the order they were chosen."""
    evictions: list[str] = msgspec.field(default_factory=list)
    """Running requests to evict: their KV is freed and they return to the waiting queue, keeping
    their generated tokens (recomputed on re-admission)."""
    predicted_s: float | None = None
    """The policy's prediction of this iteration's duration (for latency-model error and
    overrun statistics); None if the policy does not predict."""
    hold_until_s: float | None = None
    """An empty plan that waits by choice: the engine runs nothing (every decode row sits out,
    no prompt runs) and asks again, until this engine time at the latest or until a request
    arrives (tandem's anticipation of a closed-loop RT client's next request). None: a plan
    that runs nothing has nothing it could run."""

    @property
    def is_empty(self) -> bool:
        return not (self.decodes or self.prefills)


class FinishedRequest(msgspec.Struct, frozen=True):
    """A request that completed this iteration."""

    rid: str
    tier: Tier
    length_key: str
    output_len: int
    """Tokens generated in total."""


class IterationResult(msgspec.Struct, kw_only=True):
    """What happened when a plan ran."""

    start_s: float
    """Engine time when the iteration started."""
    duration_s: float
    """Measured (or simulated) iteration time."""
    plan: Plan
    """The plan that ran."""
    emitted: list[str] = msgspec.field(default_factory=list)
    """Requests that emitted a token (decodes, and prefills that completed their prompt)."""
    finished: list[FinishedRequest] = msgspec.field(default_factory=list)
    """Requests that completed."""

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


class Policy(Protocol):
    """A scheduling policy. `plan` must be cheap (it runs every iteration) and must not mutate
    the snapshot; all learning happens in `observe`."""

    name: str

    def plan(self, snapshot: Snapshot) -> Plan:
        """The next iteration's plan."""
        ...

    def observe(self, result: IterationResult) -> None:
        """Feedback after the plan ran."""
        ...
