"""CPU stand-in for ``sgl_kernel`` (SGLang's compiled kernel package), for machines without it.

What it replaces: the ``sgl_kernel`` Python package. PyPI has no CPU build of it (``sglang-kernel``
is a 373 MB CUDA-only wheel pinned to another torch); upstream builds the CPU kernels from source.

Why: with ``SGLANG_USE_CPU_ENGINE=1`` (needed so that layers take their CPU paths),
``sglang/kernels/ops/kvcache/cache_move.py`` runs ``from sgl_kernel import
copy_all_layer_kv_cache_cpu`` at import time, so the scheduler cannot even be imported without
some ``sgl_kernel``.

What it does:

* :func:`copy_all_layer_kv_cache_cpu` is implemented for real (in torch), because the KV pool
  uses it to move slots (``MHATokenToKVPool.move_kv_cache``).
* Every other name resolves (module ``__getattr__``) to a function that raises
  ``NotImplementedError`` naming the op, so an unexpected call fails loudly instead of silently.
* It registers **no** ``torch.ops.sgl_kernel.*`` operator. In particular
  ``torch.ops.sgl_kernel.convert_weight_packed`` stays missing, so
  ``sglang.srt.utils.cpu_has_amx_support()`` is False and every layer (RMSNorm, SiLU-and-mul,
  RoPE, linear) takes its pure-torch ``forward_native`` path.

How it is found: ``scripts/cpu_shims`` is on ``sys.path`` *after* site-packages (the
``tandem_cpu_shims.pth`` that ``scripts/install`` writes), so a real ``sgl_kernel`` always wins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__version__ = "0.0.0+tandem.cpu.stub"
IS_TANDEM_CPU_STUB = True  # lets tests and diagnostics tell this stub from the real package


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every K/V buffer ``b``: ``buf_b[tgt_loc[i], :] = buf_b[src_loc[i], :]`` for all ``i``.

    The contract of sgl-kernel's CPU op of the same name (the CPU arm of the Triton kernel
    ``copy_all_layer_kv_cache_tiled``):

    * ``data_ptrs``: ``[num_bufs]`` uint64 (or int64), the base address of each K/V buffer
      (``2 * num_layers`` of them: all K buffers, then all V buffers);
    * ``strides``: ``[num_bufs]`` int64, bytes per slot row of each buffer;
    * ``tgt_loc`` / ``src_loc``: ``[num_locs]`` slot indices (int32 or int64).

    Like the original, the copy is safe when the two index sets overlap arbitrarily: all source
    rows of a buffer are gathered before any target row of it is written.

    The buffers are only known by address, so each is wrapped as a byte tensor with
    ``torch.from_blob``-like semantics via ``torch.frombuffer`` over a ctypes array — no copy of
    the pool is made; only the moved rows are.
    """
    if data_ptrs.numel() != strides.numel():
        raise ValueError("data_ptrs and strides must have the same length")
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError("tgt_loc and src_loc must have the same length")
    num_locs = tgt_loc.numel()
    if num_locs == 0 or data_ptrs.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64).cpu()
    src = src_loc.to(torch.int64).cpu()
    # Rows touched: the buffer view only needs to reach the highest slot either side uses.
    num_rows = int(torch.maximum(tgt.max(), src.max()).item()) + 1
    for ptr, row_bytes in zip(data_ptrs.view(torch.int64).tolist(), strides.tolist(), strict=True):
        rows = _byte_rows(int(ptr) & ((1 << 64) - 1), num_rows, int(row_bytes))
        rows[tgt] = rows[src]  # advanced indexing gathers src into a temporary first


def _byte_rows(address: int, num_rows: int, row_bytes: int) -> torch.Tensor:
    """A ``[num_rows, row_bytes]`` uint8 view of the memory at *address* (no copy)."""
    import ctypes

    size = num_rows * row_bytes
    array = (ctypes.c_uint8 * size).from_address(address)
    return torch.frombuffer(array, dtype=torch.uint8, count=size).view(num_rows, row_bytes)


def _not_implemented(name: str) -> Callable[..., Any]:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this is tandem's CPU stand-in for sgl_kernel "
            "(scripts/cpu_shims/sgl_kernel); install a real sgl-kernel build to use it"
        )

    op.__name__ = op.__qualname__ = name
    return op


def __getattr__(name: str) -> Any:
    """Any other public name: a function that raises NotImplementedError when called."""
    # Private and dunder names stay missing, so probes like `hasattr(m, "__file__")` or
    # `getattr(m, "_C")` behave as for an ordinary module.
    if name.startswith("_"):
        raise AttributeError(name)
    return _not_implemented(name)
