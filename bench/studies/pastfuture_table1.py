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
    """Running and queued requests as parallel arrays (admission order = array order)."""

    def __init__(self, prompts: np.ndarray, outputs: np.ndarray) -> None:
        self.prompt = prompts
        self.output = outputs
        self.generated = np.zeros_like(outputs)
        self.queue: list[int] = list(range(prompts.size))
        self.running: list[int] = []

    def current(self, ids: list[int] | np.ndarray) -> np.ndarray:
        return self.prompt[ids] + self.generated[ids]


Admit = Callable[[_State, np.random.Generator, LengthHistory], int]


def pastfuture_admit(reserve: float, oracle: bool = False) -> Admit:
    """Past-Future admission; `oracle` uses the true lengths (the theoretical optimum)."""

    def admit(state: _State, rng: np.random.Generator, history: LengthHistory) -> int:
        run = np.array(state.running, dtype=np.int64)
        lists = 1 if oracle else num_sample_lists(run.size)
        if oracle:
            remaining = (state.output[run] - state.generated[run])[None, :]
        else:
            gen = np.broadcast_to(state.generated[run], (lists, run.size))
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
    gen = state.generated[i]
    if oracle:
        rem = np.array([state.output[i] - gen])
    else:
        rem = history.sample_total(rng, np.full(lists, gen), MAX_OUTPUT) - gen
    return check.try_admit(int(state.prompt[i] + gen), rem)


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
        reserved = [len(state.running) * MAX_OUTPUT + int(state.prompt[state.running].sum())]

        def fits(i: int) -> bool:
            need = int(state.prompt[i]) + MAX_OUTPUT
            if reserved[0] + need > MEM * overcommit:
                return False
            reserved[0] += need
            return True

        return _admit_while(state, fits)

    return admit


def _admit_while(state: _State, fits: Callable[[int], bool]) -> int:
    """FCFS admission under the per-round prompt budget; stops at the first refusal."""
    budget = PREFILL_TOKENS_PER_ROUND
    admitted = 0
    while state.queue:
        i = state.queue[0]
        need = int(state.prompt[i] + state.generated[i])
        if need > budget or not fits(i):
            break
        budget -= need
        state.running.append(state.queue.pop(0))
        admitted += 1
    return admitted


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
        run = np.array(state.running, dtype=np.int64)
        future_sum += future_peak(state.current(run), state.output[run] - state.generated[run])
        rounds += 1
        for _ in range(DECODE_STEPS_PER_ROUND):
            if not state.running:
                break
            run = np.array(state.running, dtype=np.int64)
            state.generated[run] += 1
            done = state.generated[run] >= state.output[run]
            if done.any():
                history.extend(state.output[run[done]].tolist())
                finished += int(done.sum())
                state.running = run[~done].tolist()
            steps += 1
            used = int(state.current(state.running).sum())
            while used > MEM and state.running:
                victim = state.running.pop()  # the most recently admitted
                used -= int(state.prompt[victim] + state.generated[victim])
                state.queue.insert(0, victim)
                evictions += 1
            mem_sum += used / MEM
    return Table1Row(
        steps=steps,
        current_memory=mem_sum / max(steps, 1),
        future_memory=future_sum / max(rounds, 1) / MEM,
        evicted=evictions / num_requests,
    )


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
