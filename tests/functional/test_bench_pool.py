"""`tandem bench … --replicas N --routers …` end to end on the simulator's pool: one run compares
the placement policies on the same requests and results.json gains a `routers` object with the
same per-row metrics as `policies`; placement that follows prefixes reuses the replicas' caches
where round-robin scatters them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backend.policy.placement import ROUTERS
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
