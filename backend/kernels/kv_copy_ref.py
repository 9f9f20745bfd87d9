"""Torch references of the KV gather/scatter kernels (backend/kernels/kv_copy.py), importable
without Triton: the CPU engine's copies use these."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def gather_slots_reference(layers: Sequence[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The torch reference of `gather_slots` (index_select per layer, then stack)."""
    index = slots.to(torch.int64)
    return torch.stack([t.index_select(0, index) for t in layers])


def scatter_slots_reference(
    layers: Sequence[torch.Tensor], slots: torch.Tensor, packed: torch.Tensor
) -> None:
    """The torch reference of `scatter_slots` (index_copy_ per layer, on the bytes: torch has
    no index_copy_ for fp8)."""
    index = slots.to(torch.int64)
    for t, rows in zip(layers, packed, strict=True):
        t.view(torch.uint8).index_copy_(0, index, rows.to(t.device).view(torch.uint8))
