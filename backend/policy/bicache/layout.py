"""The bicache layout's public class: `BiCache` (queries, allocate, protect, release) over the
block map (`blocks.py`) and the checkpoint ledger (`checkpoints.py`); the package docstring has
the picture."""

from __future__ import annotations

from backend.policy.bicache.checkpoints import CheckpointLedger
from backend.policy.bicache.records import (
    DEFAULT_BLOCK_SLOTS,
    HOST,
    BiCacheError,
    Grant,
    NeedsRestore,
    ReqKv,
    Step,
)
from common.wire import Tier


class BiCache(CheckpointLedger):
    """Block table, direction (RT left / BE right), preemption ledger (host segments)."""

    def __init__(self, num_blocks: int, block_slots: int = DEFAULT_BLOCK_SLOTS) -> None:
        super().__init__(num_blocks, block_slots)
        self.borrowed_total = 0
        """RT slots ever placed in a block that had a BE owner at the time."""

    # --- queries ------------------------------------------------------------------------------

    def __contains__(self, rid: str) -> bool:
        return rid in self._reqs

    def requests(self) -> list[str]:
        """Every request holding slots or checkpoints."""
        return list(self._reqs)

    def length(self, rid: str) -> int:
        """Tokens the request has (on device or on host)."""
        return self._req(rid).length if rid in self._reqs else 0

    def is_dormant(self, rid: str) -> bool:
        return rid in self._reqs and self._reqs[rid].dormant

    def slots(self, rid: str) -> list[int]:
        """Its device slot per token, in token order; HOST (-1) for checkpointed tokens. This is
        the request's row of the token→slot table: attention reads KV through it, so the
        direction of a block needs no kernel change in a token-granular pool."""
        out: list[int] = []
        b = self.b
        for blk, count in self._req(rid).segs:
            if blk == HOST:
                out.extend([HOST] * count)
            elif self._req(rid).tier == "rt":
                out.extend(range(blk * b, blk * b + count))
            else:
                top = blk * b + b - 1
                out.extend(range(top, top - count, -1))
        return out

    def shared(self, rid: str) -> int:
        """Its slots in blocks whose other side has an owner too: dropping (RT) or suspending
        (BE) it does not give those slots to a new request of either tier."""
        return self._shared.get(rid, 0)

    # --- operations ---------------------------------------------------------------------------

    def allocate(self, rid: str, tier: Tier, n: int, *, steal: bool = True) -> Grant:
        """`n` more slots for `rid` (registered on first use). RT may overwrite dormant BE
        slots when `steal`; BE may take over dormant BE segments when `steal`. Raises NoRoom
        (nothing changed) when the slots cannot be found, NeedsRestore for a BE request with
        checkpointed tokens, BiCacheError for a dormant request or a tier change."""
        if n < 0:
            raise ValueError(f"allocate: n must be ≥ 0, got {n}")
        req = self._reqs.get(rid)
        if req is not None:
            if req.tier != tier:
                raise BiCacheError(f"request {rid!r} is {req.tier}, not {tier}")
            if req.dormant:
                raise BiCacheError(f"request {rid!r} is dormant: resume it first")
            if req.segs and req.segs[-1][0] == HOST:
                raise NeedsRestore(f"request {rid!r} has {req.on_host} tokens on the host")
        if n == 0:
            return Grant((), ())
        if tier == "rt":
            plan = self._plan_rt(rid, req, n, steal)
        else:
            plan = self._plan_be(rid, req, n, steal, grow=True)
        if req is None:
            req = self._reqs[rid] = ReqKv(tier, [])
        return self._commit(rid, req, plan)

    def protect(self, rid: str, tokens: int) -> None:
        """Its first `tokens` tokens must never be overwritten (e.g. a prefix the radix cache
        shares); a later call replaces the count. Raises BiCacheError when some of them are
        checkpointed (restore them first: only KV on the device can be shared)."""
        req = self._req(rid)
        on_host = [i for i in self.checkpointed(rid) if i < tokens]
        if on_host:
            raise BiCacheError(
                f"request {rid!r}: token {on_host[0]} is on the host, restore "
                f"before protecting {tokens} tokens"
            )
        req.protected = max(0, tokens)
        for blk, _ in req.segs:
            if blk != HOST:
                self._index(blk)

    def release(self, rid: str) -> int:
        """Frees every slot of `rid` and drops its checkpoints; returns how many checkpointed
        tokens were dropped (a finished or aborted request is never restored)."""
        req = self._reqs.pop(rid, None)
        if req is None:
            return 0
        dropped = 0
        for blk, count in req.segs:
            if blk == HOST:
                dropped += count
                continue
            self.used -= count
            if req.dormant:
                self.dormant_used -= count
            if req.tier == "rt":
                self.rt_owner[blk], self.rt_fill[blk] = None, 0
            else:
                self.be_owner[blk], self.be_fill[blk] = None, 0
            self._index(blk)
        self.on_host -= dropped
        self.discarded_total += dropped
        self._shared.pop(rid, None)
        return dropped

    def _commit(self, rid: str, req: ReqKv, plan: list[Step]) -> Grant:
        """Carries out a plan of `_plan_rt` / `_plan_be`: checkpoints first, then the slots."""
        checkpoints = list(self._take_over(plan))
        slots: list[int] = []
        b = self.b
        for k, take, ov, _ in plan:
            if req.tier == "rt":
                if self.rt_owner[k] is None:
                    self.rt_owner[k] = rid
                    req.segs.append([k, 0])
                if self.be_owner[k] is not None:
                    self.borrowed_total += take + ov
                for _ in range(ov):
                    owner = self.be_owner[k]
                    assert owner is not None
                    checkpoints.append(self._checkpoint_inner(k, owner))
                start = self.rt_fill[k]
                self.rt_fill[k] = start + take + ov
                slots.extend(range(k * b + start, k * b + start + take + ov))
            else:
                for _ in range(take):
                    slots.append(self._place_be(rid, k))
                if req.segs and req.segs[-1][0] == k:
                    req.segs[-1][1] += take
                else:
                    req.segs.append([k, take])
                continue
            req.segs[-1][1] += take + ov
            self.used += take + ov
            self._index(k)
        return Grant(tuple(slots), tuple(checkpoints))
