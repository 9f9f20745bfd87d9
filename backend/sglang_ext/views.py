"""What tandem reads and calls on SGLang's scheduler objects, typed as Protocols (no sglang import).

The driver, the mirror and the code that carries out a directive take SGLang's objects through
these views, so they run unchanged on plain stand-ins in unit tests. Each view names the pinned
SGLang class it describes (:data:`SGLANG_CLASSES`); ``tests/functional/test_sglang_seams.py`` checks
that SGLang 0.5.23's real class has every member (class attributes, dataclass / msgspec fields
and the ``self.x = ...`` assignments of its methods), so an upgrade that renames one fails there
instead of as an ``AttributeError`` mid-iteration.

Members are read-only properties where tandem only reads them: a Protocol attribute would
promise that tandem may assign it. Only the members tandem touches are listed, not the class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class ReqKvView(Protocol):
    """A request's KV bookkeeping (``schedule_batch.ReqKvInfo``, ``req.kv``)."""

    @property
    def kv_allocated_len(self) -> int:
        """KV slots allocated to the request (its own tokens plus its cached prefix), tokens."""
        ...

    @property
    def cache_protected_len(self) -> int:
        """Leading tokens the radix cache owns (matched or inserted), tokens."""
        ...

    @property
    def req_pool_idx(self) -> int | None:
        """The request's row of ``req_to_token`` (token position → KV slot); None: no row."""
        ...


class SamplingParamsView(Protocol):
    """A request's sampling parameters (``sampling.sampling_params.SamplingParams``)."""

    @property
    def max_new_tokens(self) -> int | None:
        """Output cap, tokens."""
        ...

    @property
    def custom_params(self) -> dict[str, Any] | None:
        """The client's free-form dict: tandem's ``RequestMeta`` rides in it (``common.wire``)."""
        ...


class ReqView(Protocol):
    """One request in the scheduler (``schedule_batch.Req``)."""

    @property
    def rid(self) -> str:
        """The request id (unique: the gateway makes it so)."""
        ...

    @property
    def origin_input_ids(self) -> Sequence[int]:
        """The prompt's token ids."""
        ...

    @property
    def output_ids(self) -> Sequence[int]:
        """The token ids generated so far."""
        ...

    @property
    def full_untruncated_fill_ids(self) -> Sequence[int]:
        """Prompt plus outputs: what a (re-)prefill must have in the KV, token ids."""
        ...

    @property
    def prefix_len(self) -> int:
        """Tokens whose KV is already computed (matched prefix, or chunks done so far)."""
        ...

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, tokens."""
        ...

    @property
    def retraction_count(self) -> int:
        """Times SGLang (or tandem's eviction) retracted the request, count."""
        ...

    inflight_middle_chunks: int
    """Chunks of its prompt SGLang counts as built and not yet through their results (a result
    with a count above 0 is a middle chunk's: no token sent); tandem puts the count back when the
    request sat a pass out."""

    @property
    def finished_reason(self) -> object:
        """Why it finished (an SGLang ``BaseFinishReason`` subclass), None while it runs."""
        ...

    @property
    def to_finish(self) -> object:
        """An abort waiting for the request's next decode (SGLang ends a running request that
        way: the decode's result finishes it and frees its KV), None otherwise."""
        ...

    @property
    def priority(self) -> int | None:
        """SGLang's priority (the launcher's tier mirror; see ``common.wire``)."""
        ...

    @property
    def sampling_params(self) -> SamplingParamsView:
        """Its sampling parameters."""
        ...

    @property
    def kv(self) -> ReqKvView:
        """Its KV bookkeeping."""
        ...

    def finished(self) -> bool:
        """True once it finished (any reason, abort included)."""
        ...

    def reset_for_retract(self) -> None:
        """Resets it as SGLang resets a retracted request (its KV row already freed), to be
        re-queued and resumed from whatever of its prefix the prefix cache holds."""
        ...


class BatchView(Protocol):
    """A batch of requests (``schedule_batch.ScheduleBatch``): the running batch tandem splits
    (parking), shrinks (eviction) and merges back."""

    @property
    def reqs(self) -> Sequence[ReqView]:
        """Its requests, one per row."""
        ...

    sampling_info: Any
    """Per-row sampling state (``SamplingBatchInfo``); its ``penalizer_orchestrator`` keeps
    per-row state a split would corrupt, so a split gives the parked half its own copy."""

    @property
    def extend_lens(self) -> Sequence[int]:
        """Per row of a prefill batch: tokens it computes this pass."""
        ...

    batch_is_full: bool
    """SGLang's "no room for another prompt" flag (cleared after an eviction frees KV)."""

    def filter_batch(self, *, keep_indices: list[int]) -> None:
        """Keeps rows *keep_indices* (every per-row tensor sliced)."""
        ...

    def merge_batch(self, other: Any) -> None:
        """Appends *other*'s rows."""
        ...

    def is_empty(self) -> bool:
        """True without rows."""
        ...

    def release_req(self, idx: int, remaing_req_count: int) -> bool:
        """Frees row *idx*'s KV the way out-of-memory retraction does; True when the request
        can resume (re-queue it). SGLang's parameter name, typo included."""
        ...


class KvAllocatorView(Protocol):
    """The KV pool's allocator (``mem_cache.allocator.token.TokenToKVPoolAllocator``)."""

    def available_size(self) -> int:
        """Free KV slots, tokens."""
        ...


class TreeCacheView(Protocol):
    """The prefix cache (``mem_cache.base_prefix_cache.BasePrefixCache``)."""

    def evictable_size(self) -> int:
        """KV slots the cache holds that no request uses (freed on demand), tokens."""
        ...

    def supports_prefix_sharing(self) -> bool:
        """True when a request's KV stays in the cache for later use (a radix cache that is
        on): a prompt sent back to the queue resumes from it rather than recomputing."""
        ...


class SchedulerView(Protocol):
    """SGLang's scheduler (``managers.scheduler.Scheduler``): its queues and pool sizes."""

    @property
    def waiting_queue(self) -> list[ReqView]:
        """Requests waiting for a prefill (new, or retracted and re-queued); tandem reorders it
        in place."""
        ...

    running_batch: BatchView
    """The decoding requests between iterations; tandem assigns it when it merges parked rows
    back."""

    chunked_req: ReqView | None
    """The request mid-way through a chunked prefill (at most one), or None; tandem clears it
    when it sends that request back to the waiting queue."""

    @property
    def token_to_kv_pool_allocator(self) -> KvAllocatorView:
        """The KV pool's allocator."""
        ...

    @property
    def tree_cache(self) -> TreeCacheView:
        """The prefix cache."""
        ...

    @property
    def max_total_num_tokens(self) -> int:
        """KV pool capacity, tokens."""
        ...

    @property
    def max_running_requests(self) -> int:
        """Most requests running at once."""
        ...

    @property
    def max_prefill_tokens(self) -> int:
        """Most prompt tokens one prefill pass takes (without chunking), tokens."""
        ...

    @property
    def chunked_prefill_size(self) -> int | None:
        """Longest prefill chunk, tokens; None or ≤ 0: no chunking."""
        ...

    @property
    def is_mixed_chunk(self) -> bool:
        """Decodes ride along with prefill chunks (``--enable-mixed-chunk``)."""
        ...

    @property
    def page_size(self) -> int:
        """KV page size, tokens."""
        ...

    def _add_request_to_queue(self, req: Any, is_retracted: bool = False) -> None:
        """Queues *req* for a prefill (*is_retracted*: resumed by recomputation)."""
        ...


SGLANG_CLASSES: dict[type, str] = {
    ReqKvView: "sglang.srt.managers.schedule_batch.ReqKvInfo",
    SamplingParamsView: "sglang.srt.sampling.sampling_params.SamplingParams",
    ReqView: "sglang.srt.managers.schedule_batch.Req",
    BatchView: "sglang.srt.managers.schedule_batch.ScheduleBatch",
    KvAllocatorView: "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator",
    TreeCacheView: "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache",
    SchedulerView: "sglang.srt.managers.scheduler.Scheduler",
}
"""Each view → the pinned SGLang class whose objects it describes (the seams test checks it)."""
