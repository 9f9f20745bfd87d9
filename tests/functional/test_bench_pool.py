"""`tandem bench … --replicas N --routers …` end to end on the simulator's pool: one run compares
the placement policies on the same requests and results.json gains a `routers` object with the
same per-row metrics as `policies`; placement that follows prefixes reuses the replicas' caches
where round-robin scatters them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backend.policy.placement import ROUTERS
from bench.metrics import WALL_CLOCK_KEYS
from tandem.cli import main
from tests.functional.test_bench_sim import FRACTIONS, POLICY_KEYS


def prefix_trace(path: Path, groups: int = 5, per_group: int = 12) -> Path:
    """Requests in groups that share a two-block (1,024-token) prompt prefix — a batch's
    group, a conversation's turns — interleaved in time; one in four is BE."""
    lines = []
    for i in range(groups * per_group):
        group = i % groups
        lines.append(
            {
                "t_ms": 40 * i,
                "input_len": 1024 + 50 + 3 * i,
                "output_len": 8 + i % 7,
                "tier": "be" if i % 4 == 0 else "rt",
                "prefix_hashes": [1000 + 10 * group, 1001 + 10 * group],
            }
        )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run_pool(out: Path, trace: Path) -> dict[str, Any]:
    code = main(
        [
            "bench",
            "trace",
            str(trace),
            "--replicas",
            "2",
            "--routers",
            ",".join(ROUTERS),
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    return json.loads((out / "results.json").read_text())  # type: ignore[no-any-return]


def test_routers_compared_in_one_run(tmp_path: Path) -> None:
    results = run_pool(tmp_path / "pool", prefix_trace(tmp_path / "t.jsonl"))
    assert list(results["routers"]) == list(ROUTERS)
    assert results["replicas"] == 2 and results["engine_policy"] == "tandem"
    for name, row in results["routers"].items():
        for key in POLICY_KEYS:
            assert key in row, (name, key)
        for key in FRACTIONS:
            assert row[key] is None or 0.0 <= row[key] <= 1.0, (name, key)
        assert row["rt_requests"] == 45 and row["be_requests"] == 15, name
        assert row["replicas"] == 2 and row["placement_us_p50"] > 0.0
    rows = results["routers"]
    # one prefix, one replica: the group's later requests hit the cache; round-robin sends
    # every group to both replicas, computing each prefix twice
    assert rows["prefix"]["prefix_reuse_ratio"] > rows["round-robin"]["prefix_reuse_ratio"]
    assert rows["slo"]["prefix_reuse_ratio"] > rows["round-robin"]["prefix_reuse_ratio"]
    report = (tmp_path / "pool" / "report.md").read_text()
    assert "--replicas 2 --routers slo,round-robin,least-load,prefix" in report
    assert all(f"| {name} |" in report for name in ROUTERS)


def test_the_same_pool_run_twice_gives_identical_rows(tmp_path: Path) -> None:
    trace = prefix_trace(tmp_path / "t.jsonl")
    first, second = (run_pool(tmp_path / d, trace) for d in "ab")

    def deterministic(results: dict[str, Any]) -> dict[str, Any]:
        return {
            name: {k: v for k, v in row.items() if k not in WALL_CLOCK_KEYS}
            for name, row in results["routers"].items()
        }

    assert deterministic(first) == deterministic(second)


def dense_trace(path: Path) -> Path:
    """240 requests in 2.4 s (100 per second, 0.9–1.5K-token prompts) of three tenants: more
    than one simulated H100 replica keeps within the contracts below."""
    lines = [
        {
            "t_ms": 10 * i,
            "input_len": 900 + (37 * i) % 600,
            "output_len": 20 + i % 30,
            "tier": "be" if i % 6 == 0 else "rt",
            "tenant": "batch" if i % 6 == 0 else ("chat" if i % 2 else "search"),
        }
        for i in range(240)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


CONTRACTS = """\
chat: {tier: rt, ttft_ms: 300, tpot_ms: 100}
search: {tier: rt, ttft_ms: 150, tpot_ms: 50, weight: 2}
batch: {tier: be, deadline_s: 60}
"""


def test_plan_finds_the_fewest_replicas_meeting_every_contract(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    contracts = tmp_path / "contracts.yaml"
    contracts.write_text(CONTRACTS)
    out = tmp_path / "plan"
    argv = ["plan", "--trace", str(dense_trace(tmp_path / "t.jsonl")), "--tenants",
            str(contracts), "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    plan = json.loads((out / "plan.json").read_text())
    needed = plan["replicas_needed"]
    assert isinstance(needed, int) and needed > 1
    assert plan["judged_window"] is None  # 2.4 s of trace: judged whole
    rows = {row["replicas"]: row for row in plan["rows"]}
    assert rows[needed]["meets_target"] and not rows[needed - 1]["meets_target"]
    for n, row in rows.items():
        assert row["meets_target"] == (n >= needed)
        assert set(row["tenants"]) == {"chat", "search", "batch"}
        assert row["cost_replica_s"] == pytest.approx(n * plan["duration_s"], rel=1e-3)
        if row["meets_target"]:
            assert all(t["attainment"] >= 0.99 for t in row["tenants"].values())
        else:
            assert min(t["attainment"] for t in row["tenants"].values()) < 0.99
    assert (out / "plan.png").read_bytes().startswith(b"\x89PNG")
    stdout = capsys.readouterr().out
    assert f"{needed} replicas meet every tenant's contract" in stdout
    assert "| replicas |" in stdout


@pytest.mark.parametrize(
    ("contracts", "needle"),
    [
        ("chat: {ttft_ms: 300}\n", "no contract for tenant"),
        ("chat: {ttft_ms: -1}\nsearch: {}\nbatch: {}\n", "tenant 'chat': ttft_ms must be > 0"),
        ("- a\n", "expected a mapping"),
    ],
)
def test_plan_refuses_a_bad_contracts_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], contracts: str, needle: str
) -> None:
    path = tmp_path / "contracts.yaml"
    path.write_text(contracts)
    argv = ["plan", "--trace", str(dense_trace(tmp_path / "t.jsonl")), "--tenants", str(path),
            "--out", str(tmp_path / "plan")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--window-s", "-300"], "--window-s must be ≥ 0"),
        (["--warmup-s", "nan"], "--warmup-s must be ≥ 0"),
    ],
)
def test_plan_refuses_a_bad_window_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needle: str
) -> None:
    argv = ["plan", "--trace", str(dense_trace(tmp_path / "t.jsonl")), *flags,
            "--out", str(tmp_path / "plan")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "plan").exists()


def test_an_unequal_pool_slo_placement_routes_around_the_slow_replica(tmp_path: Path) -> None:
    """Replica 0 runs 10 times slower than the model (`--replica-slowdowns 10`; nobody is told):
    round-robin still gives it half the requests, which miss; the slo router learns its pace
    from the replica's own iterations and sends it less, so more RT requests meet the contract."""
    trace = tmp_path / "rt.jsonl"
    lines = [
        {"t_ms": 20 * i, "input_len": 600 + 7 * (i % 50), "output_len": 20, "tier": "rt"}
        for i in range(300)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "unequal"
    code = main(
        [
            "bench",
            "trace",
            str(trace),
            "--replicas",
            "2",
            "--routers",
            "slo,round-robin",
            "--replica-slowdowns",
            "10",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["replica_slowdowns"] == [10.0]
    slo, rr = results["routers"]["slo"], results["routers"]["round-robin"]
    # round-robin sends half to the slow replica, whose admission sheds what it cannot serve
    assert rr["rt_shed_rate"] > 0.2
    # slo sends nearly everything to the fast one and serves every request in its contract
    assert slo["replica_requests_max_over_mean"] > 1.8
    assert slo["rt_joint_attainment"] > rr["rt_joint_attainment"] + 0.2
    assert slo["rt_goodput_req_s"] > 1.5 * rr["rt_goodput_req_s"]
    assert "unequal replicas: replica 0 × 10" in (out / "report.md").read_text()
    # a bad list is one line naming the flag
    assert main(["bench", "W1", "--replica-slowdowns", "2", "--out", str(tmp_path / "x")]) == 2
