"""Simulator configuration (one frozen struct, validated on construction)."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from common.slowdown import Slowdown, check_slowdown, factor_at

KvLayout = Literal["token", "bicache"]

SloUnattainable = Literal["reject", "downgrade", "accept"]
"""What the contract says to do with an RT request whose targets cannot be met: shed it, run it
as BE, or run it as RT anyway."""


MAX_ENGINE_NOISE = 2.0
"""Largest `SimConfig.engine_noise`: at σ 2 one iteration in twenty already takes 3.6× the
engine's mean pace or more, and one in a hundred 14×."""


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
    kv_layout: KvLayout = "token"
    """"token": SGLang's token-granular pool, an eviction drops the KV (recompute). "bicache":
    BROS's bidirectional blocks with lazy checkpointing (backend/sim/bikv.py); needs
    page_size 1 and prefix_cache off (prefix sharing is not modelled with it)."""
    bicache_block_slots: int = 16
    """Slots per block of the bicache layout."""
    bicache_report: Literal["slots", "placeable"] = "placeable"
    """What the bicache layout reports as free/evictable KV: lower bounds on what a new request
    of either tier surely gets ("placeable"), or every slot ("slots", as SGLang's
    available_size). The engine retracts decodes it cannot place and cuts BE prompt chunks it
    cannot hold either way (backend/sim/bikv.py)."""
    kv_bytes_per_token: int = 131072
    """KV bytes per token over every layer (checkpoint traffic); default Llama-3.1-8B in bf16
    (2 · 32 layers · 8 KV heads · 128 · 2 B)."""
    host_copy_gb_s: float = 25.0
    """Device↔host bandwidth of KV checkpoints and restores, GB/s; default the H100 analytic
    profile's figure (PCIe Gen5 x16 ≈ 50 GB/s pinned bulk, halved for scattered 2 KiB rows)."""
    engine_slowdown: Slowdown = ()
    """The engine runs slower than the latency model predicts: (start_s, factor) pairs; an
    iteration starting at t takes factor(t) × the model's prediction of its compute (the
    bicache layout's host copies are not scaled: the link's bandwidth does not change). The
    policy is not told; it sees the measured durations only. () = no slowdown."""
    regime_slowdowns: tuple[float, ...] = ()
    """The engine's pace per batch regime (decode-only, prefill-only, mixed; the order of
    `backend.policy.calibration.REGIMES`), on top of `engine_slowdown`: an iteration of regime r
    takes `regime_slowdowns[r]` × the model's prediction. A real engine departs from its profile
    by different amounts per regime (a busy host CPU slows small decode batches far more than
    long prompt chunks); the live bench's twin replays the factors the engine's calibration
    learned. () = 1 for every regime."""
    replica_slowdowns: tuple[float, ...] = ()
    """In a pool (backend/sim/pool.py): replica i runs a further `replica_slowdowns[i]` times
    slower than the model (on top of `engine_slowdown`; replicas past the tuple: 1) — a pool of
    unequal engines: a slower GPU, a noisy neighbour, a degraded node. () = all equal."""
    engine_noise: float = 0.0
    """The engine's pace jitters from one iteration to the next: each iteration takes a further
    exp(σ·Z − σ²/2) × its time (σ this value, Z standard normal drawn per iteration: a
    log-normal factor of mean 1, so the engine is as fast on average and only less
    predictable), on top of the slowdowns — a GPU shared with other jobs, kernels whose time
    varies with the batch's layout, a CPU engine beside other processes. The policy is not
    told. 0 = none. A change of pace that lasts (a neighbour taking the GPU for minutes) is
    `engine_slowdown`'s schedule."""
    engine_noise_seed: int = 0
    """Seed of the jitter's draws (`engine_noise`); in a pool each replica draws its own from
    it."""

    slo_unattainable: SloUnattainable = "reject"
    """The RT contract's answer when the SLO admission predicts a miss (backend/sim/front_door.py;
    only for a policy that asks for the admission: `PolicyBase.slo_forecaster`)."""
    ttft_feedback: bool = False
    """The front door also learns from outcomes, as the gateway does: each admitted RT request,
    once finished, tells it how much later its first token came than forecast
    (`backend.policy.feasibility.TtftFeedback`), and later forecasts add what it learned. Off by
    default: the simulator's forecast reads the engine's exact state at each arrival, and the
    sim benches' results stay comparable run to run; the live bench's twin, which replays a run
    through the gateway, turns it on. One engine only (`simulate`)."""
    slo_recheck_frac: float = 0.0
    """The gateway's `slo_recheck_frac`: an RT request the front door would shed or downgrade
    only for a request slot (every one held by RT) is judged again at each iteration boundary
    until this share of its TTFT target has passed since its arrival (backend/sim/front_door.py).
    0 (default): judged once — the sim benches' engines have request slots to spare
    (`max_running`); the live bench's twin, with the real engine's 64, sets the gateway's. In a
    pool (`simulate_pool`) the request is placed again after each iteration end of any replica,
    as the gateway's router places it again on each report."""

    def slowdown_at(self, t_s: float) -> float:
        """The slowdown factor in effect at simulated time `t_s` (1.0 without a schedule)."""
        return factor_at(self.engine_slowdown, t_s)

    def replica_slowdown(self, replica: int) -> float:
        """Replica *replica*'s own slowdown factor in a pool (`replica_slowdowns`; 1.0 past it)."""
        factors = self.replica_slowdowns
        return factors[replica] if replica < len(factors) else 1.0

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be ≥ 1, got {self.kv_capacity_tokens}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be ≥ 1, got {self.page_size}")
        if not 0.0 <= self.slo_recheck_frac < 1.0:
            raise ValueError(f"slo_recheck_frac must be in [0, 1), got {self.slo_recheck_frac}")
        if self.max_running < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_running and max_prefill_tokens must be ≥ 1")
        if self.prefix_block_tokens < 1 or self.prefix_block_tokens % self.page_size:
            raise ValueError(
                f"prefix_block_tokens ({self.prefix_block_tokens}) must be a positive multiple "
                f"of page_size ({self.page_size})"
            )
        if self.kv_layout not in ("token", "bicache"):
            raise ValueError(f"kv_layout must be 'token' or 'bicache', got {self.kv_layout!r}")
        if self.kv_layout == "bicache" and (self.page_size != 1 or self.prefix_cache):
            raise ValueError("kv_layout 'bicache' needs page_size 1 and prefix_cache off")
        if self.bicache_report not in ("slots", "placeable"):
            raise ValueError(
                f"bicache_report must be 'slots' or 'placeable', got {self.bicache_report!r}"
            )
        if self.bicache_block_slots < 2 or self.kv_bytes_per_token < 1:
            raise ValueError("bicache_block_slots must be ≥ 2 and kv_bytes_per_token ≥ 1")
        if not self.host_copy_gb_s > 0:
            raise ValueError(f"host_copy_gb_s must be > 0, got {self.host_copy_gb_s}")
        check_slowdown(self.engine_slowdown)
        if self.regime_slowdowns and (
            len(self.regime_slowdowns) != 3
            or not all(0 < f < math.inf for f in self.regime_slowdowns)
        ):
            raise ValueError(
                "regime_slowdowns must be () or three finite factors > 0 (decode, prefill, "
                f"mixed), got {self.regime_slowdowns}"
            )
        if not all(f > 0 for f in self.replica_slowdowns):
            raise ValueError(f"replica_slowdowns must all be > 0, got {self.replica_slowdowns}")
        if not 0.0 <= self.engine_noise <= MAX_ENGINE_NOISE:
            raise ValueError(
                f"engine_noise must be in [0, {MAX_ENGINE_NOISE:g}] (the σ of the log of each "
                f"iteration's factor), got {self.engine_noise}"
            )
        if self.horizon_s is not None and self.horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0 or None, got {self.horizon_s}")
