"""Golden test: Past-Future's Table 1 (shared/digests/001_pastfuture.md §4.3–4.4), reproduced by
our re-implementation of its behaviour simulator driving tandem's admission code. Tolerances are
seed noise: the paper's runs and the artifact's unseeded re-runs differ by about this much."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from bench.studies.pastfuture_table1 import Table1Row, simulate_named

pytestmark = pytest.mark.slow

# (steps, current memory, future required memory, evicted) from the paper's Table 1
TABLE1 = {
    ("D1", "pf-3%"): (296_710, 0.9361, 0.9747, 0.0686),
    ("D1", "pf-5%"): (301_680, 0.9187, 0.9573, 0.0337),
    ("D2", "pf-3%"): (654_500, 0.9216, 0.9721, 0.0742),
    ("D2", "pf-5%"): (669_770, 0.9007, 0.9582, 0.0439),
    ("D3", "pf-3%"): (239_260, 0.9450, 0.9651, 0.0259),
    ("D3", "pf-5%"): (241_650, 0.9264, 0.9462, 0.0087),
}


@pytest.fixture(scope="module")
def simulated() -> dict[tuple[str, str], Table1Row]:
    """Every row of the table, simulated two at a time in child processes: six pure-Python
    runs of 3–10 s each, which the suite would otherwise run one after the other on a machine
    with two cores (spawned, not forked: the test process may hold threads)."""
    keys = sorted(TABLE1)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
        rows = list(pool.map(simulate_named, *zip(*keys, strict=True)))
    return dict(zip(keys, rows, strict=True))


@pytest.mark.parametrize(("dist", "scheduler"), sorted(TABLE1))
def test_table1_row(dist: str, scheduler: str, simulated: dict[tuple[str, str], Table1Row]) -> None:
    steps, current, future, evicted = TABLE1[(dist, scheduler)]
    row = simulated[(dist, scheduler)]
    assert row.steps == pytest.approx(steps, rel=0.03)
    assert row.current_memory == pytest.approx(current, abs=0.01)
    assert row.future_memory == pytest.approx(future, abs=0.01)
    assert row.evicted == pytest.approx(evicted, abs=0.015)
