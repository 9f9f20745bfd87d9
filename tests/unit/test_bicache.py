"""Bidirectional KV blocks (backend/policy/bicache.py): layout, borrowing, lazy checkpointing,
restore; and a property test that runs random operation sequences against a model of the device
memory and the host store, so every slot's content is checked, not only the counters."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from backend.policy.bicache.layout import BiCache
from backend.policy.bicache.records import HOST, BiCacheError, NeedsRestore, NoRoom


def test_rt_fills_from_the_left_and_be_from_the_right() -> None:
    kv = BiCache(num_blocks=1, block_slots=16)
    assert kv.allocate("a", "rt", 5).slots == (0, 1, 2, 3, 4)
    assert kv.allocate("x", "be", 6).slots == (15, 14, 13, 12, 11, 10)
    assert kv.slots("x") == [15, 14, 13, 12, 11, 10]
    assert (kv.used, kv.free, kv.room("rt"), kv.room("be")) == (11, 5, 0, 0)
    # each side keeps growing into the gap
    assert kv.allocate("a", "rt", 2).slots == (5, 6)
    assert kv.allocate("x", "be", 3).slots == (9, 8, 7)
    # the fronts met: a live BE request is never overwritten, and BE never overwrites RT
    with pytest.raises(NoRoom):
        kv.allocate("a", "rt", 1)
    with pytest.raises(NoRoom):
        kv.allocate("x", "be", 1)


def test_rt_borrows_the_free_tail_of_a_be_block_when_no_block_is_free() -> None:
    kv = BiCache(num_blocks=2, block_slots=8)
    kv.allocate("x", "be", 3)  # block 0 (both free; first one wins)
    assert kv.allocate("a", "rt", 4).slots == (8, 9, 10, 11)  # a free block first
    assert kv.borrowed_total == 0
    grant = kv.allocate("b", "rt", 5)  # no free block left: the tail of x's block
    assert grant.slots == (0, 1, 2, 3, 4) and not grant.checkpoints
    assert kv.borrowed_total == 5 and kv.shared("b") == 5 and kv.shared("x") == 3


def test_rt_overwrites_only_the_dormant_slots_it_needs_each_checkpointed_first() -> None:
    kv = BiCache(num_blocks=1, block_slots=8)
    kv.allocate("x", "be", 6)  # slots 7..2
    kv.allocate("a", "rt", 2)  # slots 0, 1: the block is full
    with pytest.raises(NoRoom):
        kv.allocate("a", "rt", 1)  # x is live
    kv.suspend("x")
    grant = kv.allocate("a", "rt", 2)
    assert grant.slots == (2, 3)
    # the inner end of x (its newest tokens 5 and 4, in slots 2 and 3) goes to the host first
    assert [(c.rid, c.index, c.slot) for c in grant.checkpoints] == [("x", 5, 2), ("x", 4, 3)]
    assert kv.slots("x") == [7, 6, 5, 4, HOST, HOST]
    assert kv.checkpointed("x") == [4, 5] and kv.host_tokens("x") == 2


def test_restore_brings_checkpointed_tokens_back_in_token_order() -> None:
    kv = BiCache(num_blocks=2, block_slots=4)
    kv.allocate("x", "be", 4)  # block 0, slots 3..0
    kv.allocate("a", "rt", 4)  # block 1 (free)
    kv.suspend("x")
    kv.allocate("b", "rt", 2)  # takes x's tokens 3 and 2 (slots 0 and 1)
    kv.resume("x")
    with pytest.raises(NeedsRestore):
        kv.allocate("x", "be", 1)
    with pytest.raises(NoRoom):
        kv.restore("x")  # nowhere to put them: BE may not overwrite RT
    kv.release("a")
    restore = kv.restore("x")
    assert restore.loads == ((2, 7), (3, 6))
    assert kv.slots("x") == [3, 2, 7, 6] and kv.host_tokens("x") == 0
    assert (kv.checkpointed_total, kv.restored_total) == (2, 2)
    assert kv.allocate("x", "be", 1).slots == (5,)  # grows in its (new) last block


def test_partial_restore_and_release_drop_the_rest() -> None:
    kv = BiCache(num_blocks=3, block_slots=4)
    kv.allocate("x", "be", 4)  # block 0
    kv.allocate("c", "rt", 4)  # block 1
    kv.suspend("x")
    kv.allocate("a", "rt", 4 + 3)  # block 2, then 3 of x's slots in block 0
    assert kv.free == 0
    kv.release("c")
    kv.resume("x")
    assert kv.restore("x", max_tokens=1).loads == ((1, 7),)
    assert kv.slots("x") == [3, 7, HOST, HOST]
    assert kv.release("x") == 2
    assert kv.discarded_total == 2 and kv.on_host == 0 and kv.used == 7


def test_protected_prefix_is_never_overwritten() -> None:
    kv = BiCache(num_blocks=1, block_slots=8)
    kv.allocate("x", "be", 8)
    kv.protect("x", 6)  # e.g. shared through the radix cache
    kv.suspend("x")
    assert kv.reclaimable("rt") == 2
    assert len(kv.allocate("a", "rt", 2).checkpoints) == 2
    with pytest.raises(NoRoom):
        kv.allocate("a", "rt", 1)


def test_be_takes_over_a_whole_dormant_segment_never_sharing_a_block() -> None:
    kv = BiCache(num_blocks=1, block_slots=8)
    kv.allocate("x", "be", 3)
    with pytest.raises(NoRoom):
        kv.allocate("y", "be", 1)  # one BE request per block
    kv.suspend("x")
    assert kv.reclaimable("be") == 3
    grant = kv.allocate("y", "be", 2)
    assert grant.slots == (7, 6)
    assert sorted(c.index for c in grant.checkpoints) == [0, 1, 2]
    assert kv.slots("x") == [HOST] * 3


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = BiCache(num_blocks=2, block_slots=4)
    kv.allocate("x", "be", 3)
    kv.allocate("a", "rt", 2)
    before = (kv.slots("x"), kv.slots("a"), kv.used)
    with pytest.raises(NoRoom):
        kv.allocate("a", "rt", 6)
    assert (kv.slots("x"), kv.slots("a"), kv.used) == before


def test_bad_requests_are_named() -> None:
    kv = BiCache(num_blocks=1, block_slots=4)
    kv.allocate("a", "rt", 1)
    with pytest.raises(BiCacheError, match="'a' is rt"):
        kv.allocate("a", "be", 1)
    with pytest.raises(BiCacheError, match="only BE"):
        kv.suspend("a")
    with pytest.raises(BiCacheError, match="unknown request 'zz'"):
        kv.slots("zz")
    with pytest.raises(ValueError, match="block_slots"):
        BiCache(4, block_slots=1)


RIDS = ("r0", "r1", "b0", "b1", "b2")
BE_RIDS = RIDS[2:]


def _tier(rid: str) -> str:
    return "rt" if rid.startswith("r") else "be"


class BiCacheMachine(RuleBasedStateMachine):
    """Random operations; the model holds what each device slot and the host store contain."""

    @initialize(blocks=st.integers(1, 4), b=st.sampled_from([2, 3, 4, 8]))
    def setup(self, blocks: int, b: int) -> None:
        self.kv = BiCache(blocks, b)
        self.device: dict[int, tuple[str, int]] = {}  # slot -> (rid, logical index) written
        self.host: dict[tuple[str, int], tuple[str, int]] = {}
        self.restored: set[tuple[str, int]] = set()  # restored since last checkpointed

    def _checkpoint(self, checkpoints: tuple) -> None:  # type: ignore[type-arg]
        for cp in checkpoints:
            assert self.device.get(cp.slot) == (cp.rid, cp.index), "checkpoint of a wrong slot"
            assert (cp.rid, cp.index) not in self.host, "token checkpointed twice"
            self.host[(cp.rid, cp.index)] = self.device.pop(cp.slot)
            self.restored.discard((cp.rid, cp.index))

    @rule(rid=st.sampled_from(RIDS), n=st.integers(0, 10), steal=st.booleans())
    def allocate(self, rid: str, n: int, steal: bool) -> None:
        kv = self.kv
        before = {r: kv.slots(r) for r in kv.requests()}
        length = kv.length(rid)
        try:
            grant = kv.allocate(rid, _tier(rid), n, steal=steal)  # type: ignore[arg-type]
        except (NoRoom, NeedsRestore, BiCacheError):
            assert {r: kv.slots(r) for r in kv.requests()} == before, "failed op changed state"
            return
        assert len(grant.slots) == n
        self._checkpoint(grant.checkpoints)
        for i, slot in enumerate(grant.slots):
            assert slot not in self.device, f"slot {slot} given out while holding a token"
            self.device[slot] = (rid, length + i)
        if not steal:
            assert not grant.checkpoints

    @rule(rid=st.sampled_from(BE_RIDS))
    def suspend(self, rid: str) -> None:
        if rid in self.kv:
            self.kv.suspend(rid)

    @rule(rid=st.sampled_from(BE_RIDS))
    def resume(self, rid: str) -> None:
        if rid in self.kv:
            self.kv.resume(rid)

    @rule(victim=st.sampled_from(BE_RIDS), rid=st.sampled_from(RIDS), n=st.integers(1, 8))
    def squeeze(self, victim: str, rid: str, n: int) -> None:
        """Memory pressure: the scheduler gives up a BE request, then somebody allocates."""
        self.suspend(victim)
        self.allocate(rid, n, True)

    @rule(rid=st.sampled_from(BE_RIDS), limit=st.none() | st.integers(0, 10))
    def come_back(self, rid: str, limit: int | None) -> None:
        """A dormant BE request is scheduled again."""
        self.resume(rid)
        self.restore(rid, limit)

    @rule(rid=st.sampled_from(BE_RIDS), limit=st.none() | st.integers(0, 10))
    def restore(self, rid: str, limit: int | None) -> None:
        if rid not in self.kv or self.kv.is_dormant(rid):
            return
        before = {r: self.kv.slots(r) for r in self.kv.requests()}
        try:
            restore = self.kv.restore(rid, limit)
        except NoRoom:
            assert {r: self.kv.slots(r) for r in self.kv.requests()} == before
            return
        self._checkpoint(restore.checkpoints)
        for index, slot in restore.loads:
            assert (rid, index) not in self.restored, "token restored twice"
            assert slot not in self.device
            self.device[slot] = self.host.pop((rid, index))
            self.restored.add((rid, index))

    @rule(rid=st.sampled_from(BE_RIDS), tokens=st.integers(0, 12))
    def protect(self, rid: str, tokens: int) -> None:
        if rid not in self.kv:
            return
        if any(i < tokens for i in self.kv.checkpointed(rid)):
            with pytest.raises(BiCacheError, match="on the host"):
                self.kv.protect(rid, tokens)
        else:
            self.kv.protect(rid, tokens)

    @rule(rid=st.sampled_from(RIDS))
    def release(self, rid: str) -> None:
        on_host = [key for key in self.host if key[0] == rid]
        assert self.kv.release(rid) == len(on_host)
        for key in on_host:
            del self.host[key]
        for slot in [s for s, owner in self.device.items() if owner[0] == rid]:
            del self.device[slot]

    @invariant()
    def every_token_is_where_the_table_says(self) -> None:
        kv = self.kv
        seen: set[int] = set()
        for rid in kv.requests():
            for index, slot in enumerate(kv.slots(rid)):
                if slot == HOST:
                    assert (rid, index) in self.host, f"{rid}[{index}] lost"
                    assert _tier(rid) == "be", "an RT token on the host"
                    continue
                assert slot not in seen, f"slot {slot} owned twice"
                seen.add(slot)
                assert self.device.get(slot) == (rid, index), f"{rid}[{index}] overwritten"
        assert len(seen) == kv.used == len(self.device)
        assert kv.free + kv.used == kv.capacity
        assert kv.on_host == len(self.host)
        assert kv.checkpointed_total == kv.restored_total + kv.discarded_total + kv.on_host
        assert 0 <= kv.dormant_used <= kv.used

    @invariant()
    def one_segment_per_request_and_block(self) -> None:
        """The block table agrees with every request's segments: a request has at most one
        run per block, and that run is the block's whole side."""
        kv = self.kv
        for rid in kv.requests():
            segs = [(blk, count) for blk, count in kv._reqs[rid].segs if blk != HOST]
            assert len({blk for blk, _ in segs}) == len(segs), f"{rid}: two runs in a block"
            owner, fill = (
                (kv.rt_owner, kv.rt_fill) if _tier(rid) == "rt" else (kv.be_owner, kv.be_fill)
            )
            assert all(owner[blk] == rid and fill[blk] == count for blk, count in segs)

    @invariant()
    def shared_counts_match_the_blocks(self) -> None:
        kv = self.kv
        want: dict[str, int] = {}
        for k in range(kv.num_blocks):
            rt, be = kv.rt_owner[k], kv.be_owner[k]
            if rt is not None and be is not None:
                want[rt] = want.get(rt, 0) + kv.rt_fill[k]
                want[be] = want.get(be, 0) + kv.be_fill[k]
        assert {r: kv.shared(r) for r in kv.requests()} == {
            r: want.get(r, 0) for r in kv.requests()
        }

    @invariant()
    def protected_tokens_stay_on_the_device(self) -> None:
        for rid in self.kv.requests():
            protected = self.kv._reqs[rid].protected
            assert all(i >= protected for i in self.kv.checkpointed(rid))


BiCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestBiCacheProperties = BiCacheMachine.TestCase
