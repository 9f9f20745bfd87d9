"""Fast latency-model arithmetic for the planner: predictions from raw batch totals and the
exact inversion "largest chunk that fits a time budget" in closed form.

`LatencyModel.max_chunk` binary-searches (≈ 13 predictions through a `BatchShape`); the planner
calls it several times per iteration, so this module solves the same question directly. Each
piece of the model is a quadratic in the chunk length l (S_p², A_p and F_p grow with l²)::

    piece(l) = a + b·l + c·l²      with every weight ≥ 0, so piece is increasing in l ≥ 0
    fits(l)  ⇔  piece(l) ≤ τ for every piece    ⇒   l* = min over pieces of the positive root

The float root is then nudged by ±1 against the exact prediction, so the answer equals the
binary search's (tests compare the two).

Calibration: `Timer.scale` holds one correction factor per batch regime
(`backend.policy.calibration`: decode-only, prefill-only, mixed); `_value` — the one place every
prediction and inversion of the planner goes through — multiplies by it, and `_root` divides the
budget by it. All 1.0 (the default, and what an engine that runs as profiled keeps) leaves every
result bit-for-bit as the uncorrected model's (x × 1.0 and x / 1.0 are exact).
"""

from __future__ import annotations

import math
from typing import Protocol

from backend.policy.calibration import DECODE, MIXED, PREFILL
from backend.policy.latency import LatencyModel, max_piece

_K = 1000.0  # tokens per feature unit (as in latency.features)
_K2 = _K * _K


class Totals(Protocol):
    """The sums a latency model reads (what `BatchTotals` and the planner's batch carry)."""

    prefill_tokens: int
    num_prefill: int
    prefill_attn: float
    prefill_attn_full: float
    decode_context: int
    num_decode: int
    decode_context_sq: float


class BatchTotals:
    """The sums a latency model reads (a `BatchShape` without the allocation)."""

    __slots__ = (
        "decode_context",
        "decode_context_sq",
        "num_decode",
        "num_prefill",
        "prefill_attn",
        "prefill_attn_full",
        "prefill_tokens",
    )

    def __init__(self) -> None:
        self.prefill_tokens = 0
        """S_p: prefill chunk tokens."""
        self.num_prefill = 0
        """N_p: requests with a chunk."""
        self.prefill_attn = 0.0
        """A_p: Σ chunk·(prefix + chunk), token²."""
        self.prefill_attn_full = 0.0
        """F_p: Σ (prefix + chunk)², token²."""
        self.decode_context = 0
        """S_d: Σ context of the decodes, tokens."""
        self.num_decode = 0
        """N_d: decodes."""
        self.decode_context_sq = 0.0
        """Σ context² of the decodes, token² (in F_p when the batch has a prefill)."""


def _full(prefill_attn_full: float, decode_context_sq: float, num_prefill: int) -> float:
    """F_p as the model defines it: the chunks over their whole prefix, plus the decodes'
    context² when they ride in a batch with a prefill (latency._full_square)."""
    return prefill_attn_full + (decode_context_sq if num_prefill else 0.0)


class Timer:
    """A latency model's weights as tuples, evaluated on `BatchTotals` without allocation,
    times the calibration factor of the batch's regime."""

    def __init__(self, latency: LatencyModel) -> None:
        self.latency = latency
        self.pieces = [tuple(piece) for piece in latency.pieces]
        self.scale: tuple[float, float, float] = (1.0, 1.0, 1.0)
        """Correction factor per regime (DECODE, PREFILL, MIXED): corrected = factor × model
        (set by the policy from its `LatencyCalibration`)."""

    def predict(self, t: Totals) -> float:
        """Predicted iteration time of the totals, seconds (0 for an empty batch)."""
        if t.num_prefill == 0 and t.num_decode == 0:
            return 0.0
        return self._value(
            t.prefill_tokens,
            t.decode_context,
            t.num_prefill,
            t.num_decode,
            t.prefill_attn,
            _full(t.prefill_attn_full, t.decode_context_sq, t.num_prefill),
        )

    def _value(
        self, sp_tokens: float, sd_tokens: float, n_p: float, n_d: float, a_p: float, f_p: float
    ) -> float:
        sp = sp_tokens / _K
        sd = sd_tokens / _K
        ap = a_p / _K2
        fp = f_p / _K2
        best = max_piece(self.pieces, sp, sd, sp * sp, sd * sd, n_p, n_d, ap, fp)
        if n_p == 0:
            return best * self.scale[DECODE]
        return best * self.scale[PREFILL if n_d == 0 else MIXED]

    def with_decodes(
        self, t: Totals, count: int, context: int, context_sq: float | None = None
    ) -> float:
        """Predicted time of the totals plus `count` decodes attending to `context` tokens in
        all (`context_sq`: Σ context², by default as if their contexts were equal)."""
        if context_sq is None:
            context_sq = context * context / count if count else 0.0
        return self._value(
            t.prefill_tokens,
            t.decode_context + context,
            t.num_prefill,
            t.num_decode + count,
            t.prefill_attn,
            _full(t.prefill_attn_full, t.decode_context_sq + context_sq, t.num_prefill),
        )

    def with_chunk(self, t: Totals, chunk: int, prefix: int) -> float:
        """Predicted time of the totals plus one prefill chunk after `prefix` tokens."""
        return self._value(
            t.prefill_tokens + chunk,
            t.decode_context,
            t.num_prefill + 1,
            t.num_decode,
            t.prefill_attn + chunk * (prefix + chunk),
            t.prefill_attn_full + (prefix + chunk) ** 2 + t.decode_context_sq,
        )

    def max_chunk(self, t: Totals, time_limit_s: float, *, prefix: int, cap: int) -> int:
        """Largest l ≤ cap with with_chunk(t, l, prefix) ≤ time_limit_s (0 if even l = 1 does
        not fit). Equals `LatencyModel.max_chunk` with page_size 1."""
        if cap <= 0 or self.with_chunk(t, 1, prefix) > time_limit_s:
            return 0
        if self.with_chunk(t, cap, prefix) <= time_limit_s:
            return cap
        guess = self._root(t, time_limit_s, prefix)
        lo = max(1, min(cap - 1, int(guess) if math.isfinite(guess) else cap - 1))
        # the float root is within a token or two of the truth: walk to the exact boundary
        while lo > 1 and self.with_chunk(t, lo, prefix) > time_limit_s:
            lo -= 1
        while lo + 1 < cap and self.with_chunk(t, lo + 1, prefix) <= time_limit_s:
            lo += 1
        return lo

    def _root(self, t: Totals, tau: float, prefix: int) -> float:
        """min over pieces of the largest real l with factor × (a + b·l + c·l²) ≤ tau."""
        tau = tau / self.scale[PREFILL if t.num_decode == 0 else MIXED]
        s_p = t.prefill_tokens
        sd = t.decode_context / _K
        best = math.inf
        for w in self.pieces:
            a = (
                w[0]
                + w[1] * s_p / _K
                + w[3] * (s_p / _K) ** 2
                + w[2] * sd
                + w[4] * sd * sd
                + w[5] * (t.num_prefill + 1)
                + w[6] * t.num_decode
                + w[7] * t.prefill_attn / _K2
                + w[8] * (t.prefill_attn_full + t.decode_context_sq + prefix * prefix) / _K2
            )
            b = w[1] / _K + 2 * w[3] * s_p / _K2 + w[7] * prefix / _K2 + 2 * w[8] * prefix / _K2
            c = (w[3] + w[7] + w[8]) / _K2
            room = tau - a
            if room < 0:
                return 0.0
            if c > 0:
                root = (-b + math.sqrt(b * b + 4 * c * room)) / (2 * c)
            elif b > 0:
                root = room / b
            else:
                continue  # this piece does not grow with l
            best = min(best, root)
        return best
