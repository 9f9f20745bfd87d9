"""Authentication: API key → tenant, contract and quota, through a small TTL cache of the store.

Lookups go by the key's non-secret prefix; the secret is checked by a constant-time comparison
of SHA-256 digests. A hit is cached for `ttl_s` so the hot path makes no SQL query. Changes made
through the admin API (revocations, tenant and contract changes) invalidate the cache at once, in
this process and, on PostgreSQL, in every other gateway process on the database
(gateway/auth_sync.py: LISTEN/NOTIFY); `ttl_s` bounds how long a change made any other way, or
a notification lost while the database was unreachable, can go unseen.

A refused key costs the same whether its prefix exists or not, so the time of a refusal is no
oracle for valid prefixes: one hash, two constant-time comparisons (with a stand-in digest where
there is no row) and one store query, whatever the cache holds for the prefix; then the refused
key's digest is remembered for a second, so a flood of one bad key cannot hammer the database.
When an entry expires under load, one store lookup per key runs and the concurrent requests for
that key await it (gateway/singleflight.py), so an expiry never becomes a stampede that exhausts
the database pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from gateway import keys
from gateway.errors import ApiError
from gateway.singleflight import SingleFlight
from gateway.store.repo import Store
from gateway.store.types import AuthRecord, Tenant

_NEGATIVE_TTL_S = 1.0
_MAX_ENTRIES = 100_000


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant (with its contract and quota) and the key used."""

    tenant: Tenant
    key_id: str
    key_prefix: str


class AuthCache:
    """Resolves bearer keys to principals; caches the store's answers."""

    def __init__(
        self, store: Store, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, tuple[float, AuthRecord]] = {}
        """Key prefix → (expiry, the store's record): keys that exist."""
        self._refused: dict[str, float] = {}
        """Digest of a refused key → expiry: no store query for it again until then."""
        self._generation = 0
        """Counts invalidations: a store answer read across one is not cached (it may be stale)."""
        self.publish: Callable[[str | None], None] | None = None
        """Tells the other gateway processes about an `invalidate` (set by gateway/auth_sync.py
        on PostgreSQL); None: there are none to tell (SQLite: one process)."""
        self._lookups: SingleFlight[str, AuthRecord | None] = SingleFlight()
        """One store lookup per key prefix at a time; concurrent requests await it."""

    async def authenticate(self, key: str) -> Principal:
        """The principal for *key*; raises a 401 ApiError for a missing, unknown or revoked key."""
        prefix = keys.parse_prefix(key)
        if prefix is None:
            raise _unauthorized("invalid API key")
        record = await self._lookup(prefix, keys.hash_key(key))
        if record is None:
            raise _unauthorized("invalid API key")
        if record.revoked or record.tenant.deleted:
            raise _unauthorized("API key has been revoked")
        return Principal(tenant=record.tenant, key_id=record.key_id, key_prefix=record.prefix)

    def invalidate(self, prefix: str | None = None) -> None:
        """Drops one cached key (or all) here and in the other gateway processes: called after
        admin changes (a revoked key, a changed or deleted tenant)."""
        self.drop(prefix)
        if self.publish is not None:
            self.publish(prefix)

    def drop(self, prefix: str | None = None) -> None:
        """Drops one cached key (or all) in this process only (another process changed it)."""
        self._generation += 1
        self._lookups.forget(prefix)  # requests from now on look the key up afresh
        if prefix is None:
            self._entries.clear()
            self._refused.clear()
        else:
            self._entries.pop(prefix, None)

    async def _lookup(self, prefix: str, sha256: str) -> AuthRecord | None:
        """The record of the key with digest *sha256*, or None when no key has it. Every
        refusal does the same work (see the module doc)."""
        now = self._clock()
        cached = self._entries.get(prefix)
        hit = cached[1] if cached is not None and cached[0] > now else None
        if _matches(sha256, hit) and hit is not None:
            return hit
        refused_until = self._refused.get(sha256)
        if refused_until is not None and refused_until > now:
            return None
        generation = self._generation
        record = await self._lookups.run(prefix, lambda: self._store.lookup_key(prefix))
        now = self._clock()
        if _matches(sha256, record) and record is not None:
            if generation == self._generation:
                if len(self._entries) >= _MAX_ENTRIES:
                    self._entries.clear()
                self._entries[prefix] = (now + self._ttl_s, record)
            return record
        if len(self._refused) >= _MAX_ENTRIES:
            self._refused.clear()
        self._refused[sha256] = now + min(self._ttl_s, _NEGATIVE_TTL_S)
        return None


def _matches(sha256: str, record: AuthRecord | None) -> bool:
    """Whether *record* is the key's; compares digests (a stand-in one without a record), so a
    missing record costs what a wrong secret does."""
    stored = record.secret_sha256 if record is not None else keys.UNKNOWN_KEY_SHA256
    return keys.digests_equal(sha256, stored)


def bearer_token(request: web.Request) -> str:
    """The token of the `Authorization: Bearer …` header; 401 when absent."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    return token.strip()


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
