"""Bench constants that the command line needs before anything heavy is imported (the `tandem`
CLI builds its parser on every start, so tandem/bench.py imports only this at module level)."""

from __future__ import annotations

from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
"""The bench package folder."""
RESULTS_DIR = BENCH_DIR / "results"
"""Default parent of output folders."""
DEFAULT_PROFILE = "h100-llama8b-analytic"
"""The simulator's default latency profile."""
DEFAULT_DATA_DIR = BENCH_DIR / "data"
"""bench/data: the Azure trace CSVs, shipped with the repository (its README: source, license)."""
ENGINES = ("sim", "sglang")
"""Engines `--engine` accepts (sglang: issue 5)."""
WORKLOAD_NAMES = ("W1", "W2", "W3", "W4", "W5", "W6")
"""Built-in workloads."""
