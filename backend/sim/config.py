"""Simulator configuration (one frozen struct, validated on construction)."""

from __future__ import annotations

import msgspec


class SimConfig(msgspec.Struct, frozen=True):
    """The simulated engine: memory, caps, prefix cache and run length."""

    kv_capacity_tokens: int
    """KV pool size, tokens (slots)."""
    page_size: int = 1
    """KV allocation granularity, tokens; a request's private KV is rounded up to pages."""
    max_running: int = 1024
    """Cap on admitted (KV-holding) requests."""
    max_prefill_tokens: int = 8192
    """Cap on prefill tokens in one iteration, tokens."""
    prefix_cache: bool = True
    """Model the prefix cache: blocks with equal leading hashes are computed and stored once."""
    prefix_block_tokens: int = 512
    """Tokens per prefix-cache block (one `prefix_hashes` entry each); a multiple of page_size."""
    horizon_s: float | None = None
    """Simulated time at which arrivals stop and the run ends, seconds; None: run until every
    request has finished."""
    reveal_lengths: bool = False
    """Oracle mode: set ReqState.true_output_len so the policy sees true output lengths."""

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be ≥ 1, got {self.kv_capacity_tokens}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be ≥ 1, got {self.page_size}")
        if self.max_running < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_running and max_prefill_tokens must be ≥ 1")
        if self.prefix_block_tokens < 1 or self.prefix_block_tokens % self.page_size:
            raise ValueError(
                f"prefix_block_tokens ({self.prefix_block_tokens}) must be a positive multiple "
                f"of page_size ({self.page_size})"
            )
        if self.horizon_s is not None and self.horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0 or None, got {self.horizon_s}")
