"""KV gather/scatter kernels (backend/kernels/kv_copy.py) against their torch references, on CPU in
Triton's interpreter, for several shapes and dtypes; and the wrappers' input checks."""

from __future__ import annotations

import os

import torch

# On a CPU-only machine the whole process may use Triton's interpreter (read when kernels are
# defined, so before backend.kernels.kv_copy is imported). Not on a GPU machine: tests/gpu needs the
# compiled kernels, and kv_copy runs CPU tensors in the interpreter either way.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from backend.kernels.kv_copy import KvLayers, gather_slots, scatter_slots
from backend.kernels.kv_copy_ref import gather_slots_reference, scatter_slots_reference

pytestmark = pytest.mark.slow  # imports torch (and Triton or SGLang): seconds, not a unit test

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8]
# (layers, slots in the pool, row shape): one head; SGLang-like heads × head_dim; odd sizes
# that force narrower copy words; a row longer than one kernel block (several iterations)
SHAPES = [(1, 8, (4,)), (4, 64, (2, 16)), (3, 33, (3, 5)), (2, 40, (1, 600))]


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-128, 127, shape, generator=gen, dtype=torch.int16).to(dtype)


def _pool(
    layers: int, slots: int, row: tuple[int, ...], dtype: torch.dtype, seed: int
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [_random((slots, *row), dtype, gen) for _ in range(layers)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN-safe, works for fp8)."""
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gather_matches_reference(
    shape: tuple[int, int, tuple[int, ...]], dtype: torch.dtype
) -> None:
    layers, num_slots, row = shape
    pool = _pool(layers, num_slots, row, dtype, seed=layers * 100 + num_slots)
    gen = torch.Generator().manual_seed(7)
    slots = torch.randperm(num_slots, generator=gen)[: num_slots // 2 + 1]
    got = gather_slots(pool, slots)
    assert got.shape == (layers, slots.numel(), *row)
    assert _same(got, gather_slots_reference(pool, slots))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_scatter_matches_reference_and_touches_nothing_else(
    shape: tuple[int, int, tuple[int, ...]], dtype: torch.dtype
) -> None:
    layers, num_slots, row = shape
    pool = _pool(layers, num_slots, row, dtype, seed=1)
    expected = [t.clone() for t in pool]
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(num_slots, generator=gen)[: max(1, num_slots // 3)].to(torch.int32)
    packed = _random((layers, slots.numel(), *row), dtype, gen)
    scatter_slots(pool, slots, packed)
    scatter_slots_reference(expected, slots, packed)
    assert all(_same(a, b) for a, b in zip(pool, expected, strict=True))


def test_checkpoint_round_trip_restores_overwritten_slots() -> None:
    """What lazy checkpointing does: copy BE slots out, let RT overwrite them, copy them back
    (to other slots): the BE request's KV is exactly what it was."""
    pool = KvLayers(_pool(4, 32, (2, 8), torch.bfloat16, seed=5))
    be_slots = torch.tensor([31, 30, 29, 28])
    before = gather_slots_reference(pool.layers, be_slots)
    host = pool.gather(be_slots)
    rt_rows = torch.zeros_like(host)
    pool.scatter(be_slots, rt_rows)  # RT overwrites them
    new_slots = torch.tensor([3, 9, 4, 12])
    pool.scatter(new_slots, host)
    assert _same(gather_slots_reference(pool.layers, new_slots), before)
    assert _same(gather_slots_reference(pool.layers, be_slots), rt_rows)


def test_layers_of_one_stacked_allocation_and_views() -> None:
    # K and V of every layer as views into one [2, L, S, H, D] allocation (a common pool form)
    gen = torch.Generator().manual_seed(0)
    stacked = torch.randn((2, 3, 20, 2, 4), generator=gen).to(torch.float16)
    layers = [stacked[kv, layer] for kv in range(2) for layer in range(3)]
    slots = torch.tensor([19, 0, 7])
    assert _same(gather_slots(layers, slots), gather_slots_reference(layers, slots))


def test_copy_word_follows_alignment() -> None:
    assert KvLayers(_pool(2, 4, (8,), torch.bfloat16, 0)).word_bytes == 8
    assert KvLayers(_pool(2, 4, (3,), torch.bfloat16, 0)).word_bytes == 2
    assert KvLayers(_pool(2, 4, (2,), torch.float8_e4m3fn, 0)).word_bytes == 2


def test_empty_slot_list() -> None:
    pool = _pool(2, 4, (4,), torch.float32, 0)
    assert gather_slots(pool, torch.tensor([], dtype=torch.int64)).shape == (2, 0, 4)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: gather_slots(p, torch.tensor([[1]])), "slots must be 1-D"),
        (lambda p: gather_slots(p, torch.tensor([1.0])), "int32 or int64"),
        (lambda p: gather_slots(p, torch.tensor([8])), "slot 8 out of range"),
        (lambda p: gather_slots(p, torch.tensor([-1])), "slot -1 out of range"),
        (lambda p: gather_slots(p, torch.tensor([1]), torch.empty(2, 2, 4)), "must have shape"),
        (
            lambda p: gather_slots(p, torch.tensor([1]), torch.empty(2, 1, 4, dtype=torch.float16)),
            "is torch.float16",
        ),
        (lambda p: scatter_slots(p, torch.tensor([1, 1]), torch.empty(2, 2, 4)), "slots repeat"),
        (lambda p: gather_slots([*p, torch.empty(8, 5)], torch.tensor([1])), "every layer must"),
        (lambda p: gather_slots([], torch.tensor([1])), "at least one layer"),
        (lambda p: gather_slots([t.t() for t in p], torch.tensor([1])), "contiguous"),
    ],
)
def test_bad_inputs_are_named(call: object, message: str) -> None:
    pool = _pool(2, 8, (4,), torch.float32, 0)
    with pytest.raises(ValueError, match=message):
        call(pool)  # type: ignore[operator]
