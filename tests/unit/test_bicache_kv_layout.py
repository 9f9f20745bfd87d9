"""The SGLang allocator adapter of the bicache layout (backend/sglang_ext/kv_layout.py) on real
CPU KV buffers: RT overwrites a suspended BE request's slots, and after its restore the BE
request reads back exactly the KV it had."""

from __future__ import annotations

import pytest
import torch

from backend.policy.bicache import NoRoom
from backend.sglang_ext.kv_layout import BiCacheKvLayout

LAYERS, HEADS, DIM = 4, 2, 8


def _pool(slots: int) -> list[torch.Tensor]:
    return [torch.zeros(slots, HEADS, DIM) for _ in range(LAYERS)]


def _write(layers: list[torch.Tensor], slots: torch.Tensor, tag: float) -> None:
    """What the forward pass does: the KV of token i goes to slots[i] (tag + i everywhere)."""
    for layer, t in enumerate(layers):
        for i, slot in enumerate(slots.tolist()):
            t[slot] = tag + i + layer / 100


def _read(layers: list[torch.Tensor], slots: list[int], tag: float) -> bool:
    return all(torch.all(t[slot] == tag + i + layer / 100).item()
               for layer, t in enumerate(layers) for i, slot in enumerate(slots))


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
