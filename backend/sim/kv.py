"""KV pool and prefix-cache accounting (token slots; no tensors).

::

    capacity ─┬─ used ─┬─ private slots of running requests (page-rounded)
              │        └─ cached prefix blocks ─┬─ referenced by a running request (pinned)
              │                                 └─ unreferenced: evictable, LRU order
              └─ free

A prefix block is `block_tokens` tokens named by its hash. Blocks are shared: a request that
finds its leading blocks cached pins them instead of computing and storing them again (shared KV
is counted once). Blocks outlive their requests and are reclaimed least-recently-used first, only
when an allocation needs the room. Within one released request the deeper blocks are released
first, so a prefix's root stays cached longer than its leaves (as in a radix tree).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class KvExhausted(Exception):
    """An allocation did not fit even after reclaiming every evictable block."""


class KvPool:
    """Slot accounting: `used`, `free`, `evictable`, and the prefix-block table."""

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        self.capacity = capacity_tokens
        """Pool size, tokens."""
        self.block_tokens = block_tokens
        """Tokens per prefix block."""
        self.used = 0
        """Slots in use (private + cached blocks), tokens."""
        self.evictable = 0
        """Slots held by unreferenced cached blocks, tokens."""
        self.touched: set[int] = set()
        """Root hashes (first block of the prefix) of blocks added or removed since the engine
        last looked: only waiting requests under these roots need to re-match."""
        self._refs: dict[int, int] = {}  # block hash -> running requests referencing it
        self._root: dict[int, int] = {}  # block hash -> hash of its prefix's first block
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks, oldest first

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def num_blocks(self) -> int:
        return len(self._refs)

    def match(self, hashes: Sequence[int], max_blocks: int) -> int:
        """How many leading blocks of `hashes` (at most max_blocks) are cached."""
        refs = self._refs
        n = 0
        limit = min(max_blocks, len(hashes))
        while n < limit and hashes[n] in refs:
            n += 1
        return n

    def pin(self, hashes: Sequence[int]) -> None:
        """A running request starts referencing these cached blocks."""
        for h in hashes:
            refs = self._refs[h]
            if refs == 0:
                del self._lru[h]
                self.evictable -= self.block_tokens
            self._refs[h] = refs + 1

    def unpin(self, hashes: Sequence[int]) -> None:
        """A request stops referencing these blocks; unreferenced ones become evictable
        (deepest first, so the shared root is the most recently used)."""
        for h in reversed(hashes):
            refs = self._refs[h] - 1
            self._refs[h] = refs
            if refs == 0:
                self._lru[h] = None
                self.evictable += self.block_tokens

    def publish(self, h: int, root: int, *, pinned: bool) -> bool:
        """Offers a block the caller computed privately. Returns True when the block is new
        (its slots move from the caller's private KV to the cache, `used` unchanged); False when
        it was already cached (the caller frees its duplicate). `root`: the first block hash of
        the prefix. `pinned`: the caller keeps a reference (a running request) rather than
        leaving it evictable (an ending one)."""
        refs = self._refs.get(h)
        if refs is None:
            self._refs[h] = 1 if pinned else 0
            self._root[h] = root
            self.touched.add(root)
            if not pinned:
                self._lru[h] = None
                self.evictable += self.block_tokens
            return True
        if pinned:
            self.pin((h,))
        return False

    def allocate(self, slots: int) -> None:
        """Takes `slots` free slots, reclaiming LRU blocks first if needed."""
        if slots > self.capacity - self.used:
            self.reclaim(slots - (self.capacity - self.used))
        self.used += slots

    def release(self, slots: int) -> None:
        self.used -= slots

    def reclaim(self, need: int) -> None:
        """Frees unreferenced blocks, least recently used first, until `need` slots are free
        beyond the current free count; raises KvExhausted if that is impossible."""
        if need > self.evictable:
            raise KvExhausted(f"need {need} more slots, only {self.evictable} evictable")
        freed = 0
        while freed < need:
            h, _ = self._lru.popitem(last=False)
            del self._refs[h]
            self.touched.add(self._root.pop(h))
            freed += self.block_tokens
        self.used -= freed
        self.evictable -= freed

    def check(self) -> None:
        """Asserts the accounting invariants (used ≤ capacity, evictable = unreferenced)."""
        assert 0 <= self.used <= self.capacity, f"KV used {self.used} > capacity {self.capacity}"
        unref = sum(1 for r in self._refs.values() if r == 0)
        assert unref * self.block_tokens == self.evictable == len(self._lru) * self.block_tokens
