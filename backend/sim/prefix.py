"""The engine core's side of the prefix cache: which waiting requests to re-match when cached
blocks come or go, and the full prompt blocks a request offers to the cache.

A waiting request is filed under the key of its first prompt block (its *root*). The pool
records the roots under which blocks were published or reclaimed (`KvPool.touched`); before a
snapshot only the requests filed under those roots are matched again, not every waiting one.
"""

from __future__ import annotations

from backend.sim.bikv import BiKv
from backend.sim.kv import KvPool
from backend.sim.track import Track


class PrefixMatcher:
    """Waiting requests by prefix root, and their cache hits (`ReqState.cached_len`)."""

    def __init__(self, kv: KvPool | BiKv, block_tokens: int) -> None:
        self.kv = kv
        self.block_tokens = block_tokens
        """Tokens per prefix-cache block."""
        self._waiters: dict[int, dict[str, Track]] = {}  # prefix root key -> waiting tracks

    def wait(self, t: Track) -> None:
        """Registers a request that enters the queue for prefix re-matching, and matches it."""
        if t.usable_blocks:
            self._waiters.setdefault(t.keys[0], {})[t.state.rid] = t
            self.match(t)

    def unwait(self, t: Track) -> None:
        """It leaves the queue (admitted or aborted): no more re-matching."""
        if t.usable_blocks:
            waiters = self._waiters[t.keys[0]]
            del waiters[t.state.rid]
            if not waiters:
                del self._waiters[t.keys[0]]

    def match(self, t: Track) -> None:
        """A waiting request's prefix-cache hit (at least one token is always computed)."""
        s = t.state
        block = self.block_tokens
        n = self.kv.match(t.keys, min(t.usable_blocks, (s.prefill_len - 1) // block))
        s.cached_len = s.prefilled = n * block

    def rematch_touched(self) -> None:
        """Re-matches the waiting requests under the roots whose blocks came or went."""
        touched = self.kv.touched
        if touched:
            for root in touched:
                for t in self._waiters.get(root, {}).values():
                    self.match(t)
            touched.clear()

    def publish(self, t: Track, *, pinned: bool) -> None:
        """Offers the full prompt blocks it computed to the prefix cache. Pinned: it keeps
        referencing them (prefill just completed); else they are left evictable (eviction)."""
        s = t.state
        block = self.block_tokens
        upto = min(t.usable_blocks, s.prefilled // block)
        for i in range(len(t.pinned), upto):
            h = t.keys[i]
            if not self.kv.publish(h, t.keys[0], pinned=pinned):
                self.kv.release(block)  # a duplicate of a cached block: free our copy
            t.private -= block
            if pinned:
                t.pinned.append(h)
        s.kv_shared_tokens = len(t.pinned) * block
