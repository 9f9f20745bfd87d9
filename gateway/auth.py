"""Authentication: API key → tenant, contract and quota, through a small TTL cache of the store.

Lookups go by the key's non-secret prefix; the secret is checked by a constant-time comparison
of SHA-256 digests. A hit is cached for `ttl_s` so the hot path makes no SQL query; revocations
made through this gateway's admin API invalidate the cache at once, other processes see them after
at most `ttl_s`. Unknown keys are cached briefly too, so a flood of bad keys cannot hammer the
database. When an entry expires under load, one lookup per key runs and the concurrent requests
for that key await it (gateway/singleflight.py), so an expiry never becomes a stampede that
exhausts the database pool.
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
        self._entries: dict[str, tuple[float, AuthRecord | None]] = {}
        self._lookups: SingleFlight[str, AuthRecord | None] = SingleFlight()
        self._generation = 0
        """Bumped by `invalidate`: a lookup that began before it must not fill the cache."""

    async def authenticate(self, key: str) -> Principal:
        """The principal for *key*; raises a 401 ApiError for a missing, unknown or revoked key."""
        prefix = keys.parse_prefix(key)
        if prefix is None:
            raise _unauthorized("invalid API key")
        record = await self._lookup(prefix)
        if record is None or not keys.digest_matches(key, record.secret_sha256):
            raise _unauthorized("invalid API key")
        if record.revoked or record.tenant.deleted:
            raise _unauthorized("API key has been revoked")
        return Principal(tenant=record.tenant, key_id=record.key_id, key_prefix=record.prefix)

    def invalidate(self, prefix: str | None = None) -> None:
        """Drops one cached key (or all): called after admin changes."""
        self._generation += 1
        self._lookups.forget(prefix)  # requests from now on look the key up afresh
        if prefix is None:
            self._entries.clear()
        else:
            self._entries.pop(prefix, None)

    async def _lookup(self, prefix: str) -> AuthRecord | None:
        now = self._clock()
        cached = self._entries.get(prefix)
        if cached is not None and cached[0] > now:
            return cached[1]
        return await self._lookups.run(prefix, lambda: self._fetch(prefix))

    async def _fetch(self, prefix: str) -> AuthRecord | None:
        """The store's record for *prefix*, cached unless the cache was invalidated meanwhile."""
        now = self._clock()
        generation = self._generation
        record = await self._store.lookup_key(prefix)
        if generation != self._generation:
            return record
        ttl = self._ttl_s if record is not None else min(self._ttl_s, _NEGATIVE_TTL_S)
        if len(self._entries) >= _MAX_ENTRIES:
            self._entries.clear()
        self._entries[prefix] = (now + ttl, record)
        return record


def bearer_token(request: web.Request) -> str:
    """The token of the `Authorization: Bearer …` header; 401 when absent."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    return token.strip()


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
