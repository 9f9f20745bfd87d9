"""Iteration latency model: predicts one engine iteration's time from its token mix.

Form (HyGen's linear regression, extended with a decode-context and a prefill-attention term,
synthesis §4 notes)::

    T = w0 + w1·S_p + w2·S_d + w3·S_p² + w4·S_d² + w5·N_p + w6·N_d + w7·A_p

    S_p  prefill tokens in the batch (sum of chunk lengths)
    S_d  decode context: Σ over decoding requests of the KV tokens they attend to
    N_p  prefill requests            N_d  decode requests
    A_p  prefill attention work: Σ over chunks of l·(prefix + l)  (a chunk attends to its prefix)

Fitted by least squares from a profile (a grid of measured batch shapes) with non-negative
weights (a negative weight would predict that more work is faster, and the inversion would be
wrong); features are scaled to thousands of tokens so the squares stay well conditioned.
`max_chunk` inverts the model: the largest prefill chunk whose batch still fits a time budget.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

FEATURES = ("intercept", "S_p", "S_d", "S_p2", "S_d2", "N_p", "N_d", "A_p")
_K = 1000.0  # tokens per feature unit


class BatchShape(msgspec.Struct, frozen=True, kw_only=True):
    """The token mix of one iteration (what the latency model reads)."""

    prefill_tokens: int = 0
    """S_p: total prefill chunk tokens."""
    num_prefill: int = 0
    """N_p: requests with a prefill chunk."""
    prefill_attn: float = 0.0
    """A_p: Σ chunk·(prefix + chunk), token²."""
    decode_context: int = 0
    """S_d: Σ context length of the decoding requests, tokens."""
    num_decode: int = 0
    """N_d: decoding requests."""

    def with_prefill(self, chunk: int, prefix: int = 0) -> BatchShape:
        """This shape plus one prefill chunk of `chunk` tokens after `prefix` tokens of KV."""
        return BatchShape(
            prefill_tokens=self.prefill_tokens + chunk,
            num_prefill=self.num_prefill + 1,
            prefill_attn=self.prefill_attn + chunk * (prefix + chunk),
            decode_context=self.decode_context,
            num_decode=self.num_decode,
        )

    def with_decode(self, context: int) -> BatchShape:
        """This shape plus one decode attending to `context` tokens."""
        return BatchShape(
            prefill_tokens=self.prefill_tokens,
            num_prefill=self.num_prefill,
            prefill_attn=self.prefill_attn,
            decode_context=self.decode_context + context,
            num_decode=self.num_decode + 1,
        )

    @property
    def is_empty(self) -> bool:
        return self.num_prefill == 0 and self.num_decode == 0


class ProfileSample(msgspec.Struct, frozen=True, kw_only=True):
    """One measured iteration: its shape and how long it took."""

    shape: BatchShape
    seconds: float


class Profile(msgspec.Struct, kw_only=True):
    """A profile file (bench/profiles/*.json): measured iteration times of one model on one
    machine, plus the machine facts the simulator needs."""

    name: str
    """Profile name (file stem by convention)."""
    description: str = ""
    """How it was produced (the command, or the arithmetic for analytic profiles)."""
    model: dict[str, Any] = msgspec.field(default_factory=dict)
    """Model shape (hidden size, layers, heads, dtype, ...)."""
    hardware: dict[str, Any] = msgspec.field(default_factory=dict)
    """Machine facts (device, peak FLOP/s, memory bandwidth, ...)."""
    kv_capacity_tokens: int = 0
    """KV pool size of the profiled engine, tokens."""
    page_size: int = 1
    """KV allocation granularity, tokens."""
    max_prefill_tokens: int = 8192
    """Largest prefill per iteration the engine accepts, tokens."""
    host_copy_gb_s: float | None = None
    """Device↔host KV copy bandwidth, GB/s (KV checkpoint cost)."""
    kv_bytes_per_token: int | None = None
    """KV cache bytes per token over all layers."""
    samples: list[ProfileSample] = msgspec.field(default_factory=list)
    """The measured (or computed) iterations."""


def load_profile(path: str | Path) -> Profile:
    """Reads a profile file; raises ValueError naming the file on a bad one."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Profile)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"bad profile {path}: {exc}") from None


def save_profile(profile: Profile, path: str | Path) -> None:
    data = json.loads(msgspec.json.encode(profile))
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def features(shape: BatchShape) -> list[float]:
    """The regression features of a shape (scaled to thousands of tokens)."""
    sp = shape.prefill_tokens / _K
    sd = shape.decode_context / _K
    return [1.0, sp, sd, sp * sp, sd * sd, float(shape.num_prefill), float(shape.num_decode),
            shape.prefill_attn / (_K * _K)]


class LatencyModel:
    """A fitted latency model: `predict(shape)` seconds; `max_chunk` inverts it."""

    def __init__(self, weights: Sequence[float]) -> None:
        if len(weights) != len(FEATURES):
            raise ValueError(f"expected {len(FEATURES)} weights, got {len(weights)}")
        self.weights = [float(w) for w in weights]

    @classmethod
    def fit(cls, samples: Iterable[ProfileSample]) -> LatencyModel:
        """Non-negative least squares on relative error (every shape counts alike, whether it
        takes 1 ms or 1 s): an active-set loop drops features whose weight goes negative."""
        rows = list(samples)
        if len(rows) < 3:
            raise ValueError(f"need at least 3 profile samples to fit, got {len(rows)}")
        x = np.array([features(s.shape) for s in rows], dtype=float)
        y = np.array([s.seconds for s in rows], dtype=float)
        scale = 1.0 / np.maximum(y, 1e-9)  # minimise relative error
        active = [j for j in range(x.shape[1]) if np.any(x[:, j] != 0)]
        weights = np.zeros(x.shape[1])
        while active:
            sol, *_ = np.linalg.lstsq(x[:, active] * scale[:, None], y * scale, rcond=None)
            if np.all(sol >= 0):
                weights[:] = 0
                weights[active] = sol
                break
            active.pop(int(np.argmin(sol)))
        return cls(weights.tolist())

    def predict(self, shape: BatchShape) -> float:
        """Predicted iteration time, seconds (0 for an empty batch)."""
        if shape.is_empty:
            return 0.0
        return sum(w * f for w, f in zip(self.weights, features(shape), strict=True))

    def max_chunk(self, shape: BatchShape, time_limit_s: float, *, prefix: int, cap: int,
                  page_size: int = 1) -> int:
        """Largest chunk l ≤ cap (a multiple of page_size unless l == cap) such that
        predict(shape + chunk l after `prefix` tokens) ≤ time_limit_s; 0 when none fits.
        Binary search: the prediction grows monotonically with l (non-negative weights)."""
        if cap <= 0 or self.predict(shape.with_prefill(1, prefix)) > time_limit_s:
            return 0
        if self.predict(shape.with_prefill(cap, prefix)) <= time_limit_s:
            return cap
        lo, hi = 1, cap  # predict(lo) fits, predict(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.predict(shape.with_prefill(mid, prefix)) <= time_limit_s:
                lo = mid
            else:
                hi = mid
        if page_size > 1 and lo >= page_size:
            lo -= lo % page_size
        return lo

    def to_dict(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.weights, strict=True))


def mape(model: LatencyModel, samples: Iterable[ProfileSample]) -> float:
    """Mean absolute percentage error of `model` on `samples`, as a fraction."""
    errors = [abs(model.predict(s.shape) - s.seconds) / s.seconds for s in samples
              if s.seconds > 0]
    return sum(errors) / len(errors) if errors else math.nan


def holdout_mape(profile: Profile, holdout_fraction: float = 0.2, seed: int = 0
                 ) -> tuple[LatencyModel, float]:
    """Fits on a random (1 − holdout_fraction) of the samples; MAPE on the rest."""
    samples = list(profile.samples)
    random.Random(seed).shuffle(samples)
    n_test = max(1, int(len(samples) * holdout_fraction))
    model = LatencyModel.fit(samples[n_test:])
    return model, mape(model, samples[:n_test])
