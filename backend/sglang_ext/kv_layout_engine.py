"""The bicache KV layout wired into SGLang's scheduler (``engine.kv_layout: bicache``).

Off by default. With ``kv_layout: bicache`` in the engine's settings (``EngineSettings``; the
launcher sets it, together with ``--disable-radix-cache``) the plugin calls :func:`install` in the
scheduler process, and every KV slot of the token pool is handed out by
:class:`~backend.sglang_ext.kv_layout.BiCacheKvLayout` (blocks of 16 slots, RT from the left,
BE from the right, dormant BE slots checkpointed to the host before RT or BE takes them over).

Where it hooks (every path is in ``backend.sglang_ext.seams.KV_LAYOUT_SEAMS``):

* AFTER ``Scheduler.init_running_status`` (the pool and the cache exist by then): builds the
  layout on the pool's K/V buffers and routes the ``TokenToKVPoolAllocator`` instance's
  ``alloc`` / ``free`` / ``available_size`` / ``check_decode_capacity`` / ``clear`` to it, and
  the ``ReqToTokenPool`` instance's ``free`` (a request SGLang lets go of leaves the layout,
  also when none of its slots is left in the pool).
* AROUND ``schedule_batch.alloc_for_extend`` and ``schedule_batch.alloc_for_decode`` (both
  imported there by name from ``mem_cache.allocation``): tell the layout which request each of
  the slots SGLang is about to ask for belongs to (``alloc(n)`` itself carries no request), and
  which ``req_to_token`` row is whose. The decode path first restores the dormant requests of
  the batch (their checkpointed rows copied back into fresh slots, their rows rewritten).
* Dormancy: a BE decode row the policy parks (the hooks report every change of the parked rows
  through :func:`set_parked`) is suspended at the next allocation; its slots stay in place, and
  only the ones another request takes over are copied out (lazy checkpointing). It is restored
  when it decodes again.
* ``check_decode_capacity`` is exact (a dry run of the restores and the one-slot allocations), so
  SGLang's own retraction, never an allocation error, handles a pool that cannot take them.

Limits: page size 1 and the plain token pool only (what CPU and dense GPU models use); no radix
cache (slots the tree keeps would outlive their request: the layout frees whole requests); the
pool size must be a multiple of the block size. A BE request the policy *evicts* is freed and
recomputed as without the layout (only parked rows go dormant): resuming it from its
checkpointed KV would need SGLang's re-admission to take the restored slots as its prefix.
Prefill admission sees one number (``available_size``), but each request's last block keeps its
unused RT (or BE) side to itself, so a prefill batch of k prompts may find up to (k − 1) × 15
slots fewer than that number. tandem's prefill adder charges every prompt those 15 slots
(:func:`prompt_slack_tokens`), so its batches fit; with ``engine.policy: none`` SGLang's own
adder reserves room for future tokens, which covers them unless the pool is nearly full.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from backend.policy.bicache.records import DEFAULT_BLOCK_SLOTS, BiCacheError, unfit_layout
from backend.sglang_ext.kv_layout import BiCacheKvLayout
from backend.sglang_ext.request_meta import get_meta
from backend.sglang_ext.seams import (
    KV_DECODE_SEAM,
    KV_EXTEND_SEAM,
    KV_INIT_SEAM,
)
from backend.sglang_ext.views import ReqView
from common.wire import Tier

logger = logging.getLogger(__name__)

_layout: BiCacheKvLayout | None = None
_pending: list[tuple[str, Tier, int]] | None = None  # who the next alloc(n) is for
_parked: tuple[ReqView, ...] = ()  # the decode rows parked right now (set_parked)


def install() -> None:
    """Registers the hooks (call from the plugin's ``register`` in the scheduler process)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(KV_INIT_SEAM, after_init_running_status, HookType.AFTER)
    HookRegistry.register(KV_EXTEND_SEAM, around_alloc_for_extend, HookType.AROUND)
    HookRegistry.register(KV_DECODE_SEAM, around_alloc_for_decode, HookType.AROUND)
    logger.info("tandem: bicache KV layout installed in pid %d", os.getpid())


def unfreeable_tokens(rid: str) -> int:
    """Of running request *rid*'s KV slots, how many evicting it would not add to what the
    allocator's ``available_size`` already reports: every one of a dormant BE request's (its
    slots in place count there as reclaimable; its checkpointed ones belong to others now),
    else its slots in blocks shared with the other tier (a block's other side keeps them).
    0 without the layout. The driver tells the policy these as shared, so a plan never counts
    the same slots twice: once as available, then again as what evicting a parked BE request
    frees (it did, and SGLang's scheduler died on the allocation that followed)."""
    lay = _layout
    if lay is None or rid not in lay.cache:
        return 0
    cache = lay.cache
    return cache.length(rid) if cache.is_dormant(rid) else cache.shared(rid)


def set_parked(reqs: Sequence[ReqView]) -> None:
    """The decode rows the policy parked (``()`` once they are merged back): their BE ones go
    dormant at the next allocation (the hooks call this on every change)."""
    global _parked
    _parked = tuple(reqs)


def stats() -> dict[str, Any]:
    """``{"kv_layout": {...counters}}`` for the control endpoint; {} when the layout is off."""
    if _layout is None:
        return {}
    return {"kv_layout": {"layout": "bicache", **_layout.stats()}}


def prompt_slack_tokens() -> int:
    """KV slots a prompt may cost beyond its own tokens: with the bicache layout its last block
    keeps the unused part of its side (at most block − 1 slots, which ``available_size`` still
    counts as free); 0 with SGLang's own pool. Prefill admission charges it per prompt so a
    prefill batch never asks the layout for more than it can place (an allocation failure there
    is SGLang's fatal out-of-memory prefill)."""
    return DEFAULT_BLOCK_SLOTS - 1 if _layout is not None else 0


# --- hooks -------------------------------------------------------------------------------------


def after_init_running_status(result: Any, sched: Any, *args: Any, **kwargs: Any) -> None:
    """The pool exists: build the layout on its buffers and route the allocator to it."""
    global _layout
    allocator = sched.token_to_kv_pool_allocator
    if type(allocator).__name__ != "TokenToKVPoolAllocator":
        raise RuntimeError(
            f"tandem: kv_layout=bicache needs the plain token pool, not {type(allocator).__name__}"
        )
    problem = unfit_layout(
        allocator.size,
        allocator.page_size,
        radix_cache_on=not getattr(sched, "disable_radix_cache", False),
    )
    if problem is not None:
        raise RuntimeError(f"tandem: {problem}")
    kvcache = allocator.get_kvcache()
    lay = BiCacheKvLayout(list(kvcache.k_buffer) + list(kvcache.v_buffer))
    lay.req_to_token = sched.req_to_token_pool.req_to_token
    _layout = lay
    _route_allocator(allocator, lay)
    _route_row_free(sched.req_to_token_pool, lay)
    logger.info(
        "tandem: bicache layout on %d slots (%d blocks)", lay.cache.capacity, lay.cache.num_blocks
    )


def around_alloc_for_extend(original: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """``alloc_for_extend(batch)``: the batch's slots, request by request, in its order."""
    lay = _layout
    if lay is None:
        return original(batch, *args, **kwargs)
    _suspend_parked(lay)
    demands = [
        (str(req.rid), _tier(req), int(n))
        for req, n in zip(batch.reqs, batch.extend_lens, strict=True)
    ]
    result = _with_demands(demands, lambda: original(batch, *args, **kwargs))
    _note_rows(lay, batch.reqs)
    return result


def around_alloc_for_decode(
    original: Any, batch: Any, token_per_req: int, *args: Any, **kwargs: Any
) -> Any:
    """``alloc_for_decode(batch, token_per_req)``: the batch's dormant requests are restored
    first (``check_decode_capacity`` made sure they fit), then each gets its slots."""
    lay = _layout
    if lay is None:
        return original(batch, token_per_req, *args, **kwargs)
    _suspend_parked(lay)
    for req in batch.reqs:
        rid = str(req.rid)
        if lay.cache.is_dormant(rid):
            lay.rows[rid] = int(req.kv.req_pool_idx)
            lay.resume_and_restore(rid)
    demands = [(str(req.rid), _tier(req), token_per_req) for req in batch.reqs]
    result = _with_demands(demands, lambda: original(batch, token_per_req, *args, **kwargs))
    _note_rows(lay, batch.reqs)
    return result


def _route_allocator(allocator: Any, lay: BiCacheKvLayout) -> None:
    """Instance attributes shadow the class's methods: only this allocator is rerouted."""
    original_clear = allocator.clear

    def alloc(need_size: int) -> torch.Tensor | None:
        demands = _pending
        if demands is None or sum(n for _, _, n in demands) != need_size:
            raise RuntimeError(
                f"tandem bicache: an allocation of {need_size} slots outside "
                f"the extend/decode paths (demands: {demands})"
            )
        try:
            return lay.alloc(demands)
        except BiCacheError as exc:
            logger.warning("tandem bicache: %s", exc)
            return None  # SGLang's out-of-memory path

    def free(free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if allocator.free_group is not None:  # SGLang batches frees between begin/end
            allocator.free_group.append(allocator._copy_for_free_group(free_index))
            return
        lay.free(free_index)

    def available_size() -> int:
        # Either tier's next request can use these, counting dormant slots it may take over
        # after a checkpoint. Rows parked since the last allocation become dormant first (the
        # prefill pass asks this right after the plan parked them).
        _suspend_parked(lay)
        cache = lay.cache
        return min(
            cache.room("rt") + cache.reclaimable("rt"), cache.room("be") + cache.reclaimable("be")
        )

    def check_decode_capacity(
        *, num_tokens: int, tree_cache: Any, requests: Any = None, spec_algorithm: Any = None
    ) -> bool:
        _suspend_parked(lay)
        reqs = list(requests or [])
        if not reqs:
            return bool(available_size() >= num_tokens)
        per_req = max(1, num_tokens // len(reqs))
        return lay.fits([(str(r.rid), _tier(r), per_req) for r in reqs])

    def clear() -> None:
        original_clear()
        fresh = BiCacheKvLayout(lay.layers)
        lay.cache, lay.host, lay._owner, lay.rows = fresh.cache, {}, {}, {}

    allocator.alloc = alloc
    allocator.free = free
    allocator.available_size = available_size
    allocator.check_decode_capacity = check_decode_capacity
    allocator.clear = clear


def _route_row_free(pool: Any, lay: BiCacheKvLayout) -> None:
    """SGLang frees a request's ``req_to_token`` row right after its KV, whenever it lets go
    of the request (finished, aborted, retracted). The slot free finds the request by its
    slots; a dormant request whose every slot was taken over has none there (its row points at
    the padding slot), so it is released here: otherwise it stayed dormant in the layout, and
    its recompute after a retraction asked the layout for slots of a dormant request, which
    SGLang's scheduler took for an out-of-memory prefill and died of."""
    original_free = pool.free

    def free(req: Any) -> None:
        original_free(req)
        rid = str(req.rid)
        if rid in lay.cache:
            lay.release(rid)

    pool.free = free


# --- helpers -----------------------------------------------------------------------------------


def _with_demands(demands: list[tuple[str, Tier, int]], call: Any) -> Any:
    global _pending
    _pending = demands
    try:
        return call()
    finally:
        _pending = None


def _note_rows(lay: BiCacheKvLayout, reqs: Sequence[Any]) -> None:
    for req in reqs:
        rid = str(req.rid)
        if rid in lay.cache:
            lay.rows[rid] = int(req.kv.req_pool_idx)


def _tier(req: Any) -> Tier:
    meta = get_meta(req)
    return "be" if meta is not None and meta.tier == "be" else "rt"


def _suspend_parked(lay: BiCacheKvLayout) -> None:
    """BE rows the policy parked are dormant: their slots may be taken over (checkpointed).
    (Without a policy in charge nothing is ever parked.)"""
    for req in _parked:
        rid = str(req.rid)
        if _tier(req) == "be" and rid in lay.cache and not lay.cache.is_dormant(rid):
            lay.suspend(rid)
