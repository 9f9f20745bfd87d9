"""BlendServe's per-request cost model (digest 002 §1.2–1.3): compute time and memory time of a
request with prompt p and output d, and their ratio, the compute density ρ.

    Comp(p, d) = [2·(p+d)·P + 4·p²·H·L] / FLOP/s         GEMMs over every token + prefill attention
    Mem(p, d)  = (p·d + d²/2)·H_kv·L·4 / bytes/s          decode attention reading K and V (fp16)

ρ > 1: compute-bound (long prompt, short output); ρ < 1: memory-bound (long output). Only ratios
of these times matter to the ordering, so the constants need only be right relative to each
other; the defaults are Llama-3.1-8B on an A100-80GB (the paper's reference).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DensityModel:
    """The model and device constants of the cost model."""

    params: float = 8.03e9
    """Model parameters, count (P)."""
    hidden: int = 4096
    """Hidden size (H)."""
    layers: int = 32
    """Transformer layers (L)."""
    kv_width: int = 1024
    """KV feature width per layer per token, n_kv_heads × head_dim (H_kv)."""
    flops_per_s: float = 312e12
    """Peak dense FLOP/s of the device."""
    bytes_per_s: float = 2.0e12
    """Memory bandwidth of the device, bytes/s."""

    def __post_init__(self) -> None:
        for name in ("params", "hidden", "layers", "kv_width", "flops_per_s", "bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DensityModel.{name} must be > 0")

    def comp_s(self, prompt_len: float, output_len: float) -> float:
        """Compute-bound time of one request, seconds (no prefix sharing)."""
        p, d = prompt_len, output_len
        return (2.0 * (p + d) * self.params + 4.0 * p * p * self.hidden * self.layers) / (
            self.flops_per_s
        )

    def mem_s(self, prompt_len: float, output_len: float, output_sq: float | None = None) -> float:
        """Memory-bound time of one request, seconds: KV reads of its decode steps.

        `output_sq`: E[d²] when d is an estimate (defaults to d², i.e. the mean plugged in)."""
        p, d = prompt_len, output_len
        d2 = d * d if output_sq is None else output_sq
        return (p * d + d2 / 2.0) * self.kv_width * self.layers * 4.0 / self.bytes_per_s

    def density(self, prompt_len: float, output_len: float) -> float:
        """ρ of one request (∞ for a request without output)."""
        mem = self.mem_s(prompt_len, output_len)
        return self.comp_s(prompt_len, output_len) / mem if mem > 0 else float("inf")


LLAMA8B_A100 = DensityModel()
"""The paper's reference constants (digest 002 §1.3: ρ(512, 256) ≈ 3.73)."""
