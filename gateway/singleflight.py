"""Single flight: concurrent callers asking for the same key share one call in flight.

When a cached answer expires under load, every request that needs it misses at the same moment;
without this each one would query the database, and a few hundred concurrent lookups of one API
key exhaust the connection pool (the others then wait for a connection until they time out).
With it, the first caller's call runs and the others await its result; the next caller after it
finished starts a new one.

The call runs as its own task, so a caller that is cancelled (its client went away) neither
cancels it nor leaves the other callers without an answer. `forget` detaches the call in flight
for a key: callers arriving afterwards start a fresh one (a cache invalidation must not be
answered by a lookup that started before it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    """Deduplicates concurrent calls by key (module doc)."""

    def __init__(self) -> None:
        self._calls: dict[K, asyncio.Task[V]] = {}

    def in_flight(self, key: K) -> bool:
        """Whether a call for *key* is running now."""
        return key in self._calls

    async def run(self, key: K, call: Callable[[], Awaitable[V]]) -> V:
        """The result of *call*, or of the call already in flight for *key* (its exception,
        when it raised one)."""
        task = self._calls.get(key)
        if task is None:
            task = asyncio.ensure_future(call())
            self._calls[key] = task
            task.add_done_callback(lambda done: self._finished(key, done))
        return await asyncio.shield(task)

    def forget(self, key: K | None = None) -> None:
        """Detaches the call in flight for *key* (every key: None); it still answers the callers
        already waiting for it."""
        if key is None:
            self._calls.clear()
        else:
            self._calls.pop(key, None)

    def _finished(self, key: K, task: asyncio.Task[V]) -> None:
        if self._calls.get(key) is task:
            del self._calls[key]
        if not task.cancelled():
            task.exception()  # retrieved: no "never retrieved" warning when every caller left
