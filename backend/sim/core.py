"""The simulated engine's state and how it executes one plan (shared by the discrete-event
simulator and the real-clock HTTP server).

One iteration, clock-agnostic::

    snap  = core.snapshot(now)            # persistent ReqState objects, updated in place
    plan  = policy.plan(snap)
    batch = core.apply(plan, now)         # validate; evict; admit; allocate KV (raises
                                          #   InfeasiblePlanError on a bad plan)
    ...the clock advances by latency.predict(batch.shape)...
    emitted, finished = core.finish(batch, end)   # emit tokens, publish prefix blocks, finish

KV per running request (page_size 1 shown)::

    [ pinned prefix blocks | private tokens: computed prompt … + one slot per decode ]
      kv_shared_tokens       kv_tokens − kv_shared_tokens

A prefill that completes `prefill_len` emits a token (the first, or after an eviction the next
one); every decode allocates one slot and emits one token. An evicted request frees everything
and waits again with prefill_len = prompt_len + generated (recompute); the full prompt blocks it
computed stay in the prefix cache (evictable), so its re-admission hits them.

The per-request records (`Track`, `Batch`) live in `track.py`, the prefix-cache matching of
waiting requests and the publishing of computed blocks in `prefix.py`.
"""

from __future__ import annotations

import msgspec

from backend.policy.bicache.records import BiCacheError
from backend.policy.common import round_up
from backend.policy.latency import BatchShape
from backend.policy.types import Plan, ReqState, Snapshot
from backend.sim.bikv import BiKv
from backend.sim.config import SimConfig
from backend.sim.kv import KvExhausted, KvPool
from backend.sim.prefix import PrefixMatcher
from backend.sim.queue import WaitQueue
from backend.sim.source import SimRequest
from backend.sim.track import Batch, Track


class InfeasiblePlanError(RuntimeError):
    """A policy returned a plan the engine cannot execute (a policy bug)."""


class EngineCore:
    """Waiting and running requests, the KV pool, and plan execution."""

    def __init__(self, config: SimConfig, policy_name: str) -> None:
        self.config = config
        self.policy_name = policy_name
        self.bikv = (
            None
            if config.kv_layout != "bicache"
            else BiKv(
                config.kv_capacity_tokens,
                config.bicache_block_slots,
                config.kv_bytes_per_token,
                config.host_copy_gb_s * 1e9,
                report=config.bicache_report,
            )
        )
        """The bidirectional layout (kv_layout "bicache"); None for the token pool."""
        self.kv: KvPool | BiKv = self.bikv or KvPool(
            config.kv_capacity_tokens, config.prefix_block_tokens
        )
        # Σ context² and Σ (prefix + chunk)² of the plan being applied (latency feature F_p)
        self._decode_context_sq = self._prefill_attn_full = 0.0
        self._computed: dict[str, int] = {}
        """This iteration's prefill chunks: rid → the tokens computed (not restored)."""
        self.tracks: dict[str, Track] = {}
        """Live requests (waiting or running) by rid."""
        self.arrived: list[Track] = []
        """Every request that arrived, in arrival order."""
        self.queue = WaitQueue()
        """Waiting requests (arrival order, and split by tier)."""
        self.running: list[ReqState] = []
        self.last_iteration_s: float | None = None
        self.num_evictions = 0
        self.prefix = PrefixMatcher(self.kv, config.prefix_block_tokens)
        """Waiting requests' prefix-cache hits, and the blocks requests offer to the cache."""

    @property
    def waiting(self) -> list[ReqState]:
        """Waiting requests in arrival order."""
        return self.queue.all

    # --- arrivals and snapshots -------------------------------------------------------------

    def add(self, req: SimRequest) -> Track:
        """A request arrives and waits."""
        if req.rid in self.tracks:
            raise ValueError(f"duplicate request id {req.rid!r}")
        if req.prompt_len < 1:
            raise ValueError(f"request {req.rid!r}: prompt_len must be ≥ 1")
        cfg = self.config
        state = ReqState(
            rid=req.rid,
            tier=req.tier,
            arrival_s=req.arrival_s,
            prompt_len=req.prompt_len,
            max_new_tokens=req.max_new_tokens,
            length_key=req.length_key,
            tenant_id=req.length_key if req.tenant_id is None else req.tenant_id,
            tenant_weight=req.tenant_weight,
            ttft_due_s=None if req.ttft_target_s is None else req.arrival_s + req.ttft_target_s,
            tpot_target_s=req.tpot_target_s,
            deadline_due_s=None if req.deadline_s is None else req.arrival_s + req.deadline_s,
            order_key=req.order_key,
            prefix_hashes=req.prefix_hashes,
            prefill_len=req.prompt_len,
        )
        usable = 0
        if cfg.prefix_cache:
            usable = min(len(req.prefix_hashes), req.prompt_len // cfg.prefix_block_tokens)
        track = Track(req, state, usable)
        if cfg.reveal_lengths:
            state.true_output_len = track.target
        self.tracks[req.rid] = track
        self.arrived.append(track)
        self.prefix.wait(track)
        self.queue.push(state)
        return track

    def snapshot(self, now_s: float) -> Snapshot:
        """The state a policy plans from (request objects by reference)."""
        self.prefix.rematch_touched()  # blocks came or went: re-match the requests under them
        if self.bikv is not None:
            self.bikv.refresh(self.running)
        cfg = self.config
        return Snapshot(
            now_s=now_s,
            waiting=self.queue.all,
            running=self.running,
            waiting_rt=self.queue.rt,
            waiting_be=self.queue.be,
            kv_capacity_tokens=cfg.kv_capacity_tokens,
            kv_free_tokens=self.kv.free,
            kv_evictable_tokens=self.kv.evictable,
            last_iteration_s=self.last_iteration_s,
            max_running=cfg.max_running,
            max_prefill_tokens=cfg.max_prefill_tokens,
            page_size=cfg.page_size,
        )

    # --- executing a plan -------------------------------------------------------------------

    def _fail(self, message: str) -> InfeasiblePlanError:
        return InfeasiblePlanError(
            f"policy {self.policy_name!r} made an infeasible plan: {message}"
        )

    def _live(self, rid: str, what: str) -> Track:
        t = self.tracks.get(rid)
        if t is None:
            raise self._fail(f"{what} names unknown or finished request {rid!r}")
        return t

    def apply(self, plan: Plan, now_s: float) -> Batch:
        """Validates and starts `plan`: evictions first, then admissions and KV allocation.
        Raises InfeasiblePlanError naming the policy when the plan breaks a rule."""
        for rid in plan.evictions:
            t = self._live(rid, "eviction")
            if not t.state.is_running:
                raise self._fail(f"evicts {rid!r}, which is not running")
            self._evict(t)
        if plan.evictions:
            self.num_evictions += len(plan.evictions)
            self.running = [s for s in self.running if s.is_running]
        decodes, need, context = self._check_decodes(plan)
        prefills, pf_need, shape_pf = self._start_prefills(plan, now_s)
        need += pf_need
        kv = self.kv
        # the bicache layout's counts are lower bounds; its placement is the real check
        if need > kv.free + kv.evictable and self.bikv is None:
            raise self._fail(
                f"needs {need} KV slots, only {kv.free} free + {kv.evictable} "
                f"evictable (capacity {kv.capacity})"
            )
        try:
            kv.allocate(need)
        except KvExhausted as exc:  # pragma: no cover - guarded by the check above
            raise self._fail(str(exc)) from None
        if self.bikv is not None:
            plan, decodes, context, prefills, shape_pf = self._place(
                self.bikv, plan, decodes, prefills, context, shape_pf
            )
        # the two squared terms feed the F_p feature (backends that recompute prefix attention)
        shape = BatchShape(
            prefill_tokens=shape_pf[0],
            num_prefill=len(prefills),
            prefill_attn=shape_pf[1],
            prefill_attn_full=self._prefill_attn_full,
            decode_context=context,
            num_decode=len(decodes),
            decode_context_sq=self._decode_context_sq,
        )
        return Batch(plan, now_s, decodes, prefills, shape, len(plan.evictions))

    def _place(
        self,
        bikv: BiKv,
        plan: Plan,
        decodes: list[Track],
        prefills: list[tuple[Track, int]],
        context: int,
        shape_pf: tuple[int, float],
    ) -> tuple[Plan, list[Track], int, list[tuple[Track, int]], tuple[int, float]]:
        """Puts the iteration's new tokens into the bidirectional layout; BE requests the
        engine retracts there (bikv.py) leave the batch, BE chunks it cuts short shrink: (plan,
        decodes, Σ context, chunks, (prefill tokens, prefill attention work)) as run."""
        retracted: list[ReqState] = []

        def retract(s: ReqState) -> None:
            self._evict(self.tracks[s.rid])
            retracted.append(s)

        try:
            dropped, cut = bikv.place(
                [t.state for t in decodes],
                [(t.state, n) for t, n in prefills],
                self.running,
                retract,
            )
        except BiCacheError as exc:
            raise self._fail(f"the bicache layout cannot place it: {exc}") from None
        if retracted:
            self.num_evictions += len(retracted)
            self.running = [s for s in self.running if s.is_running]
        if dropped:
            decodes = [t for t in decodes if t.state.rid not in dropped]
            plan = msgspec.structs.replace(
                plan, decodes=[r for r in plan.decodes if r not in dropped]
            )
            contexts = [t.state.prompt_len + t.state.generated for t in decodes]
            self._decode_context_sq = float(sum([c * c for c in contexts]))
            context = sum(contexts)
        if cut:
            prefills, shape_pf = self._cut_prefills(prefills, cut, shape_pf)
            kept = {t.state.rid: n for t, n in prefills}
            plan = msgspec.structs.replace(
                plan,
                prefills=[
                    msgspec.structs.replace(c, tokens=kept[c.rid])
                    for c in plan.prefills
                    if c.rid in kept
                ],
            )
        return plan, decodes, context, prefills, shape_pf

    def _cut_prefills(
        self, prefills: list[tuple[Track, int]], cut: dict[str, int], shape_pf: tuple[int, float]
    ) -> tuple[list[tuple[Track, int]], tuple[int, float]]:
        """Takes back the unplaced tail of each cut chunk (`_start_prefills` counted it): the
        request's progress, its KV count and the work of the batch. Restored tokens come first
        in a chunk, so the tail cut is computed work."""
        tokens_total, attn = shape_pf
        out: list[tuple[Track, int]] = []
        for t, n in prefills:
            c = cut.get(t.state.rid, 0)
            if not c:
                out.append((t, n))
                continue
            s = t.state
            end = s.prefilled  # where the chunk as planned ends
            computed = self._computed[s.rid]
            kept_computed = max(0, computed - c)
            tokens_total -= computed - kept_computed
            attn -= computed * end - kept_computed * (end - c)
            if computed:
                self._prefill_attn_full -= end * end
            if kept_computed:
                self._prefill_attn_full += (end - c) * (end - c)
            page = self.config.page_size
            self.kv.release(round_up(t.private, page) - round_up(t.private - c, page))
            s.prefilled -= c
            s.kv_tokens -= c
            t.private -= c
            if n > c:
                out.append((t, n - c))
        return out, (tokens_total, attn)

    def _check_decodes(self, plan: Plan) -> tuple[list[Track], int, int]:
        """The decode tracks, their KV slots and Σ context (validated, nothing mutated).
        Comprehensions rather than one loop: this runs once per decode per iteration."""
        tracks = self.tracks
        try:
            out = [tracks[rid] for rid in plan.decodes]
        except KeyError as exc:
            raise self._fail(f"decode names unknown or finished request {exc.args[0]!r}") from None
        states = [t.state for t in out]
        bad = [s.rid for s in states if not s.is_running or s.prefilled < s.prefill_len]
        if bad:
            raise self._fail(f"decodes {bad[0]!r}, which is not running and fully prefilled")
        if len(set(plan.decodes)) != len(out):
            raise self._fail("a request is decoded twice")
        contexts = [s.prompt_len + s.generated for s in states]
        self._decode_context_sq = float(sum([c * c for c in contexts]))
        page = self.config.page_size
        need = len(out) if page == 1 else page * sum([t.private % page == 0 for t in out])
        return out, need, sum(contexts)

    def _start_prefills(
        self, plan: Plan, now_s: float
    ) -> tuple[list[tuple[Track, int]], int, tuple[int, float]]:
        """Validates the chunks, admits new requests (pinning their cached prefix) and returns
        (chunks, KV slots needed, (prefill tokens, prefill attention work))."""
        cfg = self.config
        page = cfg.page_size
        out: list[tuple[Track, int]] = []
        need = tokens_total = planned = 0
        attn = 0.0
        self._prefill_attn_full = 0.0
        self._computed.clear()
        admitted = admitted_rt = 0
        for chunk in plan.prefills:
            t = self._live(chunk.rid, "prefill")
            s = t.state
            left = s.prefill_len - s.prefilled
            if not 1 <= chunk.tokens <= left:
                raise self._fail(
                    f"prefill of {chunk.rid!r}: {chunk.tokens} tokens, {left} left to prefill"
                )
            if chunk.tokens < left and chunk.tokens % page:
                raise self._fail(
                    f"prefill of {chunk.rid!r}: chunk {chunk.tokens} is not a "
                    f"multiple of page_size {page}"
                )
            if not s.is_running:
                self._admit(t, now_s)
                admitted += 1
                admitted_rt += s.tier == "rt"
            need += round_up(t.private + chunk.tokens, page) - round_up(t.private, page)
            planned += chunk.tokens
            # tokens restored from a checkpoint are copied, not computed
            computed = chunk.tokens - (self.bikv.restorable(s, chunk.tokens) if self.bikv else 0)
            self._computed[s.rid] = computed
            tokens_total += computed
            attn += computed * (s.prefilled + chunk.tokens)
            if computed:
                self._prefill_attn_full += (s.prefilled + chunk.tokens) ** 2
            out.append((t, chunk.tokens))
        if len({c.rid for c in plan.prefills}) != len(out):
            raise self._fail("a request has two prefill chunks")
        if planned > cfg.max_prefill_tokens:
            raise self._fail(
                f"{planned} prefill tokens > max_prefill_tokens {cfg.max_prefill_tokens}"
            )
        if admitted:
            if len(self.running) > cfg.max_running:
                raise self._fail(f"{len(self.running)} running > max_running {cfg.max_running}")
            self.queue.drop_admitted(admitted_rt, admitted - admitted_rt)
        for t, tokens in out:
            s = t.state
            s.prefilled += tokens
            s.kv_tokens += tokens
            t.private += tokens
        return out, need, (tokens_total, attn)

    def _admit(self, t: Track, now_s: float) -> None:
        """A waiting request becomes running; its cached prefix blocks are pinned."""
        s = t.state
        self.prefix.unwait(t)
        if self.bikv is not None:
            self.bikv.admit(s)
        n = s.cached_len // self.config.prefix_block_tokens
        if n:
            t.pinned = list(t.keys[:n])
            self.kv.pin(t.pinned)
        s.kv_tokens = s.kv_shared_tokens = s.cached_len
        s.is_running = True
        if t.first_cached is None:
            t.first_cached = s.cached_len
            t.admitted_s = now_s
        self.running.append(s)

    # --- ending an iteration ----------------------------------------------------------------

    def finish(self, batch: Batch, end_s: float) -> tuple[list[str], list[Track]]:
        """Emits the iteration's tokens at `end_s`; returns (emitting rids, finished tracks)."""
        emitted = list(batch.plan.decodes)
        finished: list[Track] = []
        for t in batch.decodes:  # the hot loop: one pass per decode per iteration
            s = t.state
            generated = s.generated + 1
            s.generated = generated
            s.kv_tokens += 1
            t.private += 1
            s.last_token_s = end_s
            t.times.append(end_s)
            if generated >= t.target:
                finished.append(t)
        for t, _ in batch.prefills:
            s = t.state
            if s.prefilled < s.prefill_len:
                continue
            self.prefix.publish(t, pinned=True)
            s.generated += 1
            s.last_token_s = end_s
            if s.first_token_s is None:
                s.first_token_s = end_s
            t.times.append(end_s)
            emitted.append(s.rid)
            if s.generated >= t.target:
                finished.append(t)
        for t in finished:
            self._release(t)
            t.finish_s = end_s
            del self.tracks[t.state.rid]
        if finished:
            self.running = [s for s in self.running if s.is_running]
        self.last_iteration_s = end_s - batch.start_s
        return emitted, finished

    def abort(self, rid: str) -> Track | None:
        """Drops a live request (waiting or running), freeing its KV; None if unknown."""
        t = self.tracks.pop(rid, None)
        if t is None:
            return None
        if t.state.is_running:
            self._release(t)
            self.running = [s for s in self.running if s.is_running]
        else:
            self.prefix.unwait(t)
            self.queue.remove(t.state)
        return t

    def _release(self, t: Track, *, keep: bool = False) -> None:
        """Frees a request's KV (its pinned blocks stay cached, now maybe evictable). `keep`:
        the bicache layout keeps it in place (a lazy eviction, see bikv.py)."""
        if self.bikv is not None and not keep:
            self.bikv.drop(t.state)
        if t.pinned:
            self.kv.unpin(t.pinned)
            t.pinned = []
        self.kv.release(round_up(t.private, self.config.page_size))
        t.private = 0
        s = t.state
        s.kv_tokens = s.kv_shared_tokens = 0
        s.is_running = False

    def _evict(self, t: Track) -> None:
        """Frees its KV and re-queues it for recompute of prompt + generated."""
        if self.config.prefix_cache:
            self.prefix.publish(t, pinned=False)
        self._release(t, keep=True)
        s = t.state
        s.num_evictions += 1
        s.prefill_len = s.prompt_len + s.generated
        s.prefilled = s.cached_len = 0
        if self.bikv is not None:
            self.bikv.evict(s)  # BE: KV stays (dormant), prefilled = what is still on device
        self.prefix.wait(t)
        self.queue.push(s)
