"""The slow-replica study's own arithmetic (bench/studies/slow_replica.py): the arrivals and
prompts every router is offered alike, what a router's chats add up to, and the report's table.
The study itself runs real engines (bench/results/placement/README.md)."""

from __future__ import annotations

import itertools

import pytest

from bench.studies.new_user import Chat
from bench.studies.slow_replica import Options, arrivals, prompts, replica_row, report, summary

CONTRACT = {"ttft_ms": 300, "tpot_ms": 60}


def test_every_router_is_offered_the_same_arrivals_and_prompts() -> None:
    times = arrivals(6.0, 60.0, seed=0)
    assert times == arrivals(6.0, 60.0, seed=0) != arrivals(6.0, 60.0, seed=1)
    assert all(0.0 < a < b < 60.0 for a, b in itertools.pairwise(times))
    assert 300 < len(times) < 420  # Poisson at 6/s for 60 s: 360 ± a few σ
    texts = prompts(len(times), (8, 120), seed=0)
    assert texts == prompts(len(times), (8, 120), seed=0)
    assert len({t.split(":")[0] for t in texts}) == len(texts)  # each opens with its own number
    lengths = [len(t.split(":", 1)[1].split()) for t in texts]
    assert min(lengths) >= 8 and max(lengths) <= 120


def test_the_summary_counts_every_chat_sent_and_those_served_as_rt() -> None:
    chats = [
        Chat(status=200, ttft_s=0.05, tpot_s=0.02),  # met
        Chat(status=200, ttft_s=0.50, tpot_s=0.02),  # late first token
        Chat(status=200, ttft_s=0.05, tpot_s=0.02, downgraded="ttft"),  # ran as BE
        Chat(status=429, error_code="slo_unattainable"),
        Chat(status=503, error_code="engine_unavailable"),
    ]
    got = summary(chats, CONTRACT)
    assert (got["sent"], got["served_rt"], got["refused"], got["downgraded"], got["failed"]) == (
        5,
        2,
        1,
        1,
        1,
    )
    assert got["met"] == 1 and got["attainment"] == pytest.approx(0.2)
    assert got["admitted_attainment"] == pytest.approx(0.5)
    assert (got["ttft_p50_s"], got["ttft_p99_s"]) == (0.05, 0.50)
    assert summary([], CONTRACT)["attainment"] is None


def test_a_replica_row_reads_the_engines_counters_and_learned_pace() -> None:
    stats = {
        "finished": 40,
        "iterations": 300,
        "busy_s": 6.5,
        "latency_mean_pace_decode": 2.0,
        "latency_mean_pace_prefill": 2.0,
        "latency_mean_pace_mixed": None,  # no mixed batch ran
        "latency_error_p50": 0.4,
    }
    row = replica_row(stats)
    assert row["finished"] == 40 and row["mean_pace_geomean"] == pytest.approx(2.0)
    assert replica_row({})["mean_pace_geomean"] is None


def test_the_report_has_a_row_per_router() -> None:
    chats = [Chat(status=200, ttft_s=0.05, tpot_s=0.02), Chat(status=429)]
    row = {
        "router": "slo",
        "all": summary(chats, CONTRACT),
        "steady": summary(chats[1:], CONTRACT),
        "replicas": [replica_row({"finished": 9}), replica_row({"finished": 1})],
    }
    text = report([row], Options(), "python -m bench.studies.slow_replica")
    (line,) = [x for x in text.splitlines() if x.startswith("| slo |")]
    assert "| 0.500 | 0.000 | 1.000 | 1/2 |" in line and "| 9 / 1 |" in line
