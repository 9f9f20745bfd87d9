"""The authentication cache under concurrency: when an entry expires, the requests that need it
at the same moment share one store lookup (no stampede on the database pool), and an
invalidation is never undone by a lookup that began before it."""

from __future__ import annotations

import asyncio

import pytest

from gateway import keys
from gateway.auth import AuthCache
from gateway.errors import ApiError
from gateway.store.types import AuthRecord
from tests.unit.test_keys_and_auth import Clock, FakeStore


class SlowStore(FakeStore):
    """A store whose lookups wait until the test opens the gate (a busy database)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.asked = asyncio.Event()
        """Set by the first lookup."""
        self.failure: Exception | None = None

    async def lookup_key(self, prefix: str) -> AuthRecord | None:
        self.lookups += 1
        self.asked.set()
        record = self.records.get(prefix)  # what the database holds when the query runs
        await self.gate.wait()
        if self.failure is not None:
            raise self.failure
        return record


async def test_concurrent_requests_after_expiry_share_one_lookup() -> None:
    store, clock = SlowStore(), Clock()
    material = keys.generate_key()
    store.add(material)
    auth = AuthCache(store, ttl_s=5.0, clock=clock)  # type: ignore[arg-type]
    store.gate.set()
    await auth.authenticate(material.key)
    store.gate.clear()
    store.asked.clear()
    clock.now = 6.0  # the entry expired; 300 requests arrive at once
    calls = [asyncio.create_task(auth.authenticate(material.key)) for _ in range(300)]
    await store.asked.wait()  # the refresh runs: every caller reached it first (tasks run FIFO)
    store.gate.set()
    principals = await asyncio.gather(*calls)
    assert {p.tenant.name for p in principals} == {"acme"}
    assert store.lookups == 2  # the first fill and one refresh, not 301


async def test_a_caller_that_leaves_does_not_fail_the_others() -> None:
    store = SlowStore()
    material = keys.generate_key()
    store.add(material)
    auth = AuthCache(store, ttl_s=5.0)  # type: ignore[arg-type]
    first = asyncio.create_task(auth.authenticate(material.key))
    second = asyncio.create_task(auth.authenticate(material.key))
    await store.asked.wait()  # both are waiting on the one lookup
    first.cancel()  # its client disconnected
    store.gate.set()
    assert (await second).tenant.name == "acme"
    assert store.lookups == 1


async def test_a_failed_lookup_fails_its_waiters_and_is_not_cached() -> None:
    store = SlowStore()
    material = keys.generate_key()
    store.add(material)
    auth = AuthCache(store, ttl_s=5.0)  # type: ignore[arg-type]
    store.failure = ConnectionRefusedError("database down")
    calls = [asyncio.create_task(auth.authenticate(material.key)) for _ in range(5)]
    await store.asked.wait()
    store.gate.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, ConnectionRefusedError) for r in results)
    assert store.lookups == 1
    store.failure = None
    assert (await auth.authenticate(material.key)).tenant.name == "acme"
    assert store.lookups == 2


async def test_a_lookup_in_flight_during_a_revocation_cannot_cache_the_old_answer() -> None:
    store = SlowStore()
    material = keys.generate_key()
    store.add(material)
    auth = AuthCache(store, ttl_s=60.0)  # type: ignore[arg-type]
    before = asyncio.create_task(auth.authenticate(material.key))  # reads the live key...
    await store.asked.wait()
    store.add(material, revoked=True)  # ...then the admin API revokes it and invalidates
    auth.invalidate(material.prefix)
    store.gate.set()
    assert (await before).tenant.name == "acme"  # it asked before the revocation
    with pytest.raises(ApiError, match="revoked"):  # every request after it is refused
        await auth.authenticate(material.key)
    with pytest.raises(ApiError, match="revoked"):
        await auth.authenticate(material.key)
