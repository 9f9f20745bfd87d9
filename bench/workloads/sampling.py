"""Deterministic random draws for workloads.

Every stream of a workload draws from its own generator, derived from (seed, stream label), so
that one stream does not shift when another draws more (the RT lengths are the same at every
arrival rate; the BE batches are the same whichever policy runs them).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

BLOCK_TOKENS = 512
"""Prefix-cache block size of prefix_hashes, tokens (the trace schema's unit)."""


def rng_for(seed: int, *labels: object) -> np.random.Generator:
    """A generator for one stream: the same (seed, labels) always gives the same draws."""
    digest = hashlib.sha256(repr((seed, *labels)).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def stable_hash(*parts: object) -> int:
    """A 63-bit hash that is the same in every process (Python's hash() is salted)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def lognormal_params(mean: float, std: float) -> tuple[float, float]:
    """(mu, sigma) of the lognormal with this mean and standard deviation."""
    sigma2 = math.log(1.0 + (std / mean) ** 2)
    return math.log(mean) - sigma2 / 2.0, math.sqrt(sigma2)


def lognormal_ints(
    rng: np.random.Generator, mean: float, std: float, n: int, *, low: int, high: int
) -> np.ndarray:
    """n integers from the lognormal with this mean/std, rounded and clipped to [low, high]."""
    mu, sigma = lognormal_params(mean, std)
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), low, high).astype(np.int64)


def uniform_ints(rng: np.random.Generator, low: int, high: int, n: int) -> np.ndarray:
    """n integers uniform on [low, high] inclusive."""
    return rng.integers(low, high + 1, n).astype(np.int64)


def binned_ints(
    rng: np.random.Generator, bins: Sequence[tuple[float, int, int]], n: int, *, log: bool
) -> np.ndarray:
    """n integers from a mixture of bins (weight, low, high): a bin is chosen by weight, then a
    value inside it, log-uniform (log=True) or uniform. A bin with low == high is a point mass.
    Value i uses draws 2i and 2i+1 only, so the first k values are the same for every n ≥ k."""
    weights = np.array([b[0] for b in bins], dtype=float)
    cdf = np.cumsum(weights / weights.sum())
    u = rng.random((n, 2))
    choice = np.minimum(np.searchsorted(cdf, u[:, 0], side="right"), len(bins) - 1)
    low = np.array([b[1] for b in bins], dtype=float)[choice]
    high = np.array([b[2] for b in bins], dtype=float)[choice]
    if log:
        values = np.exp(np.log(low) + u[:, 1] * (np.log(high) - np.log(low)))
    else:
        values = low + u[:, 1] * (high + 1 - low)  # integers low…high inclusive after floor
        values = np.floor(values)
    out: np.ndarray = np.clip(np.rint(values), low, high).astype(np.int64)
    return out


def poisson_times(rng: np.random.Generator, rate: float, duration_s: float) -> np.ndarray:
    """Arrival times of a Poisson process of `rate` per second on [0, duration_s): unit-mean
    exponential gaps divided by the rate (the same draws at every rate, only scaled)."""
    if rate <= 0 or duration_s <= 0:
        return np.zeros(0)
    expected = rate * duration_s
    count = int(expected + 10 * math.sqrt(expected) + 20)
    times = np.cumsum(rng.exponential(1.0, count)) / rate
    while times[-1] < duration_s:  # rare: draw more
        more = np.cumsum(rng.exponential(1.0, count)) / rate + times[-1]
        times = np.concatenate([times, more])
    return times[times < duration_s]


def unique_block_hashes(rid: str, prompt_len: int, start_block: int = 0) -> tuple[int, ...]:
    """Hashes of a prompt's full blocks from `start_block` on that no other request shares."""
    return tuple(
        stable_hash("block", rid, i) for i in range(start_block, prompt_len // BLOCK_TOKENS)
    )
