"""Errors raised by the store. Both are ValueErrors so a caller may map them to 404 / 409."""

from __future__ import annotations


class NotFound(ValueError):
    """The named tenant or key does not exist (or the tenant was deleted)."""


class Conflict(ValueError):
    """The change would break a uniqueness rule (for example a second tenant with one name)."""
