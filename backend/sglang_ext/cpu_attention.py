"""A prompt chunk's attention on SGLang's torch_native backend (the CPU engine), new rows only.

SGLang 0.5.23's ``TorchNativeAttnBackend._run_sdpa_forward_extend`` computes a chunk of a
prompt by running attention over the request's *whole* sequence: it pads the chunk's queries to
the full length (prefix + chunk) and keeps the last rows of the result. So a 16-token chunk
after 8K cached tokens costs what attention over 8K × 8K costs, and in a mixed batch each decode
(a 1-token extend there) pays its context squared. On the tiny model's shape (4 heads of 64)
that is 150–195 ms a layer for such a chunk against ~2 ms for its own 16 rows, and 7.7 against
0.3 ms after 1.5K tokens (``torch.nn.functional.scaled_dot_product_attention`` on a 2-core
host; best of five, idle). GPU kernels (FlashInfer, FlashAttention) compute only the
chunk's rows, so an iteration's time grows with the tokens it computes; on the CPU engine the
policy could not shorten a deep BE chunk's iteration at all, and an RT prompt that arrived
during one waited for it (``bench/results/long_prompt/README.md``).

:func:`extend_new_rows` is the same computation for the chunk's rows only: row i of a chunk
after P cached tokens attends to keys 0 … P + i (a causal mask offset by P), the same as rows
P … P + n − 1 of SGLang's full-square run (``tests/engine/test_cpu_attention.py`` compares the
two). Loaded as its own SGLang plugin (entry point ``tandem_cpu_attention`` in pyproject.toml)
so that every engine tandem launches with ``engine.torch_native_extend: new-rows`` runs it,
the stock-scheduling baselines of the benchmarks included: it is a kernel, not scheduling.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

from backend.sglang_ext.seams import TORCH_NATIVE_EXTEND_SEAM

logger = logging.getLogger(__name__)

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"


def register() -> None:
    """Entry point for ``sglang.srt.plugins`` (name ``tandem_cpu_attention``): replaces the
    torch_native backend's extend attention in the process that runs the model (SGLang's
    scheduler process; the others never run a forward pass, and are left alone)."""
    if SCHEDULER_MODULE not in sys.modules:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TORCH_NATIVE_EXTEND_SEAM, extend_new_rows, HookType.REPLACE)
    logger.info(
        "tandem: torch_native prompt attention computes new rows only (pid %d)", os.getpid()
    )


def extend_new_rows(
    self: Any,
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    encoder_lens: torch.Tensor | None = None,
    scaling: float | None = None,
    enable_gqa: bool = False,
    causal: bool = False,
    is_cross_attn: bool = False,
    sliding_window_size: int | None = None,
) -> torch.Tensor:
    """``TorchNativeAttnBackend._run_sdpa_forward_extend`` (same arguments, same result) with
    each request's attention computed for its new rows only.

    query, output: [num_tokens, heads, head_dim], the batch's new tokens request after request;
    k_cache, v_cache: [pool slots, kv heads, head_dim]; per request i, seq_lens[i] tokens of
    which the last extend_seq_lens[i] are new (extend_prefix_lens[i] cached before them)."""
    assert seq_lens.shape[0] == extend_prefix_lens.shape[0] == extend_seq_lens.shape[0]
    query = query.movedim(0, query.dim() - 2)  # [heads, num_tokens, head_dim]
    start_q = 0
    for i in range(seq_lens.shape[0]):
        num_new = int(extend_seq_lens[i])
        prefix = int(extend_prefix_lens[i])  # the chunk's first row is position `prefix`
        seq_len = int(seq_lens[i])
        end_q = start_q + num_new
        start_kv = 0
        if encoder_lens is not None and is_cross_attn:  # the encoder's tokens are the keys
            seq_len = int(encoder_lens[i])
        elif encoder_lens is not None:  # the decoder's tokens follow the encoder's
            start_kv = int(encoder_lens[i])
        tokens = req_to_token[req_pool_indices[i], start_kv : start_kv + seq_len]
        key = k_cache[tokens].movedim(0, query.dim() - 2)
        value = v_cache[tokens].movedim(0, query.dim() - 2)
        rows = query[:, start_q:end_q, :]
        if not (rows.dtype == key.dtype == value.dtype):
            key, value = key.to(rows.dtype), value.to(rows.dtype)
        mask = None
        is_causal = False
        if sliding_window_size is not None and sliding_window_size > -1:
            mask = self._make_sliding_window_mask(
                q_len=num_new,
                kv_len=seq_len,
                sliding_window_size=sliding_window_size,
                device=rows.device,
                query_offset=prefix,
            )
        elif causal and prefix == 0 and num_new == seq_len:
            is_causal = True  # no prefix: the plain causal square
        elif causal and num_new > 1:  # row j sees the keys up to its own position, prefix + j
            # (a single row, such as a decode riding beside a prompt, is the sequence's last
            # and sees every key: no mask)
            positions = torch.arange(prefix, prefix + num_new, device=rows.device)
            mask = torch.arange(seq_len, device=rows.device)[None, :] <= positions[:, None]
        out = scaled_dot_product_attention(
            rows.unsqueeze(0),
            key.unsqueeze(0),
            value.unsqueeze(0),
            attn_mask=mask,
            enable_gqa=enable_gqa,
            scale=scaling,
            is_causal=is_causal,
        )
        output[start_q:end_q, :, :] = out.squeeze(0).movedim(query.dim() - 2, 0)
        start_q = end_q
    return output
