"""The bicache layout's constants, errors and records, and what it needs of an engine (the
package docstring has the picture)."""

from __future__ import annotations

from dataclasses import dataclass

from common.wire import Tier

HOST = -1
"""Block id of a segment whose tokens are checkpointed on the host."""
DEFAULT_BLOCK_SLOTS = 16
"""BROS's block size, slots."""


def unfit_layout(
    pool_tokens: int | None, page_size: int | None, *, radix_cache_on: bool
) -> str | None:
    """Why an engine cannot carry the bicache KV layout, in one line, or None: a KV pool off
    its block size, a page size other than 1, the radix cache on (None for a size not known)."""
    if pool_tokens is not None and int(pool_tokens) % DEFAULT_BLOCK_SLOTS:
        return (
            f"kv_layout=bicache needs a KV pool of a multiple of {DEFAULT_BLOCK_SLOTS} "
            f"tokens, got {pool_tokens} (engine.max_total_tokens)"
        )
    if page_size is not None and int(page_size) != 1:
        return f"kv_layout=bicache needs page size 1, not {page_size}"
    if radix_cache_on:
        return (
            "kv_layout=bicache needs --disable-radix-cache (the layout frees whole requests; "
            "the radix tree keeps slots past them)"
        )
    return None


Step = tuple[int, int, int, bool]
"""One step of an allocation plan: (block, free slots taken, dormant slots overwritten, take over
the block's dormant BE segment first). RT steps never take over; BE steps never overwrite."""


class BiCacheError(Exception):
    """A request that the bookkeeping cannot serve (state left unchanged)."""


class NoRoom(BiCacheError):
    """Not enough usable slots for the allocation or restore."""


class NeedsRestore(BiCacheError):
    """A BE request with checkpointed tokens asked for more slots: restore it first."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A BE token whose slot is about to be overwritten: copy it to the host *before* the
    allocation's new owner writes the slot."""

    rid: str
    """The BE request the token belongs to."""
    index: int
    """Its logical position in that request (0 = first prompt token)."""
    slot: int
    """The device slot it occupies until the copy."""


@dataclass(frozen=True, slots=True)
class Grant:
    """The outcome of an allocation."""

    slots: tuple[int, ...]
    """The new slots, in the request's token order (write the new tokens' KV here)."""
    checkpoints: tuple[Checkpoint, ...]
    """Tokens to copy to the host first (the slots they occupy may be among `slots`)."""


@dataclass(frozen=True, slots=True)
class Restore:
    """The outcome of a restore."""

    rid: str
    """The BE request restored."""
    loads: tuple[tuple[int, int], ...]
    """Host→device copies, (logical index, destination slot), in token order."""
    checkpoints: tuple[Checkpoint, ...] = ()
    """Dormant tokens of *other* requests whose slots the restore takes over: copy them to the
    host before the loads."""


@dataclass(slots=True)
class ReqKv:
    """Where one request's KV lives (the layout's private record of it)."""

    tier: Tier
    segs: list[list[int]]  # [block or HOST, count], in token order
    protected: int = 0  # leading tokens that must not be overwritten
    dormant: bool = False

    @property
    def length(self) -> int:
        return sum(c for _, c in self.segs)

    @property
    def on_host(self) -> int:
        return sum(c for blk, c in self.segs if blk == HOST)
