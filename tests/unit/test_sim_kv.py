"""KV pool and prefix-cache accounting."""

from __future__ import annotations

import pytest

from backend.sim.kv import KvExhausted, KvPool


def test_blocks_are_shared_and_reclaimed_least_recently_used_first() -> None:
    kv = KvPool(capacity_tokens=4, block_tokens=1)
    for h in (1, 2, 3):
        kv.allocate(1)
        assert kv.publish(h, 0, pinned=True)  # a new block: our private slot moves to the cache
    assert kv.used == 3 and kv.evictable == 0
    kv.unpin([1, 2])  # a request with prefix 1→2 ends: the leaf (2) is released first
    kv.unpin([3])
    assert kv.evictable == 3 and kv.match([1, 2], 5) == 2
    kv.allocate(2)  # 1 free + reclaims the LRU block: 2 (the leaf of the older prefix)
    assert kv.match([1, 2], 5) == 1 and kv.match([3], 5) == 1
    kv.check()


def test_a_duplicate_block_is_not_stored_twice() -> None:
    kv = KvPool(capacity_tokens=10, block_tokens=2)
    kv.allocate(2)
    assert kv.publish(7, 0, pinned=True)
    kv.allocate(2)
    assert not kv.publish(7, 0, pinned=True)  # already cached: the caller frees its copy
    kv.release(2)
    assert kv.used == 2
    kv.unpin([7])
    assert kv.evictable == 0  # still referenced once
    kv.unpin([7])
    assert kv.evictable == 2
    kv.check()


def test_pinned_blocks_are_never_reclaimed() -> None:
    kv = KvPool(capacity_tokens=4, block_tokens=2)
    kv.allocate(2)
    kv.publish(1, 0, pinned=True)
    kv.allocate(2)
    with pytest.raises(KvExhausted):
        kv.allocate(1)
    assert kv.match([1], 1) == 1
