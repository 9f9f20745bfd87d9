"""Past-Future's Table-1 behaviour simulator, re-implemented from the digest's protocol
(shared/digests/001_pastfuture.md §4.3) and driving tandem's own admission code
(backend/policy/pastfuture.py). A golden test: the numbers must match the paper's within seed
noise.

Protocol: 3,000 requests all queued at t=0; KV capacity 120,000 tokens; max output 4,096. Each
round admits prompts (FCFS, stop at the first refusal, ≤ 32,768 prompt tokens), then runs 10
decode steps; a step adds one token to every running request and retires finished ones; when
memory exceeds capacity the most recently admitted request is evicted to the head of the queue
(its KV is dropped; it keeps its generated tokens and recomputes them on re-admission).

Reported: decode steps; mean current memory / capacity (after every step); mean true future
peak / capacity (after every admission round); evictions / requests.

    python -m bench.studies.pastfuture_table1            # all distributions and schedulers
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from backend.policy.pastfuture import (
    LengthHistory,
    PeakAdmission,
    future_peak,
    num_sample_lists,
)

MEM = 120_000
MAX_OUTPUT = 4096
NUM_REQUESTS = 3000
DECODE_STEPS_PER_ROUND = 10
PREFILL_TOKENS_PER_ROUND = 32_768
DISTRIBUTIONS = {  # (prompt low, high), (output low, high): uniform integers
    "D1": ((32, 4096), (2048, 4096)),
    "D2": ((3000, 5000), (3000, 5000)),  # decimal K: matches the paper's step counts
    "D3": ((2048, 4096), (32, 4096)),
}


@dataclass
class Table1Row:
    steps: int
    current_memory: float
    future_memory: float
    evicted: float


class _State:
    """Running and queued requests as parallel arrays: `running` holds request ids in admission
    order (the last is the first evicted), `queue` the waiting ids, head first."""

    def __init__(self, prompts: np.ndarray, outputs: np.ndarray) -> None:
        self.prompt = prompts
        self.output = outputs
        self.generated = np.zeros_like(outputs)
        self.queue: collections.deque[int] = collections.deque(range(prompts.size))
        self.running = np.empty(0, dtype=np.int64)

    def current(self, ids: np.ndarray) -> np.ndarray:
        """Tokens held in KV by each of `ids` (prompt plus generated)."""
        return self.prompt[ids] + self.generated[ids]


Admit = Callable[[_State, np.random.Generator, LengthHistory], int]


def pastfuture_admit(reserve: float, oracle: bool = False) -> Admit:
    """Past-Future admission; `oracle` uses the true lengths (the theoretical optimum)."""

    def admit(state: _State, rng: np.random.Generator, history: LengthHistory) -> int:
        run = state.running
        lists = 1 if oracle else num_sample_lists(run.size)
        if oracle:
            remaining = (state.output[run] - state.generated[run])[None, :]
        else:
            gen = state.generated[run][None, :].repeat(lists, axis=0)
            remaining = history.sample_total(rng, gen, MAX_OUTPUT) - gen
        check = PeakAdmission(state.current(run), remaining, MEM * (1 - reserve))
        return _admit_while(
            state, lambda i: _candidate_fits(check, state, i, rng, history, lists, oracle)
        )

    return admit


def _candidate_fits(
    check: PeakAdmission,
    state: _State,
    i: int,
    rng: np.random.Generator,
    history: LengthHistory,
    lists: int,
    oracle: bool,
) -> bool:
    gen = int(state.generated[i])
    if oracle:
        rem = np.array([int(state.output[i]) - gen])
    else:
        rem = history.sample_total(rng, np.full(lists, gen), MAX_OUTPUT) - gen
    return check.try_admit(int(state.prompt[i]) + gen, rem)


def aggressive_admit(watermark: float) -> Admit:
    """Admit while current tokens plus the prompt fit under capacity × watermark."""

    def admit(state: _State, rng: np.random.Generator, history: LengthHistory) -> int:
        used = [int(state.current(state.running).sum())]

        def fits(i: int) -> bool:
            need = int(state.prompt[i] + state.generated[i])
            if used[0] + need > MEM * watermark:
                return False
            used[0] += need
            return True

        return _admit_while(state, fits)

    return admit


def conservative_admit(overcommit: float = 1.0) -> Admit:
    """Admit while every admitted request's prompt plus the full max output fits."""

    def admit(state: _State, rng: np.random.Generator, history: LengthHistory) -> int:
        reserved = [state.running.size * MAX_OUTPUT + int(state.prompt[state.running].sum())]

        def fits(i: int) -> bool:
            need = int(state.prompt[i]) + MAX_OUTPUT
            if reserved[0] + need > MEM * overcommit:
                return False
            reserved[0] += need
            return True

        return _admit_while(state, fits)

    return admit


def _admit_while(state: _State, fits: Callable[[int], bool]) -> int:
    """FCFS admission under the per-round prompt budget; stops at the first refusal. The
    admitted ids join the end of `state.running` (`fits` keeps its own tally meanwhile)."""
    budget = PREFILL_TOKENS_PER_ROUND
    admitted: list[int] = []
    queue = state.queue
    while queue:
        i = queue[0]
        need = int(state.prompt[i] + state.generated[i])
        if need > budget or not fits(i):
            break
        budget -= need
        admitted.append(queue.popleft())
    if admitted:
        state.running = np.append(state.running, admitted)
    return len(admitted)


def simulate(dist: str, admit: Admit, seed: int = 0, num_requests: int = NUM_REQUESTS) -> Table1Row:
    """Runs the protocol for one distribution and one admission rule."""
    rng = np.random.default_rng(seed)
    (plo, phi), (olo, ohi) = DISTRIBUTIONS[dist]
    state = _State(
        rng.integers(plo, phi + 1, num_requests), rng.integers(olo, ohi + 1, num_requests)
    )
    history = LengthHistory(1000, prior=[512] * 500)
    steps, evictions, finished = 0, 0, 0
    mem_sum, future_sum, rounds = 0.0, 0.0, 0
    while finished < num_requests:
        admit(state, rng, history)
        # The round's decode steps on Python ints: with each running request's tokens at the
        # round's start (`current`) and still to generate (`remaining`), after `step` steps it
        # holds current + step and finishes at step = remaining, so memory in use grows by the
        # number running; the arrays change only when a request finishes or is evicted (about
        # one step in a hundred), and `generated` is written back when a request leaves.
        run = state.running
        current = state.current(run)
        remaining = state.output[run] - state.generated[run]
        future_sum += future_peak(current, remaining)
        rounds += 1
        used = int(current.sum())
        next_finish = _first_finish(remaining)
        stepped = 0
        for step in range(1, DECODE_STEPS_PER_ROUND + 1):
            if not run.size:
                break
            stepped = step
            used += run.size
            if step >= next_finish:
                done = remaining <= step
                n_done = int(done.sum())
                history.extend(state.output[run[done]].tolist())
                finished += n_done
                used -= int(current[done].sum()) + step * n_done
                state.generated[run[done]] = state.output[run[done]]
                run, current, remaining = run[~done], current[~done], remaining[~done]
                next_finish = _first_finish(remaining)
            steps += 1
            if used > MEM:
                while used > MEM and run.size:
                    victim = int(run[-1])  # the most recently admitted
                    used -= int(current[-1]) + step
                    state.generated[victim] += step
                    state.queue.appendleft(victim)
                    evictions += 1
                    run, current, remaining = run[:-1], current[:-1], remaining[:-1]
                next_finish = _first_finish(remaining)
            mem_sum += used / MEM
        state.generated[run] += stepped
        state.running = run
    return Table1Row(
        steps=steps,
        current_memory=mem_sum / max(steps, 1),
        future_memory=future_sum / max(rounds, 1) / MEM,
        evicted=evictions / num_requests,
    )


def _first_finish(remaining: np.ndarray) -> int:
    """The step of the round (from 1) at which the first running request finishes; past the
    round's last step when none is running."""
    return int(remaining.min()) if remaining.size else DECODE_STEPS_PER_ROUND + 1


SCHEDULERS: dict[str, Admit] = {
    "optimum": pastfuture_admit(0.0, oracle=True),
    "pf-3%": pastfuture_admit(0.03),
    "pf-5%": pastfuture_admit(0.05),
    "pf-10%": pastfuture_admit(0.10),
    "aggressive-99%": aggressive_admit(0.99),
    "aggressive-90%": aggressive_admit(0.90),
    "conservative": conservative_admit(1.0),
}


def simulate_named(dist: str, scheduler: str, seed: int = 0) -> Table1Row:
    """`simulate` with the admission rule named as in `SCHEDULERS` (picklable: for a process
    pool)."""
    return simulate(dist, SCHEDULERS[scheduler], seed=seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", action="append", choices=sorted(DISTRIBUTIONS))
    parser.add_argument("--scheduler", action="append", choices=sorted(SCHEDULERS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print("| dist | scheduler | steps | cur. mem | future req. | evicted |")
    print("|---|---|---|---|---|---|")
    for dist in args.dist or sorted(DISTRIBUTIONS):
        for name in args.scheduler or list(SCHEDULERS):
            row = simulate(dist, SCHEDULERS[name], seed=args.seed)
            print(
                f"| {dist} | {name} | {row.steps:,} | {row.current_memory:.2%} | "
                f"{row.future_memory:.2%} | {row.evicted:.2%} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
