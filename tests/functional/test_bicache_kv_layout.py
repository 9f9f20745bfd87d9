"""The SGLang allocator adapter of the bicache layout (backend/sglang_ext/kv_layout.py) on real
CPU KV buffers: RT overwrites a suspended BE request's slots, and after its restore the BE
request reads back exactly the KV it had."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backend.policy.bicache.records import NoRoom
from backend.sglang_ext import kv_layout_engine
from backend.sglang_ext.kv_layout import BiCacheKvLayout

pytestmark = pytest.mark.slow  # imports torch (and Triton or SGLang): seconds, not a unit test

LAYERS, HEADS, DIM = 4, 2, 8


def _pool(slots: int) -> list[torch.Tensor]:
    return [torch.zeros(slots, HEADS, DIM) for _ in range(LAYERS)]


def _write(layers: list[torch.Tensor], slots: torch.Tensor, tag: float) -> None:
    """What the forward pass does: the KV of token i goes to slots[i] (tag + i everywhere)."""
    for layer, t in enumerate(layers):
        for i, slot in enumerate(slots.tolist()):
            t[slot] = tag + i + layer / 100


def _read(layers: list[torch.Tensor], slots: list[int], tag: float) -> bool:
    return all(
        torch.all(t[slot] == tag + i + layer / 100).item()
        for layer, t in enumerate(layers)
        for i, slot in enumerate(slots)
    )


def test_be_kv_survives_rt_overwriting_it_and_comes_back_intact() -> None:
    layers = _pool(1 + 64)  # SGLang's padding slot 0 + 4 blocks of 16
    kv = BiCacheKvLayout(layers)
    be = kv.alloc([("x", "be", 40)])
    assert 0 not in be.tolist()  # the padding slot is never handed out
    _write(layers, be, 1000.0)
    kv.suspend("x")  # the scheduler evicted x; its KV stays
    rt = kv.alloc([("r", "rt", 36)])  # 24 free slots, then 12 of x's
    _write(layers, rt, 5000.0)
    assert kv.cache.host_tokens("x") == 12 and len(kv.host) == 12
    kv.release("r")
    row = kv.resume_and_restore("x")
    assert len(row) == 40 and len(set(row)) == 40 and not kv.host
    assert _read(layers, row, 1000.0)  # every token of x, restored ones included


def test_a_batch_gets_its_slots_in_request_order() -> None:
    kv = BiCacheKvLayout(_pool(1 + 64))
    slots = kv.alloc([("a", "rt", 3), ("x", "be", 2), ("b", "rt", 1)]).tolist()
    assert slots[:3] == [s + 1 for s in kv.cache.slots("a")]
    assert slots[3:5] == [s + 1 for s in kv.cache.slots("x")]
    assert slots[5:] == [s + 1 for s in kv.cache.slots("b")]


def test_free_releases_whole_requests_only() -> None:
    kv = BiCacheKvLayout(_pool(1 + 32))
    slots = kv.alloc([("a", "rt", 5)])
    with pytest.raises(ValueError, match="partial free of request 'a'"):
        kv.free(slots[:2])
    kv.free(slots)
    assert "a" not in kv.cache and kv.available_size() == 32


def test_a_live_be_request_is_never_overwritten() -> None:
    kv = BiCacheKvLayout(_pool(1 + 32))
    kv.alloc([("x", "be", 30)])
    with pytest.raises(NoRoom):
        kv.alloc([("r", "rt", 3)])


def test_a_be_prefix_cached_by_the_radix_tree_is_never_overwritten() -> None:
    """The radix-cache rule: a protected BE prefix is neither stolen by RT nor taken over by
    BE, even while its request is dormant; only the tokens after it may be checkpointed."""
    layers = _pool(1 + 64)  # 4 blocks of 16
    kv = BiCacheKvLayout(layers)
    x = kv.alloc([("x", "be", 28)])  # a whole block, and 12 slots of a second one
    _write(layers, x, 1000.0)
    kv.protect("x", 20)  # the tree shares x's first 20 tokens
    kv.suspend("x")
    with pytest.raises(NoRoom):
        kv.alloc([("r", "rt", 45)])  # 36 free + 8 unprotected: one slot short
    assert kv.cache.host_tokens("x") == 0  # the failed attempt changed nothing
    rt = kv.alloc([("r", "rt", 44)])
    _write(layers, rt, 5000.0)
    assert kv.cache.checkpointed("x") == list(range(20, 28))
    with pytest.raises(NoRoom):
        kv.alloc([("y", "be", 1)])  # BE may not take over a segment holding prefix tokens
    prefix = [s + kv.offset for s in kv.cache.slots("x")[:20]]
    assert _read(layers, prefix, 1000.0)  # the shared prefix is intact, in place
    kv.release("r")
    row = kv.resume_and_restore("x")
    assert row[:20] == prefix and _read(layers, row, 1000.0)


def test_rows_never_point_at_a_slot_someone_else_took_over() -> None:
    """SGLang's req_to_token row of a dormant BE request: checkpointed entries point at the
    padding slot until the restore writes the new slots; freeing the row frees the request."""
    kv = BiCacheKvLayout(_pool(1 + 64))
    table = torch.zeros(4, 64, dtype=torch.int32)
    kv.req_to_token = table
    x = kv.alloc([("x", "be", 30)])
    kv.rows["x"] = 2
    table[2, :30] = x.to(torch.int32)
    kv.suspend("x")
    rt = kv.alloc([("r", "rt", 40)])  # 34 free, then 6 of x's slots
    assert table[2, 24:30].tolist() == [0] * 6
    assert not set(rt.tolist()) & set(table[2, :30].tolist())
    kv.release("r")
    row = kv.resume_and_restore("x")
    assert table[2, :30].tolist() == row and 0 not in row
    stats = kv.stats()
    assert stats["checkpointed_tokens"] == stats["restored_tokens"] == 6
    assert stats["suspends"] == stats["restores"] == 1
    kv.suspend("x")
    kv.alloc([("s", "rt", kv.cache.room("rt") + 3)])  # checkpoints 3 of x's tokens again
    kv.free(table[2, :30].to(torch.int64))  # x aborted while dormant: its row has zeros
    assert "x" not in kv.cache and not kv.host and kv.stats()["discarded_tokens"] == 3


def test_fits_is_an_exact_dry_run() -> None:
    kv = BiCacheKvLayout(_pool(1 + 64))
    kv.alloc([("x", "be", 20)])  # a whole block and 4 slots of a second
    kv.suspend("x")
    kv.alloc([("r", "rt", 48)])  # 44 free, then x's 4 slots there (checkpointed)
    used = kv.cache.used
    assert not kv.fits([("x", "be", 1)])  # no block without a BE owner for x's 4 host tokens
    assert kv.cache.used == used and kv.cache.is_dormant("x")  # the dry run changed nothing
    assert kv.cache.host_tokens("x") == 4
    kv.release("r")
    assert kv.fits([("x", "be", 1), ("a", "rt", 30)])
    assert not kv.fits([("x", "be", 1), ("a", "rt", 44)])
    assert kv.cache.is_dormant("x") and kv.cache.host_tokens("x") == 4


def test_a_dormant_be_request_frees_nothing_the_pool_does_not_already_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = BiCacheKvLayout(_pool(1 + 64))
    kv.alloc([("x", "be", 40)])
    kv.alloc([("r", "rt", 8)])
    assert kv_layout_engine.unfreeable_tokens("x") == 0  # no layout installed
    monkeypatch.setattr(kv_layout_engine, "_layout", kv)
    assert kv_layout_engine.unfreeable_tokens("x") == kv.cache.shared("x")  # live
    assert kv_layout_engine.unfreeable_tokens("nobody") == 0
    rt_usable = kv.cache.room("rt") + kv.cache.reclaimable("rt")
    kv.suspend("x")
    # its slots in place now count as usable by RT (the allocator's available_size says so)...
    assert kv.cache.room("rt") + kv.cache.reclaimable("rt") > rt_usable
    # ...so evicting it frees none beyond that
    assert kv_layout_engine.unfreeable_tokens("x") == 40


def test_a_request_whose_slots_were_all_taken_over_leaves_when_sglang_lets_go_of_it() -> None:
    """A dormant BE request whose every slot RT took over has no slot left for SGLang's KV free
    to name; the row free that follows releases it, so its recompute after a retraction gets
    fresh slots (it was left dormant, and that allocation killed the scheduler)."""
    kv = BiCacheKvLayout(_pool(1 + 32))
    kv.alloc([("x", "be", 16)])
    kv.suspend("x")
    kv.alloc([("r", "rt", 32)])  # the 16 free slots, then all of x's
    assert kv.cache.host_tokens("x") == 16
    kv.free(torch.zeros(16, dtype=torch.int64))  # x's row: every entry at the padding slot
    assert "x" in kv.cache  # the slot free cannot tell whose those were
    freed_rows: list[str] = []
    pool = SimpleNamespace(free=lambda req: freed_rows.append(req.rid))
    kv_layout_engine._route_row_free(pool, kv)
    pool.free(SimpleNamespace(rid="x"))
    assert freed_rows == ["x"] and "x" not in kv.cache and not kv.host
    kv.release("r")
    assert len(kv.alloc([("x", "be", 16)])) == 16  # the recompute
