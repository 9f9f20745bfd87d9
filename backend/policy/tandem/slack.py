"""RT urgency and the iteration time budget τ (AccelGen, synthesis §4 step 1–2).

Every RT request has a *next deadline* D: its TTFT deadline before the first token, then the
emission of its previous token + its TPOT target. From the planned start t0::

    N      = iterations still needed before that token: ⌈prompt left / chunk at L⌉, or 1
    slack  = D − t0 − N·L          time it can still afford to wait
    urgent ⇔ slack ≤ L             waiting one more iteration could make it miss
    allowance = (D − t0) / N       time one iteration may take if it is to make D

    hard cap  = min allowance over the RT tokens the batch carries (a longer iteration makes
                one of them late)
    τ         = min(L, (1 − ε)·hard cap), raised for an urgent prompt that needs longer
                iterations (`needed_budget`), never above (1 − ε)·hard cap

An RT prompt whose deadline cannot be met even alone on the engine is *hopeless* (its TTFT is
lost); it is served after every feasible one (queues.RtQueue), without raising τ.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from backend.policy.tandem.timing import BatchTotals, Timer, Totals
from backend.policy.types import ReqState

_EMPTY = BatchTotals()


def rt_deadline(r: ReqState) -> float:
    """When `r`'s next token is due (inf without a target)."""
    if r.first_token_s is None:
        return math.inf if r.ttft_due_s is None else r.ttft_due_s
    if r.tpot_target_s is None or r.last_token_s is None:
        return math.inf
    return r.last_token_s + r.tpot_target_s


def decode_deadline(reqs: Iterable[ReqState]) -> float:
    """The earliest next-token deadline among decoding RT requests (inf if none has one)."""
    return min(
        (
            r.last_token_s + r.tpot_target_s
            for r in reqs
            if r.tpot_target_s is not None and r.last_token_s is not None
        ),
        default=math.inf,
    )


def iterations_left(prompt_left: int, chunk_tokens: int) -> int:
    """Iterations until the next token: the prompt's remaining chunks, or 1 for a decode."""
    if prompt_left <= 0:
        return 1
    return -(-prompt_left // max(1, chunk_tokens))


def slack_s(deadline_s: float, now_s: float, iterations: int, iteration_s: float) -> float:
    """Time `r` can still wait: deadline − now − the iterations it still needs."""
    return deadline_s - now_s - iterations * iteration_s


def is_urgent(slack: float, iteration_s: float) -> bool:
    """Urgent: after one more iteration of `iteration_s` the slack would be gone."""
    return slack <= iteration_s


def allowance_s(deadline_s: float, now_s: float, iterations: int) -> float:
    """How long each of its remaining iterations may take for the token to make its
    deadline."""
    return (deadline_s - now_s) / max(1, iterations)


def standalone_prefill_s(timer: Timer, tokens: int, prefix: int, max_chunk: int) -> float:
    """Time to prefill `tokens` after `prefix` alone on the engine, in max-size chunks."""
    total = 0.0
    while tokens > 0:
        chunk = min(tokens, max_chunk)
        total += timer.with_chunk(_EMPTY, chunk, prefix)
        prefix += chunk
        tokens -= chunk
    return total


def needed_budget(
    timer: Timer, batch: Totals, r: ReqState, window_s: float, max_chunk: int
) -> float | None:
    """The shortest iteration time that still lets `r` finish its prompt within `window_s`
    (N iterations of it, each carrying ⌈left/N⌉ tokens on top of `batch`); the largest feasible
    N is found by bisection (N·T(⌈left/N⌉) shrinks as N does). None when even the fewest
    iterations the engine allows cannot make it."""
    left = r.prefill_len - r.prefilled
    if left <= 0 or window_s <= 0:
        return None
    prefix = r.prefilled
    n_min = -(-left // max_chunk)

    def iteration_s(n: int) -> float:
        return timer.with_chunk(batch, -(-left // n), prefix)

    if n_min * iteration_s(n_min) > window_s:
        return None
    lo, hi = n_min, max(n_min, left)  # lo feasible
    if hi * iteration_s(hi) <= window_s:
        return iteration_s(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mid * iteration_s(mid) <= window_s:
            lo = mid
        else:
            hi = mid
    return iteration_s(lo)


def be_allowance_s(r: ReqState, now_s: float, predicted_total: int, prefill_s: float) -> float:
    """Per-iteration allowance of a running BE request with a deadline: the time left after
    its remaining prefill, spread over the tokens it still has to emit (AccelGen's JCT
    conversion); inf without a deadline."""
    if r.deadline_due_s is None:
        return math.inf
    tokens = max(1, predicted_total - r.generated)
    return (r.deadline_due_s - now_s - prefill_s) / tokens
