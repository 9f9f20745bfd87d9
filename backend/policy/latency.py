"""Iteration latency model: predicts one engine iteration's time from its token mix.

Form (HyGen's linear regression, extended with a decode-context and a prefill-attention term,
synthesis §4 notes)::

    T = w0 + w1·S_p + w2·S_d + w3·S_p² + w4·S_d² + w5·N_p + w6·N_d + w7·A_p + w8·F_p

    S_p  prefill tokens in the batch (sum of chunk lengths)
    S_d  decode context: Σ over decoding requests of the KV tokens they attend to
    N_p  prefill requests            N_d  decode requests
    A_p  prefill attention work: Σ over chunks of l·(prefix + l)  (a chunk attends to its prefix)
    F_p  full-square attention work: Σ over chunks of (prefix + l)², plus — in a batch that
         has a prefill — Σ over decodes of context². SGLang's torch_native backend (the CPU
         engine) recomputes attention for the prefix rows too, and in a mixed batch runs every
         decode as a 1-token extend over its whole context: a 16-token chunk after 1.5K cached
         tokens costs ~70 ms there, one decode at 2K context riding with a small prefill
         ~110 ms. FlashAttention-style GPU backends do neither, and their fit gives F_p no
         weight. A model built from 8 weights (the form without F_p) gets w8 = 0.

Fitted by least squares from a profile (a grid of measured batch shapes) with non-negative
weights (a negative weight would predict that more work is faster, and the inversion would be
wrong); features are scaled to thousands of tokens so the squares stay well conditioned.
`max_chunk` inverts the model: the largest prefill chunk whose batch still fits a time budget.

Roofline extension: a GPU iteration costs max(compute, memory) + overhead, and one linear form
misses the knee between the two by up to 30 % (the analytic H100 profile: 9 % MAPE). So `fit`
also tries a *max-affine* model, T = max(w·f, w'·f) with both weight vectors non-negative (one
piece per regime, found by alternating assignment and refit), and keeps it only when it cuts the
training error by a clear margin (:data:`TWO_PIECE_MIN_GAIN`); otherwise the model is the plain
HyGen form and `second_weights` is None. A max of non-decreasing forms is non-decreasing, so the
inversion stays a binary search.
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

FEATURES = ("intercept", "S_p", "S_d", "S_p2", "S_d2", "N_p", "N_d", "A_p", "F_p")
_K = 1000.0  # tokens per feature unit
TWO_PIECE_MIN_GAIN = 0.3
"""The max-affine model is kept only when it lowers the relative squared training error by at
least this fraction (noise alone buys a few percent with 8 more weights)."""
_GOOD_FIT_RMS = 1e-3  # a linear fit this close (relative RMS) is kept without trying more
_RESTARTS = 8  # random initial splits tried for the max-affine fit (fixed seed)
RELATIVE_FLOOR_OF_MEDIAN = 0.05
"""The fit weighs each sample's error relative to its time, but never relative to less than
this fraction of the median sample's time. A black-box probe can read a point near zero (a
prefill's TTFT minus an overestimated round trip, clamped at 10 µs); weighed by 1 ÷ 10 µs it
outweighs every other point together, and the fit predicts ~0 for all of them (median error
0.82 on the cpu-tiny profile with one such point). No shipped profile has a sample below 5 %
of its median, so their fits do not change."""


class BatchShape(msgspec.Struct, frozen=True, kw_only=True):
    """The token mix of one iteration (what the latency model reads)."""

    prefill_tokens: int = 0
    """S_p: total prefill chunk tokens."""
    num_prefill: int = 0
    """N_p: requests with a prefill chunk."""
    prefill_attn: float = 0.0
    """A_p: Σ chunk·(prefix + chunk), token²."""
    prefill_attn_full: float = 0.0
    """Σ (prefix + chunk)², token² (attention work of a backend that recomputes the prefix
    rows; set by `with_prefill`)."""
    decode_context: int = 0
    """S_d: Σ context length of the decoding requests, tokens."""
    num_decode: int = 0
    """N_d: decoding requests."""
    decode_context_sq: float = 0.0
    """Σ context² of the decoding requests, token² (set by `with_decode`)."""

    def with_prefill(self, chunk: int, prefix: int = 0) -> BatchShape:
        """This shape plus one prefill chunk of `chunk` tokens after `prefix` tokens of KV."""
        return BatchShape(
            prefill_tokens=self.prefill_tokens + chunk,
            num_prefill=self.num_prefill + 1,
            prefill_attn=self.prefill_attn + chunk * (prefix + chunk),
            prefill_attn_full=self.prefill_attn_full + (prefix + chunk) ** 2,
            decode_context=self.decode_context,
            num_decode=self.num_decode,
            decode_context_sq=self.decode_context_sq,
        )

    def with_decode(self, context: int) -> BatchShape:
        """This shape plus one decode attending to `context` tokens."""
        return BatchShape(
            prefill_tokens=self.prefill_tokens,
            num_prefill=self.num_prefill,
            prefill_attn=self.prefill_attn,
            prefill_attn_full=self.prefill_attn_full,
            decode_context=self.decode_context + context,
            num_decode=self.num_decode + 1,
            decode_context_sq=self.decode_context_sq + context * context,
        )

    @property
    def is_empty(self) -> bool:
        return self.num_prefill == 0 and self.num_decode == 0


class ProfileSample(msgspec.Struct, frozen=True, kw_only=True):
    """One measured iteration: its shape and how long it took."""

    shape: BatchShape
    seconds: float


class Profile(msgspec.Struct, kw_only=True):
    """A profile file (backend/policy/profiles/*.json): measured iteration times of one model on one
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
    key: str | None = None
    """The profile key of the engine it was measured on (``backend.policy.profile_key``);
    None: unkeyed (a profile from before keys, or an analytic one), matching no engine."""
    engine: dict[str, Any] | None = None
    """That engine's identity (an ``EngineIdentity`` as JSON), to say what differs when the key
    does not match the served engine's; None with an unkeyed profile."""


def load_profile(path: str | Path) -> Profile:
    """Reads a profile file; raises ValueError naming the file on a bad one."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Profile)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"bad profile {path}: {exc}") from None


def save_profile(profile: Profile, path: str | Path) -> None:
    """Writes *profile* as indented JSON (one field a line at the top level, diff-friendly).
    An unkeyed profile is written without `key` and `engine`, as before keys existed."""
    data = json.loads(msgspec.json.encode(profile))
    for field in ("key", "engine"):
        if data.get(field) is None:
            data.pop(field, None)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def features(shape: BatchShape) -> list[float]:
    """The regression features of a shape (scaled to thousands of tokens)."""
    sp = shape.prefill_tokens / _K
    sd = shape.decode_context / _K
    return [
        1.0,
        sp,
        sd,
        sp * sp,
        sd * sd,
        float(shape.num_prefill),
        float(shape.num_decode),
        shape.prefill_attn / (_K * _K),
        _full_square(shape) / (_K * _K),
    ]


def _full_square(shape: BatchShape) -> float:
    """F_p in token²: chunks over their whole prefix, and decodes when they ride in an extend
    (mixed) batch."""
    return shape.prefill_attn_full + (shape.decode_context_sq if shape.num_prefill else 0.0)


class LatencyModel:
    """A fitted latency model: `predict(shape)` seconds; `max_chunk` inverts it.

    `weights` is the HyGen-form linear model; `second_weights`, when not None, a second linear
    piece, and the prediction is the larger of the two (compute- vs memory-bound regimes).
    """

    def __init__(
        self, weights: Sequence[float], second_weights: Sequence[float] | None = None
    ) -> None:
        self.weights = _full_length(weights)
        self.second_weights = None if second_weights is None else _full_length(second_weights)
        self._pieces = [self.weights] + (
            [] if self.second_weights is None else [self.second_weights]
        )

    @classmethod
    def fit(cls, samples: Iterable[ProfileSample], *, max_pieces: int = 2) -> LatencyModel:
        """Non-negative least squares on relative error (every shape counts alike, whether it
        takes 1 ms or 1 s): an active-set loop drops features whose weight goes negative.
        With `max_pieces=2` a two-piece max-affine model replaces the linear one when it fits
        clearly better (module docstring); `max_pieces=1` is always the linear model."""
        rows = list(samples)
        if len(rows) < 3:
            raise ValueError(f"need at least 3 profile samples to fit, got {len(rows)}")
        x = np.array([features(s.shape) for s in rows], dtype=float)
        y = np.array([s.seconds for s in rows], dtype=float)
        scale = 1.0 / _relative_floor(y)  # minimise relative error
        linear = _nnls(x, y, scale)
        if max_pieces < 2 or len(rows) < 2 * len(FEATURES):
            return cls(linear.tolist())
        linear_sse = _rel_sse([linear], x, y)
        if linear_sse <= len(rows) * _GOOD_FIT_RMS**2:
            return cls(linear.tolist())
        best = _best_two_pieces(x, y, scale, linear)
        if best is None or _rel_sse(best, x, y) > (1 - TWO_PIECE_MIN_GAIN) * linear_sse:
            return cls(linear.tolist())
        return cls(best[0].tolist(), best[1].tolist())

    @property
    def pieces(self) -> list[list[float]]:
        """The weight vectors whose maximum is the prediction (one or two)."""
        return list(self._pieces)

    def predict(self, shape: BatchShape) -> float:
        """Predicted iteration time, seconds (0 for an empty batch)."""
        n_p, n_d = shape.num_prefill, shape.num_decode
        if n_p == 0 and n_d == 0:
            return 0.0
        # `features` and the dot product unrolled (the planners ask this in their inner loops);
        # the same products summed in the same order, so the same float as sum(w · features)
        sp = shape.prefill_tokens / _K
        sd = shape.decode_context / _K
        sp2, sd2, fn_p, fn_d = sp * sp, sd * sd, float(n_p), float(n_d)
        a_p = shape.prefill_attn / (_K * _K)
        f_p = _full_square(shape) / (_K * _K)
        return max_piece(self._pieces, sp, sd, sp2, sd2, fn_p, fn_d, a_p, f_p)

    def max_chunk(
        self, shape: BatchShape, time_limit_s: float, *, prefix: int, cap: int, page_size: int = 1
    ) -> int:
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
        """The first (or only) piece's weights by feature name."""
        return dict(zip(FEATURES, self.weights, strict=True))


def _full_length(weights: Sequence[float]) -> list[float]:
    """*weights* as floats, one per feature; the 8-weight form without F_p gets w8 = 0."""
    if len(weights) == len(FEATURES) - 1:
        weights = [*weights, 0.0]
    if len(weights) != len(FEATURES):
        raise ValueError(f"expected {len(FEATURES)} weights, got {len(weights)}")
    return [float(w) for w in weights]


def _nnls(x: np.ndarray, y: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Non-negative weighted least squares by an active set: the most negative weight's
    feature is dropped until none is negative (features that are all zero start dropped)."""
    active = [j for j in range(x.shape[1]) if np.any(x[:, j] != 0)]
    weights = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * scale[:, None], y * scale, rcond=None)
        if np.all(sol >= 0):
            weights[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return weights


def _relative_floor(y: np.ndarray) -> np.ndarray:
    """Each sample's time, raised to :data:`RELATIVE_FLOOR_OF_MEDIAN` of the median (and to
    1 ns): what the fit divides its errors by."""
    floored: np.ndarray = np.maximum(y, max(RELATIVE_FLOOR_OF_MEDIAN * float(np.median(y)), 1e-9))
    return floored


def _rel_sse(pieces: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Σ ((max over pieces of x·w − y) / y)², y raised as :func:`_relative_floor` does."""
    pred = np.max(np.stack([x @ w for w in pieces]), axis=0)
    return float(np.sum(((pred - y) / _relative_floor(y)) ** 2))


def _best_two_pieces(
    x: np.ndarray, y: np.ndarray, scale: np.ndarray, linear: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """The best max-affine pair over several initial splits (None when none is feasible).

    Splits tried: above/below the linear fit, each feature above/below its median, and
    :data:`_RESTARTS` random halves (seed 0) — deterministic for the same samples."""
    resid = x @ linear - y
    splits = [resid > 0] + [x[:, j] > np.median(x[:, j]) for j in range(x.shape[1])]
    rng = np.random.default_rng(0)
    splits += [rng.random(len(y)) < 0.5 for _ in range(_RESTARTS)]
    best: tuple[np.ndarray, np.ndarray] | None = None
    best_err = math.inf
    for split in splits:
        pair = _alternate(x, y, scale, split)
        if pair is not None and (err := _rel_sse(pair, x, y)) < best_err:
            best, best_err = pair, err
    return best


def _alternate(
    x: np.ndarray, y: np.ndarray, scale: np.ndarray, first: np.ndarray, max_rounds: int = 50
) -> tuple[np.ndarray, np.ndarray] | None:
    """Max-affine fit from an initial split: fit each piece on its samples, give each sample to
    the piece that predicts more, repeat until the split is stable."""
    pair: tuple[np.ndarray, np.ndarray] | None = None
    for _ in range(max_rounds):
        if first.sum() < 3 or (~first).sum() < 3:
            return pair
        pair = (_nnls(x[first], y[first], scale[first]), _nnls(x[~first], y[~first], scale[~first]))
        now_first = x @ pair[0] >= x @ pair[1]
        if np.array_equal(now_first, first):
            break
        first = now_first
    return pair


def relative_errors(model: LatencyModel, samples: Iterable[ProfileSample]) -> list[float]:
    """|predicted − measured| ÷ measured of `model` on each sample that took any time."""
    return [abs(model.predict(s.shape) - s.seconds) / s.seconds for s in samples if s.seconds > 0]


def mape(model: LatencyModel, samples: Iterable[ProfileSample]) -> float:
    """Mean absolute percentage error of `model` on `samples`, as a fraction."""
    errors = relative_errors(model, samples)
    return sum(errors) / len(errors) if errors else math.nan


def holdout_mape(
    profile: Profile, holdout_fraction: float = 0.2, seed: int = 0, *, max_pieces: int = 2
) -> tuple[LatencyModel, float]:
    """Fits on a random (1 − holdout_fraction) of the samples; MAPE on the rest.
    `max_pieces` as in :meth:`LatencyModel.fit` (1: the plain linear form)."""
    samples = list(profile.samples)
    random.Random(seed).shuffle(samples)
    n_test = max(1, int(len(samples) * holdout_fraction))
    model = LatencyModel.fit(samples[n_test:], max_pieces=max_pieces)
    return model, mape(model, samples[:n_test])


def max_piece(
    pieces: Sequence[Sequence[float]],
    sp: float,
    sd: float,
    sp2: float,
    sd2: float,
    n_p: float,
    n_d: float,
    a_p: float,
    f_p: float,
) -> float:
    """The largest piece of the max-affine model at one batch's features (already scaled by
    _K: prefill and decode tokens, their squares, counts, attention terms); unrolled, the hot
    path of every plan (`LatencyModel.predict`, the tandem policy's timing)."""
    best = -math.inf
    for w in pieces:
        v = (
            w[0]
            + w[1] * sp
            + w[2] * sd
            + w[3] * sp2
            + w[4] * sd2
            + w[5] * n_p
            + w[6] * n_d
            + w[7] * a_p
            + w[8] * f_p
        )
        if v > best:
            best = v
    return best
