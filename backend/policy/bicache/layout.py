"""Bidirectional KV blocks with lazy checkpointing (BROS §2.7): pure slot bookkeeping.

The KV pool is cut into blocks of `block_slots` (b, default 16) token slots. A block hosts at most
one real-time (RT) and one best-effort (BE) request: the RT request fills it from the left, the BE
request from the right::

      slot:  0    1    2    3    4    5    6    7    8    9   10   11   12   13   14   15
           +----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+
    blk 7  | R0 | R1 | R2 | R3 | R4 |    |    |    |    |    | B5 | B4 | B3 | B2 | B1 | B0 |
           +----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+
             RT "a" → rt_fill = 5        free (either side)        ← be_fill = 6, BE "x"

    RT "a" grows right, BE "x" grows left. Once the fronts meet, only RT may go on, and only
    over a BE request the scheduler has given up for now (a *dormant* one, see below):

           +----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+
    blk 7  | R0 | R1 | R2 | R3 | R4 | R5 | R6 | R7 | R8 | R9 | R10| R11| B3 | B2 | B1 | B0 |
           +----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+----+
                                                          ↑ B5, B4 were copied to host
                                                            (checkpointed) just before
                                                            R10, R11 overwrote them

Each request's KV is a list of *segments* in logical (token) order: a run of slots in one block,
or a run of checkpointed tokens held on the host. For BE "x" above the list is
`[..., (blk 7: B0–B3), (host: B4, B5), ...]`. A BE request with any host segment must be restored
(`restore`: host→device copies into fresh slots) before it can run again; this never needs a
device→device move, because the restored tokens simply form a new segment in another block.

Who may use which free slots:

* RT: the left part of a block without an RT owner, as BROS's FindBlock / FindPreemptBlock: its
  own last block; then free blocks; then the free tail of a BE block, most room first
  ("borrowing"); then, with `steal=True`, slots of a dormant BE request, inner end first, each one
  checkpointed first.
* BE: the right part of a block without a BE owner: its own last block, then free blocks, then
  the free tail of an RT block, most room first; then the segment of a *dormant* BE request,
  which is checkpointed whole (two BE requests never share a block). BE never overwrites RT.

A BE request is *dormant* between `suspend` (the scheduler evicted it: its KV stays in place
until the room is needed, and only what is overwritten is copied out: lazy checkpointing) and
`resume`. Tokens marked with `protect` (a prefix the radix cache shares with other requests) are
never overwritten.

No torch, no sglang: `backend/sglang_ext/kv_layout.py` turns the slot lists and checkpoint
records into tensor copies, and the simulator (`backend/sim/bikv.py`) into copy time.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.policy.types import Tier

HOST = -1
"""Block id of a segment whose tokens are checkpointed on the host."""
DEFAULT_BLOCK_SLOTS = 16
"""BROS's block size, slots."""


class BiCacheError(Exception):
    """A request that the bookkeeping cannot serve (state left unchanged)."""


class NoRoom(BiCacheError):
    """Not enough usable slots for the allocation or restore."""


class NeedsRestore(BiCacheError):
    """A BE request with checkpointed tokens asked for more slots: restore it first."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A BE token whose slot is about to be overwritten: copy it to the host *before* the
    allocation's new owner writes the slot."""

    rid: str
    """The BE request the token belongs to."""
    index: int
    """Its logical position in that request (0 = first prompt token)."""
    slot: int
    """The device slot it occupies until the copy."""


@dataclass(frozen=True, slots=True)
class Grant:
    """The outcome of an allocation."""

    slots: tuple[int, ...]
    """The new slots, in the request's token order (write the new tokens' KV here)."""
    checkpoints: tuple[Checkpoint, ...]
    """Tokens to copy to the host first (the slots they occupy may be among `slots`)."""


@dataclass(frozen=True, slots=True)
class Restore:
    """The outcome of a restore."""

    rid: str
    """The BE request restored."""
    loads: tuple[tuple[int, int], ...]
    """Host→device copies, (logical index, destination slot), in token order."""
    checkpoints: tuple[Checkpoint, ...] = ()
    """Dormant tokens of *other* requests whose slots the restore takes over: copy them to the
    host before the loads."""


@dataclass(slots=True)
class _Req:
    tier: Tier
    segs: list[list[int]]  # [block or HOST, count], in token order
    protected: int = 0  # leading tokens that must not be overwritten
    dormant: bool = False

    @property
    def length(self) -> int:
        return sum(c for _, c in self.segs)

    @property
    def on_host(self) -> int:
        return sum(c for blk, c in self.segs if blk == HOST)


class BiCache:
    """Block table, direction (RT left / BE right), preemption ledger (host segments)."""

    def __init__(self, num_blocks: int, block_slots: int = DEFAULT_BLOCK_SLOTS) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be ≥ 1, got {num_blocks}")
        if block_slots < 2:
            raise ValueError(f"block_slots must be ≥ 2, got {block_slots}")
        self.num_blocks = num_blocks
        self.b = block_slots
        """Slots per block."""
        self.rt_owner: list[str | None] = [None] * num_blocks
        self.rt_fill = [0] * num_blocks
        """Slots [0, rt_fill) of the block hold its RT owner's tokens."""
        self.be_owner: list[str | None] = [None] * num_blocks
        self.be_fill = [0] * num_blocks
        """Slots [b - be_fill, b) hold its BE owner's tokens (first token at slot b - 1)."""
        self._reqs: dict[str, _Req] = {}
        # indexes, kept exact by _index(): ordered sets (dicts) of block ids
        self._rt_room: list[dict[int, None]] = [{} for _ in range(block_slots + 1)]
        """by left room, blocks without an RT owner"""
        self._be_room: list[dict[int, None]] = [{} for _ in range(block_slots + 1)]
        """by right room, blocks without a BE owner"""
        self._dormant: dict[int, None] = {}
        """blocks whose BE owner is dormant"""
        self._where: list[tuple[int, int, bool]] = [(-1, -1, False)] * num_blocks
        self._pair: list[tuple[tuple[str, int], ...]] = [()] * num_blocks
        self._shared: dict[str, int] = {}  # rid -> its slots in blocks it shares
        self.used = 0
        """Slots holding a token (of a live or dormant request)."""
        self.dormant_used = 0
        """Of `used`, slots of dormant BE requests (reusable after a checkpoint)."""
        self.on_host = 0
        """Tokens checkpointed on the host now."""
        self.checkpointed_total = 0
        """Tokens ever checkpointed."""
        self.restored_total = 0
        """Tokens ever restored."""
        self.discarded_total = 0
        """Checkpointed tokens dropped because their request ended."""
        self.borrowed_total = 0
        """RT slots ever placed in a block that had a BE owner at the time."""
        for k in range(num_blocks):
            self._index(k)

    # --- queries ------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Slots in the pool."""
        return self.num_blocks * self.b

    @property
    def free(self) -> int:
        """Slots holding nothing."""
        return self.capacity - self.used

    def __contains__(self, rid: str) -> bool:
        return rid in self._reqs

    def requests(self) -> list[str]:
        """Every request holding slots or checkpoints."""
        return list(self._reqs)

    def tier_of(self, rid: str) -> Tier:
        return self._req(rid).tier

    def length(self, rid: str) -> int:
        """Tokens the request has (on device or on host)."""
        return self._req(rid).length if rid in self._reqs else 0

    def host_tokens(self, rid: str) -> int:
        """Its tokens checkpointed on the host (0 = ready to run)."""
        return self._req(rid).on_host if rid in self._reqs else 0

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

    def checkpointed(self, rid: str) -> list[int]:
        """Logical indices of its tokens on the host."""
        out: list[int] = []
        pos = 0
        for blk, count in self._req(rid).segs:
            if blk == HOST:
                out.extend(range(pos, pos + count))
            pos += count
        return out

    def room(self, tier: Tier) -> int:
        """Free slots a *new* request of `tier` could take without any checkpoint."""
        rooms = self._rt_room if tier == "rt" else self._be_room
        return sum(r * len(blocks) for r, blocks in enumerate(rooms))

    def reclaimable(self, tier: Tier) -> int:
        """Slots of dormant BE requests that an allocation of `tier` could take over (after a
        checkpoint): RT takes any unprotected one in a block without an RT owner, BE whole
        unprotected segments."""
        total = 0
        for k in self._dormant:
            owner = self.be_owner[k]
            assert owner is not None
            if tier == "rt" and self.rt_owner[k] is None:
                total += self._stealable(k, owner)
            elif tier == "be" and self._evictable(k, owner):
                total += self.be_fill[k]
        return total

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
            req = self._reqs[rid] = _Req(tier, [])
        return self._commit(rid, req, plan)

    def suspend(self, rid: str) -> None:
        """The scheduler evicted BE request `rid`: its slots stay as they are but may be taken
        over (each checkpointed first) until `resume`."""
        req = self._req(rid)
        if req.tier != "be":
            raise BiCacheError(f"only BE requests can be suspended, {rid!r} is {req.tier}")
        if req.dormant:
            return
        req.dormant = True
        for blk, count in req.segs:
            if blk != HOST:
                self.dormant_used += count
                self._index(blk)

    def resume(self, rid: str) -> None:
        """Its remaining slots are its own again (checkpointed tokens stay on the host until
        `restore`)."""
        req = self._req(rid)
        if not req.dormant:
            return
        req.dormant = False
        for blk, count in req.segs:
            if blk != HOST:
                self.dormant_used -= count
                self._index(blk)

    def restore(self, rid: str, max_tokens: int | None = None) -> Restore:
        """Brings checkpointed tokens of BE request `rid` back into fresh slots, in token order,
        at most `max_tokens` (None: all). Fresh slots come from BE room, then from dormant
        segments of other requests (checkpointed whole, reported in `Restore.checkpoints`).
        Raises NoRoom (nothing changed) when the room is missing."""
        req = self._req(rid)
        if req.dormant:
            raise BiCacheError(f"request {rid!r} is dormant: resume it first")
        want = req.on_host if max_tokens is None else min(max_tokens, req.on_host)
        if want <= 0:
            return Restore(rid, ())
        # plan every host run first (read-only): a request has one segment per block, so each
        # run goes to blocks no earlier run of this restore uses
        runs: list[list[tuple[int, int, int, bool]]] = []
        used: set[int] = set()
        left = want
        for blk, count in req.segs:
            if blk == HOST and left:
                take = min(count, left)
                run = self._plan_be(rid, req, take, True, grow=False, exclude=used)
                used.update(k for k, _, _, _ in run)
                runs.append(run)
                left -= take
        taken = tuple(cp for run in runs for cp in self._take_over(run))
        loads: list[tuple[int, int]] = []
        new_segs: list[list[int]] = []
        pos = 0
        left = want
        for blk, count in req.segs:
            if blk != HOST or left == 0:
                new_segs.append([blk, count])
                pos += count
                continue
            take = min(count, left)
            i = 0
            for dst_blk, room, _, _ in runs.pop(0):
                new_segs.append([dst_blk, room])
                for _ in range(room):
                    loads.append((pos + i, self._place_be(rid, dst_blk)))
                    i += 1
            if count > take:
                new_segs.append([HOST, count - take])
            pos += count
            left -= take
        req.segs = new_segs
        self.on_host -= want
        self.restored_total += want
        return Restore(rid, tuple(loads), taken)

    def protect(self, rid: str, tokens: int) -> None:
        """Its first `tokens` tokens must never be overwritten (e.g. a prefix the radix cache
        shares); a later call replaces the count. Raises BiCacheError when some of them are
        checkpointed (restore them first: only KV on the device can be shared)."""
        req = self._req(rid)
        on_host = [i for i in self.checkpointed(rid) if i < tokens]
        if on_host:
            raise BiCacheError(f"request {rid!r}: token {on_host[0]} is on the host, restore "
                               f"before protecting {tokens} tokens")
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

    # --- planning (read-only) and commit --------------------------------------------------------

    def _plan_rt(self, rid: str, req: _Req | None, n: int,
                 steal: bool) -> list[tuple[int, int, int, bool]]:
        """Steps (block, free slots taken, dormant slots overwritten, False) covering n: free
        room everywhere first, then overwrites, which must continue the last block of the
        plan (an RT run in a block is contiguous from slot 0) or open a dormant BE block."""
        b = self.b
        plan: list[tuple[int, int, int, bool]] = []
        left = n
        last = req.segs[-1][0] if req is not None and req.segs else HOST
        used = {last}
        if last != HOST:
            take = min(left, b - self.be_fill[last] - self.rt_fill[last])
            plan.append((last, take, 0, False))
            left -= take
        left = self._fill_most_room(self._rt_room, left, used, plan)  # free blocks, BE tails
        if left and steal and plan:
            k, take, _, _ = plan[-1]
            ov = min(left, self._stealable(k, self.be_owner[k]))
            plan[-1] = (k, take, ov, False)
            left -= ov
        if left and steal:
            # dormant blocks with no free slot, those of already-hit requests first (one BE
            # request stalled rather than several)
            cands = [k for k in self._dormant if k not in used and self.rt_owner[k] is None]
            cands.sort(key=lambda k: self._reqs[self.be_owner[k] or ""].on_host == 0)
            for k in cands:
                ov = min(left, self._stealable(k, self.be_owner[k]))
                if ov:
                    plan.append((k, 0, ov, False))
                    left -= ov
                    if left == 0:
                        break
        if left:
            raise NoRoom(f"RT request {rid!r}: {n} slots wanted, {n - left} usable "
                         f"({self.free} free of {self.capacity})")
        return [step for step in plan if step[1] or step[2]]

    def _fill_most_room(self, room: list[dict[int, None]], left: int, used: set[int],
                        plan: list[tuple[int, int, int, bool]]) -> int:
        """Appends steps taking slots from the blocks with the most room first (room[r]: blocks
        with r free slots on this side), skipping `used` ones (updated); returns what is left."""
        for r in range(self.b, 0, -1):
            if left == 0:
                break
            for k in room[r]:
                if k in used:
                    continue
                take = min(left, r)
                plan.append((k, take, 0, False))
                used.add(k)
                left -= take
                if left == 0:
                    break
        return left

    def _plan_be(self, rid: str, req: _Req | None, n: int, steal: bool, *, grow: bool,
                 exclude: set[int] | None = None) -> list[tuple[int, int, int, bool]]:
        """Steps (block, slots taken, 0, take over the dormant segment first) covering n, in
        blocks not in `exclude`."""
        b = self.b
        plan: list[tuple[int, int, int, bool]] = []
        left = n
        used: set[int] = set(exclude or ())
        if grow and req is not None and req.segs:
            last = req.segs[-1][0]
            take = min(left, b - self.be_fill[last] - self.rt_fill[last])
            if take:
                plan.append((last, take, 0, False))
                left -= take
            used.add(last)
        left = self._fill_most_room(self._be_room, left, used, plan)  # free blocks, RT tails
        if left and steal:
            for k in self._dormant:
                owner = self.be_owner[k]
                if k in used or owner == rid or owner is None or not self._evictable(k, owner):
                    continue
                room = b - self.rt_fill[k]
                if room:
                    take = min(left, room)
                    plan.append((k, take, 0, True))
                    left -= take
                    if left == 0:
                        break
        if left:
            raise NoRoom(f"BE request {rid!r}: {n} slots wanted, {n - left} usable "
                         f"({self.free} free of {self.capacity})")
        return plan

    def _take_over(self, plan: list[tuple[int, int, int, bool]]) -> tuple[Checkpoint, ...]:
        """Checkpoints the whole dormant segments the plan takes over."""
        out: list[Checkpoint] = []
        for k, _, _, whole in plan:
            if whole:
                owner = self.be_owner[k]
                assert owner is not None
                for _ in range(self.be_fill[k]):
                    out.append(self._checkpoint_inner(k, owner))
        return tuple(out)

    def _commit(self, rid: str, req: _Req,
                plan: list[tuple[int, int, int, bool]]) -> Grant:
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

    def _place_be(self, rid: str, k: int) -> int:
        """One more BE slot of `rid` in block k (the block's BE side becomes rid's)."""
        self.be_owner[k] = rid
        self.be_fill[k] += 1
        self.used += 1
        self._index(k)
        return k * self.b + self.b - self.be_fill[k]

    def _checkpoint_inner(self, k: int, owner: str) -> Checkpoint:
        """Moves the innermost BE token of block k to the host (its slot becomes free)."""
        req = self._reqs[owner]
        i = next(j for j, (blk, _) in enumerate(req.segs) if blk == k)
        pos = sum(c for _, c in req.segs[:i])
        count = req.segs[i][1]
        index = pos + count - 1
        slot = k * self.b + self.b - self.be_fill[k]
        if count == 1:
            del req.segs[i]
            self.be_owner[k] = None
        else:
            req.segs[i][1] -= 1
        # the token goes to a host run right after its block segment (merging with one there)
        at = i if count == 1 else i + 1
        if at < len(req.segs) and req.segs[at][0] == HOST:
            req.segs[at][1] += 1
        elif at > 0 and req.segs[at - 1][0] == HOST:
            req.segs[at - 1][1] += 1
        else:
            req.segs.insert(at, [HOST, 1])
        if 0 < at < len(req.segs) and req.segs[at - 1][0] == HOST == req.segs[at][0]:
            req.segs[at - 1][1] += req.segs.pop(at)[1]
        self.be_fill[k] -= 1
        self.used -= 1
        self.dormant_used -= req.dormant
        self.on_host += 1
        self.checkpointed_total += 1
        self._index(k)
        return Checkpoint(owner, index, slot)

    # --- helpers ------------------------------------------------------------------------------

    def _req(self, rid: str) -> _Req:
        req = self._reqs.get(rid)
        if req is None:
            raise BiCacheError(f"unknown request {rid!r}")
        return req

    def _first_index(self, k: int, owner: str) -> int:
        pos = 0
        for blk, count in self._reqs[owner].segs:
            if blk == k:
                return pos
            pos += count
        raise AssertionError(f"{owner!r} has no segment in block {k}")  # pragma: no cover

    def _stealable(self, k: int, owner: str | None) -> int:
        """Dormant BE slots of block k that RT may overwrite (inner end first)."""
        if owner is None or not self._reqs[owner].dormant:
            return 0
        protected = self._reqs[owner].protected
        start = self._first_index(k, owner)
        return max(0, min(self.be_fill[k], start + self.be_fill[k] - protected))

    def _evictable(self, k: int, owner: str) -> bool:
        """A BE allocation may take over block k's dormant segment (none of it protected)."""
        req = self._reqs[owner]
        return req.dormant and self._first_index(k, owner) >= req.protected

    def _index(self, k: int) -> None:
        """Puts block k into the index sets its state calls for."""
        old_rt, old_be, old_d = self._where[k]
        if old_rt >= 0:
            del self._rt_room[old_rt][k]
        if old_be >= 0:
            del self._be_room[old_be][k]
        if old_d:
            del self._dormant[k]
        rt = be = -1
        b = self.b
        if self.rt_owner[k] is None:
            rt = b - self.be_fill[k]
            self._rt_room[rt][k] = None
        if self.be_owner[k] is None:
            be = b - self.rt_fill[k]
            self._be_room[be][k] = None
        owner = self.be_owner[k]
        dormant = owner is not None and self._reqs[owner].dormant
        if dormant:
            self._dormant[k] = None
        self._where[k] = (rt, be, dormant)
        # shared-slot counts: take the block's old contribution out, put the new one in
        for rid, count in self._pair[k]:
            if rid in self._shared:
                self._shared[rid] -= count
        rt_owner = self.rt_owner[k]
        if rt_owner is not None and owner is not None:
            pair = ((rt_owner, self.rt_fill[k]), (owner, self.be_fill[k]))
            for rid, count in pair:
                self._shared[rid] = self._shared.get(rid, 0) + count
            self._pair[k] = pair
        else:
            self._pair[k] = ()
