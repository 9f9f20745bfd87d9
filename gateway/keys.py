"""Tenant API keys: generation, parsing, hashing. The secret is never stored or logged.

A key looks like ``tdm_<prefix>_<secret>``::

    tdm_3f9a1c0b7d2e_Jb0...43 chars of urlsafe base64...
        └── prefix ─┘ └────────── secret (256 bits) ─────────┘

The store keeps the prefix (a unique, non-secret lookup handle that operators may see) and the
SHA-256 of the whole key. Authentication finds the row by prefix and compares digests in constant
time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_SCHEME = "tdm"
PREFIX_HEX_LEN = 12


class KeyMaterial:
    """A freshly generated key: `key` is shown to the user once; the rest is stored."""

    __slots__ = ("key", "prefix", "sha256")

    def __init__(self, key: str, prefix: str, sha256: str) -> None:
        self.key = key
        self.prefix = prefix
        self.sha256 = sha256

    def __repr__(self) -> str:  # never print the secret by accident
        return f"KeyMaterial(prefix={self.prefix!r})"


def generate_key() -> KeyMaterial:
    """A new random key with its prefix and digest."""
    prefix = secrets.token_hex(PREFIX_HEX_LEN // 2)
    key = f"{KEY_SCHEME}_{prefix}_{secrets.token_urlsafe(32)}"
    return KeyMaterial(key=key, prefix=prefix, sha256=hash_key(key))


def hash_key(key: str) -> str:
    """Hex SHA-256 of the whole key string."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def parse_prefix(key: str) -> str | None:
    """The prefix of a well-formed key, else None (no lookup is made for malformed keys)."""
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_SCHEME or len(parts[1]) != PREFIX_HEX_LEN:
        return None
    if not all(c in "0123456789abcdef" for c in parts[1]) or len(parts[2]) < 16:
        return None
    return parts[1]


def digest_matches(key: str, stored_sha256: str) -> bool:
    """Constant-time comparison of *key*'s digest with the stored one."""
    return digests_equal(hash_key(key), stored_sha256)


def digests_equal(sha256: str, stored_sha256: str) -> bool:
    """Constant-time comparison of two hex digests (a key's `hash_key` and a stored one)."""
    return hmac.compare_digest(sha256, stored_sha256)


UNKNOWN_KEY_SHA256 = hash_key(f"{KEY_SCHEME}_{'0' * PREFIX_HEX_LEN}_no-such-key")
"""What a key whose prefix has no row is compared with: a miss does the same work as a key with
the wrong secret, so the time of a refusal does not tell whether a prefix exists."""
