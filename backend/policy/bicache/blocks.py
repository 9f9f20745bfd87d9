"""The bicache block map: who owns which side of each block, the indexes that find room, and the
read-only allocation search ("Who may use which free slots" in the package docstring).

Per block k (b slots), RT fills [0, rt_fill[k]) and BE fills [b - be_fill[k], b)::

    slot 0                                             b - 1
    +----------------+-----------------+----------------+
    | RT: rt_fill[k] |      free       | BE: be_fill[k] |
    +----------------+-----------------+----------------+
    |<--- RT room: b - be_fill[k] ---->|                     (indexed while no RT owner)
                     |<---- BE room: b - rt_fill[k] ----->|  (indexed while no BE owner)

`_index` keeps three indexes exact after every change of a block: blocks without an RT owner by
their left room, blocks without a BE owner by their right room, and blocks whose BE owner is
dormant. A search reads them and returns a plan of `Step`s; nothing changes until the caller
commits it.
"""

from __future__ import annotations

from backend.policy.bicache.records import HOST, BiCacheError, NoRoom, ReqKv, Step
from common.wire import Tier


class BlockMap:
    """Block table, request table and room indexes; the allocation search over them."""

    def __init__(self, num_blocks: int, block_slots: int) -> None:
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
        self._reqs: dict[str, ReqKv] = {}
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

    def _req(self, rid: str) -> ReqKv:
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

    # --- allocation search (read-only) --------------------------------------------------------

    def _plan_rt(self, rid: str, req: ReqKv | None, n: int, steal: bool) -> list[Step]:
        """Steps (block, free slots taken, dormant slots overwritten, False) covering n: free
        room everywhere first, then overwrites, which must continue the last block of the
        plan (an RT run in a block is contiguous from slot 0) or open a dormant BE block."""
        b = self.b
        plan: list[Step] = []
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
            raise NoRoom(
                f"RT request {rid!r}: {n} slots wanted, {n - left} usable "
                f"({self.free} free of {self.capacity})"
            )
        return [step for step in plan if step[1] or step[2]]

    def _fill_most_room(
        self, room: list[dict[int, None]], left: int, used: set[int], plan: list[Step]
    ) -> int:
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

    def _plan_be(
        self,
        rid: str,
        req: ReqKv | None,
        n: int,
        steal: bool,
        *,
        grow: bool,
        exclude: set[int] | None = None,
    ) -> list[Step]:
        """Steps (block, slots taken, 0, take over the dormant segment first) covering n, in
        blocks not in `exclude`."""
        b = self.b
        plan: list[Step] = []
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
            raise NoRoom(
                f"BE request {rid!r}: {n} slots wanted, {n - left} usable "
                f"({self.free} free of {self.capacity})"
            )
        return plan

    # --- block changes ------------------------------------------------------------------------

    def _place_be(self, rid: str, k: int) -> int:
        """One more BE slot of `rid` in block k (the block's BE side becomes rid's)."""
        self.be_owner[k] = rid
        self.be_fill[k] += 1
        self.used += 1
        self._index(k)
        return k * self.b + self.b - self.be_fill[k]

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
