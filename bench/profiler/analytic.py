"""An analytic roofline profile: Llama-3.1-8B-shaped model, bf16, one H100 SXM.

    python -m bench.profiler.analytic [--out FILE]    # writes h100-llama8b-analytic.json

It stands in for a measured GPU profile until one exists. Every iteration costs

    T = max(compute_s, memory_s) + overhead_s

    compute_s  = FLOPs / 800 TFLOP/s        (bf16 dense, achievable; the peak is 989)
    memory_s   = bytes / 3.0 TB/s           (HBM3, achievable; the peak is 3.35)
    overhead_s = 2 ms + 10 µs × requests    (scheduling, kernel launches, sampling, host sync)

    FLOPs = 2·P_layers·tokens                    every token runs through all 32 layers
          + 2·H·V·sampled                        LM head: one sampled row per request
          + 4·L·Hq·d·keys                        attention: QKᵀ and PV, per query·key pair
    keys  = Σ_chunks l·p + l(l+1)/2  (causal chunk of l after a prefix of p)  + Σ_decodes c
    bytes = 2·(P_layers + H·V)                   weights, read once per iteration
          + kv_bytes·(Σ_decodes c + Σ_chunks p)  KV read by decodes and by chunks over a prefix
          + kv_bytes·(Σ_chunks l + N_d)          KV written for every new token

Activation traffic is left out: it is about 147 KB per token over all layers (read + written),
at most 3 ms for an 8K-token chunk that computes for 150 ms, so it never decides the max().
The numbers, the KV capacity arithmetic and the sample grid are in :func:`description` and
bench/profiler/README.md. The output is deterministic (no randomness, fixed grid).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from backend.policy.latency import BatchShape, Profile, ProfileSample, save_profile
from backend.policy.profiles import PROFILES_DIR

PROFILE_NAME = "h100-llama8b-analytic"
DEFAULT_OUT = PROFILES_DIR / f"{PROFILE_NAME}.json"
GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder (dense, GQA, SwiGLU MLP, untied LM head)."""

    hidden: int = 4096
    """H: hidden size."""
    layers: int = 32
    """L: decoder layers."""
    q_heads: int = 32
    """Hq: attention query heads."""
    kv_heads: int = 8
    """Hkv: key/value heads (grouped-query attention)."""
    head_dim: int = 128
    """d: per-head dimension."""
    intermediate: int = 14336
    """I: MLP intermediate size."""
    vocab: int = 128256
    """V: vocabulary size."""
    bytes_per_param: int = 2
    """bf16 weights and KV cache, bytes."""

    @property
    def layer_params(self) -> int:
        """Parameters of all decoder layers: q, k, v, o projections, MLP, two RMSNorms."""
        attn = self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim
        attn += self.q_heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp + 2 * self.hidden)

    @property
    def lm_head_params(self) -> int:
        """The LM head (H×V); the input embedding has as many but is only gathered."""
        return self.hidden * self.vocab

    @property
    def total_params(self) -> int:
        """Layers + final norm + input embedding + LM head."""
        return self.layer_params + self.hidden + 2 * self.hidden * self.vocab

    @property
    def weight_bytes(self) -> int:
        """All weights in memory, bytes."""
        return self.total_params * self.bytes_per_param

    @property
    def streamed_weight_bytes(self) -> int:
        """Weights read by one iteration (layers + LM head; embedding rows are negligible)."""
        return (self.layer_params + self.lm_head_params) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers: 2·L·Hkv·d·2 bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def attn_flops_per_key(self) -> int:
        """FLOPs of one query token attending to one key over all layers: 4·L·Hq·d."""
        return 4 * self.layers * self.q_heads * self.head_dim


@dataclass(frozen=True)
class Hardware:
    """One H100 SXM 80 GB, as the roofline sees it."""

    device: str = "NVIDIA H100 SXM 80GB"
    """What the numbers describe."""
    flops_per_s: float = 800e12
    """Achievable bf16 dense FLOP/s (peak 989e12)."""
    hbm_bytes_per_s: float = 3.0e12
    """Achievable HBM bandwidth, bytes/s (peak 3.35e12)."""
    hbm_bytes: int = 80 * 10**9
    """Device memory, bytes (the nominal 80 GB; CUDA reports a little more)."""
    activation_reserve_bytes: int = 8 * 10**9
    """Kept out of the KV pool for activations, CUDA graphs, NCCL and allocator slack, bytes
    (about what SGLang's mem_fraction_static ≈ 0.9 leaves)."""
    overhead_s: float = 2.0e-3
    """Fixed cost of every iteration: scheduling, kernel launches, sampling, host sync, s."""
    overhead_per_request_s: float = 10e-6
    """Per-request bookkeeping in an iteration (metadata, detokenisation), s."""
    host_copy_gb_s: float = 25.0
    """Effective device↔host KV copy bandwidth, GB/s: PCIe Gen5 x16 moves about 50 GB/s in
    large pinned copies; paged KV is gathered in 2 KiB pieces (one token, one layer, K or V),
    which halves that."""
    page_size: int = 1
    """KV allocation granularity, tokens (SGLang's default on H100)."""
    max_prefill_tokens: int = 8192
    """SGLang's default chunked_prefill_size on an 80 GB card, tokens."""


@dataclass(frozen=True)
class Roofline:
    """One iteration's cost, broken down."""

    flops: float
    """Floating-point operations."""
    bytes: float
    """HBM bytes moved."""
    compute_s: float
    """flops / achievable FLOP/s."""
    memory_s: float
    """bytes / achievable bandwidth."""
    overhead_s: float
    """Fixed plus per-request overhead."""

    @property
    def seconds(self) -> float:
        """The iteration time: max(compute, memory) + overhead."""
        return max(self.compute_s, self.memory_s) + self.overhead_s

    @property
    def is_compute_bound(self) -> bool:
        """True when the FLOPs, not the bytes, set the time."""
        return self.compute_s >= self.memory_s


def kv_capacity_tokens(model: ModelShape, hw: Hardware) -> int:
    """Tokens of KV that fit beside the weights and the activation reserve (page-aligned)."""
    free = hw.hbm_bytes - model.weight_bytes - hw.activation_reserve_bytes
    tokens = free // model.kv_bytes_per_token
    return tokens - tokens % hw.page_size


def iteration(
    model: ModelShape, hw: Hardware, chunks: Sequence[tuple[int, int]], contexts: Sequence[int]
) -> Roofline:
    """The roofline of one iteration: prefill `chunks` as (chunk, prefix) pairs, and one decode
    for each KV length in `contexts`."""
    tokens = sum(chunk for chunk, _ in chunks) + len(contexts)
    sampled = len(chunks) + len(contexts)
    keys = sum(chunk * prefix + chunk * (chunk + 1) // 2 for chunk, prefix in chunks)
    keys += sum(contexts)
    flops = (
        2 * model.layer_params * tokens
        + 2 * model.lm_head_params * sampled
        + model.attn_flops_per_key * keys
    )
    kv_read = sum(contexts) + sum(prefix for _, prefix in chunks)
    nbytes = model.streamed_weight_bytes + model.kv_bytes_per_token * (kv_read + tokens)
    return Roofline(
        flops=float(flops),
        bytes=float(nbytes),
        compute_s=flops / hw.flops_per_s,
        memory_s=nbytes / hw.hbm_bytes_per_s,
        overhead_s=hw.overhead_s + hw.overhead_per_request_s * sampled,
    )


def to_shape(chunks: Sequence[tuple[int, int]], contexts: Sequence[int]) -> BatchShape:
    """The latency model's view of the same iteration."""
    shape = BatchShape()
    for chunk, prefix in chunks:
        shape = shape.with_prefill(chunk, prefix)
    for context in contexts:
        shape = shape.with_decode(context)
    return shape


# The sample grid (tokens). Shapes whose KV would not fit the pool are skipped.
CHUNKS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
PREFIXES = (0, 2048, 8192, 32768)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
MIXED_CHUNKS = (128, 512, 2048, 8192)
MIXED_BATCHES = (8, 32, 128)
MIXED_CONTEXTS = (512, 2048, 8192)
TWO_CHUNK_TOTALS = (256, 1024, 4096, 8192)


def grid(capacity: int) -> Iterator[tuple[list[tuple[int, int]], list[int]]]:
    """Every sampled iteration as (chunks, decode contexts), in a fixed order."""

    def fits(chunks: list[tuple[int, int]], contexts: list[int]) -> bool:
        return sum(c + p for c, p in chunks) + sum(contexts) <= capacity

    candidates: list[tuple[list[tuple[int, int]], list[int]]] = []
    for chunk in CHUNKS:  # prefill only
        candidates += [([(chunk, prefix)], []) for prefix in PREFIXES]
    for total in TWO_CHUNK_TOTALS:  # two requests share one chunk budget
        candidates += [([(total // 2, prefix)] * 2, []) for prefix in (0, 8192)]
    for batch in BATCHES:  # decode only
        candidates += [([], [context] * batch) for context in CONTEXTS]
    for chunk in MIXED_CHUNKS:  # mixed: one chunk rides with a decode batch
        for prefix in (0, 8192):
            for batch in MIXED_BATCHES:
                candidates += [([(chunk, prefix)], [ctx] * batch) for ctx in MIXED_CONTEXTS]
    yield from (c for c in candidates if fits(*c))


def description(model: ModelShape, hw: Hardware) -> str:
    """The arithmetic behind the profile, in words (stored in the profile file)."""
    kv = model.kv_bytes_per_token
    cap = kv_capacity_tokens(model, hw)
    free = hw.hbm_bytes - model.weight_bytes - hw.activation_reserve_bytes
    return (
        f"Analytic roofline (python -m bench.profiler.analytic), not a measurement. "
        f"Model: Llama-3.1-8B shape, bf16: {model.layer_params / 1e9:.3f} B layer params + "
        f"{model.lm_head_params / 1e9:.3f} B LM head + {model.lm_head_params / 1e9:.3f} B "
        f"embedding = {model.total_params / 1e9:.3f} B params, {model.weight_bytes / GB:.2f} GB. "
        f"Iteration time = max(compute, memory) + overhead. "
        f"Compute = (2*{model.layer_params / 1e9:.3f}e9*tokens + 2*H*V*sampled_rows + "
        f"4*L*Hq*d*keys) / {hw.flops_per_s / 1e12:.0f} TFLOP/s, keys = sum over prefill chunks "
        f"of l*prefix + l(l+1)/2 (causal) + sum of decode contexts. "
        f"Memory = ({model.streamed_weight_bytes / GB:.2f} GB weights read once + "
        f"{kv} B/token * (decode contexts + chunk prefixes read + new tokens written)) / "
        f"{hw.hbm_bytes_per_s / 1e12:.1f} TB/s; activations ignored. "
        f"Overhead = {hw.overhead_s * 1e3:.1f} ms + {hw.overhead_per_request_s * 1e6:.0f} us per "
        f"request. KV bytes/token = 2*{model.layers}*{model.kv_heads}*{model.head_dim}*2 = {kv}. "
        f"KV capacity = ({hw.hbm_bytes / GB:.0f} GB HBM - {model.weight_bytes / GB:.2f} GB "
        f"weights - {hw.activation_reserve_bytes / GB:.0f} GB activation reserve) = "
        f"{free / GB:.2f} GB / {kv} B = {cap} tokens. Host copy {hw.host_copy_gb_s:.0f} GB/s "
        f"(PCIe Gen5 x16, ~50 GB/s pinned bulk, halved for 2 KiB paged-KV pieces)."
    )


def build_profile(model: ModelShape | None = None, hw: Hardware | None = None) -> Profile:
    """The whole analytic profile (deterministic)."""
    model = model or ModelShape()
    hw = hw or Hardware()
    capacity = kv_capacity_tokens(model, hw)
    samples = [
        ProfileSample(
            shape=to_shape(chunks, contexts),
            seconds=round(iteration(model, hw, chunks, contexts).seconds, 9),
        )
        for chunks, contexts in grid(capacity)
    ]
    hardware = {k: v for k, v in asdict(hw).items() if k not in ("page_size", "max_prefill_tokens")}
    return Profile(
        name=PROFILE_NAME,
        description=description(model, hw),
        model={
            "architecture": "LlamaForCausalLM",
            **asdict(model),
            "dtype": "bfloat16",
            "params": model.total_params,
        },
        hardware=hardware,
        kv_capacity_tokens=capacity,
        page_size=hw.page_size,
        max_prefill_tokens=hw.max_prefill_tokens,
        host_copy_gb_s=hw.host_copy_gb_s,
        kv_bytes_per_token=model.kv_bytes_per_token,
        samples=samples,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Writes the profile and prints a one-line summary."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.profiler.analytic", description="write the analytic H100 profile"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="profile file to write")
    parser.add_argument(
        "--overhead-ms",
        type=float,
        default=None,
        help="fixed cost of every iteration, ms (sensitivity studies; default "
        f"{Hardware.overhead_s * 1e3:g})",
    )
    parser.add_argument(
        "--overhead-per-request-us",
        type=float,
        default=None,
        help="per-request cost in an iteration, µs (default "
        f"{Hardware.overhead_per_request_s * 1e6:g})",
    )
    args = parser.parse_args(argv)
    hw = Hardware()
    if args.overhead_ms is not None or args.overhead_per_request_us is not None:
        if (
            min(v for v in (args.overhead_ms, args.overhead_per_request_us, 0.0) if v is not None)
            < 0
        ):
            parser.error("overheads must be ≥ 0")
        hw = replace(
            hw,
            overhead_s=hw.overhead_s if args.overhead_ms is None else args.overhead_ms / 1e3,
            overhead_per_request_s=hw.overhead_per_request_s
            if args.overhead_per_request_us is None
            else args.overhead_per_request_us / 1e6,
        )
        if args.out == DEFAULT_OUT:
            parser.error(
                "--out is required with a changed overhead (the default file is the "
                "committed profile)"
            )
    profile = build_profile(hw=hw)
    if hw != Hardware():
        profile.name = args.out.stem
    save_profile(profile, args.out)
    print(
        f"wrote {args.out}: {len(profile.samples)} samples, "
        f"KV capacity {profile.kv_capacity_tokens} tokens"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
