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
lost); it is served after the feasible ones, or where they can spare the time
(queues.RtQueue), without raising τ.

For a prompt, the RT phase takes L in the slack and the urgency test at the engine's recent
upper pace (`TandemConfig.deadline_spread`): slack order starts prompts just in time, and on a
noisy engine one started at its mean pace misses whenever its iterations run long.
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


def decode_deadline(reqs: Iterable[ReqState], now_s: float, decode_only_s: float) -> float:
    """The earliest next-token deadline among decoding RT requests that an iteration can still
    keep (inf if none has one); `decode_only_s` is the shortest iteration that serves them all.

    A token already due sooner than that is late whatever this iteration carries: its stream
    keeps its target pace from here (due one TPOT from now), rather than every prompt waiting
    while it stays behind. A stream whose TPOT target is itself shorter than `decode_only_s`
    cannot keep pace on this engine at all (a slower machine than the contract was made for):
    it sets no deadline (`unkeepable_tpot_s` bounds the iteration for it instead)."""
    earliest = math.inf
    for r in reqs:
        if r.tpot_target_s is None or r.last_token_s is None:
            continue
        due = r.last_token_s + r.tpot_target_s
        if due - now_s < decode_only_s:
            if r.tpot_target_s < decode_only_s:
                continue  # slower than its contract even alone
            due = now_s + r.tpot_target_s  # late already: keep its pace from now
        earliest = min(earliest, due)
    return earliest


def unkeepable_tpot_s(reqs: Iterable[ReqState], decode_only_s: float) -> float:
    """The tightest TPOT target among decoding RT requests that not even a decode-only
    iteration keeps (inf if none). Such a stream still wants its tokens as fast as the engine
    can give them: τ starts at it, so BE and non-urgent prompts wait as for a stream that can
    keep pace; but it is no deadline, so an urgent RT prompt may still raise τ for itself (a
    stream that no iteration can serve in time must not keep every new RT prompt out)."""
    return min(
        (
            r.tpot_target_s
            for r in reqs
            if r.tpot_target_s is not None
            and r.last_token_s is not None
            and r.tpot_target_s < decode_only_s
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
