"""Triton kernels that move scattered KV slots of every layer in one launch (BROS's checkpoint
kernels, §3 of the digest): `gather_slots` copies the rows of a set of slots out of every layer
buffer into one contiguous buffer, `scatter_slots` writes such a buffer back.

The KV pool is a list of per-layer buffers of the same shape, dtype and device, each
`[num_slots, ...]` with contiguous rows (SGLang's `MHATokenToKVPool` keeps `k_buffer[l]` and
`v_buffer[l]`, `[size + page_size, head_num, head_dim]`; pass K and V of every layer, 2·L
buffers). A slot's row is `row_elems` = head_num·head_dim values. The packed buffer is
`[num_layers, n, row_elems]`, layer-major, so a checkpoint of n tokens is one contiguous block.

    layer buffers (device)                          packed buffer (device, or pinned host)
    L0: |..|s7|..|s2|..|s9|..|                       L0: | s7 | s2 | s9 |
    L1: |..|s7|..|s2|..|s9|..|   gather ──────▶      L1: | s7 | s2 | s9 |
    ...                          ◀────── scatter     ...

One program copies one (slot, layer) row. The kernel finds each layer through a table of base
addresses (built once per pool by `KvLayers`), so the buffers need not be one allocation. Bytes
are moved as the widest unsigned word that divides every base address and the row size (up to 8
bytes; the compiler then issues 16-byte vector accesses on aligned rows), which makes the copy
exact for every dtype, fp8 and bfloat16 included.

On a GPU the packed buffer may be pinned host memory: the kernel then writes (or reads) it over
PCIe directly (zero-copy), with no staging buffer. On CPU tensors the same kernels run in
Triton's interpreter (always: as if `TRITON_INTERPRET=1` were set for them), which is how the
tests check them against the torch references (backend/kernels/kv_copy_ref.py); that path is
for correctness only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["KvLayers", "gather_slots", "scatter_slots"]

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_TL_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}
_BLOCK_WORDS = 256  # words per program iteration: 2 KiB rows (8 KV heads × 128 × bf16) in one


@triton.jit
def _gather_kernel(
    table_ptr,
    slots_ptr,
    out_ptr,
    n,
    row_words,
    row_stride_words,
    WORD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    layer = tl.program_id(1)
    base = tl.load(table_ptr + layer).to(tl.pointer_type(WORD))
    slot = tl.load(slots_ptr + i).to(tl.int64)
    src = base + slot * row_stride_words
    dst = out_ptr + (layer.to(tl.int64) * n + i) * row_words
    for start in range(0, row_words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < row_words
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _scatter_kernel(
    table_ptr,
    slots_ptr,
    src_ptr,
    n,
    row_words,
    row_stride_words,
    WORD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    layer = tl.program_id(1)
    base = tl.load(table_ptr + layer).to(tl.pointer_type(WORD))
    slot = tl.load(slots_ptr + i).to(tl.int64)
    dst = base + slot * row_stride_words
    src = src_ptr + (layer.to(tl.int64) * n + i) * row_words
    for start in range(0, row_words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < row_words
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


_interpreted: dict[object, Any] = {}


def _launch(
    kernel: Any, grid: tuple[int, int], device: torch.device, *args: Any, **meta: Any
) -> None:
    """Runs a kernel: compiled on a GPU, in Triton's interpreter on CPU tensors."""
    if device.type == "cpu" and not isinstance(kernel, InterpretedFunction):
        fn = _interpreted.get(kernel)
        if fn is None:
            fn = _interpreted[kernel] = InterpretedFunction(kernel.fn)
        kernel = fn
    kernel[grid](*args, **meta)


class KvLayers:
    """The layer buffers of one KV pool, checked once, with the device-side table of their base
    addresses that the kernels read. Build it once per pool (the buffers must not be
    reallocated afterwards) and reuse it for every copy."""

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        if not layers:
            raise ValueError("KvLayers needs at least one layer buffer")
        first = layers[0]
        if first.dim() < 2:
            raise ValueError(
                f"a layer buffer must be [num_slots, ...], got shape {tuple(first.shape)}"
            )
        for i, t in enumerate(layers):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}; "
                    f"layer 0 is {tuple(first.shape)} {first.dtype} on "
                    f"{first.device}: every layer must match"
                )
            if t.stride() != first.stride() or not t[0].is_contiguous():
                raise ValueError(
                    f"layer {i}: each slot's row must be contiguous, with the same "
                    f"strides in every layer"
                )
        self.layers = list(layers)
        self.num_layers = len(layers)
        self.num_slots = first.shape[0]
        self.row_shape = tuple(first.shape[1:])
        self.row_elems = first[0].numel()
        self.dtype = first.dtype
        self.device = first.device
        itemsize = first.element_size()
        row_bytes = self.row_elems * itemsize
        stride_bytes = first.stride(0) * itemsize
        word = 8
        while word > 1 and any(
            x % word for x in (row_bytes, stride_bytes, *(t.data_ptr() for t in layers))
        ):
            word //= 2
        self.word_bytes = word
        """Bytes per copied word: the largest power of two ≤ 8 dividing every base address,
        the row size and the row stride."""
        self.row_words = row_bytes // word
        self.row_stride_words = stride_bytes // word
        self.table = torch.tensor(
            [t.data_ptr() for t in layers], dtype=torch.int64, device=self.device
        )
        """Base address of every layer buffer, on the buffers' device."""

    @property
    def row_bytes(self) -> int:
        return self.row_words * self.word_bytes

    def packed_shape(self, n: int) -> tuple[int, ...]:
        """Shape of the packed buffer for n slots: [num_layers, n, *row_shape]."""
        return (self.num_layers, n, *self.row_shape)

    def empty_packed(self, n: int, *, pin: bool | None = None) -> torch.Tensor:
        """A packed buffer for n slots on the host; pinned when the pool is on a GPU (the
        kernels then reach it directly), unless `pin` says otherwise."""
        pin = self.device.type == "cuda" if pin is None else pin
        return torch.empty(self.packed_shape(n), dtype=self.dtype, pin_memory=pin)

    def _check_slots(self, slots: torch.Tensor, *, check: bool, unique: bool) -> torch.Tensor:
        if slots.dim() != 1:
            raise ValueError(f"slots must be 1-D, got shape {tuple(slots.shape)}")
        if slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots must be int32 or int64, got {slots.dtype}")
        if slots.device != self.device:
            raise ValueError(f"slots are on {slots.device}, the pool on {self.device}")
        slots = slots.contiguous()
        if check and slots.numel():
            # a device→host sync on a GPU: pass check=False on hot paths with trusted indices
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 0 or hi >= self.num_slots:
                raise ValueError(f"slot {lo if lo < 0 else hi} out of range [0, {self.num_slots})")
            if unique and torch.unique(slots).numel() != slots.numel():
                raise ValueError("slots repeat: a scatter would write one slot twice")
        return slots

    def _check_packed(self, packed: torch.Tensor, n: int, what: str) -> None:
        want = self.packed_shape(n)
        if tuple(packed.shape) != want:
            raise ValueError(f"{what} must have shape {want}, got {tuple(packed.shape)}")
        if packed.dtype != self.dtype:
            raise ValueError(f"{what} is {packed.dtype}, the pool {self.dtype}")
        if not packed.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        if packed.data_ptr() % self.word_bytes:
            raise ValueError(
                f"{what} must be aligned to {self.word_bytes} bytes (the pool's copy word)"
            )
        if packed.device != self.device:
            host_ok = (
                self.device.type == "cuda" and packed.device.type == "cpu" and packed.is_pinned()
            )
            if not host_ok:
                raise ValueError(
                    f"{what} is on {packed.device}, the pool on {self.device} "
                    f"(a host buffer must be pinned memory)"
                )

    def _words(self, packed: torch.Tensor) -> torch.Tensor:
        return packed.view(-1).view(torch.uint8).view(_WORDS[self.word_bytes])

    def gather(
        self, slots: torch.Tensor, out: torch.Tensor | None = None, *, check: bool = True
    ) -> torch.Tensor:
        """Copies the rows of `slots` (every layer) into `out` ([num_layers, n, *row_shape];
        a new host buffer, pinned on a GPU, when None) and returns it. `check` validates
        the slot range (a sync on a GPU)."""
        slots = self._check_slots(slots, check=check, unique=False)
        n = slots.numel()
        if out is None:
            out = self.empty_packed(n)
        self._check_packed(out, n, "out")
        if n:
            _launch(
                _gather_kernel,
                (n, self.num_layers),
                self.device,
                self.table,
                slots,
                self._words(out),
                n,
                self.row_words,
                self.row_stride_words,
                WORD=_TL_WORDS[self.word_bytes],
                BLOCK=_block(self.row_words),
            )
        return out

    def scatter(self, slots: torch.Tensor, packed: torch.Tensor, *, check: bool = True) -> None:
        """Writes `packed` ([num_layers, n, *row_shape]) into the rows of `slots` of every layer.
        `check` validates the slot range and that no slot repeats (a sync on a GPU)."""
        slots = self._check_slots(slots, check=check, unique=True)
        n = slots.numel()
        self._check_packed(packed, n, "packed")
        if n:
            _launch(
                _scatter_kernel,
                (n, self.num_layers),
                self.device,
                self.table,
                slots,
                self._words(packed),
                n,
                self.row_words,
                self.row_stride_words,
                WORD=_TL_WORDS[self.word_bytes],
                BLOCK=_block(self.row_words),
            )


def _block(row_words: int) -> int:
    return min(_BLOCK_WORDS, triton.next_power_of_2(max(row_words, 16)))


def gather_slots(
    layers: KvLayers | Sequence[torch.Tensor],
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """`KvLayers(layers).gather(slots, out)` (build the KvLayers once on hot paths)."""
    kv = layers if isinstance(layers, KvLayers) else KvLayers(layers)
    return kv.gather(slots, out, check=check)


def scatter_slots(
    layers: KvLayers | Sequence[torch.Tensor],
    slots: torch.Tensor,
    packed: torch.Tensor,
    *,
    check: bool = True,
) -> None:
    """`KvLayers(layers).scatter(slots, packed)`."""
    kv = layers if isinstance(layers, KvLayers) else KvLayers(layers)
    kv.scatter(slots, packed, check=check)
