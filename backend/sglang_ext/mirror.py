"""The policy's view of SGLang's requests: one :class:`ReqState` per live ``Req``, kept up to date.

The policy interface (``backend.policy.types``) speaks ``ReqState``; SGLang's scheduler owns
``Req`` objects. :class:`ReqMirror` keeps one ``ReqState`` per request id and refreshes its
progress fields from the ``Req`` at each snapshot (a few attribute reads per request), so the
policy sees the same kind of objects it sees in the simulator, and its per-request caches (keyed by
``rid``) stay valid across iterations.

Clocks: the policy's times are ``time.monotonic()`` seconds in the scheduler process. The gateway
sends wall-clock instants (same host) in the request's :class:`~common.wire.RequestMeta`
(``req.tandem``); :meth:`ReqMirror.to_engine_s` converts them once, when a request is first seen:
``arrival_s``, ``ttft_due_s`` (from ``ttft_due_unix_s``) and ``deadline_due_s`` (from
``deadline_due_unix_s``); ``tpot_target_s`` is the meta's ``tpot_target_ms`` in seconds.

Field mapping (SGLang 0.5.23 ``Req``, read through ``views.ReqView``; no sglang import here):

==================  =================================================================
``prompt_len``      ``len(req.origin_input_ids)``
``prefill_len``     waiting: ``len(origin_input_ids) + len(output_ids)`` (a retracted request
                    recomputes its outputs too); running: what it had to prefill when admitted
``prefilled``       waiting: the prompt's prefix the radix cache holds (``cached_len`` too, as
                    the simulator marks a prefix-cache hit: a conversation's history, a shared
                    system prompt, a chunked prompt sent back to the queue with the KV it had
                    computed), as last matched (:meth:`ReqMirror.note_match`; at least one
                    token is always computed); the in-progress chunked request:
                    ``req.prefix_len`` (KV computed so far); decoding: ``prefill_len``
``generated``       ``len(req.output_ids)``
``kv_tokens``       ``req.kv.kv_allocated_len`` (its own KV plus its cached prefix)
``kv_shared_tokens`` ``req.kv.cache_protected_len`` (owned by the radix cache)
``num_evictions``   ``req.retraction_count``
==================  =================================================================
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from backend.policy.types import ReqState
from backend.sglang_ext.request_meta import get_meta, tpot_target_s
from backend.sglang_ext.views import ReqView


class ReqMirror:
    """``ReqState`` per live request id, refreshed from SGLang's ``Req`` on demand."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self._states: dict[str, ReqState] = {}
        self._view = MappingProxyType(self._states)
        self._prefill_len: dict[str, int] = {}  # rid -> tokens it had to prefill when admitted
        self._seen: dict[str, int] = {}  # rid -> output tokens at its last refresh
        self._cached: dict[str, int] = {}  # rid -> prefix it left in the cache when sent back
        self._matched: dict[str, tuple[int, float]] = {}  # rid -> (cached prefix, matched at)
        # rid -> (state, output tokens) of a waiting request refreshed since the last change of
        # what its state is made of (admission, a new prefix match, forget): a long queue costs
        # a lookup per request and iteration, not a refresh (2,000 waiting: 2.3 ms a snapshot)
        self._fresh: dict[str, tuple[ReqState, int]] = {}

    def __len__(self) -> int:
        return len(self._states)

    def to_engine_s(self, unix_s: float) -> float:
        """A wall-clock instant on the engine's monotonic clock."""
        return self._clock() - (self._wall_clock() - unix_s)

    def get(self, rid: str) -> ReqState | None:
        """The state of *rid* if it is mirrored."""
        return self._states.get(rid)

    @property
    def states(self) -> Mapping[str, ReqState]:
        """Every mirrored request's state by rid (a live read-only view)."""
        return self._view

    def waiting_states(
        self, queue: Iterable[ReqView], now_s: float
    ) -> tuple[list[ReqState], list[ReqState], list[ReqState]]:
        """The states of the waiting *queue*, in its order: all, the RT ones, the BE ones. A
        request whose state is fresh (nothing it is made of changed since its last refresh)
        is taken as it is; the others are refreshed (:meth:`waiting`)."""
        fresh = self._fresh
        every: list[ReqState] = []
        rt: list[ReqState] = []
        be: list[ReqState] = []
        for req in queue:
            entry = fresh.get(req.rid)
            if entry is not None and entry[1] == len(req.output_ids):
                state = entry[0]
            else:
                state = self.waiting(req, now_s)
            every.append(state)
            (rt if state.tier == "rt" else be).append(state)
        return every, rt, be

    def waiting(self, req: ReqView, now_s: float) -> ReqState:
        """The state of a request in the waiting queue (new, or retracted and re-queued)."""
        state = self._state(req, now_s)
        fill = len(req.origin_input_ids) + len(req.output_ids)
        state.prefill_len = fill
        # a prompt resumes from the KV the prefix cache holds for it (at least one token is
        # always computed): planned and predicted from there, as SGLang will run it
        matched = self._matched.get(state.rid)
        cached = max(self._cached.get(state.rid, 0), matched[0] if matched is not None else 0)
        state.prefilled = state.cached_len = min(cached, max(0, fill - 1))
        state.generated = len(req.output_ids)
        state.kv_tokens = 0
        state.kv_shared_tokens = 0
        state.num_evictions = int(getattr(req, "retraction_count", 0))
        state.is_running = False
        self._prefill_len[state.rid] = fill
        self._note_tokens(state, now_s)
        self._fresh[state.rid] = (state, state.generated)
        return state

    def running(self, req: ReqView, now_s: float, *, chunked: bool = False) -> ReqState:
        """The state of an admitted request (decoding, or *chunked*: mid-prefill)."""
        state = self._state(req, now_s)
        rid = state.rid
        self._fresh.pop(rid, None)
        self._cached.pop(rid, None)
        self._matched.pop(rid, None)  # a retracted request waits again: matched afresh
        fill = self._prefill_len.get(rid)
        if fill is None:  # admitted before the mirror saw it wait (plugin enabled mid-run)
            fill = self._prefill_len[rid] = len(req.origin_input_ids) + len(req.output_ids)
        state.prefill_len = fill
        prefilled = min(int(getattr(req, "prefix_len", 0) or 0), fill) if chunked else fill
        state.prefilled = prefilled
        state.generated = len(req.output_ids)
        kv = getattr(req, "kv", None)
        kv_tokens = int(getattr(kv, "kv_allocated_len", 0) or 0)
        state.kv_tokens = kv_tokens
        state.kv_shared_tokens = min(int(getattr(kv, "cache_protected_len", 0) or 0), kv_tokens)
        state.cached_len = min(int(getattr(req, "cached_tokens", 0) or 0), prefilled)
        state.num_evictions = int(getattr(req, "retraction_count", 0))
        state.is_running = True
        self._note_tokens(state, now_s)
        return state

    def note_cached(self, rid: str, tokens: int) -> None:
        """*rid* went back to the waiting queue with its first *tokens* prompt tokens' KV kept
        in the prefix cache: until it is admitted again, it waits with them prefilled."""
        self._cached[rid] = max(0, int(tokens))
        self._fresh.pop(rid, None)

    def note_match(self, rid: str, tokens: int, now_s: float) -> None:
        """The prefix cache held the first *tokens* tokens of waiting request *rid*'s prompt at
        *now_s* (SGLang's own prefix match): it waits with them prefilled."""
        self._matched[rid] = (max(0, int(tokens)), now_s)
        self._fresh.pop(rid, None)

    def matched_at(self, rid: str) -> float | None:
        """When *rid*'s cached prefix was last matched (None: never since it last waited)."""
        matched = self._matched.get(rid)
        return matched[1] if matched is not None else None

    def forget(self, rid: str) -> None:
        """Drops a request that left the engine (finished or aborted)."""
        self._states.pop(rid, None)
        self._fresh.pop(rid, None)
        self._prefill_len.pop(rid, None)
        self._seen.pop(rid, None)
        self._cached.pop(rid, None)
        self._matched.pop(rid, None)

    def sweep(self, live_rids: set[str]) -> int:
        """Drops every mirrored request not in *live_rids* (aborted while waiting, ...);
        returns how many were dropped."""
        gone = [rid for rid in self._states if rid not in live_rids]
        for rid in gone:
            self.forget(rid)
        return len(gone)

    def _state(self, req: ReqView, now_s: float) -> ReqState:
        rid = str(req.rid)
        state = self._states.get(rid)
        if state is None:
            state = self._states[rid] = self._new_state(req, rid, now_s)
        return state

    def _new_state(self, req: ReqView, rid: str, now_s: float) -> ReqState:
        meta = get_meta(req)
        prompt_len = len(req.origin_input_ids)
        max_new = int(getattr(req.sampling_params, "max_new_tokens", None) or 1 << 20)
        if meta is None:
            # No tandem metadata (SGLang's own /health probe, a client talking to the engine
            # directly): latency-sensitive but without targets, so never starved behind BE and
            # never urgent.
            return ReqState(
                rid=rid,
                tier="rt",
                arrival_s=now_s,
                prompt_len=prompt_len,
                max_new_tokens=max_new,
                prefill_len=prompt_len,
                is_probe=True,
            )
        arrival_s = min(self.to_engine_s(meta.arrival_unix_s), now_s)
        return ReqState(
            rid=rid,
            tier=meta.tier,
            arrival_s=arrival_s,
            prompt_len=prompt_len,
            max_new_tokens=max_new,
            length_key=meta.length_key,
            tenant_id=meta.tenant_id,
            tenant_weight=meta.tenant_weight,
            ttft_due_s=_engine_time(self, meta.ttft_due_unix_s),
            tpot_target_s=tpot_target_s(meta),
            deadline_due_s=_engine_time(self, meta.deadline_due_unix_s),
            prefill_len=prompt_len,
        )

    def _note_tokens(self, state: ReqState, now_s: float) -> None:
        """First/last token times, observed at iteration granularity (when the count grows)."""
        if state.generated <= 0 or self._seen.get(state.rid, 0) == state.generated:
            return
        self._seen[state.rid] = state.generated
        if state.first_token_s is None:
            state.first_token_s = now_s
        state.last_token_s = now_s


def _engine_time(mirror: ReqMirror, unix_s: float | None) -> float | None:
    return None if unix_s is None else mirror.to_engine_s(unix_s)
