"""The simulated KV pool under BROS's bidirectional layout (`SimConfig.kv_layout = "bicache"`).

The token-granular pool of `kv.py` (SGLang with page_size 1) lets any request use any free
slot, and an eviction drops the request's KV: it is recomputed on re-admission. Here the pool is
`backend.policy.bicache.layout.BiCache` (blocks of b slots, RT from the left, BE from the right)
and an eviction of a BE request is *lazy*:

* the request goes back to the waiting queue as the policy asked, but its KV stays where it is
  (the request is *dormant*); the policy sees those slots as evictable, like unreferenced
  prefix-cache blocks, and sees the request as partly prefilled: `prefilled` = its tokens still
  on the device;
* when an allocation needs the room, the dormant slots it overwrites are first copied to the host
  (device→host checkpoint: RT takes single slots from the inner end, BE takes a block's whole
  dormant segment, since two BE requests never share a block) and the dormant request's
  `prefilled` drops by as many tokens;
* when the policy re-admits it, prefill chunks first restore the checkpointed tokens (host→device
  copies, no compute) and compute only the rest: at least the one token whose KV never existed
  (the last one emitted).

RT evictions are not lazy (BROS never checkpoints RT): the RT request's KV is dropped and
recomputed, as in the token pool.

Costs: every checkpointed or restored token moves `kv_bytes_per_token` over the host link at
`host_copy_bytes_per_s`. A checkpoint must finish before the forward pass overwrites its slots,
so device→host time adds to the iteration; restores overlap with compute (BROS issues them on
separate streams before dispatch: T = max(T_exec, T_swap)). Iteration time is therefore
`d2h + max(exec, h2d)`.

What the policy is told (it does not know the layout), `SimConfig.bicache_report`:
"placeable" (default) reports lower bounds, the smaller of the free slots a new RT and a new BE
request could use (a BE request's unused block tail is usable by RT only, an RT request's by BE
only) as `kv_free_tokens` and the dormant slots RT could take over as `kv_evictable_tokens`;
"slots" reports every free and every dormant slot, as SGLang's `available_size()` would. Either
way a running request's `kv_shared_tokens` are its slots in shared blocks (evicting it does not
hand those to anybody).
Slot counts cannot say everything: a block hosts one request per side, so ten RT requests whose
last blocks are full need ten blocks with RT room, whatever the slot count says.

When the layout cannot place a planned token, the engine does what SGLang's scheduler does when
a decode does not fit (`retract_decode`) and what BROS's RT allocation does: it evicts a running
BE request (lazily, so RT may take its slots), one that sits this iteration out first, else one
whose decode it then drops from the batch; for RT under BROS's "extreme pressure", then another
RT request (least progress first, recomputed later); last, the decode that does not fit itself.
A started prefill is never retracted; a BE prompt chunk the layout cannot hold is cut to what it
can (SGLang's prefill adder cuts a chunk to the room there is), possibly to nothing: it waits,
running, for a later iteration. Those engine evictions are counted (`retractions`) and
the policy sees them as evictions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from backend.policy.bicache.layout import BiCache
from backend.policy.bicache.records import Checkpoint, NoRoom
from backend.policy.types import ReqState


class BiKv:
    """The layout, plus this iteration's host traffic and the run's counters."""

    def __init__(
        self,
        capacity_tokens: int,
        block_slots: int,
        kv_bytes_per_token: int,
        host_copy_bytes_per_s: float,
        *,
        report: str = "placeable",
    ) -> None:
        blocks = capacity_tokens // block_slots
        if blocks < 1:
            raise ValueError(
                f"a KV pool of {capacity_tokens} tokens holds no block of {block_slots} slots"
            )
        self.cache = BiCache(blocks, block_slots)
        self.report = report
        """"placeable": the policy sees only what a new request of either tier could surely
        use; "slots": every free and dormant slot (as SGLang's available_size would)."""
        self.seconds_per_token = kv_bytes_per_token / host_copy_bytes_per_s
        """Host-link time of one token's KV (all layers, K and V)."""
        self.d2h_tokens = 0
        """Tokens checkpointed during the current iteration."""
        self.h2d_tokens = 0
        """Tokens restored during the current iteration."""
        self.lazy_evictions = 0
        """BE evictions that kept the KV in place."""
        self.retractions = 0
        """BE requests the engine evicted because the layout could not place a token."""
        self._waiting: dict[str, ReqState] = {}  # dormant requests, to update their `prefilled`

    # --- what the policy sees -----------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def used(self) -> int:
        """Slots holding KV (dormant requests included)."""
        return self.cache.used

    @property
    def free(self) -> int:
        """Free slots ("placeable": usable by a new request of either tier)."""
        if self.report == "slots":
            return self.cache.free
        return min(self.cache.room("rt"), self.cache.room("be"))

    @property
    def evictable(self) -> int:
        """Dormant slots ("placeable": those RT may take over, each checkpointed first)."""
        if self.report == "slots":
            return self.cache.dormant_used
        return self.cache.reclaimable("rt")

    # --- the count interface of KvPool that EngineCore calls (placement happens in grow) ---

    touched: set[int] = frozenset()  # type: ignore[assignment]
    """No prefix cache with this layout: nothing to re-match."""

    def match(self, hashes: object, max_blocks: int) -> int:
        return 0

    def pin(self, hashes: object) -> None:
        pass

    def unpin(self, hashes: object) -> None:
        pass

    def publish(self, h: int, root: int, *, pinned: bool) -> bool:
        raise AssertionError("the bicache layout models no prefix cache")  # pragma: no cover

    def allocate(self, slots: int) -> None:
        pass

    def release(self, slots: int) -> None:
        pass

    def check(self) -> None:
        assert 0 <= self.cache.used <= self.cache.capacity

    def refresh(self, running: list[ReqState]) -> None:
        """Before a snapshot: a running request's `kv_shared_tokens` are its slots in shared
        blocks, which evicting it does not make usable by others (policies count an
        eviction as freeing kv_tokens − kv_shared_tokens)."""
        shared = self.cache.shared
        for s in running:
            s.kv_shared_tokens = shared(s.rid)

    # --- request life cycle ---------------------------------------------------------------------

    def evict(self, s: ReqState) -> None:
        """After core set prefill_len for recompute: BE keeps its KV in place (dormant), RT
        drops it."""
        rid = s.rid
        if s.tier == "be" and rid in self.cache:
            self.cache.suspend(rid)
            self._waiting[rid] = s
            self.lazy_evictions += 1
            s.prefilled = s.cached_len = self.cache.length(rid) - self.cache.host_tokens(rid)
        else:
            self.cache.release(rid)
            s.prefilled = s.cached_len = 0

    def admit(self, s: ReqState) -> None:
        """A waiting request is admitted: a dormant one owns its slots again."""
        if self._waiting.pop(s.rid, None) is not None:
            self.cache.resume(s.rid)

    def drop(self, s: ReqState) -> None:
        """A request ended (finished or aborted): its slots and checkpoints go."""
        self._waiting.pop(s.rid, None)
        self.cache.release(s.rid)

    def restorable(self, s: ReqState, tokens: int) -> int:
        """Of a prefill chunk of `tokens`, how many come back from the host (not computed)."""
        return min(tokens, self.cache.host_tokens(s.rid)) if s.rid in self.cache else 0

    def grow(self, s: ReqState, tokens: int) -> None:
        """Places `tokens` more tokens of an admitted request: restores first, then new slots.
        Raises BiCacheError when the layout cannot place them."""
        rid = s.rid
        restore = self.restorable(s, tokens)
        if restore:
            result = self.cache.restore(rid, restore)
            self.h2d_tokens += len(result.loads)
            self._checkpointed(result.checkpoints)
        if tokens > restore:
            grant = self.cache.allocate(rid, s.tier, tokens - restore)
            self._checkpointed(grant.checkpoints)

    def place(
        self,
        decodes: Sequence[ReqState],
        prefills: Sequence[tuple[ReqState, int]],
        running: Sequence[ReqState],
        retract: Callable[[ReqState], None],
    ) -> tuple[set[str], dict[str, int]]:
        """Places an iteration's tokens (RT first), retracting BE requests where the layout
        cannot place one (see the module docstring). Returns the rids whose decode was dropped,
        and the BE prefill chunks cut short: rid → the tokens of its chunk left unplaced (SGLang's
        prefill adder cuts a chunk to the room there is; the policy's free count is a bound for
        one new request, and several BE requests growing at once each waste their last block's
        tail). Raises NoRoom when an RT token or a decode finds no room even so."""
        in_batch = {s.rid for s in decodes}  # decodes only: a prefill is never retracted
        chunked = {s.rid for s, _ in prefills}
        dropped: set[str] = set()
        cut: dict[str, int] = {}
        be_chunks = {s.rid for s, _ in prefills if s.tier == "be"}
        steps = [(s, 1) for s in decodes if s.tier == "rt"]
        steps += [(s, n) for s, n in prefills if s.tier == "rt"]
        steps += [(s, 1) for s in decodes if s.tier == "be"]
        steps += [(s, n) for s, n in prefills if s.tier == "be"]
        cache = self.cache
        for s, tokens in steps:
            left = tokens
            while left and s.rid not in dropped:
                before = cache.length(s.rid) - cache.host_tokens(s.rid)
                try:
                    self.grow(s, left)
                    break
                except NoRoom:
                    left -= cache.length(s.rid) - cache.host_tokens(s.rid) - before
                    victim = self._victim(s, running, in_batch, chunked | dropped)
                    if victim is None:
                        if s.rid in be_chunks and s.rid not in in_batch:
                            cut[s.rid] = left
                            break
                        raise
                    retract(victim)
                    self.retractions += 1
                    if victim.rid in in_batch:
                        dropped.add(victim.rid)
        return dropped, cut

    def _victim(
        self, needy: ReqState, running: Sequence[ReqState], in_batch: set[str], exclude: set[str]
    ) -> ReqState | None:
        """Whom to retract for `needy` (never a request with a prefill chunk in the batch):
        a BE request, one sitting this iteration out first, the one whose retraction gives
        `needy`'s tier the most slots; for RT, then another RT request (out of the batch first,
        least progress first: SGLang's retract order), BROS's "extreme pressure" case; last,
        `needy` itself if it is a decode."""
        shared = self.cache.shared
        live = [
            s
            for s in running
            if s.is_running and s is not needy and s.rid not in exclude and s.rid in self.cache
        ]
        be = [s for s in live if s.tier == "be"]
        if be:

            def gain(s: ReqState) -> tuple[bool, int]:
                usable = s.kv_tokens - (shared(s.rid) if needy.tier == "rt" else 0)
                return (s.rid not in in_batch, usable)

            return max(be, key=gain)
        rt = [s for s in live if s.tier == "rt"] if needy.tier == "rt" else []
        if rt:
            return min(rt, key=lambda s: (s.rid in in_batch, s.generated))
        if needy.rid in in_batch and needy.rid not in exclude:
            return needy
        return None

    def _checkpointed(self, checkpoints: tuple[Checkpoint, ...]) -> None:
        if not checkpoints:
            return
        self.d2h_tokens += len(checkpoints)
        for rid in {c.rid for c in checkpoints}:
            s = self._waiting[rid]  # only dormant (waiting) requests lose slots
            s.prefilled = s.cached_len = self.cache.length(rid) - self.cache.host_tokens(rid)

    # --- time ---------------------------------------------------------------------------------

    def iteration_s(self, exec_s: float) -> float:
        """The iteration's duration with its host traffic, and resets the traffic."""
        d2h = self.d2h_tokens * self.seconds_per_token
        h2d = self.h2d_tokens * self.seconds_per_token
        self.d2h_tokens = self.h2d_tokens = 0
        return d2h + max(exec_s, h2d)

    def stats(self) -> dict[str, int]:
        """Run counters for the report."""
        c = self.cache
        return {
            "checkpointed_tokens": c.checkpointed_total,
            "restored_tokens": c.restored_total,
            "discarded_checkpoint_tokens": c.discarded_total,
            "rt_tokens_in_be_blocks": c.borrowed_total,
            "lazy_evictions": self.lazy_evictions,
            "engine_retractions": self.retractions,
        }
