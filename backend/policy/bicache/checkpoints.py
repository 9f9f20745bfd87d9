"""Lazy checkpointing in the bicache layout: dormant BE requests, the tokens copied to the host
just before their slots are overwritten, and the restore that brings them back.

A checkpointed token leaves its block segment for a host segment right after it, so a
request's segments stay in token order::

    before:  [(blk 7: B0–B5)]               after two checkpoints of block 7:
             [(blk 7: B0–B3), (host: B4, B5)]

A restore copies host runs into fresh slots of other blocks (new segments); nothing ever moves
device→device.
"""

from __future__ import annotations

from backend.policy.bicache.blocks import BlockMap
from backend.policy.bicache.records import HOST, BiCacheError, Checkpoint, Restore, Step


class CheckpointLedger(BlockMap):
    """The block map plus the host side: suspend/resume, checkpoints, restores and their
    counters."""

    def __init__(self, num_blocks: int, block_slots: int) -> None:
        super().__init__(num_blocks, block_slots)
        self.on_host = 0
        """Tokens checkpointed on the host now."""
        self.checkpointed_total = 0
        """Tokens ever checkpointed."""
        self.restored_total = 0
        """Tokens ever restored."""
        self.discarded_total = 0
        """Checkpointed tokens dropped because their request ended."""

    def host_tokens(self, rid: str) -> int:
        """Its tokens checkpointed on the host (0 = ready to run)."""
        return self._req(rid).on_host if rid in self._reqs else 0

    def checkpointed(self, rid: str) -> list[int]:
        """Logical indices of its tokens on the host."""
        out: list[int] = []
        pos = 0
        for blk, count in self._req(rid).segs:
            if blk == HOST:
                out.extend(range(pos, pos + count))
            pos += count
        return out

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
        runs: list[list[Step]] = []
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

    def _take_over(self, plan: list[Step]) -> tuple[Checkpoint, ...]:
        """Checkpoints the whole dormant segments the plan takes over."""
        out: list[Checkpoint] = []
        for k, _, _, whole in plan:
            if whole:
                owner = self.be_owner[k]
                assert owner is not None
                for _ in range(self.be_fill[k]):
                    out.append(self._checkpoint_inner(k, owner))
        return tuple(out)

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
